"""Weight-only FP8 (``macattn.plugins.fp8_linear``).

CPU: the quantise / dequantise round trip is within E4M3's resolution — elementwise
``|w - deq| <= max(2^-4 |w|, 2^-10 scale)``: E4M3 keeps 3 mantissa bits, so rounding to nearest
errs by at most half a spacing, ``2^-4`` of the value in the normal range (scaled ``|v| >= 2^-6``),
and by half the subnormal spacing ``2^-9``, i.e. ``2^-10`` in scaled units, below it — hence per
row at most ``2^-4`` of the row's amax; zero rows get scale 1 and exact zeros; the reference is the
dequantised ``F.linear`` in fp32; bad inputs raise naming the parameter; the launcher's dense path
(CPU, or more than 16 rows) and its ``out=``.

``TestGemv`` (``@pytest.mark.gpu``, skipped without CUDA or triton): the Triton GEMV against the
exact (float64) product of the dequantised weight on fresh random inputs into NaN-poisoned outputs:
rows M in {1, 2, 3, 5, 8, 16} x N in {1, 17, 1000, 4096} x K in {16, 200, 4096, 14336}, bf16 and
fp16 x with and without bias (the four combinations rotate over the shapes so that every M, N and K
meets each); ``out=`` with leading dims and strided x; a CUDA-graph replay equals the eager call;
more than 16 rows take the dequantised GEMM. ``MACATTN_TRITON_INTERPRET=1`` runs the class through
Triton's interpreter on the CPU (it handles the FP8 loads; the dot multiplies in fp32 there), on the
shapes with N * K <= 2^20, without the CUDA graph.

Tolerance: ``|got - exact| <= u |exact| + eps * sum_k |x_k w_nk| (+ |bias|)`` per element, ``u`` the
output dtype's unit roundoff (2^-8 bf16, 2^-11 fp16: the final rounding), ``eps = 2^-10`` for fp32
accumulation in any order over K <= 14336 (plus ``u`` where the dense path rounds the weight to x's
dtype). The interpreter truncates fp32 -> bf16 instead of rounding to nearest: one ulp there.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_env import DEVICE, GPU_MARKS, INTERPRET  # noqa: E402  (first: sets the interpreter switch)
from mac_problem import _poison  # noqa: E402

from macattn.plugins.fp8_linear import (FP8_MAX, MAX_GEMV_ROWS, dequantize_fp8_weight, fp8_linear,  # noqa: E402
                                        fp8_linear_reference, quantize_fp8_weight)

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
ACCUMULATION = 2.0 ** -10
# the interpreter truncates fp32 -> bf16 (round toward zero: one ulp, 2u); CUDA rounds to nearest
OUTPUT_ROUNDING = {**UNIT_ROUNDOFF, torch.bfloat16: 2.0 ** -7 if INTERPRET else 2.0 ** -8}


def _problem(M, N, K, dtype, bias: bool, seed: int, device=DEVICE, lead=()):
    """``x [*lead, M, K]``, ``wq, scale`` of a weight whose rows span three decades, ``bias [N]`` or None."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, generator=g, device=device) * torch.logspace(-2, 1, N, device=device)[:, None]
    wq, scale = quantize_fp8_weight(w)
    x = torch.randn(*lead, M, K, generator=g, device=device).to(dtype)
    b = torch.randn(N, generator=g, device=device).to(dtype) if bias else None
    return x, wq, scale, b


def _assert_close(got, x, wq, scale, bias, *, dense: bool = False):
    """``got`` against the float64 product (bound in the module docstring); ``dense``: the weight was
    rounded to x's dtype first."""
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], wq.shape[0])
    w = dequantize_fp8_weight(wq, scale, torch.float64)
    b = torch.zeros(wq.shape[0], dtype=torch.float64, device=x.device) if bias is None else bias.double()
    want = x.double() @ w.T + b
    mag = x.double().abs() @ w.abs().T + b.abs()
    bound = OUTPUT_ROUNDING[x.dtype] * want.abs() + (ACCUMULATION + (UNIT_ROUNDOFF[x.dtype] if dense else 0.0)) * mag
    err = (got.double() - want).abs()
    ok = err <= bound                                   # False on NaN: every element must be written
    assert bool(ok.all()), (f"{int((~ok).sum())} of {ok.numel()} elements off, worst err/bound "
                            f"{float((err / bound).nan_to_num(float('inf')).max()):.3g}")


