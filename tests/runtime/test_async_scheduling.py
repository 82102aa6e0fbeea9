"""Async scheduling (``runtime/in_flight.py``): each step is launched before the previous step's tokens are read.

The overlapped loop's outputs equal the serial loop's, request by request (tokens, finish reasons, logits), with
requests arriving, finishing by length / end token / stop token, aborted while a token is in flight, sampled ``n``
times, and slots and KV blocks reused. The per-request sampling reference under async scheduling is in
``test_engine_sampling.py``; the GPU graphs' side in ``test_cuda_decode_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

from macattn.methods.base import ModelDims
from macattn.methods.full.config import FullConfig
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.engine_args import EngineArgs
from macattn.runtime.in_flight import TokenFeed
from macattn.runtime.sampling import SamplingConfig
from macattn.runtime.sequence import Sequence

from _paged_reference import attach_cpu_decoder
from _tiny import MAC, prompts, tiny_model
from test_engine_sampling import _PagedFull


def _engine(overlap: bool, *, slots: int = 2, budget: int | None = 13, bucketed: bool = True) -> LLMEngine:
    """``bucketed``: full attention through the GPU decode's step (static inputs, ``TokenFeed`` into its ids),
    eagerly on the CPU over the paged reference plans; else MAC through the CPU's decode path."""
    model = tiny_model("llama", seed=3)
    rc = RuntimeConfig(max_batch_size=slots, max_seq_len=128, num_blocks=48, block_size=8,
                       max_num_batched_tokens=budget, async_scheduling=overlap)
    if not bucketed:
        return LLMEngine(model, MAC, rc)
    dims = ModelDims.of(model)
    eng = LLMEngine(model, None, rc, method=lambda n: _PagedFull(FullConfig(), dims, num_slots=n + 1))
    attach_cpu_decoder(eng)
    return eng


def _requests(greedy_tokens: list[list[int]] | None = None) -> list[tuple[torch.Tensor, dict]]:
    """Nine requests of every finishing kind; the end / stop tokens are tokens the greedy run generates (so
    they end requests mid-stream), taken from ``greedy_tokens`` when given."""
    ps = prompts(9, seed=5, lo=10, hi=40)
    g = greedy_tokens or [[-1] * 8 for _ in ps]
    kw = [dict(max_new_tokens=7), dict(max_new_tokens=9, end_id=g[1][3]), dict(max_new_tokens=8, stop_token_ids=[g[2][2]]),
          dict(max_new_tokens=6, temperature=0.9, top_p=0.9, random_seed=7), dict(max_new_tokens=1),
          dict(max_new_tokens=8, min_tokens=4, end_id=g[5][1], repetition_penalty=1.4),
          dict(max_new_tokens=5, temperature=1.1, random_seed=9, n=2), dict(max_new_tokens=8, logit_bias={3: 2.0}),
          dict(max_new_tokens=3, end_id=g[8][0])]
    return list(zip(ps, kw))


def _run(eng: LLMEngine, requests, *, abort: dict | None = None, each_step=None) -> dict[int, list]:
    """Submit two requests per step; ``abort``: step -> index of a request to abort before that step;
    ``each_step(eng, ids)``: called after every step with the request ids submitted so far (per index, forks
    after). Returns per request index (forks as ``(index, fork)``) its ``(token, finished, reason, logits)``
    outputs."""
    ids: list[list[int]] = []
    out: dict[int, list] = {}
    pending = list(requests)
    step = 0
    while pending or eng.has_unfinished():
        for _ in range(2):
            if pending:
                p, kw = pending.pop(0)
                kw = dict(kw)
                n = kw.pop("n", None)
                got = eng.add_request(p, SamplingConfig(**kw), n=n)
                ids.append(got if isinstance(got, list) else [got])
        if abort and step in abort:
            eng.abort(ids[abort[step]][0])
        for o in eng.step():
            out.setdefault(o.request_id, []).append((o.token, o.finished, o.finish_reason, o.logits))
        if each_step is not None:
            each_step(eng, ids)
        step += 1
    return {(i, f): out.get(rid, []) for i, rids in enumerate(ids) for f, rid in enumerate(rids)}


def _tokens(run: dict) -> dict:
    return {k: [(t, fin, r) for t, fin, r, _ in v] for k, v in run.items()}


def _greedy_tokens() -> list[list[int]]:
    run = _run(_engine(False), [(p, dict(max_new_tokens=8)) for p, _ in _requests()])
    return [[t for t, *_ in run[(i, 0)]] for i in range(9)]


