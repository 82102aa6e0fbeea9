"""The real Triton Inference Server (from the ``nvidia-pytriton`` wheel) serving a model
repository written by ``macattn triton-repo``, on the CPU, with a tiny model.

Setup (``macattn.apps.serving.triton_server.prepare_tritonserver``, after ../shared/FACTS.md): the
Python-backend stub for the running interpreter is copied into a *copy* of the wheel's
``backends`` dir (site-packages is never modified), ``LD_LIBRARY_PATH`` points at
``nvidia_pytriton.libs``, foreign ``python3`` dirs leave ``PATH``; the server listens on
127.0.0.1 with free ephemeral ports and is always stopped by the fixture.

Non-streaming requests go over HTTP to ``macattn_sync`` (the same model.py, not decoupled:
decoupled models cannot answer KServe-v2 HTTP ``infer``); streaming goes over gRPC to the
decoupled ``macattn`` model. Every output must equal ``ModelRunner``'s for the same prompt.
"""
import queue
import time

import numpy as np
import torch
import pytest
from _tiny import MAC, prompts, tiny_model

pytriton = pytest.importorskip("pytriton", reason="needs nvidia-pytriton (pip install -e '.[test]')")
httpclient = pytest.importorskip("tritonclient.http", reason="needs tritonclient[http,grpc]")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[http,grpc]")
from tritonclient.utils import InferenceServerException  # noqa: E402

from macattn.runtime import ModelRunner, write_engine_dir  # noqa: E402
from macattn.runtime.engine_args import EngineArgs  # noqa: E402
from macattn.apps.serving.triton_repo import write_model_repository  # noqa: E402
from macattn.apps.serving.triton_server import prepare_tritonserver, serve  # noqa: E402

NEW = 8


def _launcher_or_reason():
    """Check once that the bundled tritonserver can run on this machine (else: skip, saying why)."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as d:
            prepare_tritonserver(d, d, http_port=0, grpc_port=0)
    except RuntimeError as exc:
        return str(exc)
    return None


_why = _launcher_or_reason()
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton")
    engine = write_engine_dir(tiny_model(), MAC, root / "engine")
    write_model_repository(engine, root / "repo", engine_args=EngineArgs(max_batch_size=8, block_size=8), torch_num_threads=1)
    try:
        with serve(root / "repo", root) as running:
            http = httpclient.InferenceServerClient(running.http_url, concurrency=16)
            try:
                yield {"http": http, "grpc_url": running.grpc_url, "engine": engine, "running": running}
            finally:
                http.close()  # open keep-alive connections would hold the shutdown
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def expected(server):
    """What ModelRunner (same engine dir, in this process) generates for each prompt."""
    runner = ModelRunner.from_dir(server["engine"], max_batch_size=8, block_size=8)
    ps = prompts(12, seed=77)
    out = runner.generate(ps, max_new_tokens=NEW, return_dict=True, output_sequence_lengths=True)
    return ps, [out["output_ids"][b, 0, len(p):int(out["sequence_lengths"][b, 0])].tolist()
                for b, p in enumerate(ps)]


def _inputs(mod, ids, max_new_tokens, **optional):
    ids = np.asarray(ids, dtype=np.int64)
    tensors = [("input_ids", ids, "INT64"), ("max_new_tokens", np.array([max_new_tokens], np.int64), "INT64")]
    types = {"end_id": (np.int64, "INT64"), "temperature": (np.float32, "FP32"), "top_k": (np.int64, "INT64"),
             "top_p": (np.float32, "FP32"), "random_seed": (np.int64, "INT64")}
    for k, v in optional.items():
        tensors.append((k, np.array([v], types[k][0]), types[k][1]))
    out = []
    for name, arr, dt in tensors:
        t = mod.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def test_http_chunked_rag_request_matches_model_runner(server):
    """One A3 chunked prompt (rag_lengths = [system, chunk lengths]) equals ModelRunner's documents= call."""
    system, question = prompts(1, seed=91, lo=5, hi=20)[0], prompts(1, seed=93, lo=4, hi=8)[0]
    chunks = prompts(3, seed=92, lo=8, hi=20)
    runner = ModelRunner.from_dir(server["engine"], max_batch_size=8, block_size=8)
    out = runner.generate([system], documents=[chunks], question_ids=[question], max_new_tokens=NEW,
                          return_dict=True, output_sequence_lengths=True)
    ids = torch.cat([system, *chunks, question])
    want = out["output_ids"][0, 0, len(ids):int(out["sequence_lengths"][0, 0])].tolist()
    lengths = np.array([len(system)] + [len(c) for c in chunks], np.int64)
    inputs = _inputs(httpclient, ids.numpy(), NEW)
    rag = httpclient.InferInput("rag_lengths", list(lengths.shape), "INT64")
    rag.set_data_from_numpy(lengths)
    got = server["http"].infer("macattn_sync", inputs + [rag]).as_numpy("output_ids").tolist()
    assert got == want and len(want) == NEW
    bad = httpclient.InferInput("rag_lengths", [1], "INT64")
    bad.set_data_from_numpy(np.array([len(ids)], np.int64))
    with pytest.raises(InferenceServerException, match="rag_lengths"):
        server["http"].infer("macattn_sync", _inputs(httpclient, ids.numpy(), NEW) + [bad])


