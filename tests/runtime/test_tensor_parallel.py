"""Tensor parallelism on the CPU over gloo (``runtime/tensor_parallel/``): TP = 2 and 4 equal TP = 1
(logits <= 1e-5 fp32, identical greedy tokens over 64 steps, identical MAC hit decisions) for the three
families with MAC on and off; in-flight batching under TP equals solo runs; clear errors before any
process starts; a killed worker, and a killed rank 0, stop the group within its timeout with no
process left behind.

The worker groups are shared by the tests of one size (``TensorParallelGroup.get``); the failure tests
start their own (another ``tp_timeout_s``)."""
from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _tiny import prompts

from macattn.methods.mac.config import MacConfig
from macattn.models.builtin import build_builtin_model
from macattn.models.tensor_parallel import ShardLayout
from macattn.runtime import LLMEngine, ModelRunner, RuntimeConfig
from macattn.runtime.tensor_parallel import TensorParallelError, TensorParallelGroup
from macattn.runtime.tensor_parallel.comm import rank_function

# divisible by 4 in heads, KV heads and MLP width; the vocabulary (250) is not: the last rank's rows are padding
TP_SHAPES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=16, vocab_size=250, max_position_embeddings=256)
MAC = MacConfig(window=16, band=4, tau=0.2)
STEPS = 64


def tp_model(family: str, **overrides):
    return build_builtin_model(family, seed=3, **{**TP_SHAPES, **overrides})        # fp32


def _prompts():
    return [p % 250 for p in prompts(2, seed=7, lo=20, hi=40)]


@rank_function
def _start_recording(executor) -> None:
    """On one rank: keep every decode step's MAC match positions (``layer -> [B, Hq / N]``)."""
    log = executor.match_log = []
    inner = executor.decode_tokens       # every decode step's call (``decode_step`` calls it too)

    def recording(seqs, feed=None):
        out = inner(seqs, feed)
        log.append({layer: mp.clone() for layer, mp in executor.method.last_match_pos.items()})
        return out

    executor.decode_tokens = recording


@rank_function
def _recorded(executor) -> list:
    return executor.match_log


def _drive(eng: LLMEngine, requests: list, *, joins: dict | None = None, record_match: bool = False) -> dict:
    """Run ``eng`` until every request (``(prompt, max_new_tokens)``) finished; ``joins``: step -> more
    requests submitted before that step. Returns per submission order the tokens and per-token logits and
    (``record_match``) every decode step's MAC match positions over all heads ``layer -> [B, Hq]``."""
    tp = eng.config.tensor_parallel_size
    if record_match:
        eng.executor.run_on_ranks(_start_recording) if tp > 1 else _start_recording(eng.executor)
    order, out = [], {"tokens": {}, "logits": {}}
    pending = dict(joins or {})

    def submit(batch):
        for p, n in batch:
            order.append(eng.add_request(p, max_new_tokens=n))

    submit(requests)
    step = 0
    while eng.has_unfinished() or pending:
        submit(pending.pop(step, []))
        for o in eng.step():
            if o.token is not None:
                out["tokens"].setdefault(o.request_id, []).append(o.token)
                out["logits"].setdefault(o.request_id, []).append(o.logits.detach().clone())
        step += 1
    out["tokens"] = [out["tokens"][r] for r in order]
    out["logits"] = [torch.stack(out["logits"][r]) for r in order]
    if record_match:
        ranks = eng.executor.run_on_ranks(_recorded) if tp > 1 else [_recorded(eng.executor)]
        out["match"] = [{layer: torch.cat([r[i][layer] for r in ranks], dim=1) for layer in ranks[0][i]}
                        for i in range(len(ranks[0]))]
    return out


