"""Positive feature maps of the retrieval-completion cache (docs/spec.md §3, paper App. J) and teacher capture.

``FeatureMap`` holds ``H`` independent maps ``R^d -> R^F_+`` (one per head) and returns
``log φ(x)`` directly (positivity by ``exp``). One ReZero MLP block::

    h      = W0 x + b0 - (s/2)·||x||²          (stem, d -> F)
    log φ  = h + α · (W2 GELU(W1 h + b1) + b2)  (F -> hidden -> F; α per head, init 0)

The ``-(s/2)||x||²`` term (``s`` = attention scale) is our addition: with ``W0 = sqrt(s)·ω``
(``ω ~ N(0, I)`` shared by a KV head's φ_k and its query heads' φ_q) and ``b0 = -log(F)/2``, the
map at init (``α = 0``) is exactly the positive random-feature estimator of ``exp(s q·k)``
(Performer), so ``φ_q·φ_k`` starts on the absolute scale the unnormalised merge needs and
distillation only has to sharpen it.

``CompletionFeatureMaps`` holds, per layer, φ_q over the ``Hq`` query heads and φ_k over the
``Hkv`` KV heads; ``save_feature_maps`` / ``load_feature_maps`` store it with safetensors plus a
JSON of its shape. ``macattn.models.attention.capture_qkv`` runs a frozen transformers model and returns post-RoPE
q/k/v of every layer (the distillation teacher and the evaluation input).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = ["FeatureMapSpec", "FeatureMap", "CompletionFeatureMaps", "student_logits", "save_feature_maps",
           "load_feature_maps", "maps_for_model", "fitted_maps"]


@dataclass(frozen=True)
class FeatureMapSpec:
    """Shape of a ``CompletionFeatureMaps``: layers, heads, head_dim d, features F, hidden width."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    feature_dim: int = 64
    hidden: int = 128
    scale: float | None = None  # attention scale s (default 1/sqrt(d))
    seed: int = 0

    def __post_init__(self):
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "feature_dim", "hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale!r}")

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)


