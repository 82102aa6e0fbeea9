"""Patch the installed transformers' LLaMA / Qwen2 / Mistral models in place with FastMKA.

Nothing of transformers' model code is copied. Per layer, ``self_attn`` gets a submodule
``mka`` (``MkaFusion``: the new routing weights, state-dict prefix ``...self_attn.mka.``) and
three hooks:

* a forward pre-hook on ``self_attn`` notes whether the call starts a fresh sequence (the
  layer's cache is empty) and resets the per-request L2 state then;
* a forward hook on ``q_proj`` keeps the pre-RoPE query of the call (the router's input);
* forward pre-hooks on ``k_proj`` and ``v_proj`` replace their input ``x`` by the fused
  memory ``f`` (computed once per call and shared), so the model's own K/V projection, RoPE,
  cache and attention run unchanged on ``f``: ordinary causal attention over fused K/V.
  With ``MkaContext.use_op`` a decode call (one token) instead takes ``k``/``v`` from
  ``torch.ops.macattn.route_fused_attention`` (routing + L2 update + projection in one op): the
  pre-hooks hand ``k_proj`` / ``v_proj`` the call's tokens ``[:, :0]`` (they project nothing, no
  weight is read twice) and their forward hooks return the op's ``k`` / ``v``. The runtime's
  GPU executor turns it on, so its captured decode step runs the op.

The L2 state (``[B, D]`` fp32 mean and ``[B]`` int64 count per layer) lives in the
``MkaContext`` and is carried between calls of one generation (HF-style use), or, when
``MkaContext.state`` is set, in rows ``MkaContext.slots`` of a runtime-owned
``macattn.methods.mka.state.MkaState`` (the same mechanism as the MAC rings: the runtime
acquires/releases slots; a fresh prompt resets its rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from macattn.methods.mka.config import MkaConfig
from macattn.methods.mka.reference import MkaFusion
from macattn.models.architectures import check_supported

__all__ = ["MkaContext", "patch_mka", "unpatch_mka", "mka_parameters"]



@dataclass
class MkaContext:
    """The patched model's FastMKA state. ``mean[l]`` ``[B, D]`` fp32, ``count[l]`` ``[B]`` int64;
    ``last_lambda[l]`` ``[B, T, 3]`` the routing weights of the latest call (detached)."""

    config: MkaConfig
    fusions: list[MkaFusion]
    handles: list = field(default_factory=list, repr=False)
    mean: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    count: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    last_lambda: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    use_op: bool = False
    state: object | None = None          # macattn.methods.mka.state.MkaState
    slots: torch.Tensor | None = None    # [B] int64 rows of ``state`` (manual use without a runtime)
    binding: object | None = None        # the runtime's ModelBinding: rows come from its StepContext
    _q: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _fused: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _op: dict[int, tuple] = field(default_factory=dict, repr=False)            # the op's (x, (k, v)) of a call

    def bind_runtime(self, state, binding) -> None:
        """Keep the session summary in runtime-owned ``state`` rows; each call's rows are the
        ``StepContext.slots`` of ``binding`` (the attention binding of the same model)."""
        self.state, self.binding = state, binding

    def rows(self) -> torch.Tensor | None:
        """``[B]`` int64 state rows of the call in flight."""
        return self.binding.current_step.slots if self.binding is not None else self.slots

    def set_gate(self, value: float) -> None:
        """Set every layer's routing gate (0 = exactly the original model)."""
        with torch.no_grad():
            for fu in self.fusions:
                fu.router.gate.fill_(float(value))


def _cache_len(past_key_values, layer: int) -> int:
    if past_key_values is None:
        return 0
    return int(past_key_values.get_seq_length(layer))