@functools.lru_cache(maxsize=None)
def _reference(family: str, mac_on: bool) -> dict:
    eng = LLMEngine(tp_model(family), MAC if mac_on else MacConfig(enabled=False), RuntimeConfig(max_batch_size=2, block_size=8))
    return _drive(eng, [(p, STEPS) for p in _prompts()], record_match=True)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mac_on", [True, False], ids=["mac", "mac_off"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_tp_equals_tp1(family, mac_on, tp):
    ref = _reference(family, mac_on)
    eng = LLMEngine(tp_model(family), MAC if mac_on else MacConfig(enabled=False),
                    RuntimeConfig(max_batch_size=2, block_size=8, tensor_parallel_size=tp))
    try:
        # a real shard: rank 0 holds its heads only, its rings too
        assert eng.executor.local.model.config.num_attention_heads == 8 // tp
        assert eng.method.dims.num_q_heads == 8 // tp and eng.method.dims.num_kv_heads == 4 // tp
        got = _drive(eng, [(p, STEPS) for p in _prompts()], record_match=True)
    finally:
        eng.close()
    for b in range(2):
        assert got["tokens"][b] == ref["tokens"][b]
        assert len(got["tokens"][b]) == STEPS
        assert (got["logits"][b] - ref["logits"][b]).abs().max() <= 1e-5
    assert len(got["match"]) == len(ref["match"])
    for step, (g, r) in enumerate(zip(got["match"], ref["match"])):
        assert g.keys() == r.keys(), step
        for layer in r:
            assert g[layer].shape == r[layer].shape and torch.equal(g[layer], r[layer]), (step, layer)
    hits = sum(int((m >= 0).sum()) for s in ref["match"] for m in s.values())
    assert (hits > 0) == mac_on          # the hit decisions compared are not all misses


def test_in_flight_batching_equals_solo_runs():
    """TP = 2, MAC on, chunked prefill: requests join mid-flight and leave at different lengths (two
    slots for four requests) and each equals its solo TP = 1 run; per-request MAC metrics are summed
    over the ranks' heads. fp64: batched and solo fp32 runs differ by rounding already at TP = 1, which
    can flip a MAC decision at its threshold."""
    ps = [p % 250 for p in prompts(4, seed=21, lo=18, hi=44)]
    lengths = [30, 9, 17, 12]
    solo = []
    for p, n in zip(ps, lengths):
        eng1 = LLMEngine(tp_model("llama").double(), MAC, RuntimeConfig(max_batch_size=1, block_size=8))
        solo.append(_drive(eng1, [(p, n)]))
    eng = LLMEngine(tp_model("llama").double(), MAC, RuntimeConfig(max_batch_size=2, block_size=8, max_num_batched_tokens=12,
                                                          tensor_parallel_size=2))
    try:
        got = _drive(eng, [(ps[0], lengths[0]), (ps[1], lengths[1])], joins={4: [(ps[2], lengths[2])],
                                                                            11: [(ps[3], lengths[3])]})
        metrics = [s.metrics for s in eng.requests.values()]
    finally:
        eng.close()
    for i in range(4):
        assert got["tokens"][i] == solo[i]["tokens"][0]
        assert (got["logits"][i] - solo[i]["logits"][0]).abs().max() <= 1e-9
    assert len(metrics) == 4 and all(0.0 <= m["mac_hit_rate"] <= 1.0 for m in metrics)


@pytest.mark.parametrize("method", ["mac_off", "full"])
def test_fused_mixed_steps_under_tp_equal_tp1(method):
    """TP = 2 runs the one-forward mixed step (``TensorParallelExecutor.mixed_step``: the decode rows inside the
    chunks' packed call on every rank) where TP = 1 does: requests join mid-flight beside running decodes, chunked;
    tokens equal and logits within fp64 rounding of TP = 1's (fp64), and both ran the same fused steps."""
    ps = [p % 250 for p in prompts(4, seed=23, lo=18, hi=44)]
    kw = {"method": "full"} if method == "full" else {}
    mac = None if method == "full" else MacConfig(enabled=False)
    runs = []
    for tp in (1, 2):
        eng = LLMEngine(tp_model("llama").double(), mac, RuntimeConfig(max_batch_size=3, block_size=8,
                                                                      max_num_batched_tokens=12,
                                                                      tensor_parallel_size=tp), **kw)
        fused, mixed = [], eng.executor.mixed_step
        eng.executor.mixed_step = lambda d, c, feed=None: (fused.append((len(d), len(c))), mixed(d, c, feed))[1]
        try:
            got = _drive(eng, [(ps[0], 14), (ps[1], 9)], joins={3: [(ps[2], 11)], 6: [(ps[3], 8)]})
        finally:
            eng.close()
        runs.append((got, fused))
    (one, fused1), (two, fused2) = runs
    assert fused2 == fused1 and len(fused2) >= 3
    for i in range(4):
        assert two["tokens"][i] == one["tokens"][i]
        assert (two["logits"][i] - one["logits"][i]).abs().max() <= 1e-9


