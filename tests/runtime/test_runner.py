"""ModelRunner / LLMEngine on the CPU: TensorRT-LLM output format, agreement with transformers,
engine directories, sampling, slot registry."""
import json

import pytest
import torch
from _tiny import MAC, prompts, tiny_model

from macattn.methods.mac.config import MacConfig
from macattn.runtime import ModelRunner, RuntimeConfig, SlotStates, TensorSlotState, read_engine_dir, write_engine_dir


@pytest.fixture(scope="module")
def runner():
    return ModelRunner.from_hf(tiny_model(), MAC, max_batch_size=6, block_size=8)


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_mac_off_mixed_lengths_equal_transformers(family):
    """MAC disabled: batched decode over mixed lengths through the paged cache = HF greedy."""
    ps = prompts(5, seed=3)
    runner = ModelRunner.from_hf(tiny_model(family), MacConfig(enabled=False), max_batch_size=3, block_size=8)
    out = runner.generate(ps, max_new_tokens=6, return_dict=True, output_sequence_lengths=True)
    ref = tiny_model(family)
    for b, p in enumerate(ps):
        assert out["output_ids"][b, 0, len(p):len(p) + 6].tolist() == _hf_greedy(ref, p, 6)


def test_output_format(runner):
    ps = prompts(3, seed=5)
    out = runner.generate(ps, max_new_tokens=4, pad_id=7, return_dict=True, output_sequence_lengths=True)
    ids, lens = out["output_ids"], out["sequence_lengths"]
    width = max(len(p) for p in ps) + 4
    assert ids.shape == (3, 1, width) and ids.dtype == torch.int32
    assert lens.shape == (3, 1) and lens.dtype == torch.int32
    for b, p in enumerate(ps):
        assert lens[b, 0] == len(p) + 4
        assert torch.equal(ids[b, 0, :len(p)], p.to(torch.int32))
        assert (ids[b, 0, len(p) + 4:] == 7).all()
    plain = runner.generate(ps, max_new_tokens=4, pad_id=7)
    assert torch.equal(plain, ids)
    assert set(runner.generate(ps, max_new_tokens=4, return_dict=True)) == {"output_ids"}


def test_end_id_stops_and_is_not_emitted(runner):
    p = prompts(1, seed=11)[0]
    full = runner.generate([p], max_new_tokens=6)[0, 0, len(p):].tolist()
    end = full[3]
    k = full.index(end)
    out = runner.generate([p], max_new_tokens=6, end_id=end, pad_id=255, return_dict=True,
                          output_sequence_lengths=True)
    assert int(out["sequence_lengths"][0, 0]) == len(p) + k
    assert out["output_ids"][0, 0, len(p):len(p) + k].tolist() == full[:k]
    assert (out["output_ids"][0, 0, len(p) + k:] == end).all()      # padded with end_id, as upstream


def test_streaming_yields_growing_outputs(runner):
    ps = prompts(2, seed=13)
    final = runner.generate(ps, max_new_tokens=5, return_dict=True, output_sequence_lengths=True)
    steps = list(runner.generate(ps, max_new_tokens=5, streaming=True, return_dict=True,
                                 output_sequence_lengths=True))
    assert len(steps) == 5
    lens = [s["sequence_lengths"][:, 0].tolist() for s in steps]
    assert lens == [[len(ps[0]) + i, len(ps[1]) + i] for i in range(1, 6)]
    assert torch.equal(steps[-1]["output_ids"], final["output_ids"])
    # closing a stream early aborts its requests and frees their slots and blocks
    gen = runner.generate(ps, max_new_tokens=5, streaming=True)
    next(gen)
    gen.close()
    eng = runner.engine
    assert not eng.has_unfinished() and eng.slot_states.num_free == eng.config.max_batch_size
    assert eng.executor.blocks.num_free == eng.executor.blocks.num_blocks


def test_sampling_is_seeded_and_top_k_1_is_greedy(runner):
    p = prompts(1, seed=17)[0]
    greedy = runner.generate([p], max_new_tokens=6)
    assert torch.equal(runner.generate([p], max_new_tokens=6, top_k=1, temperature=0.3), greedy)
    kw = dict(max_new_tokens=6, top_k=50, top_p=0.9, temperature=1.5, random_seed=1234)
    a = runner.generate([p, p], **kw)
    b = runner.generate([p], **kw)
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], b[0])   # per-request generator, batch-independent
    outs = {tuple(runner.generate([p], **{**kw, "random_seed": s})[0, 0].tolist()) for s in range(6)}
    assert len(outs) > 1


