"""The engine names no method: the GPU decode (``runtime/cuda_decode.py``), the engine's config handling and a
tensor-parallel group's request figures go through the ``AttentionMethod`` hooks (``decode_plans``,
``decode_graph_key``, ``record_decode_step``, ``decode_step_done``, ``default_config`` / ``engine_config``,
``request_metrics_part`` / ``combine_request_metrics``).

On the CPU: ``CudaDecoder``'s eager step (no graphs; ``StepInputs`` without pinned memory) drives a test
method whose plans attend over the paged pool with plain torch, and must equal the CPU runtime's decode;
MAC's hooks are checked against its own per-layer bookkeeping with its kernel plans stubbed out (the
GPU tests, ``test_cuda_decode_gpu.py``, run them for real)."""
from __future__ import annotations


import pytest
import torch

from macattn.methods.base import AttentionMethod, DecodePlans, FullDecodePlans, ModelDims
from macattn.methods.full.backend import FullAttention
from macattn.methods.full.config import FullConfig
from macattn.methods.mac.backend import MacAttention
from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.decode_plans import MacDecodePlans, plan_key
from macattn.methods.mac.state import MacDiagnostics
from macattn.methods.registry import METHODS
from macattn.runtime import step_inputs
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import MethodSpec, LLMEngine

from _paged_reference import PagedReference, attach_cpu_decoder
from _tiny import prompts, tiny_model


class _Hooked(FullAttention):
    """Full attention that logs every GPU-decode hook the runtime calls."""

    key = "variant-a"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.log: list[tuple] = []

    def decode_plans(self, geometry, rows):
        self.log.append(("plans", geometry.batch_size))
        return PagedReference(geometry, rows)

    def decode_graph_key(self, positions):
        self.log.append(("key", list(positions)))
        return self.key

    def record_decode_step(self, plans, key):
        self.log.append(("record", key, plans.rows.valid.tolist()))

    def decode_step_done(self, plans, batch_size):
        self.log.append(("done", batch_size, type(plans).__name__))


