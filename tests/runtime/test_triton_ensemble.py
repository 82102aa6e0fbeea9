"""The text ensemble in TensorRT-LLM backend conventions on the real Triton Inference Server (the
``nvidia-pytriton`` wheel's, on the CPU) with the built-in trained checkpoint and its tokenizer:
``text_input`` -> preprocessing -> the engine model -> postprocessing -> ``text_output``.

* ``curl`` against Triton's ``generate`` (one response) and ``generate_stream`` (SSE, one event per
  token) endpoints, and ``tritonclient`` gRPC streaming: the text is the tokenizer's decoding of what
  ``ModelRunner`` generates from the same engine directory (per token when streamed, as the
  postprocessing decodes each response);
* 64 concurrent streams, each equal to its solo output;
* ``stop_words`` end a request at the word; bad requests get a 400 naming the ensemble's field;
* Prometheus metrics are on and count the ensemble's requests.
"""
import json
import queue
import shutil
import subprocess
import urllib.request
from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("pytriton", reason="needs nvidia-pytriton (pip install -e '.[test]')")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[http,grpc]")

from macattn.methods.mac.config import MacConfig  # noqa: E402
from macattn.models.checkpoint import BUILTIN_CHECKPOINT_DIR, load_builtin_checkpoint  # noqa: E402
from macattn.runtime import ModelRunner, write_engine_dir  # noqa: E402
from macattn.runtime.engine_args import EngineArgs  # noqa: E402
from macattn.apps.serving.triton_repo import write_model_repository  # noqa: E402
from macattn.apps.serving.triton_server import serve  # noqa: E402

from test_triton_server import pytestmark as _server_marks  # noqa: E402  (skips where the bundled server cannot run)

