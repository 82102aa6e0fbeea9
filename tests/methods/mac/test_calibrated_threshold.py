"""The calibrated threshold (``match_scale``): matching ``q~ / s`` at the unit radius is the per-head test
``||q~_m - q~_p|| < s_h sqrt(2d)(1 - tau)``, and every surface runs it."""

import pytest
import torch

from macattn.methods.base import ModelDims
from macattn.methods.mac.backend import MacAttention
from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.reference import mac_match_reference


def test_match_on_scaled_queries_is_the_per_head_threshold():
    g = torch.Generator().manual_seed(5)
    B, Hq, K, d, tau, band = 3, 4, 32, 16, 0.4, 2
    scales = (torch.rand(Hq, generator=g, dtype=torch.float64) * 2 + 0.3).tolist()
    cfg = MacConfig(window=K, band=band, tau=tau, match_scale=scales)
    dims = ModelDims(1, Hq, 2, d, 64, torch.float64, torch.device("cpu"))
    mac = MacAttention(cfg, dims, num_slots=B)
    s = torch.tensor(scales, dtype=torch.float64).view(1, Hq, 1, 1)
    raw_ring = torch.randn(B, Hq, K, d, generator=g, dtype=torch.float64) * s
    # queries near ring entries at distances around each head's radius
    near = torch.randint(0, K, (B, Hq), generator=g)
    q = raw_ring[torch.arange(B)[:, None], torch.arange(Hq)[None, :], near]
    q = q + torch.randn(B, Hq, d, generator=g, dtype=torch.float64) * s[0, :, 0] * (1 - tau) * 1.2
    qring = mac.match_query(0, raw_ring)                               # what the ring holds: q~ / s
    lse = torch.zeros(B, Hq, K)
    pos = torch.arange(K).repeat(B, 1) + 10
    positions = torch.full((B,), K + 10, dtype=torch.int64)
    slots = torch.arange(B)
    got, _ = mac_match_reference(mac.match_query(0, q), qring, lse, pos, slots, positions, band=band, tau=tau)
    dist = (q.unsqueeze(2) - raw_ring).norm(dim=-1)                    # [B, Hq, K]
    best, arg = dist.min(-1)
    radius = torch.tensor([cfg.threshold(d, head=h) for h in range(Hq)], dtype=torch.float64)
    want = torch.where(best < radius, torch.gather(pos, 1, arg.view(B, -1)).view(B, Hq), -1)
    assert torch.equal(got, want) and 0 < int((got >= 0).sum()) < B * Hq


def test_paper_rule_leaves_queries_untouched():
    dims = ModelDims(2, 4, 2, 8, 32, torch.float32, torch.device("cpu"))
    mac = MacAttention(MacConfig(window=8, band=0).with_match_scales([[2.0]]), dims, num_slots=1)
    q = torch.randn(1, 4, 5, 8)
    assert mac.match_query(1, q) is q and torch.equal(mac.match_query(0, q), q / 2)


def test_runtime_and_engine_dir_run_the_calibrated_rule(tmp_path):
    """A per-layer scale s = 1/2 (exact in floating point) at tau is the paper's rule at 1 - s (1 - tau):
    the runtime (ModelRunner over the paged pool), its diagnostics and an engine directory agree."""
    from tests.runtime._tiny import prompts, tiny_model
    from macattn.runtime import ModelRunner
    from macattn.runtime.engine_dir import read_engine_dir, write_engine_dir

    cal = MacConfig(window=16, band=4, tau=0.2).with_match_scales([[0.5], [0.5]])
    paper = MacConfig(window=16, band=4, tau=1 - 0.5 * 0.8)
    ps = prompts(3, seed=23)
    a = ModelRunner.from_hf(tiny_model("llama", seed=3), cal, max_batch_size=2)
    b = ModelRunner.from_hf(tiny_model("llama", seed=3), paper, max_batch_size=2)
    ta, tb = a.generate(ps, max_new_tokens=8), b.generate(ps, max_new_tokens=8)
    assert torch.equal(ta, tb)
    da, db = (r.engine.method.state.diagnostics for r in (a, b))
    assert torch.equal(da.hits, db.hits) and float(da.hits.sum()) > 0
    write_engine_dir(tiny_model("llama", seed=3), cal, tmp_path / "eng")
    assert read_engine_dir(tmp_path / "eng").mac_config == cal
    assert torch.equal(ModelRunner.from_dir(tmp_path / "eng", max_batch_size=2).generate(ps, max_new_tokens=8), ta)


def test_trtllm_swap_refuses_a_calibrated_config():
    from macattn.builder.trtllm_build import MATCH_ID, plugin_fields

    with pytest.raises(ValueError, match=r"match_scale \(the calibrated threshold\) is not in the TensorRT-LLM"):
        plugin_fields(MacConfig(match_scale=[1.3]), 64)
    assert plugin_fields(MacConfig(), 64)[MATCH_ID]["tau"] == 0.45
