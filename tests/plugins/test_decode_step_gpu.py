"""The decode-step launchers (``macattn.plugins.decode_step.op``) equal the references on fresh random
inputs with NaN-poisoned outputs across edge shapes (empty batch, odd widths, head dims that are not
powers of two). GPU; ``MACATTN_TRITON_INTERPRET=1`` runs them through Triton's interpreter on the CPU.

fp32 is compared exactly (or to the fp32 reduction order); bf16/fp16 to a few units in the last
place: silu's and the norm's fp32 internals (exp, the sum's order) may round the other way.
"""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS, INTERPRET  # noqa: E402  (first: sets the interpreter switch)
from mac_problem import _poison  # noqa: E402

from macattn.plugins.decode_step.reference import (add_rms_norm_reference, rope_append_reference,  # noqa: E402
                                                   silu_mul_reference)

pytestmark = GPU_MARKS
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture
def op(monkeypatch):
    import macattn.plugins.decode_step.op as op_mod

    monkeypatch.setattr(op_mod, "_alloc", lambda *shape, dtype, device: _poison(*shape, dtype=dtype, device=device))
    return op_mod


def _tol(dtype, fp32=1e-6):
    return {torch.float32: dict(rtol=fp32, atol=fp32), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,D", [(1, 64), (3, 100), (4, 4096), (0, 32)])
@pytest.mark.parametrize("with_res", [True, False])
def test_add_rms_norm_kernel(op, dtype, R, D, with_res):
    g = torch.Generator().manual_seed(R * 1000 + D)
    x = (3 * torch.randn(R, D, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(R, D, generator=g).to(dtype).to(DEVICE) if with_res else None
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    out, r = op.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_r = add_rms_norm_reference(x, res, w, 1e-6)
    torch.testing.assert_close(r, ref_r, **(_tol(dtype) if INTERPRET else dict(rtol=0, atol=0)))
    torch.testing.assert_close(out, ref_out, **_tol(dtype, fp32=1e-5))
    if R and dtype != torch.float32 and not INTERPRET:
        # the fp32 sum's order moves a rounded value by one unit in the last place, rarely (the
        # interpreter rounds fp32 -> bf16 its own way, so it is held to the tolerance only)
        assert (out != ref_out).float().mean() <= 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,I", [(1, 16), (2, 1000), (3, 14336), (0, 8)])
def test_silu_mul_kernel(op, dtype, R, I):
    gu = (2 * torch.randn(R, 2 * I, generator=torch.Generator().manual_seed(I))).to(dtype).to(DEVICE)
    got = op.silu_mul(gu)
    torch.testing.assert_close(got, silu_mul_reference(gu), **_tol(dtype))


def _rope_inputs(B, Hq, Hkv, d, dtype, P, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, (Hq + 2 * Hkv) * d, generator=g).to(dtype).to(DEVICE)
    ang = torch.rand(B, d // 2, generator=g) * 100
    cos = torch.cat([ang.cos()] * 2, -1).to(dtype).to(DEVICE)
    sin = torch.cat([ang.sin()] * 2, -1).to(dtype).to(DEVICE)
    rows = torch.randperm(P, generator=g)[:B].to(DEVICE)
    return qkv, cos, sin, rows


def _rope_exact(dtype) -> bool:
    """Whether the kernel must equal the reference bit for bit: in the interpreter for fp16 and fp32 (each product
    and the sum rounded as the reference rounds them; it rounds fp32 -> bf16 its own way). On the GPU the compiler
    may contract a product and the sum into one FMA: one rounding step apart (measured on an H200: up to 1 ulp in
    ~23 % of bf16 / fp16 elements), so the dtype's tolerance there."""
    return INTERPRET and dtype != torch.bfloat16


# B spans the launcher's tile choice (pairs per program: a power of two <= B, at most 16): B = 1, B not a
# multiple of any tile (a last program half full, tiles over two tokens), Hq = Hkv, Qwen-like Hq = 28 / Hkv = 4,
# one KV head, d = 64 / 128 and head dims that are not powers of two
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,d", [(1, 32, 8, 128), (3, 4, 2, 16), (2, 6, 6, 48), (5, 8, 1, 64), (0, 4, 2, 16),
                                        (1, 28, 4, 128), (7, 28, 4, 128), (37, 28, 4, 64), (17, 8, 8, 128),
                                        (16, 5, 1, 32), (130, 32, 8, 128), (33, 3, 1, 80)])
def test_rope_append_kernel(op, dtype, B, Hq, Hkv, d):
    P = 3 * B + 4
    qkv, cos, sin, rows = _rope_inputs(B, Hq, Hkv, d, dtype, P, seed=B * 100 + d + Hq)
    kp, vp = _poison(P, Hkv, d, dtype=dtype, device=DEVICE), _poison(P, Hkv, d, dtype=dtype, device=DEVICE)
    kr, vr = kp.clone(), vp.clone()
    q = op.rope_append(qkv, cos, sin, kp, vp, rows, Hq, Hkv)     # q_out comes NaN-poisoned (the fixture)
    q_ref = rope_append_reference(qkv, cos, sin, kr, vr, rows, Hq, Hkv)
    tol = dict(rtol=0, atol=0) if _rope_exact(dtype) else _tol(dtype)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(kp, kr, equal_nan=True, **tol)     # written rows equal, the others stay NaN
    torch.testing.assert_close(vp, vr, equal_nan=True, rtol=0, atol=0)
    if B:
        assert not q.isnan().any() and not kp[rows].isnan().any() and not vp[rows].isnan().any()
        untouched = torch.ones(P, dtype=torch.bool, device=DEVICE)
        untouched[rows] = False
        assert kp[untouched].isnan().all() and vp[untouched].isnan().all()


def test_rope_append_kernel_strided_qkv(op):
    """qkv as a view with a row stride wider than its heads (the launcher needs unit stride only in the last dim)."""
    B, Hq, Hkv, d, dtype = 19, 6, 2, 64, torch.bfloat16
    wide, cos, sin, rows = _rope_inputs(B, Hq + 1, Hkv, d, dtype, 40, seed=5)
    qkv = wide[:, :(Hq + 2 * Hkv) * d]
    kp, vp = _poison(40, Hkv, d, dtype=dtype, device=DEVICE), _poison(40, Hkv, d, dtype=dtype, device=DEVICE)
    kr, vr = kp.clone(), vp.clone()
    q = op.rope_append(qkv, cos, sin, kp, vp, rows, Hq, Hkv)
    q_ref = rope_append_reference(qkv, cos, sin, kr, vr, rows, Hq, Hkv)
    tol = dict(rtol=0, atol=0) if _rope_exact(dtype) else _tol(dtype)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(kp, kr, equal_nan=True, **tol)
    torch.testing.assert_close(vp, vr, equal_nan=True, rtol=0, atol=0)


@pytest.mark.skipif(INTERPRET, reason="a pool of 2^31+ elements (4 GiB in bf16 each): GPU only")
def test_rope_append_kernel_int64_pool_offsets(op):
    """Pool rows whose element offset passes 2^31 (a large paged pool) are written where the reference writes."""
    Hkv, d, dtype = 8, 128, torch.bfloat16
    P = 2 ** 31 // (Hkv * d) + 64
    need = 2 * P * Hkv * d * 2 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2 ** 30:.1f} GiB of free GPU memory")
    B, Hq = 5, 32
    qkv, cos, sin, _ = _rope_inputs(B, Hq, Hkv, d, dtype, 8, seed=7)
    rows = torch.tensor([P - 1, 0, P - 40, 2 ** 31 // (Hkv * d), 3], device=DEVICE)
    kp, vp = (torch.empty(P, Hkv, d, dtype=dtype, device=DEVICE) for _ in range(2))
    kr, vr = (torch.empty(B, Hkv, d, dtype=dtype, device=DEVICE) for _ in range(2))
    q = op.rope_append(qkv, cos, sin, kp, vp, rows, Hq, Hkv)
    q_ref = rope_append_reference(qkv, cos, sin, kr, vr, torch.arange(B, device=DEVICE), Hq, Hkv)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))                   # one FMA contraction apart (_rope_exact)
    torch.testing.assert_close(kp[rows], kr, **_tol(dtype))
    torch.testing.assert_close(vp[rows], vr, rtol=0, atol=0)              # copied
