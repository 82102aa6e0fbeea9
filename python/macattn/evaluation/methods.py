"""The decode methods ``macattn eval`` compares, behind one small interface.

A method is an ``EvalMethod``: ``attach(model)`` is a context manager that patches the model
(``macattn.models.attention.patch_model`` supplies the pre-RoPE query capture, the prefill and
ring seeding) and yields a ``Recorder`` (``None`` for the unpatched full-attention baseline).
While attached, every decode step of every layer goes through ``method.decode`` under the
attention name ``"macattn_eval"``; the recorder then keeps, per layer, the attention-output
relative error against full attention on the same inputs, hits, the docs/spec.md §1.5 skipped
prefix, and the KV read in token-equivalents. Adding a method is a subclass with ``name``,
``decode`` and (optionally) ``prefill``:

* ``FullBaseline`` — the baseline (no patch);
* ``Mac`` — MAC (``macattn.methods.mac.reference.mac_decode_step_reference``), any ``MacConfig`` including
  per-layer overrides and ``miss_policy="completion"``
  (``macattn.methods.completion.completion_on_miss``);
* ``RetrievalCompletion`` — docs/spec.md §3 on every step (``macattn.methods.completion.reference.hybrid_decode_step``);
  ``CompletionProbe`` records its parts under full attention (the calibration of ``macattn tune --completion``);
* ``A3Fusion`` — docs/spec.md §4: the prompt cut into ``[system, chunks, question]``, each chunk's K/V
  computed alone (as a chunk store holds it), fused prefill, then full-attention decode. It changes
  the prompt's K/V, not the decode, so it overrides ``run`` and records no per-layer statistics.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from macattn.methods.a3.config import A3Config, FusionMethod
from macattn.methods.completion.gate import CompletionGate, gated_log_phi_q
from macattn.methods.completion.reference import (build_completion_cache_batched, hybrid_decode_step, layer_top_k, partition,
                                                  token_equivalents)
from macattn.methods.mac.config import MacConfig
from macattn.core.attention import check_no_padding, full_attention_reference
from macattn.methods.base import AttentionMethod, Capabilities, ModelDims, StepContext
from macattn.methods.mac.backend import MacAttention
from macattn.methods.mac.reference import mac_decode_step_reference
from macattn.models.attention import bind, binding_of, unbind
from macattn.models.transformers_api import returned_cache
from macattn.methods.completion.feature_maps import CompletionFeatureMaps
from macattn.methods.completion.completion_on_miss import CompletionOnMiss, MissCompletionConfig, random_feature_maps

__all__ = ["Recorder", "Prefill", "EvalMethod", "FullBaseline", "Mac", "RetrievalCompletion", "CompletionProbe",
           "A3Fusion"]

@dataclass
class Recorder:
    """Per-layer accumulators of one attached method (lists of length ``num_layers``).

    steps: decode (step, head) pairs; hits / skipped: MAC hits and Σ (p - r)_+ / m over them;
    read / context: Σ KV tokens read (token-equivalents) and Σ (m + 1) over (step, head);
    errors: per-step ``||o - o_full|| / ||o_full||`` of the layer (all heads);
    hit_gap_error: ``(layer, m - p, per-head relative error)`` of every hit;
    timeline: with ``keep_timeline``, per layer one ``(hit fraction, skip fraction)`` of its heads per
    decode step, in step order (``macattn eval --long-gen``'s hit / skip over time).
    """

    num_layers: int
    steps: list = field(default_factory=list)
    hits: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    read: list = field(default_factory=list)
    context: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    hit_gap_error: list = field(default_factory=list)
    enabled: bool = True
    keep_timeline: bool = False
    timeline: list = field(default_factory=list)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        L = self.num_layers
        self.steps, self.hits, self.skipped = [0] * L, [0] * L, [0.0] * L
        self.read, self.context = [0.0] * L, [0.0] * L
        self.errors = [[] for _ in range(L)]
        self.hit_gap_error = []
        self.timeline = [[] for _ in range(L)]

    def record(self, layer: int, out: torch.Tensor, full: torch.Tensor, positions: torch.Tensor,
               read: torch.Tensor, match_pos: torch.Tensor | None = None, band: int = 0) -> None:
        """out / full ``[B, Hq, d]``; read ``[B, Hq]`` token-equivalents; match_pos ``[B, Hq]`` (-1 miss)."""
        if not self.enabled:
            return
        diff = (out.double() - full.double())
        self.errors[layer].append(float(diff.norm() / full.double().norm().clamp(min=1e-30)))
        m = positions.double().view(-1, 1).expand_as(read)
        self.steps[layer] += read.numel()
        self.read[layer] += float(read.double().sum())
        self.context[layer] += float((m + 1).sum())
        if match_pos is not None:
            hit = match_pos >= 0
            self.hits[layer] += int(hit.sum())
            self.skipped[layer] += float(torch.where(hit, (match_pos - band).clamp(min=0) / m.clamp(min=1), 0.0).sum())
            head_err = diff.norm(dim=-1) / full.double().norm(dim=-1).clamp(min=1e-30)
            for g, e in zip((m - match_pos)[hit].tolist(), head_err[hit].tolist()):
                self.hit_gap_error.append((layer, int(g), e))
            if self.keep_timeline:
                sk = torch.where(hit, (match_pos - band).clamp(min=0) / m.clamp(min=1), 0.0)
                self.timeline[layer].append((float(hit.double().mean()), float(sk.mean())))


class _PrefillCapture(AttentionMethod):
    """Full attention that keeps each layer's prefill inputs (``Prefill.of``)."""

    name = "prefill_capture"
    config_type = MacConfig
    capabilities = Capabilities(needs_pre_rope_query=True)

    def __init__(self, dims: ModelDims) -> None:
        super().__init__(MacConfig(enabled=False), dims, num_slots=1)
        self.layers: list = [None] * dims.num_layers

    def prefill(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        self.layers[layer] = (query, key, value, q_pre, scale)
        out, _ = fallback(module, query, key, value, attention_mask, scaling=scale, **kwargs)
        return out


@dataclass
class Prefill:
    """One full-attention prefill of ``prompt [1, L]``, replayed into any number of methods
    (``EvalMethod.run(prefilled=...)``: the tuner runs many configs per prompt and pays one prefill).

    logits: ``[V]`` of the prompt's last position; cache: the model's KV cache after the prompt (each
    run extends a deep copy); layers: per layer ``(query [1, Hq, L, d] post-RoPE, key / value
    [1, Hkv, L, d], q_pre [1, Hq, L, d], scale)``, what each method's prefill (ring seeding) reads.
    """

    prompt: torch.Tensor
    logits: torch.Tensor
    cache: object
    layers: list

    @classmethod
    @torch.no_grad()
    def of(cls, model, prompt: torch.Tensor) -> "Prefill":
        cap = _PrefillCapture(ModelDims.of(model))
        bind(model, cap)
        try:
            out = model(input_ids=prompt.to(cap.dims.device), use_cache=True)
        finally:
            unbind(model)
        return cls(prompt, out.logits[0, -1], returned_cache(out), cap.layers)

    def replay(self, method: AttentionMethod) -> None:
        """Run ``method``'s prefill on every layer's captured inputs (its output is not needed: the
        cache already holds the prompt's K/V)."""
        skip = lambda *a, **k: (None, None)  # noqa: E731
        for layer, (query, key, value, q_pre, scale) in enumerate(self.layers):
            method.prefill(None, layer, query, key, value, q_pre, None, scale, StepContext(), skip)


class _EvalAttention(AttentionMethod):
    """The attached ``EvalMethod`` as an ``AttentionMethod``: prefill through MAC (seeds the
    rings the MAC methods match against), decode through ``method.decode``; every decode step
    is recorded against full attention on the same inputs."""

    name = "eval"
    config_type = MacConfig
    capabilities = Capabilities(needs_pre_rope_query=True)

    def __init__(self, method: "EvalMethod", dims: ModelDims) -> None:
        super().__init__(method.mac_config, dims, num_slots=1)
        self.method = method
        self.mac = MacAttention(method.mac_config, dims, num_slots=1)

    def prefill(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        out = self.mac.prefill(module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback,
                               **kwargs)
        self.method.prefill(layer, key, value)
        return out

    def decode(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        check_no_padding(attention_mask)
        B, Hq, _, d = query.shape
        positions = torch.full((B,), key.shape[2] - 1, dtype=torch.int64, device=query.device)
        q = query[:, :, 0]
        q_match = self.mac.match_query(layer, q_pre[:, :, 0])     # q~ / s under a calibrated threshold
        out, read, match_pos, band = self.method.decode(self.mac, layer, q, q_match, key, value, positions,
                                                        scale)
        rec = self.method.recorder
        if rec is not None and rec.enabled:
            full = full_attention_reference(q, key, value, positions, scale=scale)
            rec.record(layer, out, full, positions, read, match_pos, band)
        return out.to(query.dtype).unsqueeze(1)

    def release(self) -> None:
        self.mac.release()


class EvalMethod:
    """Base class: ``name``; ``prefill(layer, key, value)`` after each layer's prompt attention;
    ``recorder`` accumulates over every ``attach`` until replaced (``recorder = None`` resets);
    ``decode(mac, layer, q, q_pre, key, value, positions, scale) -> (out [B, Hq, d], read [B, Hq]
    token-equivalents, match_pos [B, Hq] or None, band)`` (``mac``: the ``MacAttention`` whose rings
    the prefill seeded: ``mac.slots``, ``mac.state``); ``mac_config`` the prefill's MAC config."""

    name = "method"
    mac_config = MacConfig(window=1, band=0, enabled=False)
    recorder: Recorder | None = None

    def prefill(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        pass

    def decode(self, mac, layer, q, q_pre, key, value, positions, scale):
        raise NotImplementedError

    def run(self, model, prompt: torch.Tensor, steps: int, forced: list | None = None, *,
            prefilled: Prefill | None = None, on_step=None) -> list:
        """Greedy tokens (``steps`` of them) after ``prompt [1, L]``, teacher-forced on ``forced``;
        ``prefilled``: the prompt's ``Prefill`` instead of a fresh prefill (same tokens); ``on_step``:
        ``greedy_decode``'s per-token callback."""
        from macattn.models.generation import greedy_decode

        with self.attach(model) as rec:
            pre = None
            if prefilled is not None:
                if rec is not None:
                    prefilled.replay(binding_of(model).method)
                pre = (prefilled.logits, copy.deepcopy(prefilled.cache))
            return greedy_decode(model, prompt, steps, forced=forced, desc=self.name, prefilled=pre,
                                 on_step=on_step)[0]

    @contextmanager
    def attach(self, model):
        self._model_config = model.config
        if self.recorder is None or self.recorder.num_layers != model.config.num_hidden_layers:
            self.recorder = Recorder(model.config.num_hidden_layers)   # kept across attaches: stats accumulate
        bind(model, _EvalAttention(self, ModelDims.of(model)))
        try:
            yield self.recorder
        finally:
            unbind(model)


class FullBaseline(EvalMethod):
    """The baseline: the model's own attention, unpatched (``attach`` yields ``None``)."""

    name = "full"

    @contextmanager
    def attach(self, model):
        yield None


class Mac(EvalMethod):
    """MAC with ``config`` (per-layer overrides and ``miss_policy`` honoured). For
    ``miss_policy="completion"`` layers, ``completion`` configures the miss path, ``maps`` are the
    feature maps (default: untrained random features, ``random_feature_maps``) and ``gen_len``
    amortises the completion cache fetch in the read accounting."""

    def __init__(self, config: MacConfig, *, completion: MissCompletionConfig | None = None,
                 maps: CompletionFeatureMaps | None = None, gen_len: int = 64, name: str | None = None) -> None:
        if not isinstance(config, MacConfig):
            raise TypeError(f"config must be a MacConfig, got {type(config).__name__}")
        config.require_from_first_step("the evaluation's MAC step (macattn eval / tune)")
        self.mac_config = config
        self.completion = completion or MissCompletionConfig()
        self.maps = maps
        self.gen_len = gen_len
        self.states: dict[int, CompletionOnMiss] = {}
        if name is None:
            pol = "+completion" if config.miss_policy == "completion" else ""
            if config.match == "two_stage":
                pol += f"+two_stage({config.match_sketch},c={config.match_candidates})"
            over = [dict(f) for _, f in config.layer_overrides]
            if config.match_scale or any("match_scale" in f for f in over):
                pol += "+calibrated"
            only_scales = all(set(f) <= {"match_scale"} for f in over)
            name = (f"mac{pol}(tau={config.tau},K={config.window},r={config.band})" if only_scales
                    else f"mac{pol}(per-layer)")
        self.name = name

    def prefill(self, layer, key, value):
        p = self.mac_config.for_layer(layer)
        if p.miss_policy == "completion":
            if self.maps is None:
                self.maps = random_feature_maps(self._model_config, self.completion)
            st = CompletionOnMiss(self.completion, self.maps, layer)
            st.prefill(key, value, torch.full((key.shape[0],), key.shape[2]), band=p.band)
            self.states[layer] = st

    def decode(self, mac, layer, q, q_pre, key, value, positions, scale):
        p = self.mac_config.for_layer(layer)
        comp = self.states.get(layer) if p.miss_policy == "completion" else None
        res = mac_decode_step_reference(q, q_pre, key, value, positions, mac.slots, *mac.state.layer(layer),
                                        band=p.band, tau=p.tau, enabled=p.enabled, scale=scale,
                                        miss_policy=p.miss_policy, completion=comp, match=p.match,
                                        match_sketch=p.match_sketch, match_candidates=p.match_candidates)
        m = positions.view(-1, 1).expand_as(res.match_pos)
        miss_read = (m + 1).double()
        if comp is not None:
            miss_read = torch.tensor([[comp.miss_cost(int(positions[b]), b, band=p.band, gen_len=self.gen_len)]
                                      for b in range(q.shape[0])], dtype=torch.float64).expand_as(miss_read)
        read = torch.where(res.hit, (m - res.match_pos + p.band).double(), miss_read)
        return res.out, read, res.match_pos, p.band


class RetrievalCompletion(EvalMethod):
    """docs/spec.md §3 on every decode step: sink + tail + Top-k(mid) + generated exact, the rest of the
    prefill's mid region completed through ``maps`` (default: untrained random features);
    ``completion=False`` gives the selection-only baseline; ``selector`` picks the Top-k (None: the
    exhaustive one; e.g. ``PageSummaryTopK``, the page selector); ``gate``: a ``CompletionGate`` (a layer it
    turns off runs Top-k alone at the equal-cost Top-k, ``reference.layer_top_k``; a layer it keeps takes its
    calibrated mass, ``gate.gated_log_phi_q``)."""

    def __init__(self, config: MissCompletionConfig | None = None, *, maps: CompletionFeatureMaps | None = None,
                 completion: bool = True, gen_len: int = 64, name: str | None = None, selector=None,
                 gate: CompletionGate | None = None) -> None:
        if gate is not None and not isinstance(gate, CompletionGate):
            raise TypeError(f"gate must be a CompletionGate or None, got {type(gate).__name__}")
        self.config = config or MissCompletionConfig()
        self.maps = maps
        self.gate = gate
        self._log_mass = gate.log_mass_tensors() if gate is not None else None
        self.use_completion = completion
        self.gen_len = gen_len
        self.selector = selector
        self.caches: dict[int, tuple] = {}
        c = self.config
        self.name = name or (f"{'retrieval-completion' if completion else 'selection-only'}"
                             f"(k={c.top_k},sink={c.n_sink},tail={c.n_tail})")

    def prefill(self, layer, key, value):
        c = self.config
        if self.maps is None:
            self.maps = random_feature_maps(self._model_config, c)
        n = torch.full((key.shape[0],), key.shape[2], dtype=torch.int64)
        lpk = self.maps.log_phi_k(layer, key.transpose(1, 2)).transpose(1, 2).float()   # [B, Hkv, T, F]
        self.caches[layer] = (n, lpk, *build_completion_cache_batched(lpk, value, n, n_sink=c.n_sink,
                                                                      n_tail=c.n_tail))

    def _term(self, layer: int, q: torch.Tensor, key: torch.Tensor, log_mass=None) -> tuple:
        """``(n_prefill [B], completion)``: the ``hybrid_decode_step`` completion tuple of ``layer`` for queries
        ``q [B, Hq, d]`` over ``key [B, Hkv, T, d]``, ``log φ_q`` shifted by ``log_mass [Hq]`` (None: not)."""
        n, lpk, a, b, shift = self.caches[layer]
        pad = key.shape[2] - lpk.shape[2]
        lpk_all = torch.cat([lpk, lpk.new_zeros(*lpk.shape[:2], pad, lpk.shape[3])], dim=2)  # generated rows unread
        return n, (gated_log_phi_q(self.maps.log_phi_q(layer, q).float(), True, log_mass), lpk_all, a, b, shift)

    def decode(self, mac, layer, q, q_pre, key, value, positions, scale):
        c = self.config
        top_k, on = layer_top_k(self.gate, layer, c.top_k, feature_dim=self.maps.spec.feature_dim,
                                head_dim=q.shape[-1])
        on = on and self.use_completion
        n, comp = self._term(layer, q, key, self._log_mass[layer] if self._log_mass is not None else None)
        out, parts = hybrid_decode_step(q, key, value, positions + 1, n, n_sink=c.n_sink, n_tail=c.n_tail,
                                        top_k=top_k, scale=scale, completion=comp if on else None,
                                        return_parts=True, selector=self.selector)
        read = torch.empty(q.shape[:2], dtype=torch.float64)
        for i in range(q.shape[0]):
            pt = partition(int(n[i]), int(positions[i]) + 1, n_sink=c.n_sink, n_tail=c.n_tail)
            k_eff = int(parts["k_eff"][i, 0])
            full_mid = k_eff >= pt.mid_len
            read[i] = token_equivalents(exact_tokens=pt.seq_len - pt.mid_len + k_eff,
                                        feature_dim=self.maps.spec.feature_dim,
                                        head_dim=q.shape[-1], gen_len=self.gen_len, retrieved=k_eff,
                                        completion=on and not full_mid)["total"]
        return out, read, None, 0


class CompletionProbe(RetrievalCompletion):
    """Calibration probe of the completion term (``macattn tune --completion``): the model decodes with full
    attention (each step's output is full attention's), and per layer and step ``records[layer]`` keeps the
    ``hybrid_decode_step`` parts of completion at ``config.top_k`` (uncorrected) — ``out_exact`` / ``out_comp``
    ``[B, Hq, d]``, ``lse_exact`` / ``lse_comp`` ``[B, Hq]`` — with ``full`` ``[B, Hq, d]`` and ``alone``, Top-k
    alone at ``top_k_alone`` (all fp64, CPU): what ``methods.completion.mass.fit_log_mass`` fits the term's mass
    on and what the gate compares it with, on one trajectory for every layer."""

    def __init__(self, config: MissCompletionConfig, *, maps: CompletionFeatureMaps, top_k_alone: int,
                 selector=None, name: str = "completion-probe") -> None:
        super().__init__(config, maps=maps, completion=True, selector=selector, name=name)
        self.top_k_alone = top_k_alone
        self.records: dict[int, list[dict]] = {}

    def decode(self, mac, layer, q, q_pre, key, value, positions, scale):
        c = self.config
        n, comp = self._term(layer, q, key)
        kw = dict(n_sink=c.n_sink, n_tail=c.n_tail, scale=scale, selector=self.selector)
        _, parts = hybrid_decode_step(q, key, value, positions + 1, n, top_k=c.top_k, completion=comp,
                                      return_parts=True, **kw)
        alone = hybrid_decode_step(q, key, value, positions + 1, n, top_k=self.top_k_alone, **kw)
        full = full_attention_reference(q, key, value, positions, scale=scale)
        rec = {k: parts[k] for k in ("out_exact", "out_comp", "lse_exact", "lse_comp")}
        rec.update(full=full.double().cpu(), alone=alone.double().cpu())
        self.records.setdefault(layer, []).append(rec)
        return full, torch.zeros(q.shape[:2], dtype=torch.float64), None, 0


class A3Fusion(EvalMethod):
    """A3 KV fusion (``macattn.methods.a3.reference``, ``runtime.a3_assembly``) of the sample's prompt, then full-attention
    decode. The prompt ``[1, L]`` is read as a RAG prompt: ``system`` its first token (BOS), ``question``
    its last ``question_tokens`` tokens (the task's query and some text before it), the document tokens
    between them cut into chunks of ``chunk_tokens``, each chunk's K/V computed alone."""

    def __init__(self, config: A3Config, *, chunk_tokens: int = 512, question_tokens: int = 64,
                 name: str | None = None) -> None:
        if not isinstance(config, A3Config):
            raise TypeError(f"config must be an A3Config, got {type(config).__name__}")
        for k, v in (("chunk_tokens", chunk_tokens), ("question_tokens", question_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be an int >= 1, got {v!r}")
        self.config, self.chunk_tokens, self.question_tokens = config, chunk_tokens, question_tokens
        args = [] if config.method in (FusionMethod.FULL_RECOMPUTE, FusionMethod.FULL_REUSE) else [f"rho={config.rho}"]
        self.name = name or f"{config.method.value}({','.join(args + [f'chunk={chunk_tokens}'])})"

    def rag_prompt(self, prompt: torch.Tensor):
        from macattn.runtime.a3_assembly import RagPrompt

        ids = prompt.reshape(-1)
        if ids.numel() < self.question_tokens + 2:
            raise ValueError(f"prompt of {ids.numel()} tokens is too short for question_tokens="
                             f"{self.question_tokens} plus a system token and a document token")
        docs = ids[1:ids.numel() - self.question_tokens]
        return RagPrompt(ids[:1], list(docs.split(self.chunk_tokens)), ids[ids.numel() - self.question_tokens:])

    def run(self, model, prompt, steps, forced=None, *, prefilled=None, on_step=None):
        """As ``EvalMethod.run``; ``prefilled`` is ignored (A3 builds the prompt's K/V its own way)."""
        from macattn.runtime.a3_assembly import fused_generate

        tokens, _ = fused_generate(model, self.rag_prompt(prompt), self.config, max_new_tokens=steps, forced=forced)
        return tokens
