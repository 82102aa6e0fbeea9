"""FastMKA (docs/spec.md §2): reference math, the patched LLaMA/Qwen2/Mistral models, the CPU op, fine-tuning."""
from __future__ import annotations

import json

import pytest
import torch

from macattn.methods.mka.config import MkaConfig
from macattn.methods.mka.reference import (MkaFusion, causal_summary_reference, hashed_chunk_recall_reference, route_fused_decode_reference, router_reference)
from macattn.models.mka import mka_parameters, patch_mka, unpatch_mka
from macattn.models.builtin import FAMILIES, build_builtin_model
from macattn.models.transformers_api import CACHE_KWARG, returned_cache
from macattn.methods.mka import ops as ops_mka  # noqa: F401


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def models():
    return {fam: build_builtin_model(fam, seed=3, num_hidden_layers=2) for fam in FAMILIES}


def _decode(model, ids, prefill):
    """Logits of ``ids [B, T]``: prefill ``prefill`` tokens, then one token per call with the cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        pkv, steps = returned_cache(out), [out.logits]
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t:t + 1], **{CACHE_KWARG: pkv}, use_cache=True)
            pkv = returned_cache(out)
            steps.append(out.logits)
    return torch.cat(steps, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_hot_on_l1_reproduces_the_original_logits(models, family):
    model = models[family]
    ids = torch.randint(0, 2048, (2, 24), generator=_g(1))
    ref_full = model(ids).logits.detach()
    ref_dec = _decode(model, ids, 16)
    ctx = patch_mka(model, MkaConfig(summary="ema" if family == "qwen2" else "mean", l3=family == "mistral"))
    try:
        assert all(f.router.gate.item() == 0.0 for f in ctx.fusions)
        assert torch.equal(model(ids).logits.detach(), ref_full)
        if family != "mistral":     # L3 refuses cache continuation
            assert torch.equal(_decode(model, ids, 16), ref_dec)
        lam = torch.stack([ctx.last_lambda[i] for i in range(len(ctx.fusions))])
        assert torch.equal(lam, torch.tensor([1.0, 0.0, 0.0]).expand_as(lam))
        ctx.set_gate(0.5)      # the fused path is live: the logits move
        assert (model(ids).logits.detach() - ref_full).abs().max() > 1e-3
    finally:
        unpatch_mka(model)
    assert torch.equal(model(ids).logits.detach(), ref_full)


@pytest.mark.parametrize("family,summary", [("llama", "mean"), ("qwen2", "ema"), ("mistral", "mean")])
def test_decode_with_cache_equals_full_sequence(models, family, summary):
    model = models[family]
    ids = torch.randint(0, 2048, (3, 20), generator=_g(2))
    ctx = patch_mka(model, MkaConfig(summary=summary, seed=4))
    try:
        ctx.set_gate(0.8)
        full = model(ids).logits.detach()
        torch.testing.assert_close(_decode(model, ids, 11), full, rtol=1e-4, atol=1e-4)
        ctx.use_op = True     # decode steps through torch.ops.macattn.route_fused_attention
        torch.testing.assert_close(_decode(model, ids, 11), full, rtol=1e-4, atol=1e-4)
        assert ctx.last_lambda[0].shape == (3, 1, 3)
    finally:
        unpatch_mka(model)


def test_causal_summary_chunks_continue_the_state():
    x = torch.randn(2, 13, 8, generator=_g(3), dtype=torch.float64)
    for mode, beta in ((0, 0.0), (1, 0.7)):
        z = torch.zeros(2, 8, dtype=torch.float64)
        c = torch.zeros(2, dtype=torch.int64)
        whole, m, n = causal_summary_reference(x, z, c, mode, beta)
        a, m1, n1 = causal_summary_reference(x[:, :5], z, c, mode, beta)
        b, m2, n2 = causal_summary_reference(x[:, 5:], m1, n1, mode, beta)
        torch.testing.assert_close(torch.cat([a, b], 1), whole)
        torch.testing.assert_close(m2, m)
        assert n2.tolist() == n.tolist() == [13, 13]
    # naive definitions
    torch.testing.assert_close(whole[:, 0], x[:, 0])
    s = x[:, 0]
    for t in range(1, 13):
        s = 0.7 * s + 0.3 * x[:, t]
    torch.testing.assert_close(m, s)
    mean_whole, _, _ = causal_summary_reference(x, z, c, 0, 0.0)
    torch.testing.assert_close(mean_whole[:, 6], x[:, :7].mean(1))


def test_hashed_chunk_recall_matches_brute_force_and_is_causal():
    B, T, D, Dq, C = 2, 23, 6, 5, 4
    x = torch.randn(B, T, D, generator=_g(5), dtype=torch.float64)
    q = torch.randn(B, T, Dq, generator=_g(6), dtype=torch.float64)
    planes = torch.randn(2, Dq, generator=_g(7), dtype=torch.float64)
    got = hashed_chunk_recall_reference(x, q, planes, C)
    code = lambda v: sum(int((v @ planes[i]) > 0) << i for i in range(planes.shape[0]))  # noqa: E731
    want = torch.zeros_like(got)
    hits = 0
    for b in range(B):
        for t in range(T):
            means = [x[b, c * C:(c + 1) * C].mean(0) for c in range(t // C)
                     if code(q[b, c * C:(c + 1) * C].mean(0)) == code(q[b, t])]
            if means:
                hits += 1
                want[b, t] = torch.stack(means).mean(0)
    assert hits > 0
    torch.testing.assert_close(got, want)
    x2, q2 = x.clone(), q.clone()
    x2[:, 12:], q2[:, 12:] = torch.randn(B, T - 12, D, dtype=torch.float64), torch.randn(B, T - 12, Dq, dtype=torch.float64)
    assert torch.equal(hashed_chunk_recall_reference(x2, q2, planes, C)[:, :12], got[:, :12])


def test_decode_reference_agrees_with_the_full_sequence_module():
    D, Dq, N, T = 16, 12, 10, 9
    cfg = MkaConfig(summary="ema", ema_beta=0.8, router_hidden=7, seed=2)
    fu = MkaFusion(Dq, cfg).double().eval()
    with torch.no_grad():
        fu.router.gate.fill_(0.65)
    x = torch.randn(2, T, D, generator=_g(8), dtype=torch.float64)
    q = torch.randn(2, T, Dq, generator=_g(9), dtype=torch.float64)
    wk, bk = torch.randn(N, D, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    with torch.no_grad():
        f, lam, _, _ = fu(x, q, torch.zeros(2, D, dtype=torch.float64), torch.zeros(2, dtype=torch.int64))
    state_mean = torch.randn(5, D, dtype=torch.float64)      # other slots hold junk
    state_count = torch.full((5,), 9, dtype=torch.int64)
    slots = torch.tensor([3, 1])
    state_mean[slots] = 0
    state_count[slots] = 0
    r = fu.router
    with torch.no_grad():
        for t in range(T):
            k, v, lam_t = route_fused_decode_reference(x[:, t], q[:, t], r.w1, r.b1, r.w2, r.b2, r.gate, state_mean,
                                                       state_count, slots, wk, bk, wk, bk, 1, 0.8,
                                                       compute_dtype=torch.float64)
            torch.testing.assert_close(lam_t, lam[:, t])
            torch.testing.assert_close(k, f[:, t] @ wk.T + bk)
    assert state_count.tolist() == [9, 9, 9, 9, 9]


def _op_inputs(B=3, D=16, Dq=12, R=5, N=8, S=4, dtype=torch.float32, seed=0):
    g = _g(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return [r(B, D), r(B, Dq), r(R, Dq), r(R), r(3, R), r(3), torch.tensor(0.4, dtype=dtype),
            torch.randn(S, D, generator=g), torch.randint(0, 5, (S,), generator=g), torch.randperm(S, generator=g)[:B],
            r(N, D), r(N), r(N + 2, D), r(N + 2), 0, 0.0]


@pytest.mark.parametrize("B", [0, 1, 3])
def test_op_on_cpu_equals_fp64_reference_and_updates_only_its_slots(B):
    args = _op_inputs(B=B)
    ref = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    ref[7], ref[8] = args[7].double(), args[8].clone()
    before = args[7].clone()
    k, v, lam = torch.ops.macattn.route_fused_attention(*args)
    rk, rv, rl = route_fused_decode_reference(*ref, compute_dtype=torch.float64)
    assert k.shape == (B, 8) and v.shape == (B, 10) and lam.shape == (B, 3)
    torch.testing.assert_close(k.double(), rk, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.double(), rv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lam.double(), rl, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(args[7].double(), ref[7])
    assert torch.equal(args[8], ref[8])
    other = torch.ones(4, dtype=torch.bool)
    other[args[9]] = False
    assert torch.equal(args[7][other], before[other])


def test_op_opcheck():
    torch.library.opcheck(torch.ops.macattn.route_fused_attention.default, _op_inputs(),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("index,bad,exc,name", [
    (0, torch.zeros(3, 16, 1), ValueError, "x"), (2, torch.zeros(5, 11), ValueError, "w1"),
    (7, torch.zeros(4, 16, dtype=torch.float16), TypeError, "state_mean"),
    (8, torch.zeros(4, dtype=torch.int32), TypeError, "state_count"), (11, torch.zeros(7), ValueError, "bk"),
    (14, 2, ValueError, "mode")])
def test_op_rejects_bad_inputs_naming_them(index, bad, exc, name):
    args = _op_inputs()
    args[index] = bad
    with pytest.raises(exc, match=name):
        torch.ops.macattn.route_fused_attention(*args)


def test_router_gate_is_one_hot_at_zero_and_trainable():
    q = torch.randn(4, 6, generator=_g(10))
    w1, b1, w2, b2 = torch.randn(3, 6), torch.randn(3), torch.randn(3, 3), torch.randn(3)
    gate = torch.zeros((), requires_grad=True)
    lam = router_reference(q, w1, b1, w2, b2, gate, straight_through=True)
    assert torch.equal(lam, torch.tensor([1.0, 0.0, 0.0]).expand(4, 3))
    (lam[:, 1] * 2 + lam[:, 2]).sum().backward()
    assert gate.grad is not None and float(gate.grad) != 0.0
    with pytest.raises(ValueError, match="summary"):
        MkaConfig(summary="max")
    with pytest.raises(ValueError, match="ema_beta"):
        MkaConfig(ema_beta=1.0)


def test_patch_rejects_other_models_and_double_patch(models):
    with pytest.raises(TypeError, match="model must be one of"):
        patch_mka(torch.nn.Linear(2, 2))
    patch_mka(models["llama"])
    try:
        with pytest.raises(ValueError, match="already patched"):
            patch_mka(models["llama"])
        assert {n.split(".self_attn.mka.")[1] for n, _ in mka_parameters(models["llama"])} == \
            {"router.w1", "router.b1", "router.w2", "router.b2", "router.gate"}
    finally:
        unpatch_mka(models["llama"])


def test_finetune_trains_only_mka_weights_and_resumes_exactly(tmp_path):
    from macattn.apps.finetune_mka import FinetuneConfig, finetune, split_corpus, stdlib_corpus

    train, held = split_corpus(stdlib_corpus())
    assert train.numel() > 10_000 and held.numel() > 1_000 and int(train.max()) < 256
    cfg = FinetuneConfig(steps=2, batch=2, seq_len=24, lr=1e-1, eval_batches=1, save_every=1, dtype="fp32")
    mka = MkaConfig(router_hidden=8)

    def run(out, steps, resume):
        model = build_builtin_model("llama", seed=1, num_hidden_layers=2)
        frozen = {n: p.clone() for n, p in model.named_parameters()}
        c = FinetuneConfig(**{**cfg.__dict__, "steps": steps})
        rep = finetune(model, train, held, c, mka, out, resume=resume, progress=False)
        for n, p in model.named_parameters():
            if n in frozen:
                assert torch.equal(p, frozen[n]), n
        return rep, {n: p.detach().clone() for n, p in mka_parameters(model)}

    whole, w_whole = run(tmp_path / "a", 2, False)
    assert whole["loss_step0"] == whole["loss_unmodified"]
    assert any(g != 0.0 for g in whole["gates"])
    run(tmp_path / "b", 1, False)
    resumed, w_res = run(tmp_path / "b", 2, True)
    assert resumed["resumed_from_step"] == 1
    for n in w_whole:
        torch.testing.assert_close(w_res[n], w_whole[n], rtol=1e-6, atol=1e-7)
    assert json.loads((tmp_path / "a" / "step_000002" / "meta.json").read_text())["step"] == 2


def test_cli_adds_finetune_mka():
    from macattn.apps.finetune_mka import FinetuneConfig
    from macattn.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["finetune-mka", "--out", "x", "--summary", "ema", "--steps", "3"])
    assert args.func is not None and args.summary == "ema" and args.steps == 3 and args.dtype == "bf16"
    with pytest.raises(SystemExit):
        parser.parse_args(["finetune-mka"])            # --out is required
    with pytest.raises(ValueError, match="seq_len"):
        FinetuneConfig(seq_len=1)


def test_composes_with_the_mac_patch():
    """FastMKA fuses K/V inputs; MAC replaces the decode attention: gate 0 leaves MAC's output as is."""
    from macattn.models.attention import patch_model, unpatch_model

    model = build_builtin_model("qwen2", seed=5, num_hidden_layers=2)
    ids = torch.randint(0, 2048, (1, 40), generator=_g(12))
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    patch_model(model)
    try:
        mac = model.generate(ids, **kw)
        ctx = patch_mka(model)
        both = model.generate(ids, **kw)
        assert torch.equal(torch.stack(both.logits), torch.stack(mac.logits))
        ctx.set_gate(0.5)
        moved = model.generate(ids, **kw)
        assert (torch.stack(moved.logits) - torch.stack(mac.logits)).abs().max() > 1e-3
        unpatch_mka(model)
    finally:
        unpatch_model(model)


