"""The LLM API (``macattn.LLM`` / ``SamplingParams``) on the built-in checkpoint, CPU: greedy output =
``ModelRunner.generate``, text = the tokenizer's decoding, stop strings / stop token ids, logprobs =
the model's own log-softmax, bad requests named, slots freed."""
from __future__ import annotations

import pytest
import torch

from macattn import LLM, SamplingParams
from macattn.methods.mac.config import MacConfig
from macattn.models.checkpoint import load_builtin_checkpoint
from macattn.runtime.model_runner import ModelRunner

PROMPTS = ["The Lord is my shepherd", "In the beginning God created", "And it came to pass"]


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin", max_batch_size=4, mac=MacConfig(window=64, band=8))


def test_greedy_output_equals_model_runner(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10))
    model, tok = load_builtin_checkpoint()
    runner = ModelRunner.from_hf(model, MacConfig(window=64, band=8), max_batch_size=4)
    ids = [torch.tensor(tok.encode(p)) for p in PROMPTS]
    res = runner.generate(ids, max_new_tokens=10, end_id=tok.eos_token_id, output_sequence_lengths=True,
                          return_dict=True)
    for b, (out, prompt) in enumerate(zip(outs, ids)):
        n = int(res["sequence_lengths"][b, 0])
        assert out.prompt == PROMPTS[b] and out.prompt_token_ids == prompt.tolist() and out.finished
        assert out.outputs[0].token_ids == res["output_ids"][b, 0, len(prompt):n].tolist()
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert out.outputs[0].finish_reason in ("length", "stop") and out.metrics["num_generated_tokens"] >= 1
    again = llm.generate(out.prompt_token_ids, SamplingParams(max_tokens=10))     # a token id prompt, alone
    assert again.prompt is None and again.outputs[0].token_ids == outs[-1].outputs[0].token_ids
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_stop_strings_and_stop_token_ids_end_the_request(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16)).outputs[0]
    stop_tok = full.token_ids[3]
    first = full.token_ids.index(stop_tok)
    got = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, stop_token_ids=[stop_tok])).outputs[0]
    assert got.token_ids == full.token_ids[:first + 1]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop_tok)
    text = full.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    got = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, stop=[stop])).outputs[0]
    assert got.text == text[:text.find(stop)] and (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert len(got.token_ids) <= len(full.token_ids) and got.token_ids == full.token_ids[:len(got.token_ids)]
    kept = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, stop=stop, include_stop_str_in_output=True))
    assert kept.outputs[0].text == text[:text.find(stop) + len(stop)]
    assert not llm.engine.has_unfinished()


def test_logprobs_are_the_models_log_softmax():
    llm = LLM("builtin", max_batch_size=2, mac="off")
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=4, logprobs=3, return_generation_logits=True))
    comp = out.outputs[0]
    model, _ = load_builtin_checkpoint()
    ids = torch.tensor([out.prompt_token_ids + comp.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0].double(), -1)
    P = len(out.prompt_token_ids)
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[P - 1 + i]
        assert len(lp) == 3 and tok in lp                       # greedy: the sampled token is the top one
        for t, v in lp.items():
            assert abs(v - float(row[t])) < 1e-4
        assert set(lp) == set(row.topk(3).indices.tolist())
    assert abs(comp.cumulative_logprob - sum(lp[t] for t, lp in zip(comp.token_ids, comp.logprobs))) < 1e-9
    assert comp.generation_logits.shape == (4, model.config.vocab_size)


