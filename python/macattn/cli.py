"""``macattn`` command line: ``macattn generate`` (the main job) and the project's other tools.

Every command's flags are defined here, from modules that load no framework, so ``macattn --help`` and
``macattn COMMAND --help`` answer at once; a command imports what it runs (torch, transformers, the servers)
only when it runs. ``--model`` takes the built-in trained checkpoint as ``builtin`` (or any of its aliases,
``macattn.models.names.BUILTIN_NAMES``) in every command that has the flag.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

from macattn.apps.configs import THRESHOLD_MODES, DistillConfig, FinetuneConfig, LossConfig
from macattn.evaluation.samples import PRESETS
from macattn.evaluation.tasks import TASKS
from macattn.methods.mac.flags import add_mac_flags, mac_config_from_args
from macattn.models.names import BUILTIN_MODEL, BUILTIN_NAMES, FAMILIES, canonical_model
from macattn.runtime.engine_args import EngineArgs

__all__ = ["main", "build_parser", "command_parsers", "add_model_flag"]

Flag = tuple[str, dict]
"""One command-line flag: ``(option string, keyword arguments of ArgumentParser.add_argument)``."""

_ALIASES_HELP = f"'{BUILTIN_MODEL}' (the packaged trained checkpoint; also {', '.join(map(repr, BUILTIN_NAMES[1:]))})"


def add_model_flag(p: argparse.ArgumentParser, *, families: bool = False, others: Sequence[str] = (),
                   directories: bool = False, note: str = "", **kw) -> None:
    """``--model`` of a command: ``builtin`` (any of ``BUILTIN_NAMES``, parsed as ``BUILTIN_MODEL``), plus the
    random-weight built-in ``FAMILIES`` when ``families``, the names ``others``, and transformers model
    directories when ``directories`` (then any value passes the parser: the command checks the directory).
    ``note`` follows the generated help text; ``kw`` (default, nargs, ...) goes to ``add_argument``."""
    choices = None if directories else (BUILTIN_MODEL, *(FAMILIES if families else ()), *others)
    what = [_ALIASES_HELP]
    if families:
        what.append(f"a random-weight built-in family ({', '.join(FAMILIES)})")
    what += [repr(o) for o in others]
    if directories:
        what.append("a transformers model directory")
    text = f"{', '.join(what[:-1])} or {what[-1]}" if len(what) > 1 else what[0]
    p.add_argument("--model", type=canonical_model, choices=choices, metavar="MODEL",
                   help=f"{text}{'; ' + note if note else ''}", **kw)


def _run(module: str) -> Callable[[argparse.Namespace], int]:
    """The handler of a command whose code is ``module.run_command(args)``, imported when the command runs."""
    def handler(args: argparse.Namespace) -> int:
        return importlib.import_module(module).run_command(args)

    return handler


def _cmd_generate(args) -> int:
    from macattn.apps.generate import run_generate

    report = run_generate(family=args.model, context=args.context, new_tokens=args.tokens,
                          mac=mac_config_from_args(args), seed=args.seed, json_path=args.json,
                          progress=False if args.quiet else None)
    print(report.table())
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _cmd_triton_repo(args) -> int:
    from macattn.apps.serving.triton_repo import write_model_repository

    eargs = EngineArgs.from_cli_args(args, **({"method": "completion"} if args.completion else {}))
    dirs = write_model_repository(args.engine, args.out, engine_args=eargs, name=args.name,
                                  torch_num_threads=args.torch_threads,
                                  sys_path=(args.sys_path.split(":") if args.sys_path else None),
                                  sync_model=not args.no_sync_model, tokenizer_dir=args.tokenizer_dir)
    for d in dirs:
        print(f"wrote {d}")
    if not any(d.name == "ensemble" for d in dirs):
        print("no tokenizer in the engine's hf/ and no --tokenizer-dir: token-id models only (no text ensemble)")
    print(f"serve with: macattn serve --repo {args.out}  (the nvidia-pytriton wheel's tritonserver; or any "
          f"tritonserver with the Python backend: --model-repository={args.out})")
    return 0


def _cmd_serve(args) -> int:
    if (args.repo is None) == (args.model is None):
        raise ValueError("give exactly one of --repo (Triton model repository) and --model (OpenAI-compatible server)")
    if args.model is not None:
        return _serve_openai(args)
    given = [f for f in vars(_engine_args(args)) if getattr(args, f, None) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')}: a model repository carries its engine arguments "
                         "(macattn triton-repo ...); engine flags here apply to --model")
    import signal
    import threading

    from macattn.apps.serving.triton_server import serve

    stop = threading.Event()             # SIGTERM (systemd, Kubernetes, docker stop) as well as Ctrl-C
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with serve(args.repo, args.workdir, http_port=args.http_port, grpc_port=args.grpc_port,
               metrics_port=args.metrics_port, address=args.address) as running:
        print(f"tritonserver ready: HTTP {running.http_url}, gRPC {running.grpc_url}, metrics "
              f"{running.metrics_url}/metrics (log {running.log_path}); Ctrl-C or SIGTERM stops it", flush=True)
        while running.process.poll() is None and not stop.wait(0.5):
            pass
    return 0


def _engine_args(args):
    """``EngineArgs`` of ``macattn serve --model``'s flags (``--no-mac`` = ``--mac off``)."""
    if args.no_mac and args.mac is not None:
        raise ValueError("give at most one of --no-mac and --mac / --per-layer")
    return EngineArgs.from_cli_args(args, **({"mac": "off"} if args.no_mac else {}))