def test_runtime_owned_state_rows(models):
    """With an ``MkaState`` the patched model reads/writes only its requests' slot rows."""
    from macattn.methods.mka.state import MkaState

    model = models["llama"]
    ids = torch.randint(0, 2048, (2, 18), generator=_g(13))
    ctx = patch_mka(model, MkaConfig(seed=6))
    try:
        ctx.set_gate(0.7)
        want = _decode(model, ids, 10)
        state = MkaState.allocate(num_layers=2, num_slots=5, hidden_size=model.config.hidden_size)
        other = state.acquire()
        state.mean[0][other] = 3.0                    # another request's state
        state.count[0][other] = 7
        ctx.state = state
        ctx.slots = torch.tensor([state.acquire(), state.acquire()])
        for use_op in (False, True):
            ctx.use_op = use_op
            torch.testing.assert_close(_decode(model, ids, 10), want, rtol=1e-4, atol=1e-4)
            for layer in range(2):
                assert state.count[layer][ctx.slots].tolist() == [18, 18]
            assert state.count[0][other] == 7 and bool((state.mean[0][other] == 3.0).all())
            assert int(state.count[0][state.in_use.logical_not()].sum()) == 0
        ctx.slots = torch.tensor([1])
        with pytest.raises(ValueError, match="slots"):
            model(ids)
    finally:
        unpatch_mka(model)
