"""The one place macattn hooks into transformers' attention (LLaMA / Qwen2 / Mistral, in place).

Nothing of transformers' model code is copied. ``bind(model, method)`` installs:

* an attention function registered with transformers' ``AttentionInterface`` under the name
  ``"macattn"`` that hands every layer's call to the bound ``AttentionMethod``: ``prefill``
  for calls of more than one query token, ``decode`` for one (``macattn.methods.base``);
* if the method declares ``needs_pre_rope_query``, a forward hook on every ``self_attn.q_proj``
  that keeps the call's pre-RoPE query ``q~`` (the query MAC matches on).

The per-call metadata (slots, positions, paged plans, export rings) is a ``StepContext`` set
for the duration of one model call by ``ModelBinding.step`` — by the runtime's executor, the
graph export, or nobody (plain ``model.generate``: the method manages its own rows).

Also here: the capture hooks other tools need (pre-RoPE K/V for the A3 chunk store, the
attention inputs for distillation, the pre-RoPE queries for the recurrence study) and
``plain_attention`` (the model's own attention inside a bound model).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from macattn.models import transformers_api  # noqa: F401  (before transformers' internals: names an unsupported release)
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from macattn.methods.base import AttentionMethod, ModelDims, StepContext
from macattn.methods.mac.backend import MacAttention
from macattn.methods.mac.config import MacConfig
from macattn.models.architectures import check_supported

__all__ = ["IMPL_NAME", "ModelBinding", "attention_forward", "bind", "unbind", "binding_of", "is_patched",
           "patch_model", "unpatch_model", "capture_pre_rope_kv", "capture_pre_rope_queries",
           "capture_qkv", "run_capturing", "plain_attention"]

IMPL_NAME = "macattn"
_NO_STEP = StepContext()


class ModelBinding:
    """What a bound model needs across calls: the method, the model's original attention
    implementation (``fallback_impl``), the pre-RoPE queries of the call in flight, and the
    call's ``StepContext`` (read-only outside ``step``)."""

    def __init__(self, model, method: AttentionMethod, fallback_impl: str) -> None:
        self.model, self.method, self.fallback_impl = model, method, fallback_impl
        self.q_pre: dict[int, torch.Tensor] = {}
        self._step = _NO_STEP
        self._hooks: list = []

    @property
    def current_step(self) -> StepContext:
        return self._step

    @contextlib.contextmanager
    def step(self, ctx: StepContext) -> Iterator[StepContext]:
        """Run the model calls inside the block with ``ctx`` (the one place it is set)."""
        if not isinstance(ctx, StepContext):
            raise TypeError(f"ctx must be a StepContext, got {type(ctx).__name__}")
        prev, self._step = self._step, ctx
        try:
            yield ctx
        finally:
            self._step = prev
            self.q_pre.clear()

    def fallback(self):
        return AttentionInterface._global_mapping[self.fallback_impl]


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query ``[B, Hq, T, d]``, key/value ``[B, Hkv, S, d]``
    (cache included); returns ``([B, T, Hq, d], None)``."""
    b: ModelBinding = module._macattn
    layer = module.layer_idx
    B, Hq, T, d = query.shape
    q_pre = b.q_pre.pop(layer, None)
    if q_pre is not None:
        q_pre = q_pre.view(B, T, Hq, d).transpose(1, 2)     # [B, Hq, T, d]
    step = b.current_step
    run = b.method.prefill if T > 1 or step.prefill is not None else b.method.decode
    out = run(module, layer, query, key, value, q_pre, attention_mask, float(scaling), step,
              b.fallback(), dropout=dropout, **kwargs)
    return out, None


def _capture_q_pre(module, inputs, output) -> None:
    attn = module._macattn_parent
    attn._macattn.q_pre[attn.layer_idx] = output


def _attention_modules(model):
    return [layer.self_attn for layer in model.model.layers]


def binding_of(model) -> ModelBinding:
    b = getattr(model, "_macattn", None)
    if b is None:
        raise ValueError("model is not bound to a macattn method (macattn.models.attention.bind)")
    return b


def is_patched(model) -> bool:
    return getattr(model, "_macattn", None) is not None


def bind(model, method: AttentionMethod) -> ModelBinding:
    """Route ``model``'s attention (one of ``SUPPORTED_ARCHITECTURES``, in place) through ``method``."""
    check_supported(model)
    if is_patched(model):
        raise ValueError("model is already patched; call unpatch_model first")
    if not isinstance(method, AttentionMethod):
        raise TypeError(f"method must be an AttentionMethod, got {type(method).__name__}")
    hf = model.config
    fallback = hf._attn_implementation or "sdpa"
    if fallback not in AttentionInterface._global_mapping:
        fallback = "sdpa"
    b = ModelBinding(model, method, fallback)
    AttentionInterface.register(IMPL_NAME, attention_forward)
    AttentionMaskInterface.register(IMPL_NAME, ALL_MASK_ATTENTION_FUNCTIONS.get(fallback, sdpa_mask))
    for attn in _attention_modules(model):
        attn._macattn = b
        if method.capabilities.needs_pre_rope_query:
            # plain attribute, not a registered submodule: a module cycle q_proj -> attn -> q_proj
            # breaks named_modules(remove_duplicate=False) (torch.export) and state_dict
            object.__setattr__(attn.q_proj, "_macattn_parent", attn)
            b._hooks.append(attn.q_proj.register_forward_hook(_capture_q_pre))
    model._macattn = b
    model._macattn_prev_impl = hf._attn_implementation
    model.set_attn_implementation(IMPL_NAME)
    return b


