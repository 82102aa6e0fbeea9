"""MAC with completion on a miss (``MacConfig.miss_policy = "completion"``), plain-torch reference.

A MAC miss normally costs full attention over ``[0, m]``. With this policy a missing head
computes its ring entry ``AS^{(m)}_{[0, m-r]}`` with the Top-k retrieval + linear-attention
completion of docs/spec.md §3 instead, and its output is that entry merged with the exact band
``AS_{[m-r+1, m]}`` — the same split MAC already uses (docs/spec.md §1 step 3), so hits, ring
entries and the merge algebra are unchanged. It lives with the completion method, whose estimator it
is: MAC's reference step takes it as an object (``completion=``) and never imports it.

Per request the prefill of ``N`` tokens is partitioned as in ``macattn.methods.completion.reference``, with the
tail widened to at least the band: sink ``[0, s0)``, mid ``M = [s0, m1)`` with
``m1 = max(s0, N - max(n_tail, band))``. Every decode position ``m >= N`` then has
``M ⊂ [0, m - r]``, so the band never overlaps the completed region. For a missing head::

    E     = ([0, m-r] \\ M) ∪ R          R = Top-k of M by q·k (per query head)
    entry = AS_E ⊕ C                   C = completion of M \\ R as a summary:
            lse_C = logsumexp_f(a_f + log b'_f),  o_C = Σ_f softmax_f(a_f + log b'_f) A'_f / b'_f,
            a_f = log φ_q(q)_f + shift_f,  (A', b') = cache minus R's features (clamped)
    out   = entry ⊕ AS_[m-r+1, m]

When ``top_k >= |M|`` (or ``M`` is empty) ``R = M``, ``C`` is empty and the step equals the
plain MAC miss exactly. The feature maps are ``macattn.methods.completion.feature_maps.CompletionFeatureMaps``
(per layer, φ_q per query head, φ_k per KV head): trained ones from ``macattn distill-completion``,
or freshly initialised ones, which are exactly the positive random-feature (Performer) estimator
of ``exp(s q·k)`` — unbiased but noisy; ``macattn eval`` records which were used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from macattn.core.validation import check_int
from macattn.methods.completion.reference import ExhaustiveTopK, build_completion_cache, partition, subtract_retrieved, token_equivalents
from macattn.methods.completion.feature_maps import CompletionFeatureMaps, FeatureMapSpec
from macattn.core.attention import expand_kv_heads
from macattn.core.summaries import AttentionSummary, merge_summaries, summarize

__all__ = ["MissCompletionConfig", "CompletionOnMiss", "random_feature_maps"]


@dataclass(frozen=True)
class MissCompletionConfig:
    """n_sink / n_tail: exact prefix / suffix of the prefill (the tail is widened to the band);
    top_k: retrieved mid tokens per query head (>= 0); feature_dim / seed: ``F`` (>= 1) and
    projection seed of untrained maps (``random_feature_maps``; trained maps bring their own)."""

    n_sink: int = 16
    n_tail: int = 64
    top_k: int = 64
    feature_dim: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name, lo in (("n_sink", 0), ("n_tail", 0), ("top_k", 0), ("feature_dim", 1), ("seed", 0)):
            check_int(name, getattr(self, name), lo)


def random_feature_maps(model_config, config: "MissCompletionConfig") -> CompletionFeatureMaps:
    """Untrained ``CompletionFeatureMaps`` for a transformers ``model_config``: at init they are the
    positive random-feature estimator of ``exp(s q·k)`` (see ``macattn.methods.completion.feature_maps``)."""
    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return CompletionFeatureMaps(FeatureMapSpec(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                                                head_dim, feature_dim=config.feature_dim, seed=config.seed)).eval()


class CompletionOnMiss:
    """Completion state of one layer for the rows of a batch, built from the prefill's K/V.

    maps: the model's feature maps (``layer`` picks this layer's φ_q / φ_k). Call
    ``prefill(k, v, n_prefill, band=...)`` once after the prompt, then pass this object as
    ``completion=`` to ``macattn.methods.mac.reference.mac_decode_step_reference(..., miss_policy="completion")``;
    batch row ``b`` of every decode call must be the request of prefill row ``b``.
    """

    def __init__(self, config: MissCompletionConfig, maps: CompletionFeatureMaps, layer: int) -> None:
        if not isinstance(config, MissCompletionConfig):
            raise TypeError(f"config must be a MissCompletionConfig, got {type(config).__name__}")
        if not isinstance(maps, CompletionFeatureMaps):
            raise TypeError(f"maps must be a CompletionFeatureMaps, got {type(maps).__name__}")
        check_int("layer", layer, 0)
        if layer >= maps.spec.num_layers:
            raise ValueError(f"layer must be < the maps' num_layers={maps.spec.num_layers}, got {layer}")
        self.config, self.maps, self.layer = config, maps, layer
        self.head_dim = maps.spec.head_dim
        self.scale = maps.spec.attn_scale
        self.mids: list[tuple[int, int]] = []
        self.caches: list[tuple[torch.Tensor, ...]] = []   # per row: A, b, shift [Hkv, F(, d)], log φ_k [Hkv, M, F]

    def _log_phi_k(self, k: torch.Tensor) -> torch.Tensor:
        """``[Hkv, M, d] -> [Hkv, M, F]`` fp64."""
        return self.maps.log_phi_k(self.layer, k.transpose(0, 1)).transpose(0, 1).double()

    @torch.no_grad()
    def prefill(self, k: torch.Tensor, v: torch.Tensor, n_prefill: torch.Tensor, *, band: int) -> None:
        """k, v ``[B, Hkv, T, d]`` (post-RoPE keys); n_prefill ``[B]`` prompt lengths ``<= T``."""
        if k.dim() != 4 or v.shape != k.shape:
            raise ValueError(f"k and v must both be [B, Hkv, T, d], got {tuple(k.shape)} and {tuple(v.shape)}")
        if (k.shape[1], k.shape[3]) != (self.maps.spec.num_kv_heads, self.head_dim):
            raise ValueError(f"k must have Hkv={self.maps.spec.num_kv_heads} heads of d={self.head_dim} "
                             f"(the feature maps'), got {tuple(k.shape)}")
        check_int("band", band, 0)
        c = self.config
        self.mids, self.caches = [], []
        for b, n in enumerate(n_prefill.tolist()):
            if not 0 <= n <= k.shape[2]:
                raise ValueError(f"n_prefill[{b}] must be in [0, T={k.shape[2]}], got {n}")
            p = partition(n, n, n_sink=c.n_sink, n_tail=max(c.n_tail, band))
            self.mids.append((p.mid_start, p.mid_end))
            lpk = self._log_phi_k(k[b, :, p.mid_start:p.mid_end])
            self.caches.append((*build_completion_cache(lpk, v[b, :, p.mid_start:p.mid_end]), lpk))

    @torch.no_grad()
    def entry_summary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
                      band: int) -> AttentionSummary:
        """Approximate ``AS^{(m)}_{[0, m-r]}`` for every head: o ``[B, Hq, d]``, lse ``[B, Hq]`` (fp64)."""
        B, Hq, d = q.shape
        if len(self.mids) != B:
            raise ValueError(f"CompletionOnMiss was prefilled for {len(self.mids)} rows, the step has {B}")
        group = Hq // k.shape[1]
        kv_of = torch.arange(Hq, device=q.device) // group
        t = torch.arange(k.shape[2], device=q.device)
        os, lses = [], []
        for b in range(B):
            m = int(positions[b])
            ms, me = self.mids[b]
            if me > ms and me - 1 > m - band:
                raise ValueError(f"position {m} of row {b} is inside its prefill (mid ends at {me}, band {band}); "
                                 "completion on a miss is for decode positions >= the prompt length")
            kk = expand_kv_heads(k[b:b + 1], Hq)[0].double()           # [Hq, T, d]
            vv = expand_kv_heads(v[b:b + 1], Hq)[0].double()
            qd = q[b].double()
            logits = torch.einsum("hd,htd->ht", qd, kk) * self.scale
            exact = ((t <= m - band) & ((t < ms) | (t >= me))).expand(Hq, -1).clone()
            k_eff = min(self.config.top_k, me - ms)
            sel = torch.zeros(Hq, 0, dtype=torch.int64, device=q.device)
            if k_eff:
                sel = torch.cat([ExhaustiveTopK().select(qd[g * group:(g + 1) * group], k[b, g, ms:me], k_eff,
                                                         self.scale) for g in range(k.shape[1])])   # [Hq, k]
                exact.scatter_(1, ms + sel, True)
            part = summarize(logits, vv, exact)
            if k_eff < me - ms:   # R ⊊ M: complete the rest from the cache
                a, bb, shift, lpk = self.caches[b]
                g = kv_of[:, None]
                v_sel = vv[torch.arange(Hq)[:, None], ms + sel]
                a2, b2 = subtract_retrieved(a[kv_of], bb[kv_of], shift[kv_of], lpk[g, sel], v_sel)
                la = self.maps.log_phi_q(self.layer, q[b]).double() + shift[kv_of].double() + torch.log(b2)
                comp = summarize(la, a2 / b2.clamp_min(1e-300).unsqueeze(-1), b2 > 0)   # -inf where b' = 0
                part = merge_summaries(part, comp)
            os.append(part.o)
            lses.append(part.lse)
        return AttentionSummary(torch.stack(os), torch.stack(lses))

    def amend_misses(self, q, k, v, positions, match_pos, out, entry: AttentionSummary, *, band: int,
                     scale: float | None = None):
        """Replace ``out`` and the ring ``entry`` of the missing heads (``match_pos < 0``) by the
        completion path; hits pass through. Returns ``(out, entry)`` in the input dtypes."""
        if scale is not None and not math.isclose(float(scale), self.scale, rel_tol=1e-6):
            raise ValueError(f"scale {scale} differs from the completion state's {self.scale}")
        miss = match_pos < 0
        if not bool(miss.any()):
            return out, entry
        approx = self.entry_summary(q, k, v, positions, band=band)
        B, Hq, _ = q.shape
        t = torch.arange(k.shape[2], device=q.device)
        m = positions.view(B, 1, 1)
        logits = torch.einsum("bhd,bhtd->bht", q.double(), expand_kv_heads(k, Hq).double()) * self.scale
        tail = summarize(logits, expand_kv_heads(v, Hq).double(), (t > m - band) & (t <= m))
        new_out = merge_summaries(approx, tail).o
        mk = miss.unsqueeze(-1)
        entry = AttentionSummary(torch.where(mk, approx.o.to(entry.o.dtype), entry.o),
                                 torch.where(miss, approx.lse.to(entry.lse.dtype), entry.lse))
        return torch.where(mk, new_out.to(out.dtype), out), entry

    def miss_cost(self, m: int, row: int, *, band: int, head_dim: int | None = None, gen_len: int = 1) -> float:
        """Token-equivalents one missing head reads at position ``m`` (docs/spec.md §3 budget): exact tokens
        ``m + 1 - |M| + k`` plus the completion cache amortised over ``gen_len`` steps and the
        retrieved tokens' feature rows; compare with ``m + 1`` for a full-attention miss."""
        ms, me = self.mids[row]
        k_eff = min(self.config.top_k, me - ms)
        if k_eff >= me - ms:
            return float(m + 1)
        return token_equivalents(exact_tokens=m + 1 - (me - ms) + k_eff, feature_dim=self.maps.spec.feature_dim,
                                 head_dim=head_dim or self.head_dim, gen_len=gen_len, retrieved=k_eff)["total"]