def test_engine_start_up_captures_on_every_rank():
    """``EngineArgs.build_engine`` captures the CUDA graphs at start-up; under TP every rank captures together (a
    decode bucket's capture runs the step's all-reduces: rank 0 alone hung on two GPUs). On the CPU nothing is
    captured, but the call must reach each rank: one result per rank."""
    from macattn.runtime.engine_args import EngineArgs

    eng = EngineArgs(model="builtin", max_batch_size=1, max_seq_len=64, tensor_parallel_size=2).build_engine()
    try:
        assert eng.executor.prewarm_graphs() == [{"decode": [], "prefill": [], "cudnn_plans": []}] * 2
    finally:
        eng.close()


def test_llm_api_tp2_equals_tp1():
    from macattn import LLM, SamplingParams

    sp = SamplingParams(max_tokens=12, temperature=0)
    with LLM("builtin", max_batch_size=1, max_seq_len=64) as one:
        [ref] = one.generate("In the beginning", sp)
    with LLM("builtin", max_batch_size=1, max_seq_len=64, tensor_parallel_size=2) as two:
        [got] = two.generate("In the beginning", sp)
        assert "mac_hit_rate" in got.metrics
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert got.metrics["mac_hit_rate"] == pytest.approx(ref.metrics["mac_hit_rate"], abs=1e-12)


# --- errors before any process starts -------------------------------------------------------------
def _no_new_group(fn):
    before = set(map(id, TensorParallelGroup._live.values()))
    fn()
    assert set(map(id, TensorParallelGroup._live.values())) <= before


@pytest.mark.parametrize("overrides,tp,name", [
    ({}, 3, "num_attention_heads=8"),
    (dict(num_attention_heads=8, num_key_value_heads=2), 4, "num_key_value_heads=2"),
    (dict(intermediate_size=130), 4, "intermediate_size=130"),
])
def test_heads_not_divisible_is_refused(overrides, tp, name):
    model = tp_model("llama", **overrides)

    def build():
        with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} must divide {name}") as err:
            LLMEngine(model, MAC, RuntimeConfig(tensor_parallel_size=tp))
        assert "accepted for this model" in str(err.value)

    _no_new_group(build)
    assert ShardLayout.of(model.config, 2).num_kv_heads == model.config.num_key_value_heads // 2


def test_more_ranks_than_devices_is_refused():
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0

    def build():
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={visible + 2} needs CUDA devices .* but "
                                             rf"{visible} are visible"):
            LLMEngine(tp_model("llama"), None, RuntimeConfig(device="cuda", tensor_parallel_size=visible + 2))

    _no_new_group(build)


def test_unsharded_methods_and_bad_settings_are_refused():
    model = tp_model("llama")
    with pytest.raises(NotImplementedError, match=r"method='completion' cannot run with tensor_parallel_size=2.*"
                                                  r"accepted: \['full', 'mac'\]"):
        LLMEngine(model, None, RuntimeConfig(tensor_parallel_size=2), method="completion")
    with pytest.raises(ValueError, match="by registry name"):
        LLMEngine(model, None, RuntimeConfig(tensor_parallel_size=2), method=lambda n: None)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        RuntimeConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tp_timeout_s"):
        RuntimeConfig(tp_timeout_s=0)


def test_servers_take_tp(capsys):
    from macattn.cli import build_parser, main

    assert build_parser().parse_args(["serve", "--model", "builtin", "--tp", "2"]).tensor_parallel_size == 2
    assert build_parser().parse_args(["triton-repo", "--engine", "e", "--out", "o", "--tp", "4"]).tensor_parallel_size == 4
    with pytest.raises(SystemExit):
        main(["serve", "--repo", "repo", "--tp", "2"])
    assert "--tensor-parallel-size: a model repository carries its engine arguments" in capsys.readouterr().err


