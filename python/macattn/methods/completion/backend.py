"""Retrieval-completion (docs/spec.md §3) as an ``AttentionMethod``: the request's K/V live in its
``CompletionState`` rows (``capabilities.paged_kv`` is False: the engine runs the model without
a KV cache and this method is the cache).

* prefill (one request, ``N`` tokens): exact causal attention; the request's post-RoPE K/V and
  ``log φ_k`` of its keys go to its rows and the stable completion cache of its mid region is
  built (``macattn::completion_cache``; ``build_completion_cache`` with ``use_op=False``);
* decode (requests of different lengths, one token each at ``StepContext.positions``): the
  token's K/V are appended to the rows and attention is ``macattn::retrieval_completion`` over
  the state's rows in place, picked by slot (on CUDA the Triton kernels once
  ``register_kernels()`` ran, on the CPU the fp64 reference; with ``selector="pages"`` the
  reference functions with ``PageSummaryTopK``). With a fixed ``top_k`` the op path has no host
  synchronisation, so the runtime captures the whole step in a CUDA graph
  (``decode_capturable``); the per-step log is written by ``decoded`` from host values.

With a gate (``CompletionConfig.gate``) a layer whose term is off runs Top-k alone at the Top-k of equal
token-equivalents (``reference.layer_top_k``), through the same op with ``log φ_q = -inf``; a layer whose term is
on takes the gate's calibrated mass as ``log φ_q + δ`` (``gate.gated_log_phi_q``).

``budget_report`` gives the KV reads per decode step and KV head in token-equivalents
(``macattn.methods.completion.reference.token_equivalents``) over the logged steps.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from macattn.methods.base import AttentionMethod, Capabilities, ModelDims
from macattn.methods.completion import ops  # noqa: F401  (defines the torch ops)
from macattn.methods.completion.feature_maps import CompletionFeatureMaps, fitted_maps
from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.gate import gated_log_phi_q
from macattn.methods.completion.reference import (build_completion_cache, hybrid_decode_step, layer_top_k,
                                                  make_selector, page_retrieval_completion_step, partition,
                                                  retrieval_completion_step, token_equivalents)
from macattn.methods.completion.state import CompletionState

__all__ = ["CompletionAttention"]


class CompletionAttention(AttentionMethod):
    """maps: the distilled ``CompletionFeatureMaps`` of the model; max_seq_len: prompt + generated
    tokens per request at most (the rows' length); use_op: None/True = the torch ops, False = the
    fp64 reference functions called directly. State lives on the model's device."""

    name: ClassVar[str] = "completion"
    config_type: ClassVar[type] = CompletionConfig
    capabilities: ClassVar[Capabilities] = Capabilities(paged_kv=False, cuda_graphs=True, onnx_export=True,
                                                        tensorrt_plugin=True)

    def __init__(self, config: CompletionConfig, dims: ModelDims, *, num_slots: int,
                 maps: CompletionFeatureMaps, max_seq_len: int, use_op: bool | None = None) -> None:
        super().__init__(config, dims, num_slots=num_slots)
        self.maps = fitted_maps(maps, dims)
        spec = self.maps.spec
        if config.gate is not None:
            config.gate.check_layers(dims.num_layers, dims.num_q_heads)
        self._log_mass = (config.gate.log_mass_tensors(dims.device) if config.gate is not None
                          else [None] * dims.num_layers)
        self.state = CompletionState.allocate(num_layers=dims.num_layers, num_slots=num_slots,
                                              num_kv_heads=dims.num_kv_heads, max_seq_len=max_seq_len,
                                              head_dim=dims.head_dim, feature_dim=spec.feature_dim, dtype=dims.dtype,
                                              device=dims.device,
                                              page_size=config.page_size if config.selector == "quest" else 0)
        self.use_op = use_op is not False and config.selector in ("exact", "quest")
        self.selector = (None if config.selector == "quest" else
                         make_selector(config.selector, page_size=config.page_size, overfetch=config.page_overfetch))
        self.step_log: list[dict] = []   # one entry per (decode step, request)
        self._request_of_slot = [-1] * num_slots
        self._n_prefill = [0] * num_slots      # host copy of state.n_prefill (set at prefill)
        self._next_request = 0

    def slot_states(self):
        return {"completion": self.state}

    def _slots(self, step) -> torch.Tensor:
        if step.slots is None:
            raise RuntimeError("retrieval-completion runs under the engine (StepContext.slots must be set)")
        return step.slots.to(self.state.seq_len.device)

    # --- attention ---------------------------------------------------------------------------
    def prefill(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        st, cfg = self.state, self.config
        slots = self._slots(step)
        if slots.numel() != 1 or key.shape[2] != query.shape[2]:
            raise ValueError("retrieval-completion prefills one fresh request per call")
        T = query.shape[2]
        if T >= st.max_seq_len:
            raise ValueError(f"prompt length must be in [1, {st.max_seq_len - 1}], got {T}")
        s = int(slots[0])
        st.k[layer][s, :, :T] = key[0]
        st.v[layer][s, :, :T] = value[0]
        with torch.no_grad():
            lpk = self.maps.log_phi_k(layer, key[0].transpose(0, 1)).transpose(0, 1)  # [Hkv, T, F]
        st.log_phi_k[layer][s, :, :T] = lpk
        if self.use_op:
            a, b, c = torch.ops.macattn.completion_cache(lpk[None], value[:1], torch.tensor([T], device=lpk.device),
                                                         cfg.n_sink, cfg.n_tail)
            a, b, c = a[0], b[0], c[0]
        else:
            p = partition(T, T, n_sink=cfg.n_sink, n_tail=cfg.n_tail)
            a, b, c = build_completion_cache(lpk[:, p.mid_start:p.mid_end], value[0, :, p.mid_start:p.mid_end])
        st.comp_a[layer][s], st.comp_b[layer][s], st.comp_shift[layer][s] = a, b, c
        if st.page_size:
            st.set_page_bounds(layer, s, key[0])
        st.seq_len[s] = T
        st.n_prefill[s] = T
        if layer == 0:
            self._request_of_slot[s], self._next_request = self._next_request, self._next_request + 1
            self._n_prefill[s] = T
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                               enable_gqa=True)
        return out.transpose(1, 2)

    def decode_capturable(self) -> bool:
        # a Top-k budget fraction makes k a per-request host value (one op call per distinct k),
        # and the fp64 reference path reads lengths on the host
        return self.use_op and self.config.top_k is not None

    def decode(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        st = self.state
        slots = self._slots(step)
        B = query.shape[0]
        if step.positions is None or step.positions.shape != (B,):
            raise ValueError(f"retrieval-completion decode needs StepContext.positions [B]={B}")
        pos = step.positions.to(slots.device)
        # the engine admits prompt + max_new_tokens <= max_seq_len; eager calls check it again
        capturing = pos.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and bool((pos >= st.max_seq_len).any()):
            raise ValueError(f"a request is full (max_seq_len={st.max_seq_len})")
        rows = torch.arange(B, device=query.device)
        for name, x in (("k", key), ("v", value)):
            getattr(st, name)[layer][slots, :, pos] = x[rows, :, 0]
        if st.page_size:
            st.extend_page_bounds(layer, slots, pos, key[rows, :, 0])
        seq_lens = pos + 1
        st.seq_len[slots] = seq_lens
        q = query[:, :, 0]
        with torch.no_grad():
            lpq = self.maps.log_phi_q(layer, q)
        if self.use_op:
            out = self._decode_op(layer, q, lpq, slots, seq_lens, scale)
        else:
            out = self._decode_reference(layer, q, lpq, slots, seq_lens, scale)
        return out.unsqueeze(1)

    def _layer_k(self, layer: int, k: int) -> tuple[int, bool]:
        """``(Top-k, completion on)`` of ``layer`` for a request of Top-k ``k`` (``reference.layer_top_k``)."""
        return layer_top_k(self.config.gate, layer, k, feature_dim=self.maps.spec.feature_dim, head_dim=self.dims.head_dim)

    def _decode_op(self, layer, q, lpq, slots, seq_lens, scale) -> torch.Tensor:
        """``macattn::retrieval_completion`` over every slot's rows in place (no gathered copy of
        any K/V): rows not in this step see their first token only (length 1, no prefill) and
        their outputs are dropped. One call per distinct Top-k (one call with a fixed ``top_k``,
        which the op clamps to each row's mid region); the layer's gate picks its Top-k and masks or weighs its
        term."""
        st, cfg = self.state, self.config
        S = st.num_slots
        groups = [(cfg.top_k, None)] if cfg.top_k is not None else self._k_groups(slots)
        out = torch.empty_like(q)
        for k, idx in groups:
            k, on = self._layer_k(layer, k)
            sl, qs, lq, ln = (slots, q, lpq, seq_lens) if idx is None else (slots[idx], q[idx], lpq[idx], seq_lens[idx])
            lq = gated_log_phi_q(lq, on, self._log_mass[layer])
            lens = torch.ones(S, dtype=ln.dtype, device=ln.device)
            lens[sl] = ln
            npf = torch.zeros_like(lens)
            npf[sl] = st.n_prefill[sl]
            q_all = qs.new_zeros((S,) + tuple(qs.shape[1:]))
            q_all[sl] = qs
            lpq_all = lq.new_zeros((S,) + tuple(lq.shape[1:]))
            lpq_all[sl] = lq
            common = (q_all, st.k[layer], st.v[layer], lens, npf, lpq_all, st.log_phi_k[layer], st.comp_a[layer],
                      st.comp_b[layer], st.comp_shift[layer])
            if cfg.selector == "quest":
                res = torch.ops.macattn.page_retrieval_completion(
                    *common, st.page_lo[layer], st.page_hi[layer], cfg.n_sink, cfg.n_tail, cfg.page_size,
                    cfg.pages_for(k), scale)
            else:
                res = torch.ops.macattn.retrieval_completion(*common, cfg.n_sink, cfg.n_tail, k, scale)
            if idx is None:
                out = res[sl]
            else:
                out[idx] = res[sl]
        return out

    def _decode_reference(self, layer, q, lpq, slots, seq_lens, scale) -> torch.Tensor:
        """The fp64 reference functions on gathered rows (``use_op=False``, or a non-exact selector); the layer's
        gate picks its Top-k and masks or weighs its term."""
        st, cfg = self.state, self.config
        width = int(seq_lens.max())
        npf = st.n_prefill[slots]
        out = torch.empty_like(q)
        for k, idx in self._k_groups(slots):
            k, on = self._layer_k(layer, k)
            sl = slots[idx]
            args = (q[idx], st.k[layer][sl, :, :width], st.v[layer][sl, :, :width], seq_lens[idx], npf[idx],
                    gated_log_phi_q(lpq[idx], on, self._log_mass[layer]), st.log_phi_k[layer][sl, :, :width], st.comp_a[layer][sl], st.comp_b[layer][sl],
                    st.comp_shift[layer][sl])
            if cfg.selector == "exact":
                out[idx] = retrieval_completion_step(*args, n_sink=cfg.n_sink, n_tail=cfg.n_tail, top_k=k, scale=scale)
            elif cfg.selector == "quest":
                out[idx] = page_retrieval_completion_step(*args, n_sink=cfg.n_sink, n_tail=cfg.n_tail,
                                                          page_size=cfg.page_size, budget_pages=cfg.pages_for(k),
                                                          scale=scale)
            else:
                out[idx] = hybrid_decode_step(*args[:5], n_sink=cfg.n_sink, n_tail=cfg.n_tail, top_k=k, scale=scale,
                                              selector=self.selector, completion=args[5:])
        return out

    def _k_groups(self, slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """The batch rows grouped by their Top-k: ``(k, row indices [n] int64)`` per distinct k (rows
        differ only with a budget fraction; reads ``slots`` on the host)."""
        ks = [self._k_of(s) for s in slots.tolist()]
        return [(k, torch.tensor([i for i, kk in enumerate(ks) if kk == k], dtype=torch.int64, device=slots.device))
                for k in sorted(set(ks))]

    def _k_of(self, slot: int) -> int:
        """Top-k of the request in ``slot`` (from its prefill length, a host value kept at prefill)."""
        n, cfg = self._n_prefill[slot], self.config
        return cfg.k_for(partition(n, n, n_sink=cfg.n_sink, n_tail=cfg.n_tail).mid_len)

    def decoded(self, slots: list[int], positions: list[int]) -> None:
        cfg = self.config
        for s, m in zip(slots, positions):
            p = partition(self._n_prefill[s], m + 1, n_sink=cfg.n_sink, n_tail=cfg.n_tail)
            k = self._k_of(s)
            per_layer = [self._layer_k(layer, k) for layer in range(self.dims.num_layers)]
            self.step_log.append({"request": self._request_of_slot[s], "n_prefill": p.n_prefill,
                                  "seq_len": p.seq_len, "mid": p.mid_len, "retrieved": k,
                                  "exact": p.seq_len - p.mid_len + k,
                                  "per_layer": [(min(kl, p.mid_len), on) for kl, on in per_layer]})

    # --- accounting -----------------------------------------------------------------------
    def budget_report(self, gen_len: int | None = None) -> dict:
        """KV reads per decode step and KV head, in token-equivalents, over the logged steps.

        ``exact`` counts, per query head, sink + tail + retrieved + generated tokens; under GQA a
        KV head reads the union of its query heads' retrieved sets, at most ``group·k``
        (``exact_kv_worst``). The completion cache ``(F·d + 2F)/(2d)`` is charged once per request
        and amortised over ``gen_len`` steps (default: the steps actually logged per request;
        ``gen_len=1`` is the worst case); the retrieved tokens' ``log φ_k`` rows add ``F/(2d)`` each.
        ``full`` is what exact attention would read (``seq_len``). Means over the layers, each at its gated Top-k
        (a layer whose term is off pays no cache and no ``log φ_k`` rows).
        """
        if not self.step_log:
            return {"steps": 0}
        f, d = self.maps.spec.feature_dim, self.dims.head_dim
        grp = self.dims.num_q_heads // self.maps.spec.num_kv_heads
        per_req: dict[int, int] = {}
        for e in self.step_log:
            per_req[e["request"]] = per_req.get(e["request"], 0) + 1
        tot = {"exact": 0.0, "exact_kv_worst": 0.0, "total": 0.0, "total_kv_worst": 0.0, "full": 0.0}
        for e in self.step_log:
            g = gen_len or per_req[e["request"]]
            anchors = e["seq_len"] - e["mid"]
            for k, on in e["per_layer"]:          # the mean over layers (a gate changes a layer's k and term)
                comp = on and e["mid"] > k
                union = min(e["mid"], grp * k)
                te = token_equivalents(exact_tokens=anchors + k, feature_dim=f, head_dim=d, gen_len=g, retrieved=k,
                                       completion=comp)
                tw = token_equivalents(exact_tokens=anchors + union, feature_dim=f, head_dim=d, gen_len=g,
                                       retrieved=union, completion=comp)
                share = 1.0 / len(e["per_layer"])
                tot["exact"] += te["exact"] * share
                tot["exact_kv_worst"] += tw["exact"] * share
                tot["total"] += te["total"] * share
                tot["total_kv_worst"] += tw["total"] * share
            tot["full"] += e["seq_len"]
        n = len(self.step_log)
        rep = {k: v / n for k, v in tot.items()}
        rep.update(steps=n, requests=len(per_req), fraction_of_full=tot["total"] / tot["full"],
                   fraction_of_full_kv_worst=tot["total_kv_worst"] / tot["full"],
                   cache_once=token_equivalents(exact_tokens=0, feature_dim=f, head_dim=d)["cache_once"],
                   op="torch.ops.macattn.retrieval_completion" if self.use_op else "reference")
        return rep
