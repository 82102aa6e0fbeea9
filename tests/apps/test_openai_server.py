"""The OpenAI-compatible server (``macattn serve --model``) with the real ``openai`` client (sync, async,
streaming) against uvicorn on 127.0.0.1, the built-in checkpoint on the CPU: outputs = the LLM API's,
concurrent streams = their solo outputs, bad requests are 4xx naming the field without disturbing
other streams, a disconnect frees the slot, Prometheus metrics, SIGTERM ends the process cleanly."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from macattn.apps.llm import LLM, SamplingParams  # noqa: E402
from macattn.apps.serving.openai_server import build_app, chat_prompt  # noqa: E402
from macattn.methods.mac.config import MacConfig  # noqa: E402

PROMPTS = ["The Lord is my shepherd", "In the beginning God created", "And it came to pass", "Blessed are"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    llm = LLM("builtin", max_batch_size=4, mac=MacConfig(window=64, band=8))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(llm, "builtin"), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield llm, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=30)
    llm.shutdown()


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_completions_equal_the_llm_api(server):
    llm, url = server
    c = _client(url)
    assert [m.id for m in c.models.list().data] == ["builtin"]
    want = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8))
    got = c.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert got.choices[0].text == want.outputs[0].text and got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    ids = c.completions.create(model="builtin", prompt=want.prompt_token_ids, max_tokens=8, temperature=0)
    assert ids.choices[0].text == want.outputs[0].text
    chunks = list(c.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    lp = c.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == 3 and all(v <= 0 for v in lp.choices[0].logprobs.token_logprobs)


def test_chat_completions_use_the_documented_template(server):
    llm, url = server
    c = _client(url)
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who made the light?"}]
    prompt = chat_prompt(llm.tokenizer, msgs)
    assert prompt == "<|system|>\nAnswer briefly.\n<|user|>\nWho made the light?\n<|assistant|>\n"
    want = llm.generate(prompt, SamplingParams(max_tokens=6)).outputs[0].text
    got = c.chat.completions.create(model="builtin", messages=msgs, max_tokens=6, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="builtin", messages=msgs, max_tokens=6, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want


def test_concurrent_async_streams_equal_their_solo_outputs(server):
    llm, url = server
    prompts = [f"{p} {i}" for i in range(64 // len(PROMPTS) + 1) for p in PROMPTS][:64]   # 64 streams, 4 slots
    solo = {p: llm.generate(p, SamplingParams(max_tokens=6)).outputs[0].text for p in prompts}

    async def run():
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        async def one(p):
            s = await ac.completions.create(model="builtin", prompt=p, max_tokens=6, temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in s if ch.choices])

        return dict(zip(prompts, await asyncio.gather(*(one(p) for p in prompts))))

    assert asyncio.run(run()) == solo


@pytest.mark.parametrize("body,status,field", [
    ({"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": [1, "x"]}, 400, "prompt"),
    ({"prompt": "hi", "colour": "red"}, 400, "colour"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi " * 17000, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
])
def test_bad_requests_name_the_field_and_leave_others_alone(server, body, status, field):
    llm, url = server
    c = _client(url)
    stream = c.completions.create(model="builtin", prompt=PROMPTS[1], max_tokens=8, temperature=0, stream=True)
    r = httpx.post(f"{url}/v1/completions", json={"model": "builtin", **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["type"] == "invalid_request_error"
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert text == llm.generate(PROMPTS[1], SamplingParams(max_tokens=8)).outputs[0].text
    bad_json = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400


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
    c = _client(url)
    got = c.completions.create(model="builtin", prompt=PROMPTS[3], max_tokens=6, temperature=0)
    assert got.choices[0].text == llm.generate(PROMPTS[3], SamplingParams(max_tokens=6)).outputs[0].text


def test_health_and_metrics(server):
    _, url = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{url}/metrics").text
    for name in ("macattn_requests_total", "macattn_generated_tokens_total", "macattn_time_to_first_token_seconds",
                 "macattn_inter_token_latency_seconds", "macattn_requests_running", "macattn_requests_waiting",
                 "macattn_kv_blocks_in_use", "macattn_mac_hit_rate", "macattn_mac_kv_skip"):
        assert name in text
    assert 'macattn_requests_total{endpoint="/v1/completions",status="200"}' in text
    counts = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln.startswith("macattn_mac_")}
    assert counts["macattn_mac_hit_rate_count"] >= 1          # every finished MAC request observed
    assert counts["macattn_mac_hit_rate_sum"] > 0             # the repetitive prompts hit


def test_sigterm_with_a_request_in_flight_exits_cleanly():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "macattn.cli", "serve", "--model", "builtin", "--http-port",
                             str(port), "--grace-period", "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
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


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]
