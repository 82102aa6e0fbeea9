"""``EngineArgs``: one options object behind every surface. The same args build the same engine configuration
through ``LLM(**kwargs)``, ``macattn serve``'s flags, a Triton repository's ``engine_args`` parameter and
``ModelRunner.from_hf``; ``mac=None`` means MAC's defaults everywhere; the flags are generated from the
fields (with their docstrings and the old spellings); JSON round trip; bad values named."""
from __future__ import annotations

import argparse
import json

import pytest

from macattn.apps.llm import LLM
from macattn.cli import _engine_args, build_parser
from macattn.methods.mac.config import MacConfig
from macattn.models.checkpoint import load_builtin_checkpoint
from macattn.runtime.engine import LLMEngine
from macattn.runtime.engine_args import EngineArgs
from macattn.runtime.model_runner import ModelRunner


def _signature(engine) -> tuple:
    return engine.config, engine.method.name, engine.method.config


KW = dict(max_batch_size=3, max_seq_len=96, block_size=8, mac_tau=0.4, mac_window=32, mac_band=8,
          mac_min_context=40, max_num_batched_tokens=40)
FLAGS = ["--max-batch-size", "3", "--max-seq-len", "96", "--block-size", "8", "--tau", "0.4", "--window", "32",
         "--band", "8", "--min-context", "40", "--max-num-batched-tokens", "40"]


def test_every_surface_builds_the_same_engine(tmp_path):
    args = EngineArgs(**KW)
    want = _signature(args.build_engine())
    with LLM("builtin", **KW) as llm:
        assert _signature(llm.engine) == want and llm.args == args
    parsed = build_parser().parse_args(["serve", "--model", "builtin", *FLAGS])
    assert _engine_args(parsed) == args
    assert _signature(EngineArgs.from_json(args.to_json()).build_engine()) == want     # a Triton repo's parameter
    runner = ModelRunner.from_hf(load_builtin_checkpoint()[0], args.mac_config(), max_batch_size=3, max_seq_len=96,
                                 block_size=8, max_num_batched_tokens=40)
    assert _signature(runner.engine) == want


def test_none_means_macs_defaults_on_every_surface():
    default = MacConfig()
    assert EngineArgs().mac_config() == default
    with LLM("builtin", max_batch_size=1, max_seq_len=64) as llm:
        assert llm.engine.method.config == default
    model = load_builtin_checkpoint()[0]
    assert LLMEngine(model, None).method.config == default
    assert ModelRunner.from_hf(load_builtin_checkpoint()[0], None, max_batch_size=1).engine.method.config == default
    assert EngineArgs(mac="off").mac_config() == MacConfig(enabled=False)
    assert EngineArgs(mac="on").mac_config() == EngineArgs().mac_config() == MacConfig()


def test_cuda_graphs_default_follows_the_device():
    assert EngineArgs().runtime_config().use_cuda_graphs is False
    assert EngineArgs(device="cuda").runtime_config().use_cuda_graphs is True
    assert EngineArgs(device="cuda", use_cuda_graphs=False).runtime_config().use_cuda_graphs is False


def test_flags_are_generated_from_the_fields_with_their_docstrings():
    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    text = p.format_help()
    assert "token budget of one engine step" in text and "--max-num-batched-tokens" in text
    a = p.parse_args(["--tp", "2", "--per-layer", "x.json", "--no-use-cuda-graphs", "--max-model-len", "77"])
    assert (a.tensor_parallel_size, a.mac, a.use_cuda_graphs, a.max_seq_len) == (2, "x.json", False, 77)
    assert EngineArgs.from_cli_args(p.parse_args([])) == EngineArgs()


def test_json_round_trip_and_bad_values_are_named():
    args = EngineArgs(mac=MacConfig(window=8, band=2).with_overrides({1: {"tau": 0.5}}).to_dict(), device="cpu",
                      max_batch_size=2, dtype="bfloat16")
    assert EngineArgs.from_json(args.to_json()) == args
    with pytest.raises(ValueError, match=r"unknown engine args \['nope'\]"):
        EngineArgs.from_json(json.dumps({"nope": 1}))
    with pytest.raises(TypeError, match="unexpected engine argument"):
        LLM("builtin", max_tokens_per_step=3)
    with pytest.raises(TypeError, match="max_batch_size must be int"):
        EngineArgs(max_batch_size="4")
    with pytest.raises(TypeError, match="max_batch_size must be int"):
        EngineArgs(max_batch_size=True)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(dtype="int8")
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineArgs(max_batch_size=0)
    with pytest.raises(ValueError, match="mac_tau / mac_window / mac_band / mac_min_context configure MAC"):
        EngineArgs(method="full", mac_tau=0.5)
    with pytest.raises(ValueError, match="min_context must be"):
        EngineArgs(mac_min_context=-1)
    with pytest.raises(ValueError, match="kv_offload is retrieval-completion's option"):
        EngineArgs(kv_offload="host")
    with pytest.raises(ValueError, match="not 'nowhere'|nothing is downloaded"):
        EngineArgs(model="nowhere").load_model()
