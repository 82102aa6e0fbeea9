"""The OpenAI-compatible server (``macattn serve --model``) against uvicorn on 127.0.0.1, the built-in checkpoint
on the CPU: outputs = the LLM API's (completions, chat, prompt lists, n, every sampling field), prompt
log-probabilities = a transformers forward, the usage chunk only when asked, every problem of a request in one
400 (unknown fields, strict types, unsupported fields refused by name; harmless ones accepted and logged),
/tokenize /detokenize /version /v1/models/{id}, vLLM metric names, a disconnect frees the slot, SIGTERM ends
the process cleanly, a missing [serve] extra is a one-line message. The ``openai`` client's own loops are in
``test_real_clients.py``."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from macattn.apps.llm import LLM, SamplingParams  # noqa: E402
from macattn.apps.serving.openai_protocol import FIELDS  # noqa: E402
from macattn.apps.serving.openai_server import build_app, chat_prompt  # noqa: E402
from _serving import free_port, serving  # noqa: E402
from macattn.methods.mac.config import MacConfig  # noqa: E402

PROMPTS = ["The Lord is my shepherd", "In the beginning God created", "And it came to pass", "Blessed are"]
LLM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.fixture(scope="module")
def server():
    llm = LLM("builtin", max_batch_size=4, mac=MacConfig(window=64, band=8))
    with serving(llm) as url:
        yield llm, url


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _post(url, path, body, **kw):
    return httpx.post(f"{url}{path}", json=body, timeout=120, **kw)


def _greedy(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw))[0]


def _events(url, path, body) -> list[dict]:
    """The JSON events of a stream (``[DONE]`` last, checked)."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_completions_equal_the_llm_api(server):
    llm, url = server
    c = _client(url)
    assert [m.id for m in c.models.list().data] == ["builtin"]
    want = _greedy(llm, PROMPTS[0], max_tokens=8)
    got = c.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert got.choices[0].text == want.outputs[0].text and got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    ids = c.completions.create(model="builtin", prompt=want.prompt_token_ids, max_tokens=8, temperature=0)
    assert ids.choices[0].text == want.outputs[0].text
    # a stream without stream_options: every chunk has a choice, no usage chunk
    chunks = list(c.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True))
    assert all(ch.choices for ch in chunks) and all(ch.usage is None for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks) == want.outputs[0].text
    # with include_usage: the last chunk has no choices and the usage
    chunks = list(c.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    assert all(ch.choices and ch.usage is None for ch in chunks[:-1])
    lp = c.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2)
    lps = lp.choices[0].logprobs
    assert len(lps.token_logprobs) == 3 and all(v <= 0 for v in lps.token_logprobs)
    assert lps.text_offset == [0, len(lps.tokens[0]), len(lps.tokens[0]) + len(lps.tokens[1])]
    assert all(len(top) in (2, 3) and max(top.values()) >= v for top, v in zip(lps.top_logprobs, lps.token_logprobs))


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(server):
    """Two prompts sharing 144 tokens (9 blocks): the second prefills all but the cached blocks before MAC's window
    (64) of its end: 160 - 64 -> 96 tokens cached, once per prompt whatever n."""
    llm, url = server
    doc = [5 + i % 97 for i in range(144)]
    first = _post(url, "/v1/completions", {"prompt": doc + [7] * 8, "max_tokens": 2, "temperature": 0}).json()
    again = _post(url, "/v1/completions", {"prompt": doc + [9] * 16, "max_tokens": 2, "n": 2}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens"] == 160 and again["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}