SERVE_EXTRA_HINT = 'pip install -e ".[serve]"  (or: pip install "macattn[serve]")'


def _serve_modules():
    """uvicorn, after checking the OpenAI server's packages (the ``[serve]`` extra) are installed: a
    missing one ends the command with a message naming the install line, not a traceback."""
    import importlib

    missing = []
    for name in ("uvicorn", "fastapi", "prometheus_client"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(f"macattn serve --model: the OpenAI server needs {', '.join(missing)} (the [serve] extra), "
                         f"not installed here: {SERVE_EXTRA_HINT}")
    return importlib.import_module("uvicorn")


def _serve_openai(args) -> int:
    import asyncio
    import signal

    uvicorn = _serve_modules()

    from macattn.apps.llm import LLM
    from macattn.apps.serving.openai_server import build_app, server_config

    eargs = _engine_args(args)
    kwargs = {k: v for k, v in vars(eargs).items() if k != "model"}
    with LLM(eargs.model, **kwargs) as llm:
        name = args.served_model_name or (BUILTIN_MODEL if eargs.is_builtin else str(eargs.model))
        server = uvicorn.Server(server_config(build_app(llm, name), args.address, args.http_port,
                                              grace_period=args.grace_period,
                                              timeout_keep_alive=args.timeout_keep_alive,
                                              limit_concurrency=args.limit_concurrency))

        async def run() -> None:
            task = asyncio.create_task(server.serve())
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started:
                sock = server.servers[0].sockets[0].getsockname() if server.servers else (args.address, args.http_port)
                print(f"macattn serve: model {name!r} ready on http://{sock[0]}:{sock[1]}/v1 "
                      f"({eargs.method}, {eargs.device}); Ctrl-C or SIGTERM stops it", flush=True)
            await task

        # uvicorn stops on SIGINT / SIGTERM (no new connections, in-flight requests get the grace period),
        # then re-raises the signal under the handlers it found: these swallow it, so the exit status is 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        asyncio.run(run())
    return 0


def _cmd_build(args) -> int:
    from macattn.builder.build import build_engine_dir

    family, hf_dir = args.model, args.from_dir
    if family == BUILTIN_MODEL:
        if args.tiny or hf_dir is not None:
            raise ValueError(f"--model {BUILTIN_MODEL} is the packaged checkpoint: give neither --from nor --tiny")
        from macattn.models.checkpoint import BUILTIN_CHECKPOINT_DIR

        family, hf_dir = "llama", BUILTIN_CHECKPOINT_DIR       # a LlamaForCausalLM (build checks the class)
    elif args.tiny == (hf_dir is not None):
        raise ValueError(f"--model {family}: give exactly one of --from HF_DIR and --tiny")
    build_engine_dir(family, args.out, mac=mac_config_from_args(args), hf_dir=hf_dir,
                     tiny=args.tiny, seed=args.seed, progress=not args.no_progress, max_batch=args.max_batch,
                     max_context=args.max_context, dtype=args.dtype)
    print(f"wrote {args.out}/manifest.json, {args.out}/hf/, {args.out}/decode.onnx, {args.out}/prefill.onnx")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``macattn`` parser: every command and its flags (no framework imported)."""
    parser = argparse.ArgumentParser(prog="macattn", description="macattn generate (the main job; the default "
                                     "command) and the project's other tools; macattn COMMAND --help for each")
    sub = parser.add_subparsers(dest="command", required=False)

    gen = sub.add_parser("generate", help="decode a long prompt with full attention and with MAC on the CPU")
    add_model_flag(gen, families=True, default=BUILTIN_MODEL,
                   note="the families run a repetitive token prompt (every architecture, no language)")
    gen.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    gen.add_argument("--tokens", type=int, default=64, help="tokens to decode")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", default=None, help="write the statistics to this JSON file")
    gen.add_argument("--quiet", action="store_true",
                     help="no progress bars (they show on stderr only when it is a terminal)")
    add_mac_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    build = sub.add_parser("build", help="export the patched model to ONNX (+ TensorRT engine where available)")
    add_model_flag(build, families=True, required=True,
                   note=f"a family takes --from (its trained weights) or --tiny; {BUILTIN_MODEL} takes neither")
    src = build.add_mutually_exclusive_group()
    src.add_argument("--from", dest="from_dir", default=None, help="transformers model directory (save_pretrained)")
    src.add_argument("--tiny", action="store_true", help="use the built-in tiny model (no download)")
    build.add_argument("--out", required=True, help="engine directory to write")
    build.add_argument("--seed", type=int, default=0, help="weight seed of --tiny")
    build.add_argument("--max-batch", type=int, default=8, help="TensorRT profile: largest batch")
    build.add_argument("--max-context", type=int, default=None, help="TensorRT profile: longest context")
    build.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                       help="model dtype of the exported graphs (default bf16: the TensorRT plugins' dtype; TensorRT "
                            "builds strongly typed)")
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_mac_flags(build)
    build.set_defaults(func=_cmd_build)

    tri = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository for an engine dir")
    tri.add_argument("--engine", required=True, help="engine directory (manifest.json + hf/)")
    tri.add_argument("--out", required=True, help="model repository directory to write")
    tri.add_argument("--name", default="macattn", help="model name (a NAME_sync non-decoupled twin is added)")
    tri.add_argument("--torch-threads", type=int, default=0, help="torch threads in the server (0 = default)")
    tri.add_argument("--sys-path", default=None,
                     help="':'-separated site-packages for model.py (default: this interpreter's)")
    tri.add_argument("--no-sync-model", action="store_true", help="write only the decoupled streaming model")
    tri.add_argument("--completion", action="store_true", help="retrieval-completion instead of MAC (= --method completion)")
    tri.add_argument("--tokenizer-dir", default=None,
                     help="tokenizer for the text ensemble (default: the engine's hf/ when it holds one)")
    EngineArgs.add_cli_args(tri, skip=("model", "tokenizer"))   # the engine the models run (model: the engine's hf/)
    tri.set_defaults(func=_cmd_triton_repo)

    srv = sub.add_parser("serve", help="--model: an OpenAI-compatible server (FastAPI + uvicorn); --repo: a model "
                                       "repository with the tritonserver of the nvidia-pytriton wheel")
    srv.add_argument("--repo", default=None, help="model repository (from macattn triton-repo)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    srv.add_argument("--no-mac", action="store_true", help="MAC off (= --mac off; OpenAI server)")
    EngineArgs.add_cli_args(srv)      # --model and every engine flag (OpenAI server; a --repo carries its own)
    srv.add_argument("--grace-period", type=int, default=10, help="seconds in-flight requests get on SIGTERM")
    srv.add_argument("--timeout-keep-alive", type=int, default=5,
                     help="seconds a connection may take to send a request head, and stay idle after a response "
                          "(OpenAI server)")
    srv.add_argument("--limit-concurrency", type=int, default=None,
                     help="most connections / requests at once; more get a 503 (OpenAI server; default: no cap)")
    srv.add_argument("--workdir", default=".tritonserver", help="where the backends copy and the log go")
    srv.add_argument("--address", "--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--http-port", "--port", type=int, default=8000, help="HTTP port; 0 picks a free port")
    srv.add_argument("--grpc-port", type=int, default=8001, help="0 picks a free port")
    srv.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics (Triton); 0 picks a free port")
    srv.set_defaults(func=_cmd_serve)

    _add_tune(sub)
    _add_eval(sub)
    _add_recurrence(sub)
    _add_finetune_mka(sub)
    _add_distill_completion(sub)
    return parser


def command_parsers(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """``{command: its parser}`` of every ``macattn`` command (of ``parser``, default ``build_parser()``)."""
    parser = parser or build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _add_tune(sub) -> None:
    """``macattn tune`` (``macattn.apps.tune``)."""
    p = sub.add_parser("tune", help="choose per-layer MAC tau, K, r (and calibrated thresholds) maximising KV skip "
                                    "under an agreement target (--min-agreement) or an error budget")
    add_model_flag(p, others=("random",), directories=True, default=BUILTIN_MODEL,
                   note="'random': the random-weight built-in llama")
    p.add_argument("--taus", default="0.3,0.45,0.6,0.75")
    p.add_argument("--windows", default="512,1024,2048")
    p.add_argument("--bands", default="64,128,256")
    p.add_argument("--max-error", "--error-budget", dest="error_budget", default=None,
                   help="per-layer mean attention-output rel. error bound (> 0); without --min-agreement "
                        "'default' (also the default when absent): the global default's own per-layer error")
    p.add_argument("--min-agreement", type=float, default=None,
                   help="quality first: the most KV skip whose greedy agreement with full attention is at least "
                        "this (in (0, 1]) on calibration and held-out prompts")
    p.add_argument("--thresholds", choices=THRESHOLD_MODES, default="paper",
                   help="threshold rules tried: the paper's sqrt(2d)(1-tau), the calibrated one (per-head query "
                        "scale from the calibration prompts) or both")
    p.add_argument("--levels", type=int, default=8, help="per-layer error levels explored (--min-agreement)")
    p.add_argument("--verify", type=int, default=3, help="feasible configs checked on held-out prompts at most")
    p.add_argument("--plot", default=None, help="frontier PNG (default: OUT_frontier.png next to --out)")
    p.add_argument("--device", default="cpu", help="torch device of the model (e.g. cuda)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--lengths", default="4096", help="calibration prompt lengths")
    p.add_argument("--n", type=int, default=2, help="calibration (and held-out) prompts per length")
    p.add_argument("--gen", type=int, default=32, help="teacher-forced decode steps per prompt")
    p.add_argument("--tau", type=float, default=0.45, help="global default tau (compared against)")
    p.add_argument("--window", type=int, default=1024, help="global default K")
    p.add_argument("--band", type=int, default=256, help="global default r")
    p.add_argument("--haystack", default=None, help=".npy of token ids or a text file for the haystack")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="mac_per_layer.json", help="MacConfig JSON to write")
    p.add_argument("--report", default=None, help="also write the search statistics here (JSON)")
    c = p.add_argument_group("retrieval-completion's per-layer gate (--completion)")
    c.add_argument("--completion", action="store_true",
                   help="tune retrieval-completion's gate instead of MAC: the term's mass calibrated per layer and head "
                        "on what the Top-k leaves at --budget, the term kept only in the layers where it then lowers "
                        "the error against full attention and keeps Top-k alone's greedy agreement (writes a gate JSON "
                        "to --out)")
    c.add_argument("--feature-maps", default=None, help="distilled completion feature maps (macattn distill-completion)")
    c.add_argument("--budget", type=float, default=0.02, help="KV reads per step as a share of the prompt, in (0, 1]")
    c.add_argument("--n-sink", type=int, default=4)
    c.add_argument("--n-tail", type=int, default=16)
    c.add_argument("--selector", choices=("exact", "pages"), default="exact", help="Top-k selector")
    c.add_argument("--page-size", type=int, default=16)
    c.add_argument("--page-overfetch", type=int, default=2)
    c.add_argument("--no-mass-calibration", action="store_true",
                   help="keep the maps' own mass (no per-head log_mass in the gate)")
    c.add_argument("--no-agreement-check", action="store_true",
                   help="choose the layers on the error alone (no whole-model agreement check)")
    p.set_defaults(func=_run("macattn.apps.tune"))


def _add_eval(sub) -> None:
    """``macattn eval`` (``macattn.evaluation.harness``)."""
    p = sub.add_parser("eval", help="RULER-style long-context accuracy and fidelity of MAC vs full attention")
    add_model_flag(p, others=("random",), directories=True, default=BUILTIN_MODEL,
                   note="'random': the random-weight built-in llama")
    p.add_argument("--preset", choices=tuple(PRESETS), default="quick",
                   help="quick: 4K, 1 sample/task, 32 steps (~4 min, 2 cores); "
                        "full: 4K-16K, 4 samples/task, 128 steps (1-2 h)")
    p.add_argument("--lengths", default=None, help="comma-separated sample lengths (overrides the preset)")
    p.add_argument("--tasks", default=None, help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--n", type=int, default=None, help="samples per task and length")
    p.add_argument("--gen", type=int, default=None, help="teacher-forced decode steps per sample")
    p.add_argument("--taus", default=None, help="MAC thresholds to evaluate (comma-separated)")
    p.add_argument("--window", type=int, default=1024, help="MAC ring capacity K")
    p.add_argument("--band", type=int, default=256, help="MAC band r")
    p.add_argument("--bands", default=None, help="band sweep (error vs r) values; '' disables")
    p.add_argument("--band-sweep-tau", type=float, default=0.45)
    p.add_argument("--no-completion", dest="completion", action="store_false",
                   help="skip MAC+completion-on-miss and retrieval-completion")
    p.add_argument("--completion-tau", type=float, default=0.45, help="tau of MAC with completion on a miss")
    p.add_argument("--n-sink", type=int, default=16)
    p.add_argument("--n-tail", type=int, default=64)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--feature-dim", type=int, default=64, help="features F of untrained completion maps")
    p.add_argument("--feature-maps", default=None, help="trained completion feature maps (macattn distill-completion)")
    p.add_argument("--per-layer", default=None, help="also evaluate this MacConfig JSON (from macattn tune)")
    p.add_argument("--a3-rhos", default=None, help="A3 recompute ratios to evaluate (comma-separated; '' none; "
                                                   "default: the preset's)")
    p.add_argument("--a3-chunk", type=int, default=512, help="A3: document chunk length in tokens")
    p.add_argument("--a3-question", type=int, default=64, help="A3: the prompt's last tokens taken as the question")
    p.add_argument("--haystack", default=None, help=".npy of token ids or a text file for the haystack")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="eval.json", help="JSON to write; PNGs go next to it")
    p.add_argument("--device", default="cpu", help="torch device of the model and the reference MAC (e.g. cuda)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--long-gen", action="store_true",
                   help="long continuous generation instead: each method generates --long-gen-tokens tokens "
                        "free-running from the sample's document, then answers its question (first divergence "
                        "from full attention, accuracy at the end, per-layer hit / skip over time)")
    p.add_argument("--long-gen-tokens", type=int, default=4096, help="free-running tokens before the question")
    p.add_argument("--bins", type=int, default=32, help="--long-gen: time bins of the hit / skip summary")
    p.add_argument("--two-stage", action="store_true", help="--long-gen: also MAC's two-stage match (fp8, c=4)")
    p.add_argument("--no-uniform", action="store_true",
                   help="--long-gen: no uniform-tau MAC runs (only --two-stage / --per-layer; one method per "
                        "process, merged with --long-gen-merge)")
    p.add_argument("--long-gen-merge", nargs="+", default=None, metavar="JSON",
                   help="merge --long-gen results of one model and settings into --out (JSON + PNG)")
    p.set_defaults(func=_run("macattn.evaluation.harness"))


def _add_recurrence(sub) -> None:
    """``macattn recurrence`` (``macattn.evaluation.recurrence``)."""
    p = sub.add_parser("recurrence", help="oracle MAC hit rate / skip per layer from one forward per prompt "
                                          "(threshold and window sweeps, several checkpoints)")
    add_model_flag(p, others=("random",), directories=True, nargs="+", default=[BUILTIN_MODEL],
                   note="each one line in the table and the plot")
    p.add_argument("--lengths", default="4096", help="prompt lengths (comma-separated)")
    p.add_argument("--tasks", default="niah_single,niah_multikey,vt,cwe", help="RULER-style tasks of the prompts")
    p.add_argument("--n", type=int, default=2, help="prompts per task and length")
    p.add_argument("--taus", default="0.3,0.45,0.6,0.75")
    p.add_argument("--windows", default="256,1024,4096")
    p.add_argument("--band", type=int, default=256)
    p.add_argument("--positions", type=int, default=512, help="final tokens of each prompt that are scored")
    p.add_argument("--plot-tau", type=float, default=0.45)
    p.add_argument("--plot-window", type=int, default=1024)
    p.add_argument("--haystack", default=None, help="text file or .npy of ids (default: the checkpoint's heldout.txt)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--out", default="recurrence.json", help="JSON to write; the PNG goes next to it")
    p.set_defaults(func=_run("macattn.evaluation.recurrence"))


def _add_finetune_mka(sub) -> None:
    """``macattn finetune-mka`` (``macattn.apps.finetune_mka``)."""
    p = sub.add_parser("finetune-mka", help="train the FastMKA routing weights of a model (only those), report perplexity")
    cfg = FinetuneConfig()
    add_trainer_args(
        p, cfg, out_help="checkpoint directory",
        source=("--from", dict(dest="from_dir", default=None,
                               help="transformers model directory instead of the built-in")),
        optim=[("--eval-batches", dict(type=int, default=cfg.eval_batches))],
        extra=[("--dtype", dict(choices=("bf16", "fp32"), default=cfg.dtype)),
               ("--summary", dict(choices=("mean", "ema"), default="mean")),
               ("--ema-beta", dict(type=float, default=0.9)),
               ("--router-hidden", dict(type=int, default=64)),
               ("--l3", dict(action="store_true", help="enable L3 hashed chunk recall"))])
    p.set_defaults(func=_run("macattn.apps.finetune_mka"))


def _add_distill_completion(sub) -> None:
    """``macattn distill-completion`` (``macattn.apps.distill_completion``)."""
    p = sub.add_parser("distill-completion",
                       help="train the retrieval-completion feature maps (phi_q, phi_k) by distillation")
    cfg = DistillConfig()
    add_trainer_args(
        p, cfg, out_help="checkpoint / output directory",
        source=("--model-dir", dict(default=None, help="trained checkpoint dir (e.g. macattn/data/tiny_llama)")),
        shape=[("--n-queries", dict(type=int, default=cfg.n_queries,
                                    help="decode queries per window (its last positions)")),
               ("--n-sink", dict(type=int, default=cfg.n_sink)),
               ("--n-tail", dict(type=int, default=cfg.n_tail)),
               ("--features", dict(type=int, default=64, help="feature dimension F")),
               ("--hidden", dict(type=int, default=128, help="ReZero block inner width"))],
        optim=[("--temperature", dict(type=float, default=LossConfig().temperature))],
        extra=[("--device", dict(default="cpu", help="torch device of the model and the maps (e.g. cuda)"))])
    p.set_defaults(func=_run("macattn.apps.distill_completion"))


def _add(p: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    for name, kw in flags:
        p.add_argument(name, **kw)


def add_trainer_args(p: argparse.ArgumentParser, defaults, *, source: Flag, out_help: str,
                     shape: Sequence[Flag] = (), optim: Sequence[Flag] = (), extra: Sequence[Flag] = ()) -> None:
    """Add the flags of a trainer command to ``p``, in this order: ``--model`` (a built-in family, or
    ``builtin``: the packaged checkpoint), ``source`` (where a trained model comes from instead), ``--corpus``,
    ``--out`` (help ``out_help``), ``--resume``, ``--steps``, ``--batch``, ``--seq-len``, ``shape``, ``--lr``,
    ``optim``, ``--save-every``, ``--seed``, ``extra``, ``--json``, ``--no-progress``. The defaults of the
    ``RUN_FIELDS`` flags (``macattn.apps.trainer_common``) are the fields of ``defaults`` (the trainer's
    default config)."""
    add_model_flag(p, families=True, default="llama", note="a family has random weights")
    _add(p, [source])
    p.add_argument("--corpus", default=None, help="UTF-8 text file (default: Python stdlib docstrings)")
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch", type=int, default=defaults.batch)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    _add(p, shape)
    p.add_argument("--lr", type=float, default=defaults.lr)
    _add(p, optim)
    p.add_argument("--save-every", type=int, default=defaults.save_every)
    p.add_argument("--seed", type=int, default=defaults.seed)
    _add(p, extra)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--no-progress", action="store_true")


def main(argv: list[str] | None = None) -> int:
    """Run ``macattn`` with ``argv`` (default: the process's arguments; none: ``generate``). A ``ValueError`` or
    ``TypeError`` of the command ends it as a usage error naming the parameter."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["generate"]
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
