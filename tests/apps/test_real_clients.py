"""Clients this project did not write, used as their users write them, against the OpenAI server on the CPU
(the built-in checkpoint):

* the ``openai`` Python client's usual loops (``chunk.choices[0].delta.content`` over a stream, with and
  without ``stream_options={"include_usage": True}``, chat, completions, logprobs, ``n``, ``extra_body``,
  errors, the async client): fast, in CI (``openai`` is in the test extra);
* guidellm 0.8.1 and lm-eval 0.4.13 (marker ``clients``, heavy): their commands come from
  ``$MACATTN_CLIENTS_BIN`` or else from the pinned virtual environment that ``run_clients.setup_clients`` makes
  once (about 2 minutes) at ``$MACATTN_CLIENTS_VENV`` (default ``~/.cache/macattn/clients``), never from the
  project's own environment, whose numpy pin they conflict with; skipped, with the reason, only when that
  environment cannot be made. They run ``benchmarks/run_clients.py``, which starts ``macattn serve --model
  builtin`` and records ``benchmarks/results/clients_cpu.json``.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from macattn.apps.llm import LLM, SamplingParams  # noqa: E402
from _serving import serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who made the light?"}]
PROMPT = "In the beginning God created"


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "async"])
def served(request):
    """The server with serial engine steps (the CPU default) and with async scheduling (CUDA's default)."""
    llm = LLM("builtin", max_batch_size=4, async_scheduling=request.param)
    with serving(llm) as url:
        yield llm, openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)


def test_the_chat_stream_loop(served):
    """The loop of the openai README: no usage chunk unless asked, so ``choices[0]`` always exists."""
    llm, client = served
    reply = client.chat.completions.create(model="builtin", messages=MESSAGES, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model="builtin", messages=MESSAGES, max_tokens=8, temperature=0,
                                            stream=True)
    text = ""
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
    assert text == reply.choices[0].message.content
    assert text == llm.chat(MESSAGES, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert reply.usage.completion_tokens == 8 or reply.choices[0].finish_reason == "stop"


def test_the_stream_loop_with_usage(served):
    """With ``include_usage`` the last chunk carries the usage and no choice (OpenAI's documented shape)."""
    _, client = served
    reply = client.chat.completions.create(model="builtin", messages=MESSAGES, max_tokens=8, temperature=0)
    text, usage = "", None
    for chunk in client.chat.completions.create(model="builtin", messages=MESSAGES, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == reply.choices[0].message.content
    assert usage.prompt_tokens == reply.usage.prompt_tokens and usage.completion_tokens == reply.usage.completion_tokens
    comp = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=8, temperature=0)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="builtin", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert streamed == comp.choices[0].text


def test_completions_chat_logprobs_n_and_extra_body(served):
    llm, client = served
    comp = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == comp.choices[0].text and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model="builtin", messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 and t.bytes for t in content)
    two = client.chat.completions.create(model="builtin", messages=MESSAGES, max_tokens=6, n=2, seed=7,
                                         temperature=1.0)
    assert sorted(c.index for c in two.choices) == [0, 1]
    want = llm.chat(MESSAGES, SamplingParams(max_tokens=6, n=2, seed=7, temperature=1.0, top_p=1.0))[0]
    assert [c.message.content for c in two.choices] == [o.text for o in want.outputs]
    batch = client.completions.create(model="builtin", prompt=[PROMPT, "And God said"], max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    vllm_style = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=6, temperature=0,
                                           extra_body={"repetition_penalty": 1.3, "top_k": 5, "min_tokens": 2})
    assert vllm_style.choices[0].text == llm.generate(PROMPT, SamplingParams(
        max_tokens=6, temperature=0, repetition_penalty=1.3, top_k=5, min_tokens=2))[0].outputs[0].text
    assert client.models.retrieve("builtin").id == "builtin"


def test_errors_reach_the_client_as_openai_errors(served):
    _, client = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="builtin", messages=MESSAGES, max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert "not supported by this server: tools" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)


def test_the_async_client_streams(served):
    _, client = served

    async def run():
        ac = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="EMPTY", max_retries=0)
        stream = await ac.chat.completions.create(model="builtin", messages=MESSAGES, max_tokens=6, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return text, usage

    text, usage = asyncio.run(run())
    reply = client.chat.completions.create(model="builtin", messages=MESSAGES, max_tokens=6, temperature=0)
    assert text == reply.choices[0].message.content and usage.total_tokens == reply.usage.total_tokens


# --- guidellm and lm-eval (marker clients) ------------------------------------------------------------

def _runner():
    spec = importlib.util.spec_from_file_location("run_clients", ROOT / "benchmarks" / "run_clients.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CLIENTS_VENV = Path(os.environ.get("MACATTN_CLIENTS_VENV", "~/.cache/macattn/clients")).expanduser()


@pytest.fixture(scope="module")
def clients_bin() -> str:
    """The folder of the pinned ``guidellm`` and ``lm_eval`` commands (module doc)."""
    if os.environ.get("MACATTN_CLIENTS_BIN"):
        return os.environ["MACATTN_CLIENTS_BIN"]
    try:
        return str(_runner().setup_clients(CLIENTS_VENV))
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"the clients' virtual environment could not be made at {CLIENTS_VENV}: {e}")


def test_the_runner_serves_and_stops_its_server(tmp_path):
    """``run_clients.Server`` (what the guidellm and lm-eval runs talk to) answers ``/metrics`` and ``stop`` ends
    its ``macattn serve`` process with SIGTERM: nothing is left behind."""
    srv = _runner().Server(tmp_path / "server.log")
    try:
        assert "macattn_requests" in srv.metrics()
    finally:
        code = srv.stop()
    assert code is not None and srv.proc.poll() is not None


def _run_clients(tmp_path, only: str, clients_bin: str) -> tuple[dict, str]:
    """``run_clients.py --only only``: its summary and the tails of the clients' logs (for failure messages)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_clients.py"), "--only", only, "--out",
                          str(tmp_path), "--requests", "4", "--clients-bin", clients_bin],
                         capture_output=True, text=True, timeout=3000, cwd=ROOT)
    summary = tmp_path / "clients_cpu.json"
    assert summary.is_file(), out.stdout + out.stderr
    logs = "".join(f"\n--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:])
                   for log in sorted((tmp_path / "clients_cpu").glob("*.log")))
    return json.loads(summary.read_text()), logs


@pytest.mark.clients
@pytest.mark.slow
def test_guidellm_default_chat_run_and_completions_run_have_no_failed_request(tmp_path, clients_bin):
    summary, logs = _run_clients(tmp_path, "guidellm", clients_bin)
    res = summary["guidellm"]
    for run in ("chat", "completions"):
        assert res[run]["exit_code"] == 0 and res[run]["failed_requests"] == 0, (res[run], logs)
        assert res[run]["requests"]["successful"] == 4 and res[run]["median_output_tokens"] == 16, res[run]
        assert res[run]["ok"], res[run]


@pytest.mark.clients
@pytest.mark.slow
def test_lm_eval_local_completions_scores_equal_a_transformers_forward(tmp_path, clients_bin):
    summary, logs = _run_clients(tmp_path, "lm_eval", clients_bin)
    res = summary["lm_eval"]
    assert res["exit_code_server"] == 0 and res["exit_code_transformers"] == 0, (res, logs)
    assert res["failed_requests"] == 0 and res["max_abs_loglikelihood_diff"] <= 1e-4, res
    for task, r in res["tasks"].items():
        assert r["docs"] >= 5 and r["equal"], (task, r)
    assert res["ok"]
