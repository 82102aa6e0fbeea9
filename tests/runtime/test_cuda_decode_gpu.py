"""The runtime's GPU decode (``runtime/cuda_decode.py``): the Triton MAC plan over the paged
pool, CUDA graphs per batch bucket, scratch-padded buckets. Marked ``gpu``.

Requests are teacher-forced with a fixed token script, so every engine sees the same inputs
and their logits can be compared step by step:

* CUDA-graph replay == eager run of the same bucket (bit for bit);
* GPU paged path == the CPU reference runtime (MAC off: full attention, no match decisions
  that rounding could flip) within TF32/fp32 tolerance;
* in-flight batching with padding (6 requests through 4 slots, buckets 1/2/4): each request's
  logits equal its solo run (no state of one request visible to another, none left in a reused slot);
* the same three for a FastMKA-patched model (route-fused K/V inputs, the session summary in
  runtime-owned rows updated inside the captured step).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from macattn.methods.mac.config import MacConfig  # noqa: E402
from macattn.models.builtin import build_builtin_model  # noqa: E402
from macattn.runtime.config import RuntimeConfig  # noqa: E402
from macattn.runtime.engine import LLMEngine, StepOutput  # noqa: E402

pytest.importorskip("triton")


class ForcedEngine(LLMEngine):
    """Records each request's logits per step and appends the scripted token instead of sampling."""

    def __init__(self, model, mac, config: RuntimeConfig, *, script: dict[int, list[int]], **kw):
        # serial steps: the scripted token is fed from the host (async scheduling feeds the sampled one)
        super().__init__(model, mac, replace(config, async_scheduling=False), **kw)
        self.script, self.logits, self.names = script, {}, {}

    def add(self, name: int, prompt: torch.Tensor, new_tokens: int) -> None:
        rid = self.add_request(prompt, max_new_tokens=new_tokens)
        self.names[rid] = name

    def _append(self, seq, token, logits):
        name = self.names[seq.request_id]
        self.logits.setdefault(name, []).append(logits.float().cpu())
        token = self.script[name][len(seq.output)]
        seq.output.append(token)
        done = len(seq.output) >= seq.sampling.max_new_tokens
        if done:
            self.scheduler.finish(seq, "length")
        return StepOutput(seq.request_id, token, done, "length" if done else None)


def _script(n, new_tokens, vocab=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randint(0, vocab, (new_tokens,), generator=g).tolist() for i in range(n)}