pytestmark = [_server_marks, pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")]

NEW = 12
MAC = MacConfig(window=64, band=16, tau=0.3)
PROMPTS = ["And the LORD said unto Moses,", "Q: What is a dictionary?\nA:", "The quick brown fox"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton_text")
    model, tok = load_builtin_checkpoint()
    engine = write_engine_dir(model, MAC, root / "engine")
    dirs = write_model_repository(engine, root / "repo", engine_args=EngineArgs(max_batch_size=4, block_size=16), torch_num_threads=1,
                                  sync_model=False, tokenizer_dir=BUILTIN_CHECKPOINT_DIR)
    assert {d.name for d in dirs} == {"macattn", "preprocessing", "postprocessing", "ensemble"}
    runner = ModelRunner.from_dir(engine, max_batch_size=4, block_size=16)
    expected = {}
    for p in PROMPTS:
        ids = torch.tensor(tok.encode(p))
        out = runner.generate([ids], max_new_tokens=NEW, end_id=tok.eos_token_id, return_dict=True,
                              output_sequence_lengths=True)
        expected[p] = out["output_ids"][0, 0, len(ids):int(out["sequence_lengths"][0, 0])].tolist()
    with serve(root / "repo", root) as running:
        yield {"running": running, "tok": tok, "expected": expected, "runner": runner}


def _curl(url, body, *, stream=False):
    cmd = ["curl", "-sS", "-X", "POST", url, "-H", "Content-Type: application/json", "-d", json.dumps(body),
           "-w", "\n%{http_code}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    text, code = out.rsplit("\n", 1)
    return int(code), text


def _generate(server, body):
    return _curl(f"http://{server['running'].http_url}/v2/models/ensemble/generate", body)


def test_generate_returns_the_engines_text(server):
    tok = server["tok"]
    for p in PROMPTS:
        code, text = _generate(server, {"text_input": p, "max_tokens": NEW})
        assert code == 200, text
        assert json.loads(text)["text_output"] == tok.decode(server["expected"][p], skip_special_tokens=True)


def test_generate_stream_sends_one_event_per_token(server):
    tok = server["tok"]
    p = PROMPTS[1]
    code, text = _curl(f"http://{server['running'].http_url}/v2/models/ensemble/generate_stream",
                       {"text_input": p, "max_tokens": NEW, "stream": True})
    assert code == 200, text
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    want = server["expected"][p]
    assert [e["text_output"] for e in events] == [tok.decode([t], skip_special_tokens=True) for t in want]


def test_tritonclient_grpc_stream(server):
    tok = server["tok"]
    p = PROMPTS[2]
    got, done = [], queue.Queue()

    def callback(result, error):
        done.put(error if error is not None else result.as_numpy("text_output"))

    client = grpcclient.InferenceServerClient(server["running"].grpc_url)
    try:
        inputs = []
        for name, arr, dt in (("text_input", np.array([p.encode()], dtype=np.object_), "BYTES"),
                              ("max_tokens", np.array([NEW], np.int64), "INT64"),
                              ("stream", np.array([True]), "BOOL")):
            t = grpcclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        client.start_stream(callback=partial(callback))
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        want = server["expected"][p]
        while len(got) < len(want):
            item = done.get(timeout=120)
            assert not isinstance(item, Exception), item
            if item is not None and item.size:
                got.append(item.reshape(-1)[0].decode())
        client.stop_stream()
    finally:
        client.close()
    assert got == [tok.decode([t], skip_special_tokens=True) for t in want]


def test_64_concurrent_streams_equal_their_solo_outputs(server):
    """64 different prompts streamed at once (``generate_stream``) through 4 slots, each against
    ModelRunner's solo output decoded token by token (as the postprocessing streams it)."""
    from concurrent.futures import ThreadPoolExecutor

    tok, runner = server["tok"], server["runner"]
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    solo = {}
    for p in prompts:
        ids = torch.tensor(tok.encode(p))
        out = runner.generate([ids], max_new_tokens=4, end_id=tok.eos_token_id, return_dict=True,
                              output_sequence_lengths=True)
        new = out["output_ids"][0, 0, len(ids):int(out["sequence_lengths"][0, 0])].tolist()
        solo[p] = [tok.decode([t], skip_special_tokens=True) for t in new]
    url = f"http://{server['running'].http_url}/v2/models/ensemble/generate_stream"

    def stream(p):
        code, text = _curl(url, {"text_input": p, "max_tokens": 4, "stream": True})
        assert code == 200, text
        return [json.loads(ln[len("data: "):])["text_output"] for ln in text.splitlines() if ln.startswith("data: ")]

    with ThreadPoolExecutor(64) as pool:
        got = dict(zip(prompts, pool.map(stream, prompts)))
    assert got == solo


def test_stop_words_end_the_request_at_the_word(server):
    tok = server["tok"]
    p = PROMPTS[0]
    want = server["expected"][p]
    for i in range(2, len(want)):                       # a token whose text encodes back to itself
        word = tok.decode([want[i]])
        if tok.encode(word, add_special_tokens=False) == [want[i]] and want[i] not in want[:i]:
            break
    else:
        pytest.fail("no generated token round-trips through the tokenizer")
    code, text = _generate(server, {"text_input": p, "max_tokens": NEW, "stop_words": [word]})
    assert code == 200, text
    assert json.loads(text)["text_output"] == tok.decode(want[:i + 1], skip_special_tokens=True)


@pytest.mark.parametrize("body,field", [({"text_input": "", "max_tokens": 4}, "text_input"),
                                        ({"text_input": "Hello", "max_tokens": 0}, "max_tokens"),
                                        ({"text_input": "Hello", "max_tokens": 4, "bad_words": ["the"]}, "bad_words"),
                                        ({"text_input": "Hello", "max_tokens": 4, "top_p": 1.5}, "top_p"),
                                        ({"text_input": "Hello", "max_tokens": 4, "temperature": -1.0},
                                         "temperature")])
def test_bad_requests_get_a_400_naming_the_field(server, body, field):
    code, text = _generate(server, body)
    assert code == 400 and field in json.loads(text)["error"], (code, text)
    code, text = _generate(server, {"text_input": PROMPTS[0], "max_tokens": NEW})   # the server still serves
    assert code == 200 and json.loads(text)["text_output"] == server["tok"].decode(server["expected"][PROMPTS[0]],
                                                                                 skip_special_tokens=True)


def test_metrics_are_on(server):
    _generate(server, {"text_input": PROMPTS[0], "max_tokens": 2})
    body = urllib.request.urlopen(f"http://{server['running'].metrics_url}/metrics", timeout=10).read().decode()
    lines = [ln for ln in body.splitlines() if ln.startswith("nv_inference_request_success") and 'model="ensemble"' in ln]
    assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 1