def test_engine_dir_roundtrip(tmp_path):
    model = tiny_model("qwen2", seed=4)
    mac = MacConfig(window=16, band=4, tau=0.2).with_overrides({1: {"tau": 0.5}})
    write_engine_dir(model, mac, tmp_path / "eng", extra={"onnx": {"decode": "decode.onnx"}})
    # tolerant reading: unknown top-level and MAC keys are ignored
    mf = tmp_path / "eng" / "manifest.json"
    raw = json.loads(mf.read_text())
    raw["mac_config"]["future_field"] = 1
    raw["something_new"] = {"x": 1}
    mf.write_text(json.dumps(raw))
    manifest = read_engine_dir(tmp_path / "eng")
    assert manifest.family == "qwen2" and manifest.mac_config == mac and manifest.ignored == ("future_field",)
    ps = prompts(3, seed=19)
    a = ModelRunner.from_dir(tmp_path / "eng", max_batch_size=2).generate(ps, max_new_tokens=5)
    b = ModelRunner.from_hf(model, mac, max_batch_size=2).generate(ps, max_new_tokens=5)
    assert torch.equal(a, b)
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        ModelRunner.from_dir(tmp_path)


def test_cuda_graph_hook_is_explicit_on_cpu():
    with pytest.raises(NotImplementedError, match="use_cuda_graphs"):
        RuntimeConfig(use_cuda_graphs=True)
    with pytest.raises(ValueError, match="max_batch_size"):
        RuntimeConfig(max_batch_size=0)


def test_slot_registry_resets_every_state():
    reg = SlotStates(3)
    summary = reg.register("mka_summary", TensorSlotState(3, (2, 4)))
    s = reg.acquire()
    summary.data[s] = 5.0
    reg.release(s)
    assert (summary.data == 0).all()
    summary.data[s] = 9.0             # a stale write into a free row is wiped at the next acquire
    t = reg.acquire()
    assert t == s and (summary.data[t] == 0).all()
    with pytest.raises(ValueError, match="2 slots"):
        reg.register("bad", TensorSlotState(2, (1,)))
    with pytest.raises(TypeError, match="reset"):
        reg.register("bad", object())
    reg.acquire(), reg.acquire()
    with pytest.raises(RuntimeError, match="no free slot"):
        reg.acquire()


def test_engine_slot_registry_carries_extra_state(runner):
    eng = runner.engine
    name = "test_extra"
    if name not in eng.slot_states.states:
        eng.slot_states.register(name, TensorSlotState(eng.config.max_batch_size, (3,), fill=-1.0))
    extra = eng.slot_states.states[name]
    rid = eng.add_request(prompts(1, seed=23)[0], max_new_tokens=3)
    eng.step()
    slot = eng.requests[rid].slot
    assert (extra.data[slot] == -1.0).all()
    extra.data[slot] = 42.0
    eng.run_to_completion()
    assert (extra.data[slot] == -1.0).all()
    eng.pop_finished(rid)


def test_upstream_keywords_at_neutral_values_and_log_probs(runner):
    """What TensorRT-LLM's examples/run.py passes on every call is accepted at its defaults; log
    probabilities / logits are the model's; temperature 0 is greedy."""
    ps = prompts(2, seed=17)
    base = runner.generate(ps, max_new_tokens=4, return_dict=True)
    run_py = dict(num_beams=1, length_penalty=1.0, early_stopping=1, repetition_penalty=1.0, presence_penalty=0.0,
                  frequency_penalty=0.0, min_p=0.0, stop_words_list=None, bad_words_list=None, lora_uids=["-1", "-1"],
                  prompt_table=None, prompt_tasks=None, max_attention_window_size=None, sink_token_length=None,
                  no_repeat_ngram_size=None, medusa_choices=None, eagle_choices=None, return_all_generated_tokens=False,
                  input_token_extra_ids=None, language_adapter_uids=None, num_return_sequences=None)
    out = runner.generate(ps, max_new_tokens=4, temperature=0.0, top_k=50, top_p=0.9, return_dict=True,
                          output_log_probs=True, output_cum_log_probs=True, output_generation_logits=True, **run_py)
    assert torch.equal(out["output_ids"], base["output_ids"])
    V = runner.vocab_size
    assert out["log_probs"].shape == (2, 1, 4) and out["cum_log_probs"].shape == (2, 1)
    assert out["generation_logits"].shape == (2, 1, 4, V)
    for b, p in enumerate(ps):
        gen = out["output_ids"][b, 0, len(p):len(p) + 4]
        lp = torch.log_softmax(out["generation_logits"][b, 0].double(), -1)
        assert torch.allclose(out["log_probs"][b, 0].double(), lp[torch.arange(4), gen.long()], atol=1e-5)
        assert torch.equal(lp.argmax(-1), gen.long())                       # greedy
    assert torch.allclose(out["cum_log_probs"], out["log_probs"].sum(-1))
    with pytest.raises(ValueError, match=r"num_beams=2 is not supported"):
        runner.generate(ps, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match=r"lora_uids=\['3'\] is not supported"):
        runner.generate(ps, max_new_tokens=2, lora_uids=["3"])