def unbind(model) -> None:
    """Undo ``bind``: remove the hooks, restore the original attention, release the method's rows."""
    b = binding_of(model)
    for h in b._hooks:
        h.remove()
    for attn in _attention_modules(model):
        del attn._macattn
        if hasattr(attn.q_proj, "_macattn_parent"):
            del attn.q_proj._macattn_parent
    model.set_attn_implementation(model._macattn_prev_impl)
    b.method.release()
    del model._macattn, model._macattn_prev_impl


def patch_model(model, config: MacConfig | None = None, *, num_slots: int = 8,
                query_dtype: torch.dtype | None = None) -> MacAttention:
    """Bind ``model`` to MAC with ``config`` (default ``MacConfig()``); returns the ``MacAttention``
    (its rings in ``.state``; ring queries in ``query_dtype``, default the model's dtype)."""
    check_supported(model)
    if config is None:
        config = MacConfig()
    if not isinstance(config, MacConfig):
        raise TypeError(f"config must be a MacConfig, got {type(config).__name__}")
    method = MacAttention(config, ModelDims.of(model), num_slots=num_slots, query_dtype=query_dtype)
    bind(model, method)
    return method


def unpatch_model(model) -> None:
    if not is_patched(model):
        raise ValueError("model is not patched")
    unbind(model)


# --- capture hooks -----------------------------------------------------------------------------
@contextlib.contextmanager
def _output_hooks(modules: dict, store) -> Iterator[None]:
    """While inside, ``store(key, output)`` receives every forward output of ``modules {key: module}``."""
    handles = [mod.register_forward_hook(lambda module, inputs, output, _key=key: store(_key, output))
               for key, mod in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def capture_pre_rope_kv(model):
    """Within the block, every forward of ``model`` records each layer's ``k_proj`` / ``v_proj``
    outputs ``[B, T, Hkv * d]`` (keys before RoPE, values) in the yielded dict
    ``{layer: [k, v]}`` (the latest call wins). LLaMA / Qwen2 / Mistral apply no norm between
    ``k_proj`` and RoPE, so ``k_proj``'s output is the pre-RoPE key (A3 chunk store)."""
    attns = _attention_modules(model)
    captured: dict[int, list] = {i: [None, None] for i in range(len(attns))}
    mods = {(i, j): proj for i, attn in enumerate(attns) for j, proj in enumerate((attn.k_proj, attn.v_proj))}

    def store(key, output):
        captured[key[0]][key[1]] = output

    with _output_hooks(mods, store):
        yield captured


@torch.no_grad()
def capture_pre_rope_queries(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """One forward of ``ids [1, T]``; per layer the pre-RoPE query ``[Hq, T, d]`` (fp32, on the
    model's device): the ``q_proj`` output, which is what MAC's ring stores."""
    dims = ModelDims.of(model)
    attns = _attention_modules(model)
    out: list = [None] * len(attns)

    def store(i, o):
        out[i] = o[0].detach().float().view(-1, dims.num_q_heads, dims.head_dim).transpose(0, 1)

    with _output_hooks({i: a.q_proj for i, a in enumerate(attns)}, store):
        model(input_ids=ids.to(dims.device), use_cache=False)
    return out


class _Stop(Exception):
    pass


def run_capturing(fn, capture: dict, stop) -> dict:
    """Run ``fn()`` while recording ``{name: output}`` of the modules in ``capture {name: module}``;
    the forward is cut off right after module ``stop`` ran (what ``fn`` returns is dropped)."""
    captured: dict = {}

    def halt(module, inputs, output):
        raise _Stop

    with _output_hooks(capture, captured.__setitem__):
        handle = stop.register_forward_hook(halt)
        try:
            fn()
        except _Stop:
            pass
        finally:
            handle.remove()
    return captured


_CAPTURE_IMPL = "macattn_capture"


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run ``model`` (frozen, its own causal attention) on ``input_ids [B, T]``; per layer the
    post-RoPE ``(q [B, Hq, T, d], k [B, Hkv, T, d], v [B, Hkv, T, d])`` as the attention function
    sees them, in the model's dtype."""
    prev = model.config._attn_implementation or "sdpa"
    base = prev if prev in AttentionInterface._global_mapping else "sdpa"
    fallback = AttentionInterface._global_mapping[base]
    store: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        store[module.layer_idx] = (query.detach(), key.detach(), value.detach())
        return fallback(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CAPTURE_IMPL, capture)
    AttentionMaskInterface.register(_CAPTURE_IMPL, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(_CAPTURE_IMPL)
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(prev)
    return [store[i] for i in range(len(store))]


@contextlib.contextmanager
def plain_attention(model):
    """Run a bound ``model`` with its original attention (no method state touched) within the
    block; a no-op on an unbound model or inside another ``plain_attention`` block."""
    if not is_patched(model) or model.config._attn_implementation != IMPL_NAME:
        yield
        return
    b = binding_of(model)
    model.set_attn_implementation(b.fallback_impl)
    try:
        yield
    finally:
        model.set_attn_implementation(IMPL_NAME)
        b.q_pre.clear()
