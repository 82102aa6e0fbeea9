"""MAC as a sparse-attention algorithm of TensorRT-LLM's PyTorch backend — the classes that subclass upstream.

**Written against upstream sources, never run against TensorRT-LLM** (it cannot be installed in this workplace;
see ``docs/tensorrt.md`` "TensorRT-LLM PyTorch backend" for the files and the pinned commit read). Nothing here
is defined until :func:`load` imports ``tensorrt_llm``; without it, outside ``TRTLLM_PYTORCH_RANGE`` (1.2.x), or
with one lacking a name these classes need, :func:`require_trtllm_pytorch` raises ``ImportError`` naming the
range and what is missing.

:func:`load` returns :class:`MacTrtllmClasses`:

* ``MacSparseAttentionConfig`` — subclass of ``llmapi.llm_args.BaseSparseAttentionConfig`` with
  ``algorithm = "mac"``, ``window`` / ``band`` / ``tau`` / ``layer_overrides`` (validated by ``MacConfig``).
  The classes are importable as ``macattn.builder.trtllm_pytorch.registered.<name>``: a config pickled into
  the LLM API's spawned executor worker is unpickled there by that name, which runs :func:`install` in the
  worker (where nobody called it).
* ``MacKVCacheManager`` — subclass of ``pyexecutor.resource_manager.KVCacheManager`` that owns the ring pools
  in the RocketKV pattern (``RocketKVCacheManager`` owns its KT-cache pool beside the paged KV): one ring slot
  per running request (``RingSlotTable`` over ``SlotFreeList(max_batch_size)``), assigned in
  ``prepare_resources`` / ``add_dummy_requests``, released in ``free_resources``; the rings themselves
  (``MacState``, all layers) are allocated at the first attention forward, which knows ``Hq`` / ``d`` / dtype.
  ``get_cache_size_per_token`` declares them to the KV-cache size estimator (RocketKV overrides it for its KT
  cache): upstream's bytes per token plus one ring slot spread over ``max_seq_len`` tokens
  (``ring_slots.ring_bytes_per_token``). KV block reuse is refused (a reused prefix is never seen by the
  attention, so its request's rings would stay empty): ``KvCacheConfig(enable_block_reuse=False)``.
* ``MacTrtllmAttentionMetadata`` — subclass of ``TrtllmAttentionMetadata`` whose ``prepare()`` also builds
  the step's ``MacStepInputs`` and context spans (``plan_inputs``) on the host. These are new tensors each
  step, so a captured CUDA graph would replay the capture step's inputs: ``create_cuda_graph_metadata`` (what
  upstream's CUDA-graph runner calls before capturing) and ``prepare()`` of graph metadata raise ``ValueError``
  asking for ``cuda_graph_config=None``.
* ``MacTrtllmAttention`` — subclass of ``TrtllmAttention`` (``support_fused_rope() is True``: the model hands
  it the pre-RoPE ``q``). ``forward`` first runs ``TrtllmAttention.forward`` unchanged (RoPE, KV-cache write,
  attention for every token), then seeds the rings of whole-prompt context requests and replaces the
  generation tokens' output rows by MAC's (``MacDecodePlan.run`` over TensorRT-LLM's paged pool).
  It therefore computes the dense generation attention too: correct, **not yet faster** — a path that
  appends K/V without attending is what a speed-up needs (not in TensorRT-LLM's op). ``sparse_kv_predict`` /
  ``sparse_attn_predict`` (which upstream's forward calls whenever a sparse config is set, and whose base
  versions raise ``NotImplementedError``) return ``(None, None)``: no KV or attention sparsity in that op.

:func:`install` makes TensorRT-LLM dispatch ``algorithm == "mac"`` to these classes. Upstream's dispatch
(``_torch/attention_backend/sparse/registry.py``) is a fixed ``if / elif`` chain with no registration hook, so
``install`` wraps ``get_sparse_attn_kv_cache_manager`` / ``get_trtllm_sparse_attn_attention_backend`` and
rebinds every loaded ``tensorrt_llm`` module attribute that holds the original function (callers import them
by name). ``LlmArgs.sparse_attention_config`` is a closed pydantic union: the LLM API does not accept the
``mac`` config without extending that union; a model config built by hand can carry it.

Limits (checked where stated): beam width 1 (manager), one query token per generation request (no draft
tokens; ``mac_step_inputs``), KV cache in bf16/fp16 with K and V (``paged_kv_views`` / the plan's checks),
full-width rotate-half RoPE with none/linear scaling (``RopeSpec.from_rope_params``), NHD pool layout as
``KVCacheManager.get_buffers`` returns it, no CUDA graphs, no KV block reuse. Chunked context (a context chunk
not starting at 0) leaves the rings empty: decode misses until they fill.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from macattn.methods.mac.config import MacConfig
from macattn.plugins.trt_compat import TensorRTVersionError, parse_version

from .plan_inputs import BatchView, RopeSpec, context_spans, mac_step_inputs, paged_kv_views, rope_rotate
from .ring_slots import RingSlotTable, SlotFreeList, ring_bytes_per_token

__all__ = ["TRTLLM_PYTORCH_RANGE", "REQUIRED_NAMES", "REGISTERED_MODULE", "CLASS_NAMES", "require_trtllm_pytorch",
           "MacTrtllmClasses", "load", "install"]

# [first, last) tensorrt_llm versions this module is written for: the 1.2 line, whose TrtllmAttention.forward
# calls sparse_kv_predict / sparse_attn_predict(q, k, metadata, **kwargs) (trtllm.py at the commit pinned in
# docs/tensorrt.md); 1.3 (main) reworked that forward (AttentionForwardArgs) and the KV-cache managers
TRTLLM_PYTORCH_RANGE = ((1, 2), (1, 3))
ALGORITHM = "mac"
# where the classes _define makes are importable (and picklable): the worker process unpickles them by name
REGISTERED_MODULE = "macattn.builder.trtllm_pytorch.registered"
CLASS_NAMES = {"MacSparseAttentionConfig": "config", "MacKVCacheManager": "kv_cache_manager",
               "MacTrtllmAttentionMetadata": "metadata", "MacTrtllmAttention": "attention"}
# (module, names) this layer subclasses or patches; all read at the commits named in docs/tensorrt.md
REQUIRED_NAMES = (
    ("tensorrt_llm._torch.attention_backend.interface", ("AttentionBackend", "AttentionMetadata")),
    ("tensorrt_llm._torch.attention_backend.trtllm", ("TrtllmAttention", "TrtllmAttentionMetadata")),
    ("tensorrt_llm._torch.attention_backend.sparse.registry",
     ("get_sparse_attn_kv_cache_manager", "get_trtllm_sparse_attn_attention_backend")),
    ("tensorrt_llm._torch.pyexecutor.resource_manager", ("KVCacheManager",)),
    ("tensorrt_llm.llmapi.llm_args", ("BaseSparseAttentionConfig",)),
)
_RANGE = (f"tensorrt_llm >= {'.'.join(map(str, TRTLLM_PYTORCH_RANGE[0]))}, "
          f"< {'.'.join(map(str, TRTLLM_PYTORCH_RANGE[1]))}")
_HINT = (f"macattn's TensorRT-LLM PyTorch-backend module needs {_RANGE} (its PyTorch backend with "
         "_torch.attention_backend.sparse, as read at the commit docs/tensorrt.md pins); install that "
         "`tensorrt-llm` wheel from NVIDIA's package index")


def require_trtllm_pytorch() -> dict[str, object]:
    """``{name: object}`` of every ``REQUIRED_NAMES`` entry, else ``ImportError`` (``TensorRTVersionError`` for
    a version outside ``TRTLLM_PYTORCH_RANGE``) naming the range and the modules / names missing."""
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise ImportError(f"{_HINT} ({exc})") from exc
    version = str(getattr(tensorrt_llm, "__version__", "0"))
    if not TRTLLM_PYTORCH_RANGE[0] <= parse_version(version)[:2] < TRTLLM_PYTORCH_RANGE[1]:
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


def _define(up: dict[str, object]) -> MacTrtllmClasses:
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
            if getattr(kv_cache_config, "enable_block_reuse", False):
                raise ValueError("MAC seeds a request's rings from its whole prompt; with KV block reuse a reused "
                                 "prefix never reaches the attention and the rings stay empty: set "
                                 "kv_cache_config.enable_block_reuse=False (KvCacheConfig(enable_block_reuse=False))")
            if max_beam_width != 1:
                raise ValueError(f"MAC keeps one ring row per request: max_beam_width must be 1, got {max_beam_width}")
            super().__init__(kv_cache_config, kv_cache_type, num_layers=num_layers, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                             max_batch_size=max_batch_size, mapping=mapping, max_beam_width=max_beam_width, **kwargs)
            self.mac_config = sparse_attn_config.mac_config()
            self.ring_pool = SlotFreeList(max_batch_size)
            self.ring_slots = RingSlotTable(self.ring_pool)
            self.mac_state: Optional[MacState] = None

        @staticmethod
        def get_cache_size_per_token(model_config, mapping, **kwargs):
            """Upstream's KV bytes per token plus the rings' (``ring_slots.ring_bytes_per_token``: one slot of
            every layer's rings, ``Hq`` of this tensor-parallel rank, in the model dtype, over ``max_seq_len``
            tokens), so the estimator leaves room for them before the pool takes its fraction."""
            base = KVCacheManager.get_cache_size_per_token(model_config, mapping, **kwargs)
            pc = model_config.pretrained_config
            heads = int(pc.num_attention_heads)
            tp = 1 if getattr(mapping, "enable_attention_dp", False) else int(getattr(mapping, "tp_size", 1))
            head_dim = getattr(pc, "head_dim", None)
            head_dim = int(head_dim) if isinstance(head_dim, int) else int(pc.hidden_size) // heads
            dtype = getattr(model_config, "torch_dtype", None) or getattr(pc, "torch_dtype", None) or torch.bfloat16
            max_seq_len = kwargs.get("max_seq_len") or int(pc.max_position_embeddings)
            rings = ring_bytes_per_token(model_config.sparse_attention_config.mac_config(),
                                         num_layers=int(pc.num_hidden_layers), num_q_heads=heads // tp,
                                         head_dim=head_dim, query_dtype=dtype, max_seq_len=int(max_seq_len))
            return base + rings

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
        def create_cuda_graph_metadata(self, *args, **kwargs):
            raise ValueError(_NO_CUDA_GRAPHS)

        def prepare(self):
            if getattr(self, "is_cuda_graph", False):
                raise ValueError(_NO_CUDA_GRAPHS)
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

        def sparse_kv_predict(self, q, k, metadata, *args, **kwargs):
            """No KV sparsity in TensorRT-LLM's op: ``(sparse_kv_indices, sparse_kv_offsets) = (None, None)``
            (MAC replaces the generation rows after it, in ``forward``)."""
            return None, None

        def sparse_attn_predict(self, q, k, metadata, *args, **kwargs):
            """No attention sparsity in TensorRT-LLM's op: ``(None, None)``."""
            return None, None

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

    classes = MacTrtllmClasses(MacSparseAttentionConfig, MacKVCacheManager, MacTrtllmAttentionMetadata,
                               MacTrtllmAttention)
    for name, attr in CLASS_NAMES.items():
        cls = getattr(classes, attr)
        cls.__module__, cls.__qualname__ = REGISTERED_MODULE, name
    return classes


_NO_CUDA_GRAPHS = ("MAC's decode inputs (token rows, positions, ring slots, page tables) are new tensors built on the "
                   "host by prepare() each step, so a captured CUDA graph would replay the capture step's inputs: run "
                   "TensorRT-LLM without CUDA graphs (cuda_graph_config=None)")
