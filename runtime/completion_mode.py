"""Retrieval-completion as a runtime attention mode on the model's device, with slot state and budget.

``CompletionDecoder`` patches a LLaMA / Qwen2 / Mistral ``*ForCausalLM`` in place with an
attention function registered with transformers' ``AttentionInterface`` as
``"macattn_completion"`` and runs greedy generation with in-flight batching over
``CompletionState`` slots (``runtime.completion_state``):

* prefill (one request, ``N`` tokens): exact causal attention; the request's post-RoPE K/V and
  ``log φ_k`` of its keys are written to its slot and the stable completion cache of its mid
  region is built (``macattn::completion_cache``; ``build_completion_cache`` when the op is not used);
* decode (a batch of requests of different lengths, one token each): the token's K/V are
  appended to the slot rows and attention is ``macattn::retrieval_completion`` (on CUDA the Triton
  kernels of ``macattn.plugins.retrieval_completion``, on the CPU the fp64 reference; with
  ``selector="pages"`` always the reference with ``PageSummaryTopK``).

The model runs with ``use_cache=False``: the slot rows are the KV cache. A slot is reset when a
request is admitted and when it is released. ``budget_report`` gives the KV reads per decode step
and KV head in token-equivalents (``macattn.methods.completion.reference.token_equivalents``).
"""
from __future__ import annotations

from collections import deque

import torch

from macattn.methods.completion.reference import (CompletionConfig, build_completion_cache, hybrid_decode_step, partition,
                                retrieval_completion_step, token_equivalents)
from macattn.methods.completion.feature_maps import CompletionFeatureMaps

from macattn.methods.completion.state import CompletionState

__all__ = ["IMPL_NAME", "CompletionDecoder", "completion_op"]