def _attn_pre(ctx: MkaContext, layer: int, hidden_size: int):
    def hook(module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        B = x.shape[0]
        # transformers >= 5.2x names it ``cache``; earlier releases ``past_key_values``
        fresh = _cache_len(kwargs.get("cache", kwargs.get("past_key_values")), layer) == 0
        if ctx.state is not None:
            rows = ctx.rows()
            if rows is None or rows.shape != (B,):
                raise ValueError(f"MkaContext.slots must be [B={B}] rows of MkaContext.state")
            if fresh:
                sm, sc = ctx.state.layer(layer)
                sm[rows] = 0.0
                sc[rows] = 0
        elif fresh or layer not in ctx.mean or ctx.mean[layer].shape[0] != B:
            ctx.mean[layer] = torch.zeros(B, hidden_size, dtype=torch.float32, device=x.device)
            ctx.count[layer] = torch.zeros(B, dtype=torch.int64, device=x.device)
        ctx._fused.pop(layer, None)
        ctx._op.pop(layer, None)
    return hook


def _attn_post(ctx: MkaContext, layer: int):
    def hook(module, args, kwargs, output):
        ctx._fused.pop(layer, None)
        ctx._op.pop(layer, None)
        ctx._q.pop(layer, None)
    return hook


def _capture_q(ctx: MkaContext, layer: int):
    def hook(module, args, output):
        ctx._q[layer] = output
    return hook


def _op_mode(ctx: MkaContext, x: torch.Tensor) -> bool:
    return ctx.use_op and x.shape[1] == 1


def _fuse_input(ctx: MkaContext, layer: int, attn):
    def hook(module, args):
        x = args[0]
        if _op_mode(ctx, x):
            _op_kv(ctx, layer, attn, x)
            return (x[:, :0],) + tuple(args[1:])     # the projection runs over no tokens: the op made k / v
        hit = ctx._fused.get(layer)
        if hit is not None and hit[0] is x:
            return (hit[1],) + tuple(args[1:])
        q = ctx._q[layer]
        if ctx.state is not None:
            sm, sc = ctx.state.layer(layer)
            rows = ctx.rows()
            f, lam, mean, count = ctx.fusions[layer](x, q, sm[rows], sc[rows])
            sm[rows] = mean
            sc[rows] = count
        else:
            f, lam, mean, count = ctx.fusions[layer](x, q, ctx.mean[layer], ctx.count[layer])
            ctx.mean[layer], ctx.count[layer] = mean, count
        ctx.last_lambda[layer] = lam.detach()
        ctx._fused[layer] = (x, f)
        return (f,) + tuple(args[1:])
    return hook


def _bias(attn, which: int) -> torch.Tensor:
    """``k_proj`` / ``v_proj``'s bias, or the zeros ``patch_mka`` registered for one that has none (a buffer of
    ``attn.mka``: it follows the model's ``.to()``, and is never allocated inside a captured step)."""
    lin = (attn.k_proj, attn.v_proj)[which]
    return lin.bias if lin.bias is not None else getattr(attn.mka, ("zero_bk", "zero_bv")[which])


def _op_kv(ctx: MkaContext, layer: int, attn, x: torch.Tensor) -> None:
    """``ctx._op[layer] = (x, (k [B, 1, Nk], v [B, 1, Nv]))`` from ``route_fused_attention``, once per call
    (the first of the k_proj / v_proj pre-hooks computes it; the state advances once)."""
    hit = ctx._op.get(layer)
    if hit is not None and hit[0] is x:
        return
    if ctx.config.l3:
        raise NotImplementedError("route_fused_attention has no L3 path; set use_op=False")
    from macattn.methods.mka import ops as ops_mka  # noqa: F401  (registers the op)
    r = ctx.fusions[layer].router
    B = x.shape[0]
    if ctx.state is not None:
        (sm, sc), slots = ctx.state.layer(layer), ctx.rows().to(x.device)
    else:
        sm, sc, slots = ctx.mean[layer], ctx.count[layer], torch.arange(B, device=x.device)
    k, v, lam = torch.ops.macattn.route_fused_attention(
        x[:, 0], ctx._q[layer][:, 0], r.w1, r.b1, r.w2, r.b2, r.gate, sm, sc, slots,
        attn.k_proj.weight, _bias(attn, 0), attn.v_proj.weight, _bias(attn, 1), ctx.config.mode,
        float(ctx.config.ema_beta))
    ctx.last_lambda[layer] = lam.unsqueeze(1)
    ctx._op[layer] = (x, (k.unsqueeze(1), v.unsqueeze(1)))


def _op_output(ctx: MkaContext, layer: int, which: int):
    def hook(module, args, output):
        hit = ctx._op.get(layer)
        if hit is None or args[0].shape[1] != 0:
            return None
        return hit[1][which].to(output.dtype)
    return hook


def patch_mka(model, config: MkaConfig | None = None) -> MkaContext:
    """Patch ``model`` (one of ``SUPPORTED_ARCHITECTURES``) in place; returns its ``MkaContext``.

    The new weights are fp32 submodules ``model.model.layers[l].self_attn.mka``; the gate
    starts at 0 so the patched model computes exactly what the unpatched one does.
    """
    check_supported(model)
    if getattr(model, "_mka_ctx", None) is not None:
        raise ValueError("model is already patched with FastMKA; call unpatch_mka first")
    config = MkaConfig() if config is None else config
    if not isinstance(config, MkaConfig):
        raise TypeError(f"config must be an MkaConfig, got {type(config).__name__}")
    hf = model.config
    device = next(model.parameters()).device
    ctx = MkaContext(config=config, fusions=[])
    for layer, block in enumerate(model.model.layers):
        attn = block.self_attn
        fu = MkaFusion(attn.q_proj.out_features, config, layer).to(device)
        for name, lin in (("zero_bk", attn.k_proj), ("zero_bv", attn.v_proj)):   # the op's bias where there is none
            fu.register_buffer(name, torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=device),
                               persistent=False)
        attn.mka = fu
        ctx.fusions.append(fu)
        ctx.handles += [
            attn.register_forward_pre_hook(_attn_pre(ctx, layer, hf.hidden_size), with_kwargs=True),
            attn.register_forward_hook(_attn_post(ctx, layer), with_kwargs=True),
            attn.q_proj.register_forward_hook(_capture_q(ctx, layer)),
            attn.k_proj.register_forward_pre_hook(_fuse_input(ctx, layer, attn)),
            attn.v_proj.register_forward_pre_hook(_fuse_input(ctx, layer, attn)),
            attn.k_proj.register_forward_hook(_op_output(ctx, layer, 0)),
            attn.v_proj.register_forward_hook(_op_output(ctx, layer, 1)),
        ]
    model._mka_ctx = ctx
    return ctx


def unpatch_mka(model) -> None:
    """Remove the hooks and the ``mka`` submodules."""
    ctx = getattr(model, "_mka_ctx", None)
    if ctx is None:
        raise ValueError("model is not patched with FastMKA")
    for h in ctx.handles:
        h.remove()
    for block in model.model.layers:
        del block.self_attn.mka
    model._mka_ctx = None


def mka_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The new (trainable) parameters of a patched model, by state-dict name."""
    return [(n, p) for n, p in model.named_parameters() if ".self_attn.mka." in n]