def _offsets(words_per_request):
    """TensorRT-LLM's ``[batch, 2, N]`` int32 word lists (``to_word_list_format`` of token ids)."""
    n = max(max(sum(len(w) for w in words), len(words)) for words in words_per_request)
    out = torch.full((len(words_per_request), 2, n), -1, dtype=torch.int32)
    out[:, 0] = 0
    for b, words in enumerate(words_per_request):
        flat = [t for w in words for t in w]
        out[b, 0, :len(flat)] = torch.tensor(flat, dtype=torch.int32)
        ends = torch.tensor([len(w) for w in words]).cumsum(0)
        out[b, 1, :len(words)] = ends.to(torch.int32)
    return out


def test_stop_words_end_the_request_keeping_the_word(runner):
    """TensorRT-LLM's stop words (both layouts): a request ends at the step its tokens end with a word, the word
    kept in ``output_ids`` / ``sequence_lengths`` and the rest padded with end_id; other requests run on."""
    ps = prompts(2, seed=29)
    full = runner.generate(ps, max_new_tokens=8, return_dict=True, output_sequence_lengths=True)
    gen = [full["output_ids"][b, 0, len(p):len(p) + 8].tolist() for b, p in enumerate(ps)]
    word = gen[0][2:4]                                   # a two-token word, first complete after token 4
    first = next(i for i in range(2, 9) if gen[0][i - 2:i] == word)
    for stop in (_offsets([[word], [[255, 254, 253]]]), [[word], [[255, 254, 253]]]):
        out = runner.generate(ps, max_new_tokens=8, end_id=250, stop_words_list=stop, return_dict=True,
                              output_sequence_lengths=True)
        assert int(out["sequence_lengths"][0, 0]) == len(ps[0]) + first
        assert out["output_ids"][0, 0, len(ps[0]):len(ps[0]) + first].tolist() == gen[0][:first]
        assert (out["output_ids"][0, 0, len(ps[0]) + first:] == 250).all()
        if 250 not in gen[1] and not any(gen[1][i:i + 3] == [255, 254, 253] for i in range(6)):
            assert out["output_ids"][1, 0, len(ps[1]):len(ps[1]) + 8].tolist() == gen[1]
    eng = runner.engine
    assert not eng.has_unfinished() and eng.slot_states.num_free == eng.config.max_batch_size
    with pytest.raises(ValueError, match=r"stop_words_list must have shape \[batch=2, 2, N\]"):
        runner.generate(ps, max_new_tokens=2, stop_words_list=torch.zeros(3, 2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"stop_words_list\[1\]: token ids must lie in \[0, 255\]"):
        runner.generate(ps, max_new_tokens=2, stop_words_list=[[[1]], [[999]]])


def test_bad_words_are_never_generated(runner):
    """Single-token bad words never appear; a two-token bad word's second token never follows its first (the
    ban decided on the host before each step), whatever the greedy output would have been."""
    ps = prompts(2, seed=31)
    n = 10
    full = runner.generate(ps, max_new_tokens=n)
    gen = [full[b, 0, len(p):len(p) + n].tolist() for b, p in enumerate(ps)]
    singles = sorted(set(gen[0][:3]))
    pair = gen[1][3:5]
    out = runner.generate(ps, max_new_tokens=n, bad_words_list=_offsets([[[t] for t in singles], [pair]]))
    got = [out[b, 0, len(p):len(p) + n].tolist() for b, p in enumerate(ps)]
    assert not set(got[0]) & set(singles) and got[0] != gen[0]
    tokens = ps[1].tolist() + got[1]
    assert not any(tokens[i:i + 2] == pair for i in range(len(ps[1]) - 1, len(tokens) - 1))
    full1 = ps[1].tolist() + gen[1]
    g = next(j + 1 for j in range(len(ps[1]) - 1, len(full1) - 1) if full1[j:j + 2] == pair) - len(ps[1])
    assert got[1][:g] == gen[1][:g] and got[1][g] != gen[1][g]    # the same until the banned completion
    same = runner.generate(ps, max_new_tokens=n, bad_words_list=[[[t] for t in singles], [pair]])
    assert torch.equal(same, out)                                 # ModelRunnerCpp's nested lists: the same
    with pytest.raises(ValueError, match=r"bad_words_list\[0\]: .*bias table holds 64"):
        runner.generate(ps, max_new_tokens=2, bad_words_list=[[[t] for t in range(70)], []])


def test_penalties_and_min_p_reach_the_engine(runner):
    """repetition / presence / frequency penalties and min_p (one value or one per request) change what the
    engine samples exactly as the engine's own SamplingConfig do; a neutral value changes nothing."""
    from macattn.runtime.sampling import SamplingConfig

    ps = prompts(2, seed=37)
    base = runner.generate(ps, max_new_tokens=8)
    assert torch.equal(runner.generate(ps, max_new_tokens=8, repetition_penalty=1.0, presence_penalty=0.0,
                                       frequency_penalty=0.0, min_p=0.0), base)
    for kw in (dict(repetition_penalty=1.8), dict(presence_penalty=2.0), dict(frequency_penalty=2.0)):
        got = runner.generate(ps, max_new_tokens=8, **kw)
        want = runner.generate(ps, sampling_config=SamplingConfig(max_new_tokens=8, **kw))
        assert torch.equal(got, want) and not torch.equal(got, base), kw
    per = runner.generate(ps, max_new_tokens=8, repetition_penalty=[1.0, 1.8])
    assert torch.equal(per[0], base[0]) and torch.equal(per[1], runner.generate(ps, max_new_tokens=8,
                                                                                  repetition_penalty=1.8)[1])
    kw = dict(max_new_tokens=8, temperature=1.5, top_k=0, top_p=1.0, random_seed=5)
    assert torch.equal(runner.generate(ps, min_p=1.0, **kw), base)     # min_p = 1 keeps the top token only
    assert not torch.equal(runner.generate(ps, **kw), base)
    with pytest.raises(ValueError, match=r"repetition_penalty must be a finite float in \[1e-06, 1e\+06\]"):
        runner.generate(ps, max_new_tokens=2, repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"min_p must be one value or one per request \(2\)"):
        runner.generate(ps, max_new_tokens=2, min_p=[0.1, 0.2, 0.3])


def test_engine_args_seed_makes_unseeded_sampling_repeat():
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)
    ps = prompts(2, seed=41)
    a = ModelRunner.from_hf(tiny_model(), MAC, max_batch_size=2, seed=123).generate(ps, **kw)
    b = ModelRunner.from_hf(tiny_model(), MAC, max_batch_size=2, seed=123).generate(ps, **kw)
    assert torch.equal(a, b)