def test_prompt_lists_give_one_choice_per_prompt_and_sample(server):
    llm, url = server
    solo = [_greedy(llm, p, max_tokens=4) for p in PROMPTS[:3]]
    for prompt in (PROMPTS[:3], [o.prompt_token_ids for o in solo]):
        got = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0}).json()
        assert [ch["index"] for ch in got["choices"]] == [0, 1, 2]
        assert [ch["text"] for ch in got["choices"]] == [o.outputs[0].text for o in solo]
        assert got["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in solo)
    # n samples per prompt: index = prompt * n + sample, each sample as the LLM API draws it
    got = _post(url, "/v1/completions", {"prompt": PROMPTS[:2], "max_tokens": 5, "n": 2, "temperature": 1.0,
                                         "seed": 11}).json()
    assert [ch["index"] for ch in got["choices"]] == [0, 1, 2, 3]
    outs = [c for p in PROMPTS[:2] for c in llm.generate(p, SamplingParams(max_tokens=5, n=2, temperature=1.0,
                                                                             top_p=1.0, seed=11))[0].outputs]
    want = [c.text for c in outs]
    assert [ch["text"] for ch in got["choices"]] == want
    assert got["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in outs)
    events = _events(url, "/v1/completions", {"prompt": PROMPTS[:2], "max_tokens": 5, "n": 2, "temperature": 1.0,
                                              "seed": 11, "stream": True, "stream_options": {"include_usage": True}})
    texts = ["", "", "", ""]
    for e in events[:-1]:
        (ch,) = e["choices"]
        texts[ch["index"]] += ch["text"]
    assert texts == want and events[-1]["usage"]["completion_tokens"] == got["usage"]["completion_tokens"]
    assert events[-1]["usage"]["prompt_tokens"] == got["usage"]["prompt_tokens"]


def test_chat_uses_the_template_and_takes_openai_message_shapes(server):
    llm, url = server
    c = _client(url)
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who made the light?"}]
    prompt = chat_prompt(llm.tokenizer, msgs)
    assert prompt == "<|system|>\nAnswer briefly.\n<|user|>\nWho made the light?\n<|assistant|>\n"
    want = llm.chat(msgs, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text
    got = c.chat.completions.create(model="builtin", messages=msgs, max_tokens=6, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="builtin", messages=msgs, max_tokens=6, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == want
    # content parts (text joined by newlines), developer and tool roles, a name, assistant content null
    rich = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Kind."}]},
            {"role": "user", "name": "ann", "content": "Who made the light?"},
            {"role": "assistant", "content": None},
            {"role": "tool", "tool_call_id": "call_1", "content": "God"},
            {"role": "user", "content": [{"type": "text", "text": "And then?"}]}]
    plain = [{"role": "developer", "content": "Be brief.\nKind."}, {"role": "user", "content": "Who made the light?"},
             {"role": "assistant", "content": ""}, {"role": "tool", "content": "God"},
             {"role": "user", "content": "And then?"}]
    want = llm.chat(plain, SamplingParams(max_tokens=5, temperature=0))[0]
    got = _post(url, "/v1/chat/completions", {"model": "builtin", "messages": rich, "max_completion_tokens": 5,
                                              "temperature": 0}).json()
    assert got["choices"][0]["message"]["content"] == want.outputs[0].text
    assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    # chat logprobs: the sampled token and top_logprobs per generated token, kept when streaming
    lp = c.chat.completions.create(model="builtin", messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                   top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob
                                     for t in content)
    assert "".join(t.token for t in content) == lp.choices[0].message.content
    streamed = [t for ch in c.chat.completions.create(model="builtin", messages=msgs, max_tokens=4, temperature=0,
                                                      logprobs=True, top_logprobs=2, stream=True)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 1.5), ("frequency_penalty", 1.5), ("repetition_penalty", 1.8), ("min_p", 0.2),
    ("top_k", 3), ("seed", 5), ("min_tokens", 6), ("stop_token_ids", [16]), ("ignore_eos", True),
    ("include_stop_str_in_output", True), ("skip_special_tokens", False), ("logit_bias", {"16": 5.0}),
])
def test_sampling_fields_reach_the_llm_api(server, field, value):
    """Each field works as the LLM API's same field, or (an LLM API without it) is refused by name."""
    llm, url = server
    sampled = field in ("seed", "top_k", "min_p")
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.7 if sampled else 0, "seed": 3 if sampled else None,
            "stop": ["."] if field == "include_stop_str_in_output" else None, field: value}
    r = _post(url, "/v1/completions", body)
    if field not in LLM_FIELDS:
        assert r.status_code == 400 and f"not supported by this server: {field}" in r.json()["error"]["message"]
        return
    assert r.status_code == 200, r.text
    kw = {k: v for k, v in body.items() if k != "prompt" and v is not None}
    if kw["temperature"] > 0:
        kw["top_p"] = 1.0
    if field == "logit_bias":
        kw["logit_bias"] = {16: 5.0}
    want = llm.generate(PROMPTS[1], SamplingParams(**kw))[0].outputs[0]
    got = r.json()["choices"][0]
    assert got["text"] == want.text and got["finish_reason"] == want.finish_reason