# ----------------------------------------------------------------------------------------------
# quantisation and the reference (CPU)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_within_e4m3_resolution(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 300, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    w[:, :40] *= 1e-5                                   # E4M3's subnormal range of each row
    w = w.to(dtype)
    wq, scale = quantize_fp8_weight(w)
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (37,)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert wq.float().abs().amax(1).eq(FP8_MAX).all()   # each row's amax maps to 448
    w32, back = w.float(), dequantize_fp8_weight(wq, scale, torch.float32)
    err = (back - w32).abs()
    slack = 1 + 2.0 ** -20                              # the fp32 divide and multiply
    assert (err <= torch.maximum(2.0 ** -4 * w32.abs(), 2.0 ** -10 * scale[:, None]) * slack).all()
    amax = w32.abs().amax(1)
    assert (err.amax(1) <= 2.0 ** -4 * amax * slack).all()
    torch.testing.assert_close(back.abs().amax(1), amax, rtol=2.0 ** -20, atol=0)
    assert dequantize_fp8_weight(wq, scale, torch.bfloat16).dtype == torch.bfloat16


def test_zero_rows_get_scale_one_and_exact_zeros():
    w = torch.zeros(3, 16, dtype=torch.bfloat16)
    w[1] = torch.linspace(-1, 1, 16)
    wq, scale = quantize_fp8_weight(w)
    assert scale[0] == 1 and scale[2] == 1
    back = dequantize_fp8_weight(wq, scale, torch.float32)
    assert torch.equal(back[0], torch.zeros(16)) and torch.equal(back[2], torch.zeros(16))
    assert torch.isfinite(back).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_is_the_dequantised_linear(dtype, bias):
    x, wq, scale, b = _problem(5, 24, 40, dtype, bias, seed=1, device="cpu", lead=(2,))
    want = F.linear(x.float(), dequantize_fp8_weight(wq, scale, torch.float32), None if b is None else b.float())
    got = fp8_linear_reference(x, wq, scale, b)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_launcher_and_out(dtype):
    x, wq, scale, b = _problem(3, 24, 40, dtype, True, seed=2, device="cpu", lead=(2,))
    _assert_close(fp8_linear(x, wq, scale, b), x, wq, scale, b, dense=True)
    out = torch.full((2, 3, 24), float("nan"), dtype=dtype)
    assert fp8_linear(x, wq, scale, b, out=out) is out
    _assert_close(out, x, wq, scale, b, dense=True)
    for bad in (torch.empty(2, 3, 23, dtype=dtype), torch.empty(2, 3, 24, dtype=torch.float16),
                torch.empty(2, 24, 3, dtype=dtype).transpose(1, 2)):
        with pytest.raises(ValueError, match="out must be"):
            fp8_linear(x, wq, scale, b, out=bad)


def test_bad_inputs_name_the_parameter():
    wq, scale = quantize_fp8_weight(torch.randn(8, 16))
    x = torch.randn(2, 16)
    cases = [
        (ValueError, "x must be", (torch.randn(2, 15), wq, scale, None)),
        (TypeError, "x must be", (x.to(torch.int32), wq, scale, None)),
        (TypeError, "wq must be", (x, wq.float(), scale, None)),
        (ValueError, "wq must be", (x, wq[0], scale, None)),
        (ValueError, "scale must be", (x, wq, scale[:7], None)),
        (TypeError, "scale must be", (x, wq, scale.double(), None)),
        (ValueError, "bias must be", (x, wq, scale, torch.zeros(9))),
        (TypeError, "bias must be", (x, wq, scale, torch.zeros(8, dtype=torch.int64))),
        (ValueError, "scale must be on", (x, wq, scale.to("meta"), None)),
    ]
    for fn in (fp8_linear_reference, fp8_linear):
        for exc, msg, args in cases:
            with pytest.raises(exc, match=msg):
                fn(*args)
    with pytest.raises(TypeError, match="w must be"):
        quantize_fp8_weight(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="w must be"):
        quantize_fp8_weight(torch.randn(4))
    with pytest.raises(ValueError, match="w must be finite"):
        quantize_fp8_weight(torch.tensor([[1.0, float("inf")]]))