@pytest.mark.parametrize("bucketed", [True, False], ids=["bucketed", "mac"])
def test_the_overlapped_loop_equals_the_serial_loop(bucketed, monkeypatch):
    requests = _requests(_greedy_tokens())
    serial = _run(_engine(False, bucketed=bucketed), requests)
    fed = []
    write = TokenFeed.write
    monkeypatch.setattr(TokenFeed, "write", lambda self, ids, seqs: (fed.append(sum(s.num_pending for s in seqs)),
                                                                    write(self, ids, seqs))[1])
    eng = _engine(True, bucketed=bucketed)
    free = eng.slot_states.num_free, eng.executor.blocks.num_free
    overlapped = _run(eng, requests)
    assert sum(fed) > 20              # decodes took their previous token from the device, not the host
    assert _tokens(overlapped) == _tokens(serial)
    reasons = {r for v in serial.values() for _, fin, r, _ in v if fin}
    assert {"length", "end_id", "stop_token_id"} <= reasons       # every finishing kind ran
    for k in serial:
        for a, b in zip(serial[k], overlapped[k]):
            if a[3] is not None:
                assert (a[3] - b[3]).abs().max() <= 1e-9
    assert not eng.has_unfinished() and eng._in_flight is None
    assert (eng.slot_states.num_free, eng.executor.blocks.num_free) == free      # every slot and block released


def test_a_step_returns_the_previous_steps_outputs():
    eng = _engine(True, budget=None)
    rid = eng.add_request(prompts(1, seed=2)[0], max_new_tokens=3)
    assert eng.step() == []                             # the prefill and its first token: launched, not read
    seq = eng.requests[rid]
    assert seq.num_pending == 1 and seq.output == [] and seq.prefilled
    got = []
    while eng.has_unfinished():
        got += [(o.token is not None, o.finished) for o in eng.step()]
    assert got == [(True, False), (True, False), (True, True)]
    assert seq.num_pending == 0 and len(seq.output) == 3


def test_a_request_aborted_while_its_token_is_in_flight_gets_no_more_outputs_and_frees_its_slot():
    requests = _requests(_greedy_tokens())[:4]
    serial = _run(_engine(False), requests, abort={4: 0})
    overlapped = _run(_engine(True), requests, abort={4: 0})
    assert _tokens(overlapped)[(0, 0)] == _tokens(serial)[(0, 0)][:len(overlapped[(0, 0)])]
    assert not any(fin for _, fin, _, _ in overlapped[(0, 0)])       # aborted: no finishing output
    # the other requests, which took the aborted one's slot and blocks, equal their serial runs
    for k in list(serial)[1:]:
        assert _tokens(overlapped)[k] == _tokens(serial)[k]


def test_a_slot_freed_by_an_end_token_in_flight_serves_the_next_request_as_a_fresh_one():
    """Request 0 ends on its end token while its next row is in flight; request 1 waits for its slot (one slot),
    so the dropped row's KV and ring writes land before request 1's prefill: request 1 equals its solo run."""
    g = _greedy_tokens()
    p0, p1 = prompts(2, seed=8)
    first = [(p0, dict(max_new_tokens=8, end_id=g[0][2])), (p1, dict(max_new_tokens=6))]
    solo = _run(_engine(True, slots=1), first[1:])[(0, 0)]
    both = _run(_engine(True, slots=1), first)
    assert [r for *_, r, _ in both[(0, 0)]][-1:] in (["end_id"], ["length"])
    assert _tokens({0: both[(1, 0)]}) == _tokens({0: solo})


def test_a_sync_step_reads_the_step_in_flight_first():
    eng = _engine(True, budget=None)
    eng.add_request(prompts(1, seed=4)[0], max_new_tokens=4)
    assert eng.step() == []
    outs = eng.step(sync=True)          # the first token (read), then a serial decode step's token
    assert len(outs) == 2 and eng._in_flight is None


def test_token_feed_writes_pending_rows_and_names_a_missing_one():
    a, b, c = (Sequence(prompt=[1], sampling=SamplingConfig()) for _ in range(3))
    a.num_pending = c.num_pending = 1
    b.output = [5]
    feed = TokenFeed(torch.tensor([11, 22, 33]), {a.request_id: 2, c.request_id: 0})
    ids = torch.full((4, 1), -7, dtype=torch.int64)
    feed.write(ids, [a, b, c])
    assert ids.view(-1).tolist() == [33, -7, 11, -7]          # host-written rows untouched
    with pytest.raises(RuntimeError, match="pending token"):
        TokenFeed(torch.tensor([1]), {}).write(ids, [a])


def test_async_scheduling_is_resolved_validated_and_on_every_surface():
    assert RuntimeConfig().resolved(64).async_scheduling is False                    # CPU: off by default
    assert RuntimeConfig(async_scheduling=True).resolved(64).async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling=True is not available with tensor_parallel_size=2"):
        RuntimeConfig(async_scheduling=True, tensor_parallel_size=2)
    assert RuntimeConfig(tensor_parallel_size=2).resolved(64).async_scheduling is False
    with pytest.raises((TypeError, ValueError), match="async_scheduling"):
        RuntimeConfig(async_scheduling="yes")
    assert EngineArgs(async_scheduling=True).runtime_config().async_scheduling is True
    parser = __import__("argparse").ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