def test_logit_bias_and_stop_token_ids_change_the_output(server):
    llm, url = server
    dot = llm.tokenizer.encode(".")[0]
    got = _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                         "logit_bias": {str(dot): 100}, "ignore_eos": True, "logprobs": 0}).json()
    assert got["choices"][0]["text"] == "...." and got["choices"][0]["logprobs"]["tokens"] == ["."] * 4
    got = _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                         "logit_bias": {str(dot): 100}, "stop_token_ids": [dot]}).json()
    assert got["choices"][0]["text"] == "." and got["choices"][0]["stop_reason"] == dot


def test_echo_and_prompt_logprobs_equal_a_transformers_forward(server):
    llm, url = server
    import torch

    from macattn.models.checkpoint import load_builtin_checkpoint

    text = PROMPTS[1] + " the heaven and the earth."
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    model, _ = load_builtin_checkpoint(dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    want = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    # lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1, token ids
    r = _post(url, "/v1/completions", {"model": "builtin", "prompt": [ids], "echo": True, "logprobs": 1,
                                       "max_tokens": 1, "temperature": 0, "seed": 1234})
    if "prompt_logprobs" not in LLM_FIELDS:
        assert r.status_code == 400 and "not supported by this server: echo with logprobs" in r.json()["error"]["message"]
        return
    ch = r.json()["choices"][0]
    lps = ch["logprobs"]
    assert len(lps["tokens"]) == len(ids) + 1           # the prompt, then exactly one generated token
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(lps["token_logprobs"][1:len(ids)], want)) < 1e-4
    assert ch["text"].startswith(text) and lps["text_offset"][:2] == [0, len(lps["tokens"][0])]
    greedy = [lp[i - 1].argmax().item() for i in range(1, len(ids))]
    for i, top in enumerate(lps["top_logprobs"][1:len(ids)]):
        assert abs(max(top.values()) - lp[i, greedy[i]].item()) < 1e-4
    # echo with max_tokens 0: the prompt scored, nothing generated
    r = _post(url, "/v1/completions", {"prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    assert r["choices"][0]["text"] == text and len(r["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert r["usage"]["completion_tokens"] == 0
    # vLLM's prompt_logprobs: per position {id: {logprob, rank, decoded_token}}
    r = _post(url, "/v1/completions", {"prompt": ids, "prompt_logprobs": 2, "max_tokens": 1}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        assert abs(plp[i][str(ids[i])]["logprob"] - want[i - 1]) < 1e-4
        assert len(plp[i]) in (2, 3) and any(v["rank"] == 1 for v in plp[i].values())
    chat = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1,
                                               "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_streaming_keeps_logprobs_and_never_takes_text_back(server):
    llm, url = server
    body = {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "logprobs": 1, "stop": [" the", "\n\n"]}
    whole = _post(url, "/v1/completions", body).json()["choices"][0]
    events = _events(url, "/v1/completions", {**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    tokens = [t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    offsets = [o for e in events if e["choices"][0]["logprobs"] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    echo = _events(url, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 3, "temperature": 0, "echo": True,
                                            "stream": True})
    assert "".join(e["choices"][0]["text"] for e in echo) == PROMPTS[2] + _greedy(llm, PROMPTS[2],
                                                                                   max_tokens=3).outputs[0].text
    usage = _events(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                  "temperature": 0, "stream": True,
                                                  "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}})
    assert all(e["usage"] is not None for e in usage)
    assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] == 3


def test_default_max_tokens_is_the_rest_of_the_context():
    from fastapi.testclient import TestClient

    with LLM("builtin", max_batch_size=2, max_seq_len=40) as llm:
        client = TestClient(build_app(llm, "tiny"))
        n = len(llm.tokenizer.encode(PROMPTS[0]))
        for path, body in (("/v1/completions", {"prompt": PROMPTS[0]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}]})):
            got = client.post(path, json={"model": "tiny", "temperature": 0, "ignore_eos": True, **body}).json()
            assert got["usage"]["total_tokens"] == 40 and got["choices"][0]["finish_reason"] == "length", got
        got = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 41 - n})
        assert got.status_code == 400 and "max_seq_len=40" in got.json()["error"]["message"]
        card = client.get("/v1/models/tiny").json()
        assert card["id"] == "tiny" and card["max_model_len"] == 40


@pytest.mark.parametrize("body,status,field", [
    ({"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 5.0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ({"prompt": "hi", "stream": 1}, 400, "stream"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "stop": ["a", ""]}, 400, "stop"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": [1, "x"]}, 400, "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt[1]"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": [1, -2]}, 400, "prompt"),
    ({"prompt": [1, True]}, 400, "prompt"),
    ({"prompt": [1, 2.0]}, 400, "prompt"),
    ({"prompt": "hi", "colour": "red"}, 400, "colour"),
    ({"prompt": "hi", "seed": 1 << 63, "temperature": 1}, 400, "seed"),
    ({"prompt": "hi", "top_k": 1 << 63, "temperature": 1}, 400, "top_k"),
    ({"prompt": "hi", "temperature": 1e-40}, 400, "temperature"),
    ({"prompt": "hi", "repetition_penalty": 1e7}, 400, "repetition_penalty"),
    ({"prompt": "hi", "max_tokens": 1 << 64}, 400, "max_tokens"),
    ({"prompt": "hi " * 17000, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
])
def test_bad_requests_name_the_field_and_leave_others_alone(server, body, status, field):
    llm, url = server
    c = _client(url)
    stream = c.completions.create(model="builtin", prompt=PROMPTS[1], max_tokens=8, temperature=0, stream=True)
    r = _post(url, "/v1/completions", {"model": "builtin", **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert field in err["message"] and field in err["param"] and err["type"] == "invalid_request_error"
    text = "".join(ch.choices[0].text for ch in stream)
    assert text == _greedy(llm, PROMPTS[1], max_tokens=8).outputs[0].text
    bad_json = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]


def test_every_problem_in_one_400(server):
    _, url = server
    r = _post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                     {"role": "robot", "content": "hi"}],
        "max_tokens": "5", "temperature": True, "n": 0, "colour": 1, "tools": [{"type": "function"}],
        "response_format": {"type": "json_object"}, "top_logprobs": 3})
    assert r.status_code == 400
    err = r.json()["error"]
    for part in ("not supported by this server: image_url content", "messages[1].role", "max_tokens", "temperature",
                 "n: ", "colour: unknown field", "not supported by this server: tools",
                 "not supported by this server: response_format json_object", "top_logprobs: needs logprobs"):
        assert part in err["message"], (part, err["message"])
    assert err["param"].split(", ")[0] == "colour" and "max_tokens" in err["param"]


@pytest.mark.parametrize("path,extra,name", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format json_schema"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, "input_audio content"),
    ("/v1/chat/completions", {"messages": [{"role": "function", "name": "f", "content": "x"}]}, "the function role"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls"),
    ("/v1/completions", {"suffix": "amen"}, "suffix"),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format json_object"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"length_penalty": 2.0}, "length_penalty"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {"bad_words": ["x"]}, "bad_words"),
    ("/v1/completions", {"logits_processors": ["m.f"]}, "logits_processors"),
    ("/v1/completions", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
])
def test_fields_that_would_change_the_output_are_refused_by_name(server, path, extra, name):
    _, url = server
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = _post(url, path, {"max_tokens": 2, **body, **extra})
    assert r.status_code == 400, r.text
    assert f"not supported by this server: {name}" in r.json()["error"]["message"]


def test_harmless_fields_are_accepted_and_logged(server, caplog):
    _, url = server
    caplog.set_level(logging.WARNING, logger="macattn.serve")
    extra = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "request_id": "r1",
             "priority": 0, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
             "parallel_tool_calls": False, "modalities": ["text"], "best_of": 1, "length_penalty": 1.0}
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    logged = " ".join(rec.getMessage() for rec in caplog.records)
    for name in ("user", "metadata", "store", "service_tier", "request_id", "priority", "parallel_tool_calls"):
        assert name in logged
    assert set(FIELDS["chat"]["accepted_logged"]) >= {"user", "metadata", "store"}


def test_tokenize_detokenize_version_models(server):
    llm, url = server
    r = _post(url, "/tokenize", {"model": "builtin", "prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert r["tokens"] == llm.tokenizer.encode(PROMPTS[0]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == llm.engine.config.max_seq_len and len(r["token_strs"]) == r["count"]
    msgs = [{"role": "user", "content": "hi"}]
    r = _post(url, "/tokenize", {"messages": msgs}).json()
    assert r["tokens"] == llm.tokenizer.encode(chat_prompt(llm.tokenizer, msgs), add_special_tokens=False)
    assert _post(url, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == chat_prompt(llm.tokenizer, msgs)
    assert _post(url, "/detokenize", {"tokens": [10**6]}).status_code == 400
    assert _post(url, "/tokenize", {"prompt": 5}).status_code == 400
    assert httpx.get(f"{url}/version").json()["version"]
    assert httpx.get(f"{url}/v1/models/builtin").json()["id"] == "builtin"
    assert httpx.get(f"{url}/v1/models/gpt-9").status_code == 404
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == llm.tokenizer.eos_token


def test_a_disconnect_mid_stream_frees_its_slot(server):
    llm, url = server
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"model": "builtin", "prompt": PROMPTS[2], "max_tokens": 2000, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 30
    while llm.engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    with pytest.raises(httpx.ReadTimeout):      # a client that stops waiting for a whole response
        httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 2000, "n": 2}, timeout=1.0)
    deadline = time.time() + 30
    while llm.engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    c = _client(url)
    got = c.completions.create(model="builtin", prompt=PROMPTS[3], max_tokens=6, temperature=0)
    assert got.choices[0].text == _greedy(llm, PROMPTS[3], max_tokens=6).outputs[0].text


def test_health_and_metrics(server):
    _, url = server
    _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{url}/metrics").text
    for name in ("macattn_requests_total", "macattn_generated_tokens_total", "macattn_time_to_first_token_seconds",
                 "macattn_inter_token_latency_seconds", "macattn_requests_running", "macattn_requests_waiting",
                 "macattn_kv_blocks_in_use", "macattn_mac_hit_rate", "macattn_mac_kv_skip",
                 'vllm:num_requests_running{model_name="builtin"}', 'vllm:num_requests_waiting{model_name="builtin"}',
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:time_per_output_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:request_success_total", "vllm:kv_cache_usage_perc",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "macattn_prefix_cache_queries_total",
                 "macattn_prefix_cache_hits_total", 'vllm:prefix_cache_queries_total{model_name="builtin"}',
                 'vllm:prefix_cache_hits_total{model_name="builtin"}'):
        assert name in text, name
    assert 'macattn_requests_total{endpoint="/v1/completions",status="200"}' in text
    counts = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln.startswith(("macattn_mac_",
                                                                                                    "vllm:"))}
    assert counts["macattn_mac_hit_rate_count"] >= 1          # every finished MAC request observed
    assert counts["macattn_mac_hit_rate_sum"] > 0             # the repetitive prompts hit
    assert counts['vllm:generation_tokens_total{model_name="builtin"}'] >= 2
    # vLLM v1's meanings: one inter-token observation per gap between a sequence's tokens, one mean per request
    def itl_counts():
        text = httpx.get(f"{url}/metrics").text
        return [float(ln.split(" ")[1]) for name in ("vllm:inter_token_latency_seconds_count",
                                                     "vllm:time_per_output_token_seconds_count",
                                                     "vllm:request_time_per_output_token_seconds_count")
                for ln in text.splitlines() if ln.startswith(name)]

    before = itl_counts()
    _post(url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 5, "n": 2, "ignore_eos": True})
    assert [a - b for a, b in zip(itl_counts(), before)] == [8, 8, 1]     # 2 sequences x 4 gaps; 1 request
    # one registry per app: a second app on the same process does not collide
    other = build_app(server[0], "other")
    assert other is not None


def test_sigterm_with_a_request_in_flight_exits_cleanly():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "macattn.cli", "serve", "--model", "builtin", "--port",
                             str(port), "--grace-period", "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        ready = proc.stdout.readline()
        while ready and "ready on" not in ready:
            ready = proc.stdout.readline()
        assert f"ready on http://127.0.0.1:{port}/v1" in ready
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                          json={"model": "builtin", "prompt": "In the beginning", "max_tokens": 2000,
                                "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            t0 = time.time()
            proc.send_signal(signal.SIGTERM)
            try:
                for _ in lines:
                    pass
            except httpx.HTTPError:
                pass
        assert proc.wait(timeout=60) == 0
        assert time.time() - t0 < 30
        assert not _children(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_without_the_serve_extra_names_the_install_line():
    code = ("import sys; sys.modules['uvicorn'] = None\n"
            "from macattn.cli import main\n"
            "sys.exit(main(['serve', '--model', 'builtin']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 1
    assert 'pip install -e ".[serve]"' in out.stderr and "uvicorn" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_async_streams_interleave_and_equal_their_solo_outputs(server):
    llm, url = server
    prompts = [f"{p} {i}" for i in range(16 // len(PROMPTS) + 1) for p in PROMPTS][:16]   # 16 streams, 4 slots
    solo = {p: _greedy(llm, p, max_tokens=6).outputs[0].text for p in prompts}

    async def run():
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        async def one(p):
            s = await ac.completions.create(model="builtin", prompt=p, max_tokens=6, temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in s])

        return dict(zip(prompts, await asyncio.gather(*(one(p) for p in prompts))))

    assert asyncio.run(run()) == solo


def test_metrics_follow_each_requests_final_state_after_engine_failures():
    """A failing engine step: each request in flight ends as a 500 (counted as 500, streamed or not, never
    499), the running gauge is back to 0, and the next request runs (issue 41, metrics from the final state)."""
    from fastapi.testclient import TestClient

    llm = LLM("builtin", max_batch_size=4, max_seq_len=128)
    real, calls = llm.engine.step, {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise RuntimeError("injected step failure")
        return real()

    llm.engine.step = failing_step
    try:
        with TestClient(build_app(llm, "builtin")) as c:
            r = c.post("/v1/completions", json={"model": "builtin", "prompt": "In the", "max_tokens": 8})
            assert r.status_code == 500 and "injected step failure" in r.text
            with c.stream("POST", "/v1/completions", json={"model": "builtin", "prompt": "In the", "max_tokens": 8,
                                                         "stream": True}) as s:
                body = "".join(s.iter_text())
            assert "injected step failure" in body and body.rstrip().endswith("data: [DONE]")
            ok = c.post("/v1/completions", json={"model": "builtin", "prompt": "In the", "max_tokens": 4})
            assert ok.status_code == 200
            text = c.get("/metrics").text
    finally:
        llm.shutdown()
    assert 'macattn_requests_total{endpoint="/v1/completions",status="500"} 2.0' in text
    assert 'status="499"' not in text
    assert "macattn_requests_running 0.0" in text


def test_the_start_up_heap_is_frozen_while_serving_only():
    """What exists when the server starts (model, engine, app) is out of the collector's full passes while it
    serves, and back in after shutdown (so the process's objects are finalized at exit)."""
    import gc

    from fastapi.testclient import TestClient

    with LLM("builtin", max_batch_size=1, max_seq_len=64) as llm:
        app = build_app(llm, "builtin")
        assert gc.get_freeze_count() == 0
        with TestClient(app) as c:
            assert gc.get_freeze_count() > 0
            assert c.get("/health").status_code == 200
        assert gc.get_freeze_count() == 0