class _Unpinned:
    """``torch`` for ``StepInputs`` on a machine without CUDA: ``empty`` ignores ``pin_memory``."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory: bool = False, **kwargs):
        return torch.empty(*args, **kwargs)


def _engine(decoder: bool) -> LLMEngine:
    model = tiny_model("llama", seed=7)
    dims = ModelDims.of(model)
    eng = LLMEngine(model, None, RuntimeConfig(max_batch_size=4, max_seq_len=128, num_blocks=64),
                    method=lambda n: _Hooked(FullConfig(), dims, num_slots=n))
    if decoder:     # the GPU decode's step, eagerly on the CPU
        attach_cpu_decoder(eng)
    return eng


def test_the_gpu_decode_drives_the_method_hooks_and_equals_the_cpu_decode(monkeypatch):
    monkeypatch.setattr(step_inputs, "torch", _Unpinned())
    ps = prompts(3, seed=5, lo=20, hi=40)
    runs = {}
    for decoder in (False, True):
        eng = _engine(decoder)
        ids = [eng.add_request(p, max_new_tokens=5) for p in ps]
        eng.run_to_completion()
        runs[decoder] = ([eng.pop_finished(i).output for i in ids], eng.method.log)
    (plain, plain_log), (bucketed, log) = runs[False], runs[True]
    assert bucketed == plain
    assert plain_log == []                                   # the CPU decode has no buckets
    records = [e for e in log if e[0] == "record"]
    dones = [e for e in log if e[0] == "done"]
    assert records and len(records) == len(dones)
    keys = [e[1] for e in log if e[0] == "key"]          # each step's key is asked with its rows' positions
    assert len(keys) == len(dones) and all(len(k) == B and min(k) >= 20 for k, (_, B, _) in zip(keys, dones))
    for (_, key, valid), (_, B, kind) in zip(records, dones):
        assert key == "variant-a" and kind == "PagedReference"
        assert valid == [1.0] * B + [0.0] * (len(valid) - B)        # padding rows weigh 0
    # the step key: (the sampler variant: argmax only, the method's key); the plans are made once per bucket
    dec = eng.executor.decoder
    assert dec.step_key([]) == ((False, False, False), "variant-a")
    assert sorted(e[1] for e in log if e[0] == "plans") == sorted(dec.buckets)      # once per bucket
    assert all(isinstance(b.plans, PagedReference) for b in dec.buckets.values())


def test_the_default_hooks():
    dims = ModelDims.of(tiny_model())
    m = FullAttention(FullConfig(), dims, num_slots=2)
    assert m.decode_graph_key([3, 9]) is None and m.decode_graph_keys() == (None,)
    assert m.record_decode_step(None, None) is None and m.decode_step_done(None, 1) is None
    assert FullAttention.decode_plans is AttentionMethod.decode_plans          # attend-only: FullDecodePlans
    assert issubclass(FullDecodePlans, DecodePlans)
    assert m.request_metrics_part(0) == {} and m.combine_request_metrics([{"a": 1.0}, {"a": 2.0}]) == {"a": 1.0}
    for name, cls in METHODS.items():
        assert isinstance(cls.engine_config(None), cls.config_type), name
        assert isinstance(cls.default_config(), cls.config_type), name
    plans = DecodePlans(None, None)
    with pytest.raises(NotImplementedError):
        plans.attend_full(None, None, None, None)


def test_the_engine_maps_mac_config_through_the_registry():
    assert MacAttention.engine_config(None) == MacConfig()           # None: MAC's defaults
    with pytest.raises(ValueError, match="miss_policy"):
        MacAttention.engine_config(MacConfig(miss_policy="completion"))
    on = MacConfig(window=16, band=4, tau=0.2)
    assert MethodSpec.of("mac", on) == MethodSpec("mac", on, {})
    assert MethodSpec.of("full", on) == MethodSpec("full", None, {})       # mac_config is MAC's only
    with pytest.raises(ValueError, match="mac_config, not method_config"):
        MethodSpec.of("mac", on, FullConfig())
    rc = RuntimeConfig(max_batch_size=1, max_seq_len=64)
    eng = LLMEngine(tiny_model(), on, rc)
    assert eng.method.config == on and eng.mac_state is eng.method.state
    assert eng.method_state("mac") is eng.method.state and eng.method_state("other") is None
    default = LLMEngine(tiny_model(), None, rc)             # None: MAC's defaults, as on every surface
    assert default.mac_config == MacConfig() and default.method.config == default.mac_config
    full = LLMEngine(tiny_model(), on, rc, method="full")
    assert full.mac_state is None and full.mac_config == on and full.method.config == FullConfig()
    with pytest.raises(ValueError, match="miss_policy"):
        LLMEngine(tiny_model(), MacConfig(miss_policy="completion"), rc, method="full")


class _StubPlan:
    """Stands in for a ``MacDecodePlan`` (a Triton plan needs CUDA or the interpreter)."""

    def __init__(self, **kw) -> None:
        self.kw = kw


def _mac_plans(monkeypatch, config: MacConfig, nb: int = 4, hq: int = 4):
    from macattn.methods.base import DecodeGeometry, DecodeRows

    monkeypatch.setattr(DecodePlans, "make_plan", lambda self, **kw: _StubPlan(**kw))
    dims = ModelDims(num_layers=3, num_q_heads=hq, num_kv_heads=2, head_dim=16, hidden_size=64,
                     dtype=torch.float32, device=torch.device("cpu"))
    mac = MacAttention(config, dims, num_slots=nb + 1)
    geometry = DecodeGeometry(batch_size=nb, max_context=128, page_size=16, num_q_heads=hq, num_kv_heads=2,
                              head_dim=16, dtype=torch.float32, device=torch.device("cpu"))
    rows = DecodeRows(positions=torch.tensor([40, 41, 50, 0]), slots=torch.tensor([2, 0, 1, nb]),
                      valid=torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64),
                      page_table=torch.zeros(nb, 8, dtype=torch.int32), scratch_slot=nb)
    return mac, mac.decode_plans(geometry, rows)


def test_mac_owns_its_plans_diagnostics_and_match_view(monkeypatch):
    config = MacConfig(window=16, band=4, tau=0.3).with_overrides({1: {"window": 32}, 2: {"enabled": False}})
    mac, plans = _mac_plans(monkeypatch, config)
    assert isinstance(plans, MacDecodePlans)
    # one plan per distinct configuration: layer 2 (MAC off) runs layer 0's plan's full-attention path
    assert set(plans.plans) == {plan_key(config.for_layer(layer)) for layer in range(3)} and len(plans.plans) == 2
    assert plans.plans[plan_key(config.for_layer(1))].kw["window"] == 32
    assert mac.decode_graph_key([40]) == (True, True) and mac.decode_graph_keys() == ((True, True),)
    mac.collect_diagnostics = False
    assert mac.decode_graph_key([40]) == (False, True)
    g = torch.Generator().manual_seed(0)
    for layer in (0, 1):      # what the MAC layers' attend writes each step
        plans.match_pos[layer] = torch.randint(-1, 40, (4, 4), generator=g)
    mac.record_decode_step(plans, (False, True))              # the variant without diagnostics records nothing
    assert mac.state.diagnostics.steps.sum() == 0
    mac.record_decode_step(plans, (True, True))
    want = MacDiagnostics.zeros(3, 4, mac.num_slots)
    for layer, mp in plans.match_pos.items():                 # the per-layer record of the real rows
        want.record(layer, mp[:3], plans.rows.positions[:3], config.for_layer(layer).band, plans.rows.slots[:3])
    got = mac.state.diagnostics
    for name in ("steps", "hits", "skipped", "gap", "per_slot"):
        assert torch.allclose(getattr(got, name), getattr(want, name)), name
    mac.decode_step_done(plans, 3)
    assert set(mac.last_match_pos) == {0, 1}
    assert all(torch.equal(mac.last_match_pos[layer], plans.match_pos[layer][:3]) for layer in (0, 1))
    plans.match_pos[0].fill_(7)                                # a view: the next step's values, sliced when read
    assert (mac.last_match_pos[0] == 7).all() and mac.last_match_pos[0].shape == (3, 4)


def test_mac_combines_a_requests_counts_over_the_ranks(monkeypatch):
    mac, _ = _mac_plans(monkeypatch, MacConfig(window=16, band=4, tau=0.3))
    mac.state.diagnostics.per_slot[1] = torch.tensor([8.0, 2.0, 0.5], dtype=torch.float64)
    part = mac.request_metrics_part(1)
    assert mac.request_metrics(1) == {}         # no decode step of slot 1 engaged: the device is not read
    mac.decoded([0, 1], [3, 40])
    assert mac.state.diagnostics.counted == {0, 1}
    assert part == [8.0, 2.0, 0.5] and mac.request_metrics(1) == MacDiagnostics.request_of(part)
    mac.state.reset(1)
    assert mac.state.diagnostics.counted == {0} and mac.request_metrics(1) == {}
    assert mac.combine_request_metrics([part, [8.0, 6.0, 1.5]]) == MacDiagnostics.request_of([16.0, 8.0, 2.0])
    mac.collect_diagnostics = False
    assert mac.request_metrics_part(1) is None and mac.combine_request_metrics([None, None]) == {}


def test_mac_counts_only_the_slots_whose_steps_engaged():
    """``MacAttention.decoded`` marks a slot counted (``MacDiagnostics.counted``) only for a step at ``m >= min_context``
    of a MAC layer; a fork's slot copies the mark; a reset slot loses it."""
    from macattn.models.builtin import build_builtin_model
    from macattn.methods.base import ModelDims
    from macattn.methods.mac.backend import MacAttention

    dims = ModelDims.of(build_builtin_model("llama", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64))
    mac = MacAttention(MacConfig(window=16, band=4, tau=0.3, min_context=50), dims, num_slots=4)
    mac.decoded([0, 1, 2], [49, 50, 10])
    assert mac.state.diagnostics.counted == {1}
    mac.state.copy(1, 3)
    mac.state.copy(2, 1)
    assert mac.state.diagnostics.counted == {3}
    off = MacAttention(MacConfig(enabled=False), dims, num_slots=2)
    off.decoded([0, 1], [500, 900])
    assert not off.state.diagnostics.counted
