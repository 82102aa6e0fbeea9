"""macattn.methods.a3.reference selection math against explicit loops."""
import pytest
import torch

from macattn.methods.a3.reference import (question_attention_scores, recompute_budget, sink_selection, top_tokens,
                        value_deviation_scores)


def test_question_attention_scores_match_loops():
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, Q, S, d = 4, 2, 3, 11, 8
    q, k = torch.randn(Hq, Q, d, generator=g, dtype=torch.float64), torch.randn(Hkv, S, d, generator=g, dtype=torch.float64)
    qpos = torch.tensor([8, 9, 10])
    doc = torch.arange(2, 8)
    got = question_attention_scores(q, k, qpos, doc, scale=0.3)
    want = torch.zeros(S, dtype=torch.float64)
    for h in range(Hq):
        for i in range(Q):
            n = int(qpos[i]) + 1
            want[:n] += torch.softmax((k[h // 2, :n] @ q[h, i]) * 0.3, 0)
    torch.testing.assert_close(got, want[doc].float(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        question_attention_scores(q[:3], k, qpos, doc, scale=1.0)


def test_value_deviation_and_top_tokens():
    a = torch.zeros(5, 2, 3)
    b = a.clone()
    b[3] += 2.0
    b[1, 0, 0] = 1.0
    s = value_deviation_scores(a, b)
    torch.testing.assert_close(s, torch.tensor([0.0, 1.0, 0.0, 2.0 * 6 ** 0.5, 0.0]))
    assert top_tokens(s, 2).tolist() == [1, 3]
    with pytest.raises(ValueError, match="budget"):
        top_tokens(s, 6)
    with pytest.raises(ValueError, match="shapes"):
        value_deviation_scores(a, b[:4])


def test_budget_and_sink_selection():
    assert [recompute_budget(r, 10) for r in (0.0, 0.15, 0.25, 1.0)] == [0, 2, 3, 10]
    assert sink_selection([6, 4], 0.5).tolist() == [0, 1, 5, 6, 9]        # 3 = 2 head + 1 tail, 2 = 1 + 1
    assert sink_selection([5], 0.0).tolist() == []
    assert sink_selection([3, 2], 1.0).tolist() == [0, 1, 2, 3, 4]