def test_chunked_prompts_are_refused_under_tp():
    runner = ModelRunner.from_hf(tp_model("llama"), MAC, tp_size=2, max_batch_size=2, block_size=8)
    try:
        with pytest.raises(NotImplementedError, match="A3 chunked prompts"):
            runner.generate([torch.tensor([1, 2])], documents=[[torch.tensor([3, 4, 5])]],
                            question_ids=[torch.tensor([6])], max_new_tokens=2)
        out = runner.generate([torch.tensor([1, 2, 3])], max_new_tokens=3)     # the group still serves
        assert out.shape == (1, 1, 6)
    finally:
        runner.engine.close()


# --- failures: no hang, no process left -----------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_killed_worker_stops_the_group_within_the_timeout():
    """After every other TP = 4 test: it breaks the group they shared (or starts one when run alone)."""
    timeout = RuntimeConfig().tp_timeout_s
    runner = ModelRunner.from_hf(tp_model("llama"), MAC, tp_size=4, max_batch_size=2, block_size=8)
    group = runner.engine.executor.group
    pids = [p.pid for p in group.procs]
    gen = runner.generate(_prompts(), max_new_tokens=40, streaming=True)
    for _ in range(3):
        next(gen)
    os.kill(pids[1], signal.SIGKILL)                # rank 2
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=rf"rank 2 \(pid {pids[1]}\) exited with code -9"):
        for _ in gen:
            pass
    assert time.monotonic() - t0 < timeout
    assert all(_gone(pid) for pid in pids)          # ranks 1 and 3 exited too
    assert group not in TensorParallelGroup._live.values()
    with pytest.raises(TensorParallelError, match="rank 2"):          # refused from now on, no hang
        runner.generate(_prompts(), max_new_tokens=2)


_RANK0 = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_tensor_parallel import MAC, tp_model
    from macattn.runtime import ModelRunner

    if __name__ == "__main__":
        runner = ModelRunner.from_hf(tp_model("llama"), MAC, tp_size=2, max_batch_size=2, block_size=8)
        runner.generate([__import__("torch").tensor([1, 2, 3])], max_new_tokens=2)
        print(*[p.pid for p in runner.engine.executor.group.procs], flush=True)
        time.sleep(600)
""")


def test_killed_rank0_takes_its_workers_down(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(_RANK0.format(tests=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stdout.readline()
        assert line.strip(), proc.stderr.read()[-3000:]
        pids = [int(x) for x in line.split()]
        assert pids and not any(_gone(p) for p in pids)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(_gone(p) for p in pids):
            time.sleep(0.1)
        assert all(_gone(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()


_WEDGED = textwrap.dedent("""
    import sys, time
    import macattn.runtime.tensor_parallel.group as tp

    tp._WEDGE_GRACE_S = 1.0
    if __name__ == "__main__":
        group = tp.TensorParallelGroup(2, ["cpu", "cpu"], 30.0)
        group.backend = "nccl"      # the branch under test: gloo ends a dead peer's collective by itself
        print(group.procs[0].pid, flush=True)
        # an op the worker does not know (it exits), while rank 0's share never returns, as a stream
        # waiting on a dead NCCL peer does
        group.run(0, "no such op", (), lambda: time.sleep(600))
        print("RETURNED", flush=True)
""")


def _exits_wedged_naming_rank1(tmp_path, text: str) -> str:
    """Run ``text`` as rank 0's script (its first line of output: its worker's pid); assert it exits
    ``EXIT_WEDGED`` naming rank 1 and leaves no worker. Returns its standard output."""
    from macattn.runtime.tensor_parallel import EXIT_WEDGED

    script = tmp_path / "rank0.py"
    script.write_text(text)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        pid = int(proc.stdout.readline())
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_WEDGED, (proc.returncode, out, err[-2000:])
    assert re.search(r"rank 1 \(pid \d+\) exited with code \d+; NCCL cannot release .* exits with code 70", err), err
    assert _gone(pid)
    return out


def test_rank0_stuck_in_an_op_after_a_worker_died_exits_with_the_cause(tmp_path):
    """The NCCL case (module doc): rank 0 cannot leave an op whose collective waits on a dead peer, so it
    names the dead rank and exits with ``EXIT_WEDGED`` within the grace period; the worker is gone."""
    out = _exits_wedged_naming_rank1(tmp_path, _WEDGED)
    assert "RETURNED" not in out


_ABORT_AT_EXIT = textwrap.dedent("""
    import sys, threading
    import macattn.runtime.tensor_parallel.group as tp

    tp._WEDGE_GRACE_S = 1.0
    tp.abort_quietly = lambda part, peer_died=False: threading.Event().wait(600)   # as NCCL's abort of a dead peer
    if __name__ == "__main__":
        group = tp.TensorParallelGroup(2, ["cpu", "cpu"], 30.0)
        print(group.procs[0].pid, flush=True)
        try:
            group.run(0, "no such op", (), lambda: group.control.broadcast(None))   # the worker exits; rank 0 fails
        except tp.TensorParallelError as exc:
            print("RAISED", exc, flush=True)
        sys.exit(0)
