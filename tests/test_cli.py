"""The ``macattn`` command line: help loads no framework, one name for the built-in model in every command that
takes ``--model``, ``macattn generate``'s first screen without warnings, the supported transformers range,
the main job's progress bars."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from macattn.cli import _engine_args, build_parser, command_parsers, main
from macattn.models.names import BUILTIN_MODEL, BUILTIN_NAMES
from macattn.models.transformers_api import SUPPORTED_TRANSFORMERS, check_transformers_version

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "python")}     # this checkout's package in the child processes
HEAVY = ("torch", "transformers", "triton", "fastapi", "uvicorn", "onnx", "onnxruntime", "tensorrt")
MODEL_COMMANDS = {"generate", "build", "serve", "tune", "eval", "recurrence", "finetune-mka", "distill-completion"}
REQUIRED = {"build": ["--out", "x"], "finetune-mka": ["--out", "x"], "distill-completion": ["--out", "x"]}


def test_help_imports_no_framework():
    """Building the parser and ``--help`` of the program and of every command, in a fresh process."""
    code = f"""
import sys
from macattn.cli import build_parser, command_parsers, main
heavy = lambda: sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))
commands = list(command_parsers(build_parser()))
after_parser = heavy()
for argv in [['--help'], *([c, '--help'] for c in commands)]:
    try:
        main(argv)
    except SystemExit:
        pass
print('HEAVY', after_parser, heavy(), len(commands))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last == f"HEAVY [] [] {len(command_parsers())}", last


def test_every_model_flag_takes_every_builtin_name():
    parsers = command_parsers()
    with_model = {c for c, p in parsers.items() if any("--model" in a.option_strings for a in p._actions)}
    assert with_model == MODEL_COMMANDS
    for command in sorted(with_model):
        for name in BUILTIN_NAMES:
            args = build_parser().parse_args([command, "--model", name, *REQUIRED.get(command, [])])
            if command == "serve":
                assert _engine_args(args).is_builtin, name
            else:
                assert (args.model[0] if command == "recurrence" else args.model) == BUILTIN_MODEL, (command, name)


def test_an_unknown_model_is_named(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "nope"])
    err = capsys.readouterr().err
    assert "--model" in err and "'nope'" in err and BUILTIN_MODEL in err


def test_build_runs_the_packaged_checkpoint(monkeypatch, tmp_path):
    import macattn.builder.build as build
    from macattn.models.checkpoint import BUILTIN_CHECKPOINT_DIR

    seen = []
    monkeypatch.setattr(build, "build_engine_dir", lambda family, out, **kw: seen.append((family, kw["hf_dir"])))
    assert main(["build", "--model", "trained", "--out", str(tmp_path)]) == 0
    assert seen == [("llama", BUILTIN_CHECKPOINT_DIR)]
    for bad in (["--model", "builtin", "--tiny"], ["--model", "llama"]):
        with pytest.raises(SystemExit):
            main(["build", *bad, "--out", str(tmp_path)])


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_eval_tune_and_recurrence_load_the_packaged_checkpoint(name):
    from macattn.evaluation.harness import load_eval_model

    model, _encode, _hay, bos, _desc = load_eval_model(name)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 8 and bos == [0]


def _trainer_model(monkeypatch, tmp_path, module: str, function: str, report: dict, argv: list[str]):
    """The model a trainer command hands its training function (patched to return ``report`` at once)."""
    import importlib

    seen = []
    monkeypatch.setattr(importlib.import_module(module), function,
                        lambda model, *a, **kw: seen.append(model) or dict(report))
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n\n" * 40)
    assert main([*argv, "--model", "tiny-llama", "--corpus", str(corpus), "--out", str(tmp_path / "o")]) == 0
    [model] = seen
    return model


def test_trainers_take_the_packaged_checkpoint(monkeypatch, tmp_path):
    ppl = dict.fromkeys(("ppl_unmodified", "ppl_step0", "ppl_after", "loss_step0", "loss_after"), 0.0)
    for module, function, report, argv in (
            ("macattn.apps.finetune_mka", "finetune", ppl, ["finetune-mka"]),
            ("macattn.apps.distill_completion", "distill", {"losses": []}, ["distill-completion", "--features", "8",
                                                                            "--hidden", "8"])):
        model = _trainer_model(monkeypatch, tmp_path, module, function, report, argv)
        assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 8, module


def test_generate_first_screen_has_no_warning():
    """A fresh process, as a user runs it (an alias of the built-in model, few tokens): stdout is the table,
    stderr is empty (no deprecation, no tokenizer note, no loading bar; bars only on a terminal)."""
    r = subprocess.run([sys.executable, "-m", "macattn", "generate", "--model", "tiny-llama", "--context", "256",
                        "--tokens", "3"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == ""
    assert r.stdout.startswith(f"model{' ' * 33}{BUILTIN_MODEL}, the trained checkpoint")


def test_quiet_turns_the_progress_off(monkeypatch):
    import macattn.apps.generate as generate

    seen = []

    class Report:
        def table(self) -> str:
            return ""

    monkeypatch.setattr(generate, "run_generate", lambda **kw: seen.append(kw["progress"]) or Report())
    assert main(["generate", "--quiet"]) == 0 and main(["generate"]) == 0
    assert seen == [False, None]          # None: bars when stderr is a terminal


def test_progress_names_every_phase(capsys):
    from macattn.apps.generate import PHASES, run_generate

    run_generate(family="llama", context=64, new_tokens=3, progress=True)
    err = capsys.readouterr().err
    assert all(phase in err for phase in PHASES), err[-2000:]
    run_generate(family="llama", context=64, new_tokens=3, progress=False)
    assert capsys.readouterr().err == ""


def test_supported_transformers_is_pyprojects_and_checked_by_name():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers{SUPPORTED_TRANSFORMERS}" in deps
    check_transformers_version()                               # the installed release is supported
    for version in ("5.40.0", "6.0.0", "4.55.4"):
        with pytest.raises(RuntimeError, match=rf"transformers {version} is not supported.*{SUPPORTED_TRANSFORMERS}"):
            check_transformers_version(version)


def test_help_benchmark_reports_every_command(tmp_path):
    """``benchmarks/bench_cli_help.py`` (one run each, a loose budget on a shared machine): every command timed."""
    out = tmp_path / "help.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cli_help.py"), "--runs", "1",
                        "--budget", "5", "--json", str(out)], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report) == {"macattn --help", *(f"macattn {c} --help" for c in command_parsers())}