def test_http_concurrent_requests_match_model_runner(server, expected):
    ps, want = expected
    http = server["http"]
    good = [http.async_infer("macattn_sync", _inputs(httpclient, p.numpy(), NEW)) for p in ps]
    bad = {"max_new_tokens": http.async_infer("macattn_sync", _inputs(httpclient, ps[0].numpy(), 0)),
           "temperature": http.async_infer("macattn_sync", _inputs(httpclient, ps[1].numpy(), 4, temperature=0.0,
                                                                   top_k=5)),
           "top_p": http.async_infer("macattn_sync", _inputs(httpclient, ps[2].numpy(), 4, top_p=2.0)),
           "input_ids": http.async_infer("macattn_sync", _inputs(httpclient, np.zeros(0, np.int64), 4))}
    got = [r.get_result().as_numpy("output_ids").tolist() for r in good]
    assert got == want
    for name, r in bad.items():
        with pytest.raises(InferenceServerException, match=name):
            r.get_result()


def test_grpc_streaming_matches_model_runner(server, expected):
    ps, want = expected
    end_id = want[5][3]
    stop = want[5].index(end_id)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for i, p in enumerate(ps):
            opt = {"end_id": end_id} if i == 5 else {}
            client.async_stream_infer("macattn", _inputs(grpcclient, p.numpy(), NEW, **opt), request_id=str(i),
                                      enable_empty_final_response=True)
            if i == 3:
                client.async_stream_infer("macattn", _inputs(grpcclient, p.numpy(), -2), request_id="bad",
                                          enable_empty_final_response=True)
            time.sleep(0.01)                  # staggered arrival: later requests join mid-flight
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
        counts = dict.fromkeys(tokens, 0)
        done, errors = set(), []
        deadline = time.monotonic() + 60
        while len(done) < len(ps) or not errors:
            result, error = responses.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                errors.append(str(error))
                continue
            resp = result.get_response()
            out = result.as_numpy("output_ids")
            if out is not None:
                tokens[resp.id] += out.tolist()
                counts[resp.id] += 1
            if resp.parameters["triton_final_response"].bool_param:
                done.add(resp.id)
    finally:
        client.stop_stream()
        client.close()
    assert len(errors) == 1 and "max_new_tokens" in errors[0]
    expect = {str(i): w for i, w in enumerate(want)}
    expect["5"] = want[5][:stop]              # stopped at end_id, which is not emitted
    assert tokens == expect
    assert counts == {k: len(v) for k, v in expect.items()}     # one streamed response per token


