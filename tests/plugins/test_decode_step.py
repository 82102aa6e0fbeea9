"""The decode-step kernels' references (``macattn.plugins.decode_step.reference``) equal transformers'
own LLaMA modules bit for bit, and bad inputs are named (CPU). The launchers: ``test_decode_step_gpu.py``."""
from __future__ import annotations

import pytest
import torch

from macattn.plugins.decode_step import REFERENCE
from macattn.plugins.decode_step.reference import add_rms_norm_reference, rope_append_reference, silu_mul_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- references vs transformers (CPU) ------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_references_equal_transformers_llama_modules(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, rotate_half

    g = torch.Generator().manual_seed(0)
    R, D = 3, 96
    x, res = (torch.randn(R, D, generator=g).to(dtype) for _ in range(2))
    norm = LlamaRMSNorm(D, eps=1e-5).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    out, r = add_rms_norm_reference(x, res, norm.weight, 1e-5)
    torch.testing.assert_close(r, x + res, rtol=0, atol=0)
    torch.testing.assert_close(out, norm(x + res), rtol=0, atol=0)
    torch.testing.assert_close(add_rms_norm_reference(x, None, norm.weight, 1e-5)[0], norm(x), rtol=0, atol=0)

    gu = torch.randn(R, 2 * D, generator=g).to(dtype)
    torch.testing.assert_close(silu_mul_reference(gu), torch.nn.functional.silu(gu[:, :D]) * gu[:, D:], rtol=0, atol=0)

    B, Hq, Hkv, d = 2, 4, 2, 16
    qkv = torch.randn(B, (Hq + 2 * Hkv) * d, generator=g).to(dtype)
    ang = torch.rand(B, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    kp, vp = torch.zeros(10, Hkv, d, dtype=dtype), torch.zeros(10, Hkv, d, dtype=dtype)
    rows = torch.tensor([7, 2])
    q = rope_append_reference(qkv, cos, sin, kp, vp, rows, Hq, Hkv)
    heads = qkv.view(B, Hq + 2 * Hkv, d)
    q_hf, k_hf = apply_rotary_pos_emb(heads[:, :Hq].unsqueeze(2), heads[:, Hq:Hq + Hkv].unsqueeze(2),
                                      cos.unsqueeze(1), sin.unsqueeze(1), unsqueeze_dim=1)
    torch.testing.assert_close(q, q_hf[:, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(kp[rows], k_hf[:, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(vp[rows], heads[:, Hq + Hkv:], rtol=0, atol=0)
    assert kp[[0, 1, 3, 4, 5, 6, 8, 9]].abs().sum() == 0 and rotate_half is not None


def test_bad_inputs_name_the_parameter():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm_reference(x, None, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        add_rms_norm_reference(x, None, torch.ones(8), 0.0)
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm_reference(x, torch.randn(2, 9), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="odd width"):
        silu_mul_reference(torch.randn(2, 7))
    pool = torch.zeros(4, 1, 8)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_append_reference(torch.randn(1, 30), torch.ones(1, 8), torch.ones(1, 8), pool, pool.clone(),
                              torch.tensor([0]), 2, 1)
    with pytest.raises(ValueError, match="write_rows"):
        rope_append_reference(torch.randn(1, 32), torch.ones(1, 8), torch.ones(1, 8), pool, pool.clone(),
                              torch.tensor([0], dtype=torch.int32), 2, 1)
    with pytest.raises(TypeError, match="k_pool / v_pool must have qkv's dtype"):
        rope_append_reference(torch.randn(1, 32), torch.ones(1, 8), torch.ones(1, 8), pool.half(), pool.half(),
                              torch.tensor([0]), 2, 1)


def test_kernels_for_picks_launchers_only_on_cuda():
    from macattn.plugins.decode_step import kernels_for

    assert kernels_for("cpu") is REFERENCE