# ----------------------------------------------------------------------------------------------
# the Triton GEMV (GPU, or the interpreter)
# ----------------------------------------------------------------------------------------------

ROWS, NS, KS = (1, 2, 3, 5, 8, 16), (1, 17, 1000, 4096), (16, 200, 4096, 14336)
COMBOS = [(torch.bfloat16, False), (torch.float16, True), (torch.bfloat16, True), (torch.float16, False)]
CASES = [(M, N, K, *COMBOS[(i + j + k) % 4])
         for i, M in enumerate(ROWS) for j, N in enumerate(NS) for k, K in enumerate(KS)
         if not INTERPRET or N * K <= 1 << 20]


@pytest.fixture
def op(monkeypatch):
    """The launcher module, allocating its outputs NaN-filled."""
    import macattn.plugins.fp8_linear.op as op_module

    monkeypatch.setattr(op_module, "_alloc", _poison)
    return op_module


class TestGemv:
    pytestmark = GPU_MARKS

    @pytest.mark.parametrize("M,N,K,dtype,bias", CASES)
    def test_matches_reference(self, op, M, N, K, dtype, bias):
        x, wq, scale, b = _problem(M, N, K, dtype, bias, seed=M * 100003 + N * 101 + K)
        _assert_close(op.fp8_linear(x, wq, scale, b), x, wq, scale, b)

    @pytest.mark.parametrize("M", [1, 6])
    def test_out_leading_dims_and_strided_x(self, op, M):
        x, wq, scale, b = _problem(M, 96, 320, torch.bfloat16, True, seed=3, lead=(2,))
        wide = torch.randn(2, M, 400, device=DEVICE).to(x.dtype)
        wide[..., :320] = x
        x = wide[..., :320]                             # row stride 400
        out = _poison(2, M, 96, dtype=x.dtype, device=DEVICE)
        assert op.fp8_linear(x, wq, scale, b, out=out) is out
        _assert_close(out, x, wq, scale, b)
        with pytest.raises(ValueError, match="wq must be contiguous"):
            op.fp8_linear(x, wq.t().contiguous().t(), scale, b)

    @pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
    @pytest.mark.parametrize("M", [1, 4])
    def test_cuda_graph_replay_equals_eager(self, op, M):
        x, wq, scale, b = _problem(M, 4096, 4096, torch.bfloat16, True, seed=5)
        eager = op.fp8_linear(x, wq, scale, b)          # autotunes, outside the capture
        out = torch.empty_like(eager)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op.fp8_linear(x, wq, scale, b, out=out)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)

    @pytest.mark.parametrize("M", [MAX_GEMV_ROWS, MAX_GEMV_ROWS + 1, 40])
    def test_more_than_16_rows_take_the_dense_path(self, op, monkeypatch, M):
        calls = []
        launch = op.launch_fp8_gemv
        monkeypatch.setattr(op, "launch_fp8_gemv", lambda *a, **k: calls.append(M) or launch(*a, **k))
        x, wq, scale, b = _problem(M, 300, 4096, torch.bfloat16, True, seed=7)
        _assert_close(op.fp8_linear(x, wq, scale, b), x, wq, scale, b, dense=M > MAX_GEMV_ROWS)
        assert calls == ([M] if M <= MAX_GEMV_ROWS else [])