class FeatureMap(nn.Module):
    """``n_heads`` maps; ``forward(x [..., H, d]) -> log φ(x) [..., H, F]`` (fp32)."""

    def __init__(self, n_heads: int, head_dim: int, feature_dim: int, hidden: int, *, scale: float,
                 omega: torch.Tensor, generator: torch.Generator) -> None:
        super().__init__()
        h, d, f = n_heads, head_dim, feature_dim
        if tuple(omega.shape) != (h, d, f):
            raise ValueError(f"omega must be [H={h}, d={d}, F={f}], got {tuple(omega.shape)}")
        self.scale = float(scale)
        self.stem_w = nn.Parameter(math.sqrt(self.scale) * omega.float().clone())
        self.stem_b = nn.Parameter(torch.full((h, f), -0.5 * math.log(f)))
        self.w1 = nn.Parameter(torch.randn(h, f, hidden, generator=generator) / math.sqrt(f))
        self.b1 = nn.Parameter(torch.zeros(h, hidden))
        self.w2 = nn.Parameter(torch.randn(h, hidden, f, generator=generator) / math.sqrt(hidden))
        self.b2 = nn.Parameter(torch.zeros(h, f))
        self.alpha = nn.Parameter(torch.zeros(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        hs = torch.einsum("...hd,hdf->...hf", x, self.stem_w) + self.stem_b - 0.5 * self.scale * (x * x).sum(-1,
                                                                                                       keepdim=True)
        inner = torch.nn.functional.gelu(torch.einsum("...hf,hfj->...hj", hs, self.w1) + self.b1)
        return hs + self.alpha[:, None] * (torch.einsum("...hj,hjf->...hf", inner, self.w2) + self.b2)


class CompletionFeatureMaps(nn.Module):
    """Per layer: ``phi_q[l]`` over the query heads, ``phi_k[l]`` over the KV heads (see module doc)."""

    def __init__(self, spec: FeatureMapSpec) -> None:
        super().__init__()
        self.spec = spec
        g = torch.Generator().manual_seed(spec.seed)
        grp = spec.num_q_heads // spec.num_kv_heads
        qs, ks = [], []
        for _ in range(spec.num_layers):
            omega = torch.randn(spec.num_kv_heads, spec.head_dim, spec.feature_dim, generator=g)
            ks.append(FeatureMap(spec.num_kv_heads, spec.head_dim, spec.feature_dim, spec.hidden,
                                 scale=spec.attn_scale, omega=omega, generator=g))
            qs.append(FeatureMap(spec.num_q_heads, spec.head_dim, spec.feature_dim, spec.hidden,
                                 scale=spec.attn_scale, omega=omega.repeat_interleave(grp, 0), generator=g))
        self.phi_q = nn.ModuleList(qs)
        self.phi_k = nn.ModuleList(ks)

    def log_phi_q(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q ``[..., Hq, d]`` -> ``[..., Hq, F]`` fp32."""
        return self.phi_q[layer](q)

    def log_phi_k(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k ``[..., Hkv, d]`` -> ``[..., Hkv, F]`` fp32."""
        return self.phi_k[layer](k)


def student_logits(log_phi_q: torch.Tensor, log_phi_k: torch.Tensor) -> torch.Tensor:
    """``log φ_q·φ_k``: log_phi_q ``[..., nq, F]``, log_phi_k ``[..., M, F]`` -> ``[..., nq, M]``.

    Computed as ``log(exp(a - max a) @ exp(b - max b)ᵀ) + max a + max b`` (a matmul, not an
    ``[nq, M, F]`` logsumexp); the product is clamped at 1e-30 before the log.
    """
    mq = log_phi_q.amax(-1, keepdim=True).detach()
    mk = log_phi_k.amax(-1, keepdim=True).detach()
    prod = torch.exp(log_phi_q - mq) @ torch.exp(log_phi_k - mk).transpose(-1, -2)
    return torch.log(prod.clamp_min(1e-30)) + mq + mk.transpose(-1, -2)


def save_feature_maps(maps: CompletionFeatureMaps, path: str | Path) -> Path:
    """Write ``<path>/feature_maps.safetensors`` and ``<path>/feature_maps.json``; returns the dir."""
    from safetensors.torch import save_file

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in maps.state_dict().items()},
              str(d / "feature_maps.safetensors"))
    (d / "feature_maps.json").write_text(json.dumps(asdict(maps.spec), indent=1))
    return d


def load_feature_maps(path: str | Path) -> CompletionFeatureMaps:
    """Inverse of ``save_feature_maps`` (eval mode, fp32, CPU)."""
    from safetensors.torch import load_file

    d = Path(path)
    for f in ("feature_maps.safetensors", "feature_maps.json"):
        if not (d / f).is_file():
            raise FileNotFoundError(f"{d / f} not found; write it with `macattn distill-completion --out {d}`")
    maps = CompletionFeatureMaps(FeatureMapSpec(**json.loads((d / "feature_maps.json").read_text())))
    maps.load_state_dict(load_file(str(d / "feature_maps.safetensors")))
    return maps.eval()


def maps_for_model(model, *, feature_dim: int, hidden: int, seed: int = 0) -> CompletionFeatureMaps:
    """Untrained maps (the Performer initialisation, ``α = 0``) shaped for a transformers ``*ForCausalLM``."""
    hf = model.config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return CompletionFeatureMaps(FeatureMapSpec(num_layers=hf.num_hidden_layers, num_q_heads=hf.num_attention_heads,
                                                num_kv_heads=hf.num_key_value_heads, head_dim=head_dim,
                                                feature_dim=feature_dim, hidden=hidden, seed=seed))


def fitted_maps(maps, dims) -> CompletionFeatureMaps:
    """``maps`` checked against the model's ``dims`` (a ``ModelDims``: layers, heads, head dim) and moved to
    its device in eval mode; a clear error names what does not fit."""
    if not isinstance(maps, CompletionFeatureMaps):
        raise TypeError(f"maps must be a CompletionFeatureMaps, got {type(maps).__name__}")
    spec = maps.spec
    if (spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim) != (
            dims.num_layers, dims.num_q_heads, dims.num_kv_heads, dims.head_dim):
        raise ValueError(f"maps {spec} do not fit the model ({dims.num_layers} layers, "
                         f"{dims.num_q_heads}/{dims.num_kv_heads} heads, head_dim {dims.head_dim})")
    return maps.eval().to(dims.device)