def _prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        period = int(torch.randint(5, 11, (1,), generator=g))
        length = int(torch.randint(40, 300, (1,), generator=g))
        out.append(torch.randint(0, 2048, (period,), generator=g).repeat(-(-length // period))[:length].clone())
    return out


def _run(make_model, mac, device, graphs, prompts, script, new_tokens, max_batch=4, order=None):
    """make_model: a fresh model per engine (an engine patches its model in place)."""
    eng = ForcedEngine(make_model(), mac, RuntimeConfig(max_batch_size=max_batch, max_seq_len=512, device=device,
                                                 use_cuda_graphs=graphs), script=script)
    for i in (order or range(len(prompts))):
        eng.add(i, prompts[i], new_tokens)
    eng.run_to_completion()
    return eng


def _rel(a, b):
    return float((a - b).norm() / b.norm())


MAC = MacConfig(window=64, band=8, tau=0.3)


def test_graph_replay_equals_eager():
    def model():
        return build_builtin_model("llama", seed=3).to("cuda", torch.bfloat16)

    prompts, script = _prompts(6), _script(6, 12)
    eager = _run(model, MAC, "cuda", False, prompts, script, 12)
    graph = _run(model, MAC, "cuda", True, prompts, script, 12)
    for i in range(6):
        for a, b in zip(eager.logits[i], graph.logits[i]):
            assert torch.equal(a, b)
    hits = graph.mac_state.diagnostics.hits.sum()
    assert hits > 0, "the scripted repetitive prompts should produce MAC hits"


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_paged_gpu_path_equals_cpu_reference_mac_off(family):
    off = MacConfig(enabled=False)
    prompts, script = _prompts(5, seed=2), _script(5, 10, seed=2)
    cpu = _run(lambda: build_builtin_model(family, seed=4), off, "cpu", False, prompts, script, 10)
    gpu = _run(lambda: build_builtin_model(family, seed=4).to("cuda"), off, "cuda", True, prompts, script, 10)
    for i in range(5):
        for step, (a, b) in enumerate(zip(gpu.logits[i], cpu.logits[i])):
            assert _rel(a, b) < 5e-3, f"request {i} step {step}: rel err {_rel(a, b):.2e}"


def test_inflight_padding_and_slot_reuse_are_isolated():
    def model():     # fp32: batched and solo runs agree far below the match threshold's margin
        return build_builtin_model("llama", seed=5).to("cuda")

    prompts, script = _prompts(6, seed=6), _script(6, 9, seed=6)
    batched = _run(model, MAC, "cuda", True, prompts, script, 9, max_batch=4, order=[3, 0, 5, 1, 4, 2])
    for i in range(6):
        solo = _run(model, MAC, "cuda", True, [prompts[i]], {0: script[i]}, 9, max_batch=4)
        for step, (a, b) in enumerate(zip(batched.logits[i], solo.logits[0])):
            assert _rel(a, b) < 2e-2, f"request {i} step {step}: rel err {_rel(a, b):.2e} vs solo"


def _generate(model, mac, graphs, prompts, sampling, quantization=None, device="cuda"):
    """Free-running generation (the engine's own sampler) -> each request's tokens."""
    eng = LLMEngine(model, mac, RuntimeConfig(max_batch_size=4, max_seq_len=512, device=device,
                                              use_cuda_graphs=graphs, quantization=quantization))
    ids = [eng.add_request(p, sampling[i % len(sampling)]) for i, p in enumerate(prompts)]
    eng.run_to_completion()
    return [eng.pop_finished(i).output for i in ids]


@pytest.mark.parametrize("mac", [MAC, None], ids=["mac-on", "mac-off"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_whole_step_graph_with_sampler_equals_eager(mac, quantization):
    """Embedding -> layers -> logits -> sampler as one replay: the same tokens as the eager step,
    greedy and sampled requests mixed (both sampler variants captured), bf16 and FP8 weights."""
    from macattn.runtime.sampling import SamplingConfig

    sampling = [SamplingConfig(max_new_tokens=10), SamplingConfig(max_new_tokens=10, top_k=20, top_p=0.9,
                                                                  temperature=0.8, random_seed=11)]
    prompts = _prompts(5, seed=8)
    model = lambda: build_builtin_model("llama", seed=3).to("cuda", torch.bfloat16)  # noqa: E731
    eager = _generate(model(), mac, False, prompts, sampling, quantization)
    graph = _generate(model(), mac, True, prompts, sampling, quantization)
    assert eager == graph
    greedy_only = _generate(model(), mac, True, prompts[:2], sampling[:1], quantization)
    assert greedy_only[0] == graph[0]           # the greedy variant alone gives the same greedy tokens


def test_fp8_paged_gpu_path_equals_cpu_fp8_reference():
    """FP8 weights: the GPU step (FP8 GEMV, Triton decode-step kernels) equals the CPU reference runtime
    with the same quantised weights (dequantised fp32 math), MAC off."""
    off = MacConfig(enabled=False)
    prompts, script = _prompts(3, seed=9), _script(3, 8, seed=9)

    def run(device):
        eng = ForcedEngine(build_builtin_model("llama", seed=4).to(device), off,
                           RuntimeConfig(max_batch_size=4, max_seq_len=512, device=device, quantization="fp8",
                                         use_cuda_graphs=device == "cuda"), script=script)
        for i, p in enumerate(prompts):
            eng.add(i, p, 8)
        eng.run_to_completion()
        return eng

    cpu, gpu = run("cpu"), run("cuda")
    for i in range(3):
        for step, (a, b) in enumerate(zip(gpu.logits[i], cpu.logits[i])):
            assert _rel(a, b) < 5e-3, f"request {i} step {step}: rel err {_rel(a, b):.2e}"


def _mka_model(device):
    from macattn.methods.mka.config import MkaConfig
    from macattn.models.mka import patch_mka

    model = build_builtin_model("llama", seed=3)
    patch_mka(model, MkaConfig(summary="ema", ema_beta=0.8, seed=3)).set_gate(0.9)
    return model.to(device)


@pytest.mark.parametrize("mac", [MAC, MacConfig(enabled=False)], ids=["mac-on", "mac-off"])
def test_fastmka_whole_step_graph(mac):
    """FastMKA composes with MAC / full attention inside the captured step: replay == eager bit for
    bit, == the CPU reference runtime (MAC off), and batched (6 requests, 4 slots) == solo."""
    prompts, script = _prompts(6, seed=10), _script(6, 9, seed=10)
    order = [3, 0, 5, 1, 4, 2]
    eager = _run(lambda: _mka_model("cuda"), mac, "cuda", False, prompts, script, 9, order=order)
    graph = _run(lambda: _mka_model("cuda"), mac, "cuda", True, prompts, script, 9, order=order)
    assert graph.executor.decoder.use_cuda_graphs and graph.executor.decoder.buckets
    assert all(b.graphs for b in graph.executor.decoder.buckets.values())
    for i in range(6):
        for a, b in zip(eager.logits[i], graph.logits[i]):
            assert torch.equal(a, b)
    if not mac.enabled:
        cpu = _run(lambda: _mka_model("cpu"), mac, "cpu", False, prompts, script, 9, order=order)
        for i in range(6):
            for step, (a, b) in enumerate(zip(graph.logits[i], cpu.logits[i])):
                assert _rel(a, b) < 5e-3, f"request {i} step {step}: rel err {_rel(a, b):.2e}"
    for i in (0, 5):
        solo = _run(lambda: _mka_model("cuda"), mac, "cuda", True, [prompts[i]], {0: script[i]}, 9)
        for step, (a, b) in enumerate(zip(graph.logits[i], solo.logits[0])):
            assert _rel(a, b) < 2e-2, f"request {i} step {step}: rel err {_rel(a, b):.2e} vs solo"


def test_two_stage_match_in_the_captured_step():
    """MacConfig(match="two_stage") on the GPU path: the plan's Triton two-stage kernels over the
    sketch ring, appended to in the graph. With every entry a candidate (C = K = 16) it decides as
    the exact match; with E4M3 sketches and 4 candidates replay decides as eager at every layer, head and step
    (logits within fp32 rounding); the sketch ring
    equals the sketch of the query ring for every live slot while requests run."""
    from dataclasses import replace

    from macattn.methods.mac.match_sketch import sketch

    def model():
        return build_builtin_model("llama", seed=3).to("cuda")

    mac16 = MacConfig(window=16, band=8, tau=0.3)
    prompts, script = _prompts(5, seed=12), _script(5, 10, seed=12)
    exact = _run(model, mac16, "cuda", True, prompts, script, 10)
    every = _run(model, replace(mac16, match="two_stage", match_candidates=16), "cuda", True, prompts, script, 10)
    assert exact.mac_state.diagnostics.hits.sum() > 0
    assert torch.equal(every.mac_state.diagnostics.hits, exact.mac_state.diagnostics.hits)
    for i in range(5):
        for a, b in zip(exact.logits[i], every.logits[i]):
            assert _rel(b, a) < 1e-5

    # eager and graph decide alike at every (layer, head, step). The logits agree to fp32 rounding, not bit for bit:
    # the fifth prompt is prefilled alone once a slot frees, and the graph engine's prefill pieces run its GEMMs on
    # rows padded to a token bucket, which in fp32 round differently from the eager call's exact rows on the
    # CUDA 13 images (benchmarks/notes/serving.md, eighth session: every ring agrees bit for bit until that prefill;
    # from it, layer 0's still do, layers 1-3 differ by <= 4e-7)
    two = replace(MAC, match="two_stage", match_sketch="fp8", match_candidates=4)
    eager = _run(model, two, "cuda", False, prompts, script, 10)
    graph = _run(model, two, "cuda", True, prompts, script, 10)
    assert graph.executor.decoder.use_cuda_graphs and all(b.graphs for b in graph.executor.decoder.buckets.values())
    assert graph.mac_state.diagnostics.hits.sum() > 0
    assert torch.equal(graph.mac_state.diagnostics.hits, eager.mac_state.diagnostics.hits)
    for i in range(5):
        for a, b in zip(eager.logits[i], graph.logits[i]):
            assert _rel(b, a) < 1e-5

    eng = ForcedEngine(model(), replace(two, match_sketch="proj16"),
                       RuntimeConfig(max_batch_size=4, max_seq_len=512, device="cuda", use_cuda_graphs=True),
                       script=script)
    for i, p in enumerate(prompts):
        eng.add(i, p, 10)
    st = eng.mac_state
    checked = 0
    for _ in range(6):
        eng.step()
        live = [s for s in eng.slot_states.in_use if s != eng.executor.scratch_slot]
        checked += bool(live)
        for layer, sr in enumerate(st.sring if live else []):
            got, want = sr[live].float(), sketch(st.qring[layer][live], "proj16")
            # the kernels' projection sums in another fp32 order: one bf16 rounding step at most
            assert ((got - want).abs() <= 2.0 ** -7 * want.abs()).all(), f"layer {layer}"
            assert (got == want).float().mean() > 0.99
    assert checked >= 3


def test_the_method_owns_its_bucket_plans_and_graph_variants():
    """The runtime names no method: a bucket's plans are the method's (MAC: one ``MacDecodePlan`` per
    distinct layer configuration; full attention: the attend-only ``FullDecodePlans``), its captured
    variants are keyed by ``(greedy, method.decode_graph_key(positions))`` (MAC: ``collect_diagnostics`` and
    whether a row has reached ``min_context``), MAC's
    diagnostics are recorded inside the variant that has them only, and ``last_match_pos`` views the
    latest step's rows."""
    from macattn.methods.base import FullDecodePlans
    from macattn.methods.mac.decode_plans import MacDecodePlans, plan_key
    from macattn.runtime.sampling import SamplerVariant

    ARGMAX = SamplerVariant(draw=False, bias=False, penalize=False)     # the sampler variant of greedy steps

    def model():
        return build_builtin_model("llama", seed=3).to("cuda", torch.bfloat16)

    rc = RuntimeConfig(max_batch_size=4, max_seq_len=512, device="cuda", use_cuda_graphs=True)
    prompts, script = _prompts(3, seed=13), _script(3, 8, seed=13)
    mac = MAC.with_overrides({0: {"window": 32}})
    eng = ForcedEngine(model(), mac, rc, script=script)
    for i, p in enumerate(prompts):
        eng.add(i, p, 8)
    while min(len(s.output) for s in eng.requests.values()) < 3:     # every request decoded
        eng.step()
    dec = eng.executor.decoder
    layers = range(eng.executor.num_layers)
    for b in dec.buckets.values():
        assert isinstance(b.plans, MacDecodePlans) and b.plans.page_table is b.page_table
        assert set(b.plans.plans) == {plan_key(mac.for_layer(layer)) for layer in layers}
        assert len(b.plans.plans) == 2 and set(b.graphs) == {(ARGMAX, (True, True))}
    steps = eng.mac_state.diagnostics.steps.sum().item()
    assert steps > 0
    eng.method.collect_diagnostics = False
    eng.step()                                                       # the three requests: bucket 4
    assert set(dec.buckets[4].graphs) == {(ARGMAX, (True, True)), (ARGMAX, (False, True))}
    assert eng.mac_state.diagnostics.steps.sum().item() == steps     # the variant without diagnostics records none
    mp = eng.method.last_match_pos
    assert set(mp) == set(layers) and all(t.shape == (3, eng.method.dims.num_q_heads) for t in mp.values())

    full = ForcedEngine(model(), None, rc, script=script, method="full")
    for i, p in enumerate(prompts):
        full.add(i, p, 8)
    full.run_to_completion()
    assert all(type(b.plans) is FullDecodePlans and set(b.graphs) == {(ARGMAX, None)}
               for b in full.executor.decoder.buckets.values())


@pytest.mark.parametrize("match", ["exact", "two_stage"])
def test_min_context_rows_attend_in_full_and_leave_their_ring(match):
    """``MacConfig.min_context`` on the GPU plans, fp32: a step where no row has reached ``C`` replays the variant
    whose MAC layers attend in full (bit for bit MAC off's step); in the variant with a row at ``m >= C`` a row
    below matches nothing (full attention, within the kernels' TF32 rounding of MAC off) and appends into the
    scratch slot, so its ring stays empty until it reaches ``C``; a request past ``C`` from its first step runs as
    with ``C = 0`` (its logits within fp32 rounding); graph = eager (the same hits); the diagnostics count the
    engaged rows only."""
    from macattn.runtime.sampling import SamplerVariant

    ARGMAX = SamplerVariant(draw=False, bias=False, penalize=False)

    def model():
        return build_builtin_model("llama", seed=5).to("cuda")

    mac = MAC if match == "exact" else replace(MAC, match="two_stage", match_candidates=4)
    C, new = 125, 12
    prompts, script = _prompts(6, seed=3), _script(6, new, seed=3)      # 45, 56, 119, 228, 231, 291 tokens
    lengths = [len(p) for p in prompts]
    assert sorted(lengths)[:3] == [45, 56, 119]

    def run(config, graphs, which):
        eng = ForcedEngine(model(), config, RuntimeConfig(max_batch_size=4, max_seq_len=512, device="cuda",
                                                          use_cuda_graphs=graphs), script=script)
        for i in which:
            eng.add(i, prompts[i], new)
        while eng.has_unfinished():
            eng.step()
            for seq in eng.requests.values():      # a row below C leaves its ring empty (none of these seed it)
                if (config.min_context and seq.slot is not None and seq.prefilled and len(seq.prompt) < C
                        and seq.num_tokens - 2 < C):
                    for ring_pos in eng.mac_state.ring_pos:
                        assert (ring_pos[seq.slot] == -1).all(), (seq.request_id, seq.num_tokens)
        return eng

    every, short = range(6), [i for i in range(6) if lengths[i] + new < C]
    on = run(replace(mac, min_context=C), True, every)
    eager = run(replace(mac, min_context=C), False, every)
    off = run(replace(mac, enabled=False), True, every)
    paper = run(mac, True, every)
    assert torch.equal(on.mac_state.diagnostics.hits, eager.mac_state.diagnostics.hits)
    engaged = 0
    for i in every:
        L = lengths[i]
        for step, (a, b, c, d) in enumerate(zip(on.logits[i], eager.logits[i], off.logits[i], paper.logits[i])):
            m = L - 1 + step
            assert _rel(a, b) < 1e-5, (i, step)     # graph = eager (fp32: the prefill pieces pad their GEMMs' rows)
            if m < C:
                # the MAC plan's miss path splits the keys apart from run_full's (TF32 dots): ~3e-5 measured
                assert _rel(a, c) < 5e-4, f"request {i} at m={m}: rel err {_rel(a, c):.2e} vs MAC off"
            elif L >= C:
                assert _rel(a, d) < 1e-4, f"request {i} at m={m}: rel err {_rel(a, d):.2e} vs C = 0"
            engaged += step > 0 and m >= C
    diag = on.mac_state.diagnostics
    assert torch.all(diag.steps == engaged) and paper.mac_state.diagnostics.hits.sum() > 0
    assert any((ARGMAX, (True, True)) in b.graphs for b in on.executor.decoder.buckets.values())
    # the short prompts alone: every step in the variant without a match, bit for bit MAC off's step
    alone = run(replace(mac, min_context=C), True, short)
    alone_off = run(replace(mac, enabled=False), True, short)
    assert all(set(b.graphs) == {(ARGMAX, (True, False))} for b in alone.executor.decoder.buckets.values())
    for i in short:
        assert all(torch.equal(a, b) for a, b in zip(alone.logits[i], alone_off.logits[i]))
    assert alone.mac_state.diagnostics.steps.sum() == 0
    assert all(len(mp) and all((t == -1).all() for t in mp.values()) for mp in [alone.method.last_match_pos])


@pytest.mark.parametrize("kind", ["mac_off", "min_context", "full"])
def test_fused_mixed_step_equals_two_calls(kind):
    """The one-forward mixed step on the GPU (``ModelExecutor.mixed_step``; the CPU side in ``test_mixed_step.py``),
    fp32, graphs on: with a request arriving at every step, the decode rows beside each prompt ride its packed call
    (the prefill pieces' tail ids, the bucket plans' ``attend_full``), and every request's logits equal those of
    the engine that runs each mixed step as two calls (within the GEMMs' TF32 rounding over other row counts);
    with async scheduling (the pending tokens scattered into the tail on the device) the greedy tokens equal the
    serial loop's."""
    mac, kw = {"mac_off": (replace(MAC, enabled=False), {}), "min_context": (replace(MAC, min_context=480), {}),
               "full": (None, dict(method="full"))}[kind]
    prompts, new = _prompts(6, seed=4), 10
    script = _script(6, new, seed=4)

    def engine(fuse, overlap=False, forced=True):
        cfg = RuntimeConfig(max_batch_size=4, max_seq_len=512, device="cuda", async_scheduling=overlap)
        model = build_builtin_model("llama", seed=5).to("cuda")
        eng = (ForcedEngine(model, mac, cfg, script=script, **kw) if forced else LLMEngine(model, mac, cfg, **kw))
        ex, eng.fused = eng.executor, []
        if not fuse:
            ex.fuses = lambda decodes, chunks: False
        else:
            mixed = ex.mixed_step
            ex.mixed_step = lambda d, c, feed=None: (eng.fused.append(len(d)), mixed(d, c, feed))[1]
        return eng

    def run(eng, forced=True):
        out = {}
        for i, p in enumerate(prompts):
            if forced:
                eng.add(i, p, new)
            else:
                out[eng.add_request(p, max_new_tokens=new)] = i
            for o in eng.step():
                if not forced and o.token is not None:
                    eng.tokens.setdefault(out[o.request_id], []).append(o.token)
        while eng.has_unfinished():
            for o in eng.step():
                if not forced and o.token is not None:
                    eng.tokens.setdefault(out[o.request_id], []).append(o.token)
        return eng

    fused, apart = run(engine(True)), run(engine(False))
    assert len(fused.fused) >= 4 and not apart.fused
    for i in range(6):
        assert len(fused.logits[i]) == len(apart.logits[i]) == new
        for step, (a, b) in enumerate(zip(fused.logits[i], apart.logits[i])):
            assert _rel(a, b) < 5e-4, f"request {i} step {step}: rel err {_rel(a, b):.2e}"
    tokens = []
    for overlap in (False, True):
        eng = engine(True, overlap=overlap, forced=False)
        eng.tokens = {}
        tokens.append(run(eng, forced=False).tokens)
        assert len(eng.fused) >= 4
    assert tokens[0] == tokens[1]