def test_bad_requests_are_named_and_run_nothing(llm):
    cases = [
        ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
        ({"temperature": -0.5}, "temperature must be a finite float >= 0"),
        ({"top_p": 1.5}, r"top_p must be a float in \[0, 1\]"),
        ({"n": 2}, r"n=2 is not supported \(accepted: \[1\]\)"),
        ({"use_beam_search": True}, "use_beam_search=True is not supported"),
        ({"stop": ""}, "stop must be a non-empty string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be ints >= 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    with pytest.raises(TypeError, match="unknown field 'colour'"):
        SamplingParams(colour="red")
    SamplingParams(n=1, best_of=None, repetition_penalty=1.0, exclude_input_from_output=True)   # neutral: fine
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        llm.generate(["fine", ""])
    with pytest.raises(ValueError, match=r"prompts\[0\]: .*input_ids"):
        llm.generate([[1, 2, 10 ** 9]])
    with pytest.raises(ValueError, match="one SamplingParams or one per prompt"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()])
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_streaming_snapshots_grow_to_the_blocking_result(llm):
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = llm.generate(PROMPTS[2], sp).outputs[0]
    snaps = list(llm.generate_async(PROMPTS[2], sp))
    assert [len(s.outputs[0].token_ids) for s in snaps] == list(range(1, 9))
    assert all(not s.finished for s in snaps[:-1]) and snaps[-1].finished
    assert snaps[-1].outputs[0].token_ids == want.token_ids and snaps[-1].outputs[0].text == want.text
    assert all(want.text.startswith(s.outputs[0].text.rstrip("\ufffd")) for s in snaps)

    async def consume():
        return [s async for s in llm.generate_async(PROMPTS[2], sp)]

    import asyncio
    assert [s.outputs[0].token_ids for s in asyncio.run(consume())] == [s.outputs[0].token_ids for s in snaps]


def test_concurrent_callers_get_their_solo_outputs(llm):
    import threading

    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    solo = {p: llm.generate(p, sp).outputs[0].token_ids for p in prompts}
    got, errors = {}, []

    def call(p):
        try:
            got[p] = llm.generate_async(p, sp).result(timeout=120).outputs[0].token_ids
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == solo


def test_abort_mid_stream_frees_the_slot(llm):
    sp = SamplingParams(max_tokens=1000, ignore_eos=True)        # far more than it gets to run
    handle = llm.generate_async(PROMPTS[0], sp)
    stream = iter(handle)
    first = next(stream), next(stream)
    handle.abort()
    last = list(stream)[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(first[1].outputs[0].token_ids) == 2 and 2 <= len(last.outputs[0].token_ids) < 1000
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    # every slot is free again: a full batch runs and equals its solo outputs
    solo = [llm.generate(p, SamplingParams(max_tokens=5)).outputs[0].token_ids for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=5))] == solo


def test_shutdown_stops_the_loop_and_a_new_call_restarts_it():
    with LLM("builtin", max_batch_size=2, mac="off") as llm:
        a = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3))
        thread = llm._engine_loop.thread
    assert not thread.is_alive()
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=3)).outputs[0].token_ids == a.outputs[0].token_ids
    llm.shutdown()


def test_request_metrics_report_its_own_mac_hits():
    """``metrics["mac_hit_rate"]`` / ``["mac_kv_skip"]`` are the request's own: with one request at a time
    they equal the change of the engine-wide diagnostics over that request, and a reused slot starts at 0."""
    with LLM("builtin", max_batch_size=1, mac=MacConfig(window=64, band=8)) as llm:
        d = llm.engine.mac_state.diagnostics
        seen = []
        for prompt in ("The Lord is my shepherd; " * 6, "And it came to pass " * 5):
            before = [t.sum().item() for t in (d.steps, d.hits, d.skipped)]
            out = llm.generate(prompt, SamplingParams(max_tokens=10))
            steps, hits, skipped = (t.sum().item() - b for t, b in zip((d.steps, d.hits, d.skipped), before))
            assert out.metrics["mac_hit_rate"] == pytest.approx(hits / steps)
            assert out.metrics["mac_kv_skip"] == pytest.approx(skipped / steps)
            seen.append(out.metrics["mac_hit_rate"])
        assert max(seen) > 0 and 0 <= min(seen) <= 1
        assert torch.count_nonzero(d.per_slot) == 0             # released slots are empty again


def test_the_overlapped_loop_equals_the_serial_engine(llm):
    """The LLM's two threads (engine steps back to back, detokenizing / streaming on the output thread) give
    every request the tokens the engine gives when stepped serially, sampled requests included."""
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=5),
              SamplingParams(max_tokens=7, temperature=1.0, top_p=0.9, seed=6), SamplingParams(max_tokens=11)]
    prompts = PROMPTS + ["Blessed are the meek"]
    handles = [llm.generate_async(p, sp) for p, sp in zip(prompts, params)]
    streamed = [[len(s.outputs[0].token_ids) for s in h] for h in handles]
    outs = [h.result() for h in handles]
    for counts, out in zip(streamed, outs):
        assert counts == sorted(counts) and counts[-1] == len(out.outputs[0].token_ids)
    engine = llm.engine
    seqs = [engine.make_request(o.prompt_token_ids, sp.engine_params(llm.tokenizer.eos_token_id))
            for o, sp in zip(outs, params)]
    for s in seqs:
        engine.submit(s)
    with llm._loop().cv:               # step serially, with the loop held off
        engine.run_to_completion()
    for s, out in zip(seqs, outs):
        engine.requests.pop(s.request_id, None)
        assert s.output == out.outputs[0].token_ids
