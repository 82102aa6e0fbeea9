"""MAC as a sparse-attention algorithm of TensorRT-LLM's PyTorch backend — the classes that subclass upstream.

**Written against upstream sources, never run** (TensorRT-LLM cannot be installed in this workplace; see
``docs/tensorrt.md`` "TensorRT-LLM PyTorch backend" for the files and commits read). Nothing here is
defined until :func:`load` imports ``tensorrt_llm``; without it (or with one lacking a name these classes
need) :func:`require_trtllm_pytorch` raises ``ImportError`` naming ``tensorrt_llm >= 1.2`` and what is missing.

:func:`load` returns :class:`MacTrtllmClasses`:

* ``MacSparseAttentionConfig`` — subclass of ``llmapi.llm_args.BaseSparseAttentionConfig`` with
  ``algorithm = "mac"``, ``window`` / ``band`` / ``tau`` / ``layer_overrides`` (validated by ``MacConfig``).
* ``MacKVCacheManager`` — subclass of ``pyexecutor.resource_manager.KVCacheManager`` that owns the ring pools
  in the RocketKV pattern (``RocketKVCacheManager`` owns its KT-cache pool beside the paged KV): one ring slot
  per running request (``RingSlotTable`` over ``SlotFreeList(max_batch_size)``), assigned in
  ``prepare_resources`` / ``add_dummy_requests``, released in ``free_resources``; the rings themselves
  (``MacState``, all layers) are allocated at the first attention forward, which knows ``Hq`` / ``d`` / dtype.
* ``MacTrtllmAttentionMetadata`` — subclass of ``TrtllmAttentionMetadata`` whose ``prepare()`` also builds
  the step's ``MacStepInputs`` and context spans (``plan_inputs``) on the host.
* ``MacTrtllmAttention`` — subclass of ``TrtllmAttention`` (``support_fused_rope() is True``: the model hands
  it the pre-RoPE ``q``). ``forward`` first runs ``TrtllmAttention.forward`` unchanged (RoPE, KV-cache write,
  attention for every token), then seeds the rings of whole-prompt context requests and replaces the
  generation tokens' output rows by MAC's (``MacDecodePlan.run`` over TensorRT-LLM's paged pool).
  It therefore computes the dense generation attention too: correct, **not yet faster** — a path that
  appends K/V without attending is what a speed-up needs (not in TensorRT-LLM's op).

:func:`install` makes TensorRT-LLM dispatch ``algorithm == "mac"`` to these classes. Upstream's dispatch
(``_torch/attention_backend/sparse/registry.py``) is a fixed ``if / elif`` chain with no registration hook, so
``install`` wraps ``get_sparse_attn_kv_cache_manager`` / ``get_trtllm_sparse_attn_attention_backend`` and
rebinds every loaded ``tensorrt_llm`` module attribute that holds the original function (callers import them
by name). ``LlmArgs.sparse_attention_config`` is a closed pydantic union: the LLM API does not accept the
``mac`` config without extending that union; a model config built by hand can carry it.

Limits (checked where stated): beam width 1 (manager), one query token per generation request (no draft
tokens; ``mac_step_inputs``), KV cache in bf16/fp16 with K and V (``paged_kv_views`` / the plan's checks),
full-width rotate-half RoPE with none/linear scaling (``RopeSpec.from_rope_params``), NHD pool layout as
``KVCacheManager.get_buffers`` returns it. ``prepare()`` does host work and allocates: not CUDA-graph safe.
Chunked context (a context chunk not starting at 0) leaves the rings empty: decode misses until they fill.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from macattn.methods.mac.config import MacConfig
from macattn.plugins.trt_compat import TensorRTVersionError, parse_version

from .plan_inputs import BatchView, RopeSpec, context_spans, mac_step_inputs, paged_kv_views, rope_rotate
from .ring_slots import RingSlotTable, SlotFreeList

__all__ = ["MIN_TRTLLM_PYTORCH", "REQUIRED_NAMES", "require_trtllm_pytorch", "MacTrtllmClasses", "load", "install"]

MIN_TRTLLM_PYTORCH = (1, 2)
ALGORITHM = "mac"
# (module, names) this layer subclasses or patches; all read at the commits named in docs/tensorrt.md
REQUIRED_NAMES = (
    ("tensorrt_llm._torch.attention_backend.interface", ("AttentionBackend", "AttentionMetadata")),
    ("tensorrt_llm._torch.attention_backend.trtllm", ("TrtllmAttention", "TrtllmAttentionMetadata")),
    ("tensorrt_llm._torch.attention_backend.sparse.registry",
     ("get_sparse_attn_kv_cache_manager", "get_trtllm_sparse_attn_attention_backend")),
    ("tensorrt_llm._torch.pyexecutor.resource_manager", ("KVCacheManager",)),
    ("tensorrt_llm.llmapi.llm_args", ("BaseSparseAttentionConfig",)),
)
_HINT = ("macattn's TensorRT-LLM PyTorch-backend module needs tensorrt_llm >= "
         f"{'.'.join(map(str, MIN_TRTLLM_PYTORCH))} (its PyTorch backend with _torch.attention_backend.sparse); "
         "install the `tensorrt-llm` wheel from NVIDIA's package index")


def require_trtllm_pytorch() -> dict[str, object]:
    """``{name: object}`` of every ``REQUIRED_NAMES`` entry, else ``ImportError`` (``TensorRTVersionError`` for
    an old version) naming ``tensorrt_llm >= 1.2`` and the modules / names missing."""
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise ImportError(f"{_HINT} ({exc})") from exc
    version = str(getattr(tensorrt_llm, "__version__", "0"))
    if parse_version(version)[:2] < MIN_TRTLLM_PYTORCH:
        raise TensorRTVersionError(f"{_HINT}; found tensorrt_llm {version}")
    found, missing = {}, []
    for module, names in REQUIRED_NAMES:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module} ({exc})")
            continue
        for name in names:
            if hasattr(mod, name):
                found[name] = getattr(mod, name)
            else:
                missing.append(f"{module}.{name}")
    if missing:
        raise ImportError(f"{_HINT}; tensorrt_llm {version} lacks: {', '.join(missing)}")
    return found


@dataclass(frozen=True)
class MacTrtllmClasses:
    """The classes :func:`load` defines over the installed TensorRT-LLM."""

    config: type
    kv_cache_manager: type
    metadata: type
    attention: type


_LOADED: MacTrtllmClasses | None = None


def load() -> MacTrtllmClasses:
    """Define (once) and return the subclasses of upstream types; ``ImportError`` as in
    :func:`require_trtllm_pytorch`."""
    global _LOADED
    if _LOADED is None:
        _LOADED = _define(require_trtllm_pytorch())
    return _LOADED


def install() -> list[str]:
    """Make upstream's sparse dispatch return the MAC classes for ``algorithm == "mac"`` (others unchanged);
    returns the ``module.function`` names rebound. Idempotent."""
    classes = load()
    import sys

    registry = importlib.import_module("tensorrt_llm._torch.attention_backend.sparse.registry")
    wrapped = {
        "get_sparse_attn_kv_cache_manager": lambda cfg: classes.kv_cache_manager,
        "get_trtllm_sparse_attn_attention_backend": lambda cfg: classes.attention,
    }
    rebound = []
    for fname, ours in wrapped.items():
        original = getattr(registry, fname)
        original = getattr(original, "__macattn_original__", original)

        def dispatch(cfg, *args, __orig=original, __ours=ours, **kwargs):
            if getattr(cfg, "algorithm", None) == ALGORITHM:
                return __ours(cfg)
            return __orig(cfg, *args, **kwargs)

        dispatch.__macattn_original__ = original
        dispatch.__name__ = fname
        for name, mod in list(sys.modules.items()):
            if not name.startswith("tensorrt_llm") or mod is None:
                continue
            current = getattr(mod, fname, None)
            if current is original or getattr(current, "__macattn_original__", None) is original:
                setattr(mod, fname, dispatch)
                rebound.append(f"{name}.{fname}")
    return sorted(rebound)


def _define(up: dict[str, object]) -> MacTrtllmClasses:  # pragma: no cover - needs tensorrt_llm (never run here)
    from typing import Literal, Optional

    from pydantic import Field

    from macattn.methods.mac.seeding import seed_rings_
    from macattn.methods.mac.state import MacState
    from macattn.plugins.mac.decode_plan import MacDecodePlan

    Base = up["BaseSparseAttentionConfig"]
    KVCacheManager = up["KVCacheManager"]
    TrtllmAttention = up["TrtllmAttention"]
    TrtllmAttentionMetadata = up["TrtllmAttentionMetadata"]

    class MacSparseAttentionConfig(Base):
        """MAC (``algorithm="mac"``): ring window, band, threshold, per-layer overrides (``MacConfig``)."""

        algorithm: Literal["mac"] = "mac"
        window: int = Field(default=1024, description="ring capacity K")
        band: int = Field(default=256, description="rectification band r")
        tau: float = Field(default=0.45, description="match threshold in [0, 1)")
        layer_overrides: Optional[dict] = Field(default=None, description="{layer: {field: value}}")

        def mac_config(self) -> MacConfig:
            return MacConfig(window=self.window, band=self.band, tau=self.tau,
                             layer_overrides=self.layer_overrides or {})

        def supports_backend(self, backend: str) -> bool:
            return backend == "pytorch"

    class MacKVCacheManager(KVCacheManager):
        """Paged KV (upstream's) plus MAC's ring pools, one ring slot per running request."""

        def __init__(self, kv_cache_config, kv_cache_type, *, num_layers, num_kv_heads, head_dim, tokens_per_block,
                     max_seq_len, max_batch_size, mapping, sparse_attn_config=None, max_beam_width: int = 1, **kwargs):
            if sparse_attn_config is None or getattr(sparse_attn_config, "algorithm", None) != ALGORITHM:
                raise ValueError("MacKVCacheManager needs sparse_attn_config with algorithm='mac'")
            if max_beam_width != 1:
                raise ValueError(f"MAC keeps one ring row per request: max_beam_width must be 1, got {max_beam_width}")
            super().__init__(kv_cache_config, kv_cache_type, num_layers=num_layers, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                             max_batch_size=max_batch_size, mapping=mapping, max_beam_width=max_beam_width, **kwargs)
            self.mac_config = sparse_attn_config.mac_config()
            self.ring_pool = SlotFreeList(max_batch_size)
            self.ring_slots = RingSlotTable(self.ring_pool)
            self.mac_state: Optional[MacState] = None

        def ensure_rings(self, num_q_heads: int, head_dim: int, query_dtype: torch.dtype, device) -> MacState:
            """The rings of every layer (``MacState`` indexed by the model-wide layer index), allocated once."""
            if self.mac_state is None:
                self.mac_state = MacState.allocate(self.mac_config, num_layers=self.num_layers,
                                                   num_slots=self.ring_pool.num_slots, num_q_heads=num_q_heads,
                                                   head_dim=head_dim, query_dtype=query_dtype, device=device)
                self.ring_pool.attach(self.mac_state)
            return self.mac_state

        def add_dummy_requests(self, request_ids, *args, **kwargs):
            requests = super().add_dummy_requests(request_ids, *args, **kwargs)
            for req in requests or ():
                self.ring_slots.ensure(req.py_request_id)
            return requests

        def prepare_resources(self, scheduled_batch):
            super().prepare_resources(scheduled_batch)
            for req in list(scheduled_batch.context_requests) + list(scheduled_batch.generation_requests):
                self.ring_slots.ensure(req.py_request_id)

        def free_resources(self, request, *args, **kwargs):
            super().free_resources(request, *args, **kwargs)
            self.ring_slots.free(request.py_request_id)

    class MacTrtllmAttentionMetadata(TrtllmAttentionMetadata):
        def prepare(self):
            super().prepare()
            self.mac_step = self.mac_spans = None
            mgr = self.kv_cache_manager
            if isinstance(mgr, MacKVCacheManager):
                view = BatchView.from_metadata(self)
                self.mac_step = mac_step_inputs(view, mgr.ring_slots.slot, device="cuda")
                self.mac_spans = context_spans(view, mgr.ring_slots.slot)

    class MacTrtllmAttention(TrtllmAttention):
        Metadata = MacTrtllmAttentionMetadata

        def __init__(self, layer_idx, num_heads, head_dim, num_kv_heads=None, quant_config=None,
                     sparse_attention_config=None, pos_embd_params=None, **kwargs):
            super().__init__(layer_idx, num_heads, head_dim, num_kv_heads=num_kv_heads, quant_config=quant_config,
                             sparse_attention_config=sparse_attention_config, pos_embd_params=pos_embd_params,
                             **kwargs)
            if sparse_attention_config is None:
                raise ValueError("MacTrtllmAttention needs sparse_attention_config (algorithm='mac')")
            self.mac_params = sparse_attention_config.mac_config().for_layer(layer_idx)
            if pos_embd_params is None or pos_embd_params.rope is None:
                raise ValueError("MAC needs RoPE position embedding (pos_embd_params.rope)")
            self.mac_rope = RopeSpec.from_rope_params(pos_embd_params.rope, head_dim, is_neox=pos_embd_params.is_neox)
            self._mac_tables = None
            self._mac_plans = {}

        def _tables(self, device):
            if self._mac_tables is None:
                self._mac_tables = self.mac_rope.tables(device)
            return self._mac_tables

        def forward(self, q, k, v, metadata, *args, **kwargs):
            out = super().forward(q, k, v, metadata, *args, **kwargs)
            step = getattr(metadata, "mac_step", None)
            if not self.mac_params.enabled or step is None:
                return out
            if not isinstance(out, torch.Tensor):
                raise ValueError("MAC replaces output rows of one tensor; quantized (nvfp4) outputs are not supported")
            H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            mgr = metadata.kv_cache_manager
            state = mgr.ensure_rings(H, d, q.dtype, q.device)
            rings = state.layer(self.layer_idx)
            k_pages, v_pages = paged_kv_views(mgr.get_buffers(self.layer_idx), "NHD")
            cos, sin = self._tables(q.device)
            q_pre_all = q[:, :H * d].reshape(q.shape[0], H, d)   # q, or the q part of fused qkv
            p = self.mac_params
            for span in metadata.mac_spans or ():
                if not span.is_whole_prompt:
                    continue        # chunked context: rings stay empty for this request
                L = span.length
                rows = slice(span.row_start, span.row_start + L)
                pos = torch.arange(L, device=q.device)
                qp = q_pre_all[rows].transpose(0, 1).unsqueeze(0)                       # [1, H, L, d]
                qr = rope_rotate(q_pre_all[rows], pos, cos, sin).transpose(0, 1).unsqueeze(0)
                blocks = mgr.get_batch_cache_indices([span.request_id])[0]
                t = pos
                pages = torch.tensor(blocks, device=q.device)[t // k_pages.shape[1]]
                kk = k_pages[pages, t % k_pages.shape[1]].permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, L, d]
                vv = v_pages[pages, t % v_pages.shape[1]].permute(1, 0, 2).unsqueeze(0)
                seed_rings_(rings, torch.tensor([span.slot], device=q.device), qr, qp, kk, vv,
                            band=p.band, scale=d ** -0.5)
            G = step.num_tokens
            if G == 0:
                return out
            q_pre = q_pre_all.index_select(0, step.rows).contiguous()
            q_rot = rope_rotate(q_pre, step.positions, cos, sin)
            plan = self._mac_plans.get(G)
            if plan is None:
                plan = self._mac_plans[G] = MacDecodePlan(
                    batch_size=G, max_context=mgr.max_seq_len, num_q_heads=H, num_kv_heads=Hkv, head_dim=d,
                    window=p.window, band=p.band, tau=p.tau, page_size=k_pages.shape[1], q_dtype=q.dtype,
                    device=q.device)
            mac_out, _, _ = plan.run(q_rot, q_pre, k_pages, v_pages, step.positions, step.slots, *rings,
                                     page_table=step.page_table)
            out.view(out.shape[0], -1).index_copy_(0, step.rows, mac_out.reshape(G, H * d).to(out.dtype))
            return out

    return MacTrtllmClasses(MacSparseAttentionConfig, MacKVCacheManager, MacTrtllmAttentionMetadata,
                            MacTrtllmAttention)