def test_gpu_memory_utilization_sizes_the_kv_pool(monkeypatch):
    """On CUDA, ``gpu_memory_utilization`` gives the KV pool (u x total - in use - weights to load) / bytes per
    block, at most what max_batch_size requests of max_seq_len need; on the CPU it is unused."""
    from macattn.runtime.engine_args import EngineArgs

    model = tiny_model().to(torch.float32)        # 2 layers, 2 KV heads of 16: 2*2*2*16*8*4 = 4 KiB per block
    weights = sum(p.numel() for p in model.parameters()) * 4
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))   # 20 GiB in use
    args = EngineArgs(device="cuda", gpu_memory_utilization=0.5, block_size=8, max_batch_size=4, max_seq_len=256)
    assert args.kv_blocks_from_memory(model) == 4 * 256 // 8          # capped: plenty of room
    u = 20.01 / 80                                                     # ~10 MB left for weights and KV
    args = EngineArgs(device="cuda", gpu_memory_utilization=u, block_size=8, max_batch_size=4000, max_seq_len=256)
    want = int((u * 80 * gib - 20 * gib - weights) // (2 * 2 * 2 * 16 * 8 * 4))
    assert 1000 < args.kv_blocks_from_memory(model) == want < 4000 * 32
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.2: .* leave no room for a KV block"):
        EngineArgs(device="cuda", gpu_memory_utilization=0.2).kv_blocks_from_memory(model)
    assert EngineArgs(device="cuda", gpu_memory_utilization=0.5, num_blocks=7).kv_blocks_from_memory(model) is None
    assert EngineArgs(gpu_memory_utilization=0.5).kv_blocks_from_memory(model) is None       # the CPU
