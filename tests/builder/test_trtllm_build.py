"""CPU tests of macattn-trtllm-build: argument split, config -> plugin fields, patch targets, import guard."""
import importlib.util
import json
import math
import shutil
import subprocess
import sys

import pytest

from macattn.builder import trtllm_build as tb
from macattn.methods.mac.config import MacConfig
from macattn.plugins.mac import attend_plugin
from macattn.plugins.mac import match_plugin

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def test_split_args_ours_vs_passthrough():
    argv = ["--checkpoint_dir", "ck", "--plugin", "mac", "--tau=0.4", "--output_dir", "out", "--band", "8",
            "--max_batch_size=4", "--window", "16", "--tau", "0.5", "--per-layer=cfg.json", "--gpt_attention_plugin",
            "auto", "--", "--band", "3"]
    ours, rest = tb.split_args(argv)
    assert ours == ["--plugin", "mac", "--tau=0.4", "--band", "8", "--window", "16", "--tau", "0.5",
                    "--per-layer=cfg.json"]
    assert rest == ["--checkpoint_dir", "ck", "--output_dir", "out", "--max_batch_size=4",
                    "--gpt_attention_plugin", "auto", "--band", "3"]
    args = tb.build_parser().parse_args(ours)
    assert args.tau == 0.5 and args.band == 8 and args.window == 16 and args.per_layer == "cfg.json"


def test_split_args_missing_value():
    with pytest.raises(ValueError, match="--tau"):
        tb.split_args(["--plugin", "mac", "--tau", "--output_dir", "x"])
    with pytest.raises(ValueError, match="--window"):
        tb.split_args(["--window"])


def test_plugin_fields_match_plugin_attributes(tmp_path):
    cfg = MacConfig(window=32, band=4, tau=0.3, layer_overrides={1: {"tau": 0.6, "band": 2}, 2: {"enabled": False}})
    fields = tb.layer_plugin_fields(cfg, num_layers=3, head_dim=64)
    assert fields[0] == {"mac_py::match": {"band": 4, "tau": 0.3}, "mac_py::attend": {"band": 4, "scale": 0.125}}
    assert fields[1]["mac_py::match"] == {"band": 2, "tau": 0.6}
    assert fields[2] is None
    # The attribute names/values are accepted by the plugin definitions' own validation.
    match_plugin._check_attrs(**fields[1]["mac_py::match"])
    attend_plugin._check_attrs(**fields[1]["mac_py::attend"])
    assert set(fields[0]) == {match_plugin.PLUGIN_ID, attend_plugin.PLUGIN_ID}
    with pytest.raises(ValueError, match="head_dim"):
        tb.plugin_fields(cfg, 0)
    with pytest.raises(ValueError, match="num_layers"):
        tb.layer_plugin_fields(cfg, 0, 64)


def test_mac_config_flags_override_per_layer_json(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(MacConfig(window=8, band=2, tau=0.2, layer_overrides={0: {"band": 1}}).to_dict()))
    args = tb.build_parser().parse_args(["--plugin", "mac", "--per-layer", str(path), "--tau", "0.7"])
    cfg = tb.mac_config(args)
    assert (cfg.window, cfg.band, cfg.tau) == (8, 2, 0.7)
    assert cfg.for_layer(0).band == 1 and math.isclose(cfg.for_layer(0).tau, 0.7)
    with pytest.raises(ValueError, match="tau"):
        tb.mac_config(tb.build_parser().parse_args(["--plugin", "mac", "--tau", "1.5"]))


def test_patch_targets():
    t = tb.patch_targets(["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
    assert t["LlamaForCausalLM"][1:] == ("LLaMAForCausalLM", "LLaMADecoderLayer")
    assert t["MistralForCausalLM"] == t["LlamaForCausalLM"]
    assert t["Qwen2ForCausalLM"][1:] == ("QWenForCausalLM", "QWenDecoderLayer")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        tb.patch_targets(["GPT2LMHeadModel"])


def _cli():
    exe = shutil.which("macattn-trtllm-build")
    return [exe] if exe else [sys.executable, "-m", "macattn.builder.trtllm_build"]


def test_help_without_trtllm():
    r = subprocess.run([*_cli(), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--plugin", "--tau", "--window", "--band", "--per-layer", "passed through"):
        assert flag in r.stdout


@pytest.mark.skipif(HAVE_TRTLLM, reason="tensorrt_llm is installed; the missing-package path cannot be taken")
def test_missing_trtllm_exit_code():
    r = subprocess.run([*_cli(), "--plugin", "mac", "--tau", "0.5", "--checkpoint_dir", "ck", "--max_batch_size", "4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "tensorrt_llm" in r.stderr and "tensorrt-llm" in r.stderr and "package index" in r.stderr
    bad = subprocess.run([*_cli(), "--plugin", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--plugin" in bad.stderr


def test_passthrough_workers():
    assert tb._passthrough(["--checkpoint_dir", "c"], "--workers") is None
    assert tb._passthrough(["--workers", "2", "--workers=3"], "--workers") == 3
    r = subprocess.run([*_cli(), "--plugin", "mac", "--workers", "4"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--workers" in r.stderr


def test_passthrough_max_batch_required():
    assert tb._passthrough(["--checkpoint_dir", "c"], "--max_batch_size") is None
    assert tb._passthrough(["--max_batch_size", "8", "--max_batch_size=16"], "--max_batch_size") == 16
    r = subprocess.run([*_cli(), "--plugin", "mac", "--checkpoint_dir", "ck"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--max_batch_size" in r.stderr


def test_t4_pipeline_parallel_checkpoint_is_refused(tmp_path, capsys):
    """T4: the patched Attention sees a stage-local layer index; a pp_size > 1 checkpoint is refused by name."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"mapping": {"world_size": 2, "tp_size": 1, "pp_size": 2}}')
    assert tb.checkpoint_pp_size(str(ck)) == 2
    assert tb.checkpoint_pp_size(None) == 1
    assert tb.main(["--plugin", "mac", "--max_batch_size", "4", "--checkpoint_dir", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "pp_size = 2" in err and "accepted: pp_size 1" in err
    (ck / "config.json").write_text('{"mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}}')
    assert tb.checkpoint_pp_size(str(ck)) == 1


def test_t10_trtllm_engine_backend_is_version_gated(monkeypatch, capsys):
    """TensorRT-LLM's main branch removed trtllm-build (July 2026); 1.2.x still has it."""
    import types

    monkeypatch.setitem(sys.modules, "tensorrt_llm", types.SimpleNamespace(__version__="1.3.0rc1"))
    with pytest.raises(ImportError, match=r"removed after 1\.2\.x; found tensorrt_llm 1\.3\.0rc1"):
        tb.require_trtllm_engine_backend()
    assert tb.main(["--plugin", "mac", "--max_batch_size", "4", "--checkpoint_dir", "ck"]) == 2
    assert "tensorrt_llm < 1.3" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tensorrt_llm", types.SimpleNamespace(__version__="1.2.0"))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.commands", None)
    with pytest.raises(ImportError, match=r"no tensorrt_llm.commands.build"):
        tb.require_trtllm_engine_backend()


def test_t7_beam_search_is_refused(capsys):
    assert tb.main(["--plugin", "mac", "--max_batch_size", "4", "--max_beam_width", "2"]) == 2
    assert "--max_beam_width 2 is not supported" in capsys.readouterr().err
