"""Every attention method in the registry, through the one engine, against one reference: the
model's own greedy decode (``model(ids)`` over the whole sequence, no cache). Each method runs
with settings at which it is exact, so the engine's plumbing — binding, the per-call
StepContext, slot states, paged or method-owned KV, in-flight batching over reused slots — is
what is checked; each method's approximation has its own tests."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.completion.config import CompletionConfig
from macattn.methods.mac.config import MacConfig
from macattn.methods.registry import ATTENTION_METHODS, METHODS
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine

from _completion import completion_maps
from _tiny import prompts, tiny_model

NEW = 6


def _exact_engine(name: str, model) -> LLMEngine:
    rc = RuntimeConfig(max_batch_size=2, max_seq_len=128)
    if name == "mac":
        return LLMEngine(model, MacConfig(window=16, band=4, enabled=False), rc)
    if name == "completion":   # Top-k covering the whole mid region: exact attention
        cfg = CompletionConfig(n_sink=4, n_tail=8, top_k=10_000, feature_dim=16, hidden=32)
        return LLMEngine(model, None, rc, method="completion", method_config=cfg,
                         method_kwargs={"maps": completion_maps(model, cfg)})
    if name == "completion_offload":   # every mid page fetched: exact attention over offloaded KV
        from macattn.methods.completion.offload import OffloadConfig

        cfg = CompletionConfig(n_sink=4, n_tail=8, top_k=64, feature_dim=16, hidden=32, selector="quest", page_size=8)
        off = OffloadConfig(hot_pages=8, max_generated=NEW, max_prefill=64, prefetch="none")
        return LLMEngine(model, None, rc, method=name, method_config=cfg,
                         method_kwargs={"maps": completion_maps(model, cfg), "offload": off})
    return LLMEngine(model, None, rc, method=name)


def _reference(model, p: torch.Tensor) -> list[int]:
    ids, out = p[None], []
    with torch.no_grad():
        for _ in range(NEW):
            out.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], 1)
    return out


def test_the_registry_lists_every_method_once_with_its_declarations():
    assert set(METHODS) == {"full", "mac", "completion", "completion_offload", "mka", "a3"}
    assert set(ATTENTION_METHODS) == {"full", "mac", "completion", "completion_offload"}
    for name, cls in METHODS.items():
        assert cls.name == name and isinstance(cls.capabilities.paged_kv, bool)
        assert cls.config_type() is not None          # every config has usable defaults
    with pytest.raises(ValueError, match="method must be one of"):
        LLMEngine(tiny_model(), None, RuntimeConfig(max_batch_size=1, max_seq_len=64), method="a3")


@pytest.mark.parametrize("name", ATTENTION_METHODS)
def test_every_method_equals_the_reference_through_the_engine(name):
    ps = prompts(5, seed=21, lo=24, hi=48)              # 5 requests through 2 slots: slots are reused
    engine = _exact_engine(name, tiny_model("llama", seed=4))
    ids = [engine.add_request(p, max_new_tokens=NEW) for p in ps]
    engine.run_to_completion()
    got = [engine.pop_finished(i).output for i in ids]
    plain = tiny_model("llama", seed=4)
    assert got == [_reference(plain, p) for p in ps]
    assert engine.method.name == name and engine.slot_states.num_free == 2


def test_register_adds_a_method_every_surface_builds_by_name(monkeypatch):
    """``registry.register``: a method defined outside the package (a benchmark's peer) is built by name by
    the engine (and by every tensor-parallel rank, whose process imports the registering module); one
    name, one class."""
    from macattn.methods import registry
    from macattn.methods.full.backend import FullAttention

    monkeypatch.setattr(registry, "METHODS", dict(registry.METHODS))
    monkeypatch.setattr(registry, "ATTENTION_METHODS", registry.ATTENTION_METHODS)

    class Mine(FullAttention):
        name = "mine"

    class Other(FullAttention):
        name = "mine"

    assert registry.register(Mine) is Mine and registry.register(Mine) is Mine      # idempotent
    assert registry.method_class("mine") is Mine and registry.ATTENTION_METHODS.count("mine") == 1
    with pytest.raises(ValueError, match="method name 'mine' is already registered to Mine"):
        registry.register(Other)
    p = prompts(1, seed=3, lo=20, hi=30)[0]
    engine = LLMEngine(tiny_model("llama", seed=4), None, RuntimeConfig(max_batch_size=1, max_seq_len=64),
                       method="mine")
    rid = engine.add_request(p, max_new_tokens=NEW)
    engine.run_to_completion()
    assert type(engine.method) is Mine
    assert engine.pop_finished(rid).output == _reference(tiny_model("llama", seed=4), p)