""")


def test_an_abort_still_running_at_exit_ends_the_process_with_the_cause(tmp_path):
    """The NCCL abort of a group whose peer died can outlive the op (H200 x2: it had not returned when the script
    exited, and the interpreter's finalization unwound its thread: SIGABRT, "terminate called recursively"). At
    exit ``group._at_exit`` waits ``_WEDGE_GRACE_S`` for it, then exits ``EXIT_WEDGED`` naming the dead rank."""
    assert "RAISED" in _exits_wedged_naming_rank1(tmp_path, _ABORT_AT_EXIT)


def test_the_gpu_killed_worker_script_runs_its_except_path_on_the_cpu(tmp_path):
    """The GPU test's killed-worker script (``test_tensor_parallel_gpu.killed_worker_script``) over gloo: the names
    its except path takes resolve (issue 41: a NameError there made rank 0 abort on two GPUs), rank 0 raises
    ``TensorParallelError`` naming the killed rank, no worker is left."""
    from test_tensor_parallel_gpu import killed_worker_script

    script = tmp_path / "killed_worker.py"
    script.write_text(killed_worker_script(timeout=30.0, device="cpu", graphs=False))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (out, err[-3000:])
    assert re.search(r"RAISED .*rank 1 \(pid \d+\) exited with code -9", out), out
    assert pids and all(_gone(pid) for pid in pids)


def _listening_addresses(pid: int) -> list[str]:
    """The IPv4 / IPv6 addresses ``pid``'s listening TCP sockets are bound to (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:         # LISTEN
                    raw = bytes.fromhex(cols[1].split(":")[0])
                    words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]   # each 32-bit word little-endian
                    import ipaddress

                    out.append(str(ipaddress.ip_address(b"".join(words))))
    return out


def test_the_groups_listen_on_the_loopback_interface_only():
    """Issue 41: the store and both gloo groups accept connections from this host only."""
    runner = ModelRunner.from_hf(tp_model("llama"), MAC, tp_size=2, max_batch_size=2, block_size=8)
    group = runner.engine.executor.group
    listening = [ip for pid in (os.getpid(), *(p.pid for p in group.procs)) for ip in _listening_addresses(pid)]
    assert listening and all(ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for ip in listening), listening


def test_the_control_channel_resolves_only_what_the_group_exchanges():
    """A control message naming anything outside the wire's allow-list (``os.system`` here) is refused before
    it is called; the group's own messages (configs, tensors, registered functions) decode."""
    import io
    import os
    import pickle

    from macattn.runtime.tensor_parallel.comm import WireUnpickler

    class Payload:
        def __reduce__(self):
            return os.system, ("echo reached",)

    with pytest.raises(pickle.UnpicklingError, match="carries no posix.system"):
        WireUnpickler(io.BytesIO(pickle.dumps(Payload()))).load()
    msg = (MacConfig(), RuntimeConfig(max_batch_size=2), torch.arange(4, dtype=torch.bfloat16), _recorded)
    back = WireUnpickler(io.BytesIO(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))).load()
    assert back[:2] == msg[:2] and torch.equal(back[2], msg[2]) and back[3] is _recorded


def test_run_on_ranks_refuses_an_unregistered_function():
    eng = LLMEngine(tp_model("llama"), MAC, RuntimeConfig(max_batch_size=2, max_seq_len=64, tensor_parallel_size=2))
    try:
        with pytest.raises(ValueError, match="fn must be registered with .*rank_function"):
            eng.executor.run_on_ranks(len)
        assert eng.executor.run_on_ranks(_start_recording) == [None, None]      # a registered one runs
    finally:
        eng.close()