def _post(server, path, body, headers=None):
    """(status, JSON body) of a request to the server's HTTP endpoint ``path``."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{server['running'].http_url}{path}", method="GET" if body is None else "POST",
                                 data=None if body is None else json.dumps(body).encode(), headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_integers_past_int32_reach_the_model_whole_and_are_range_checked(server):
    """Triton wraps a JSON number into an INT32 input (4294967300 -> 4): the counts and ids are INT64, so the
    model sees the value sent and answers a 400 naming the field and its range."""
    for body, field in (({"input_ids": [1, 2, 3], "max_new_tokens": 4294967300}, "max_new_tokens"),
                        ({"input_ids": [1, 2, 3], "max_new_tokens": 2, "end_id": 4294967646}, "end_id")):
        code, out = _post(server, "/v2/models/macattn_sync/generate", body)
        assert code == 400 and field in out["error"], (code, out)
    code, out = _post(server, "/v2/models/macattn_sync/generate", {"input_ids": [1, 2, 3], "max_new_tokens": 2})
    assert code == 200 and len(out["output_ids"]) == 2
    infer = {"inputs": [{"name": "input_ids", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]},
                        {"name": "max_new_tokens", "shape": [1], "datatype": "INT32", "data": [4294967300]}]}
    code, out = _post(server, "/v2/models/macattn_sync/infer", infer)      # an INT32 sender is told the type
    assert code == 400 and "max_new_tokens" in out["error"] and "INT64" in out["error"], (code, out)


def test_admin_endpoints_answer_only_the_admin_token(server):
    token = {"triton-access-token": server["running"].admin_token}
    for path, body in (("/v2/logging", None), ("/v2/logging", {"log_verbose_level": 1}),
                       ("/v2/models/macattn/config", None), ("/v2/models/stats", None),
                       ("/v2/repository/index", {})):
        code, out = _post(server, path, body)
        assert code == 403 and "triton-access-token" in out["error"], (path, code, out)
    code, out = _post(server, "/v2/logging", None, token)
    assert code == 200 and out["log_verbose_level"] == 0
    assert _post(server, "/v2/models/macattn_sync/config", None, token)[0] == 200
    assert _post(server, "/v2/models/macattn_sync", None)[0] == 200                  # metadata stays open
    with pytest.raises(InferenceServerException, match="triton-access-token"):
        grpcclient.InferenceServerClient(server["grpc_url"]).update_log_settings({"log_verbose_level": 1})


def test_cancelled_or_abandoned_grpc_stream_stops_its_request(server, expected):
    """A stream cancelled by its client, or whose client process dies, ends its request before the next
    engine step (the server log names it), and the server goes on serving."""
    import subprocess as sp
    import sys

    log = server["running"].log_path

    def cancelled():
        return log.read_text(errors="replace").count("cancelled by its client")

    before = cancelled()
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    client.start_stream(callback=lambda result, error: got.put(error))
    client.async_stream_infer("macattn", _inputs(grpcclient, np.array([1, 2, 3]), 250), request_id="long")
    assert got.get(timeout=30) is None                      # it is generating
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 5
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 1
    script = (f"import os, signal, sys, numpy as np, tritonclient.grpc as g\n"
              f"c = g.InferenceServerClient({server['grpc_url']!r}); seen = []\n"
              f"c.start_stream(callback=lambda result, error: seen.append(1))\n"
              f"ids = g.InferInput('input_ids', [3], 'INT64'); ids.set_data_from_numpy(np.array([1, 2, 3], np.int64))\n"
              f"n = g.InferInput('max_new_tokens', [1], 'INT64'); n.set_data_from_numpy(np.array([250], np.int64))\n"
              f"c.async_stream_infer('macattn', [ids, n])\n"
              f"while not seen: pass\n"
              f"os.kill(os.getpid(), signal.SIGKILL)\n")
    assert sp.run([sys.executable, "-c", script], timeout=60).returncode == -9
    deadline = time.monotonic() + 5
    while cancelled() == before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 2
    ps, want = expected
    assert server["http"].infer("macattn_sync", _inputs(httpclient, ps[0].numpy(), NEW)).as_numpy(
        "output_ids").tolist() == want[0]


def _descendants(pid: int) -> list[int]:
    import subprocess as sp

    kids = [int(x) for x in sp.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                                   text=True).stdout.split()]
    return kids + [d for k in kids for d in _descendants(k)]


def test_serve_command_stops_tritonserver_and_its_stubs_on_sigterm(tmp_path):
    import os
    import signal
    import subprocess as sp
    import sys

    engine = write_engine_dir(tiny_model(), MAC, tmp_path / "engine")
    write_model_repository(engine, tmp_path / "repo", engine_args=EngineArgs(max_batch_size=2, block_size=8), torch_num_threads=1)
    proc = sp.Popen([sys.executable, "-m", "macattn.cli", "serve", "--repo", str(tmp_path / "repo"), "--workdir",
                     str(tmp_path / "work"), "--http-port", "0", "--grpc-port", "0"], stdout=sp.PIPE, stderr=sp.STDOUT,
                    text=True)
    try:
        for line in proc.stdout:
            if "tritonserver ready" in line:
                break
        else:
            pytest.fail(f"the server did not start (exit {proc.wait()})")
        family = _descendants(proc.pid)
        assert family, "tritonserver should run as a child of the command"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        time.sleep(1)
        alive = []
        for pid in family:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        assert not alive, f"left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