IMPL_NAME = "macattn_completion"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def completion_op():
    """``torch.ops.macattn.retrieval_completion``: the Triton kernels on CUDA when triton is importable
    (``macattn.plugins`` registers them), the reference elsewhere."""
    import macattn.methods.completion.ops  # noqa: F401
    import macattn.plugins  # noqa: F401
    return torch.ops.macattn.retrieval_completion


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query ``[B, Hq, T, d]``, key/value ``[B, Hkv, T, d]`` of this call's tokens only
    (``use_cache=False``); returns ``([B, T, Hq, d], None)``."""
    dec: CompletionDecoder = module._macattn_completion
    return dec._attend(module.layer_idx, query, key, value, float(scaling)), None


class CompletionDecoder:
    """Greedy generation with retrieval-completion decode attention (see the module docstring).

    model: a supported ``*ForCausalLM`` (patched in place; ``unpatch()`` restores it); maps: the
    distilled ``CompletionFeatureMaps`` of that model; config: ``CompletionConfig`` (n_sink,
    n_tail, top_k or budget fraction, selector); num_slots: requests in flight at most;
    max_seq_len: prompt + generated tokens per request at most; use_op: None = the ops
    (``completion_op``), False = the fp64 reference functions called directly. State lives on the
    model's device.
    """

    def __init__(self, model, maps: CompletionFeatureMaps, config: CompletionConfig, *, num_slots: int = 4,
                 max_seq_len: int = 1024, use_op: bool | None = None) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise TypeError(f"model must be one of {SUPPORTED_ARCHITECTURES}, got {arch}")
        if not isinstance(config, CompletionConfig):
            raise TypeError(f"config must be a CompletionConfig, got {type(config).__name__}")
        if not isinstance(maps, CompletionFeatureMaps):
            raise TypeError(f"maps must be a CompletionFeatureMaps, got {type(maps).__name__}")
        if hasattr(model, "_macattn_completion"):
            raise ValueError("model is already patched with a CompletionDecoder")
        hf = model.config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        spec = maps.spec
        if (spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim) != (
                hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, head_dim):
            raise ValueError(f"maps {spec} do not fit the model ({hf.num_hidden_layers} layers, "
                             f"{hf.num_attention_heads}/{hf.num_key_value_heads} heads, head_dim {head_dim})")
        self.model, self.maps, self.config = model.eval(), maps.eval(), config
        self.num_q_heads, self.head_dim = hf.num_attention_heads, head_dim
        param = next(model.parameters())
        self.device = param.device
        self.maps = self.maps.to(self.device)
        self.state = CompletionState.allocate(num_layers=hf.num_hidden_layers, num_slots=num_slots,
                                              num_kv_heads=hf.num_key_value_heads, max_seq_len=max_seq_len,
                                              head_dim=head_dim, feature_dim=spec.feature_dim, dtype=param.dtype,
                                              device=self.device)
        op = completion_op() if use_op is not False else None
        self.op = op if config.selector == "exact" else None
        self.selector = config.selector_impl()
        self._slots: torch.Tensor | None = None
        self._prefill = False
        self.step_log: list[dict] = []   # one entry per (decode step, request)
        self._request_of_slot = [-1] * num_slots
        self._next_request = 0
        self._prev_impl = hf._attn_implementation
        AttentionInterface.register(IMPL_NAME, _attention)
        AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)
        for layer in model.model.layers:
            layer.self_attn._macattn_completion = self
        model._macattn_completion = self
        model.set_attn_implementation(IMPL_NAME)

    def unpatch(self) -> None:
        for layer in self.model.model.layers:
            del layer.self_attn._macattn_completion
        del self.model._macattn_completion
        self.model.set_attn_implementation(self._prev_impl)

    # --- attention ------------------------------------------------------------------------
    def _attend(self, layer: int, query, key, value, scale: float) -> torch.Tensor:
        st, cfg = self.state, self.config
        slots = self._slots
        B, Hq, T, d = query.shape
        pos = st.seq_len[slots]
        if self._prefill:
            s = int(slots[0])
            st.k[layer][s, :, :T] = key[0]
            st.v[layer][s, :, :T] = value[0]
            with torch.no_grad():
                lpk = self.maps.log_phi_k(layer, key[0].transpose(0, 1)).transpose(0, 1)  # [Hkv, T, F]
            st.log_phi_k[layer][s, :, :T] = lpk
            if self.op is not None:
                a, b, c = torch.ops.macattn.completion_cache(lpk[None], value[:1], torch.tensor([T], device=lpk.device),
                                                             cfg.n_sink, cfg.n_tail)
                a, b, c = a[0], b[0], c[0]
            else:
                p = partition(T, T, n_sink=cfg.n_sink, n_tail=cfg.n_tail)
                a, b, c = build_completion_cache(lpk[:, p.mid_start:p.mid_end], value[0, :, p.mid_start:p.mid_end])
            st.comp_a[layer][s], st.comp_b[layer][s], st.comp_shift[layer][s] = a, b, c
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                                   enable_gqa=True)
            return out.transpose(1, 2)
        rows = torch.arange(B, device=query.device)
        for name, x in (("k", key), ("v", value)):
            getattr(st, name)[layer][slots, :, pos] = x[rows, :, 0]
        seq_lens = pos + 1
        width = int(seq_lens.max())
        q = query[:, :, 0]
        with torch.no_grad():
            lpq = self.maps.log_phi_q(layer, q)
        npf = st.n_prefill[slots]
        out = torch.empty_like(q)
        ks = [cfg.k_for(partition(int(n), int(n), n_sink=cfg.n_sink, n_tail=cfg.n_tail).mid_len) for n in npf]
        for k in sorted(set(ks)):   # one call per distinct Top-k (differs per row only with a budget fraction)
            idx = torch.tensor([i for i, kk in enumerate(ks) if kk == k], dtype=torch.int64, device=query.device)
            sl = slots[idx]
            args = (q[idx], st.k[layer][sl, :, :width], st.v[layer][sl, :, :width], seq_lens[idx], npf[idx],
                    lpq[idx], st.log_phi_k[layer][sl, :, :width], st.comp_a[layer][sl], st.comp_b[layer][sl],
                    st.comp_shift[layer][sl])
            if self.op is not None:
                out[idx] = self.op(*args, cfg.n_sink, cfg.n_tail, k, scale)
            elif cfg.selector == "exact":
                out[idx] = retrieval_completion_step(*args, n_sink=cfg.n_sink, n_tail=cfg.n_tail, top_k=k, scale=scale)
            else:
                out[idx] = hybrid_decode_step(*args[:5], n_sink=cfg.n_sink, n_tail=cfg.n_tail, top_k=k, scale=scale,
                                              selector=self.selector, completion=args[5:])
        if layer == 0:
            for i in range(B):
                p = partition(int(npf[i]), int(seq_lens[i]), n_sink=cfg.n_sink, n_tail=cfg.n_tail)
                self.step_log.append({"request": self._request_of_slot[int(slots[i])], "n_prefill": p.n_prefill, "seq_len": p.seq_len,
                                      "mid": p.mid_len, "retrieved": ks[i],
                                      "exact": p.seq_len - p.mid_len + ks[i]})
        return out.unsqueeze(1)

    # --- requests -------------------------------------------------------------------------
    @torch.inference_mode()
    def admit(self, prompt) -> tuple[int, torch.Tensor]:
        """Take a slot and prefill ``prompt`` (1-D int tensor / list); returns ``(slot, logits [V])``."""
        ids = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1)
        n = ids.numel()
        if not 1 <= n < self.state.max_seq_len:
            raise ValueError(f"prompt length must be in [1, {self.state.max_seq_len - 1}], got {n}")
        slot = self.state.acquire()
        self._request_of_slot[slot], self._next_request = self._next_request, self._next_request + 1
        self._slots, self._prefill = torch.tensor([slot], device=self.device), True
        try:
            out = self.model(input_ids=ids[None].to(self.device), use_cache=False, logits_to_keep=1,
                             position_ids=torch.arange(n, device=self.device)[None])
        finally:
            self._slots, self._prefill = None, False
        self.state.seq_len[slot] = n
        self.state.n_prefill[slot] = n
        return slot, out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed one token per request in ``slots`` at its next position; returns logits ``[B, V]``."""
        if len(slots) != len(tokens) or not slots:
            raise ValueError(f"slots and tokens must be non-empty and of equal length, got {len(slots)}, {len(tokens)}")
        for s in slots:
            if not bool(self.state.in_use[s]):
                raise ValueError(f"slot {s} is not in use")
            if int(self.state.seq_len[s]) >= self.state.max_seq_len:
                raise ValueError(f"slot {s} is full (max_seq_len={self.state.max_seq_len})")
        sl = torch.tensor(slots, dtype=torch.int64, device=self.device)
        pos = self.state.seq_len[sl].clone()
        self._slots = sl
        try:
            out = self.model(input_ids=torch.tensor(tokens, dtype=torch.int64, device=self.device)[:, None],
                             position_ids=pos[:, None], use_cache=False, logits_to_keep=1)
        finally:
            self._slots = None
        self.state.seq_len[sl] = pos + 1
        return out.logits[:, -1]

    def release(self, slot: int) -> None:
        self.state.release(slot)

    def generate(self, prompts, *, max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy generation of every prompt with in-flight batching over the slots; returns the
        generated token ids per prompt (``max_new_tokens`` each)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        pending = deque(enumerate(prompts))
        outputs: list[list[int]] = [[] for _ in prompts]
        active: dict[int, int] = {}   # slot -> prompt index
        while pending or active:
            while pending and self.state.num_free:
                i, p = pending.popleft()
                slot, logits = self.admit(p)
                outputs[i].append(int(logits.argmax()))
                if max_new_tokens == 1:
                    self.release(slot)
                else:
                    active[slot] = i
            if not active:
                continue
            slots = sorted(active)
            logits = self.decode(slots, [outputs[active[s]][-1] for s in slots])
            for s, row in zip(slots, logits):
                i = active[s]
                outputs[i].append(int(row.argmax()))
                if len(outputs[i]) == max_new_tokens:
                    self.release(s)
                    del active[s]
        return outputs

    # --- accounting -----------------------------------------------------------------------
    def budget_report(self, gen_len: int | None = None) -> dict:
        """KV reads per decode step and KV head, in token-equivalents, over the logged steps.

        ``exact`` counts, per query head, sink + tail + retrieved + generated tokens; under GQA a
        KV head reads the union of its query heads' retrieved sets, at most ``group·k``
        (``exact_kv_worst``). The completion cache ``(F·d + 2F)/(2d)`` is charged once per request
        and amortised over ``gen_len`` steps (default: the steps actually logged per request;
        ``gen_len=1`` is the worst case); the retrieved tokens' ``log φ_k`` rows add ``F/(2d)`` each.
        ``full`` is what exact attention would read (``seq_len``).
        """
        if not self.step_log:
            return {"steps": 0}
        f, d = self.maps.spec.feature_dim, self.head_dim
        grp = self.num_q_heads // self.maps.spec.num_kv_heads
        per_req: dict[int, int] = {}
        for e in self.step_log:
            per_req[e["request"]] = per_req.get(e["request"], 0) + 1
        tot = {"exact": 0.0, "exact_kv_worst": 0.0, "total": 0.0, "total_kv_worst": 0.0, "full": 0.0}
        for e in self.step_log:
            g = gen_len or per_req[e["request"]]
            comp = e["mid"] > e["retrieved"]
            union = min(e["mid"], grp * e["retrieved"])
            te = token_equivalents(exact_tokens=e["exact"], feature_dim=f, head_dim=d, gen_len=g,
                                   retrieved=e["retrieved"], completion=comp)
            tw = token_equivalents(exact_tokens=e["exact"] - e["retrieved"] + union, feature_dim=f, head_dim=d,
                                   gen_len=g, retrieved=union, completion=comp)
            tot["exact"] += e["exact"]
            tot["exact_kv_worst"] += tw["exact"]
            tot["total"] += te["total"]
            tot["total_kv_worst"] += tw["total"]
            tot["full"] += e["seq_len"]
        n = len(self.step_log)
        rep = {k: v / n for k, v in tot.items()}
        rep.update(steps=n, requests=len(per_req), fraction_of_full=tot["total"] / tot["full"],
                   fraction_of_full_kv_worst=tot["total_kv_worst"] / tot["full"],
                   cache_once=token_equivalents(exact_tokens=0, feature_dim=f, head_dim=d)["cache_once"],
                   op="torch.ops.macattn.retrieval_completion" if self.op is not None else "reference")
        return rep
