"""``macattn`` command line: ``macattn generate`` (the main job) and the project's other tools."""
from __future__ import annotations

import argparse
import sys

from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.flags import add_mac_flags, mac_config_from_args
from macattn.apps.generate import TRAINED, run_generate
from macattn.runtime.engine_args import EngineArgs

__all__ = ["main"]


def _cmd_generate(args) -> int:
    report = run_generate(family=args.model, context=args.context, new_tokens=args.tokens,
                          mac=mac_config_from_args(args), seed=args.seed, json_path=args.json)
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
    from macattn.runtime.engine_args import EngineArgs

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
        name = args.served_model_name or ("builtin" if eargs.is_builtin else str(eargs.model))
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

    if args.tiny == (args.from_dir is not None):
        raise ValueError("give exactly one of --from HF_DIR and --tiny")
    build_engine_dir(args.model, args.out, mac=mac_config_from_args(args), hf_dir=args.from_dir,
                     tiny=args.tiny, seed=args.seed, progress=not args.no_progress, max_batch=args.max_batch,
                     max_context=args.max_context, dtype=args.dtype)
    print(f"wrote {args.out}/manifest.json, {args.out}/hf/, {args.out}/decode.onnx, {args.out}/prefill.onnx")
    return 0


# modules whose register(sub) adds their own subcommands (training and evaluation tools)
COMMAND_MODULES = ("macattn.apps.finetune_mka", "macattn.apps.distill_completion", "macattn.evaluation.harness",
                   "macattn.evaluation.recurrence", "macattn.apps.tune")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="macattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=False)

    gen = sub.add_parser("generate", help="decode a long prompt with full attention and with MAC on the CPU")
    gen.add_argument("--model", choices=(TRAINED, "llama", "qwen2", "mistral"), default=TRAINED,
                     help=f"{TRAINED}: the packaged trained checkpoint; others: random-weight built-in models")
    gen.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    gen.add_argument("--tokens", type=int, default=64, help="tokens to decode")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", default=None, help="write the statistics to this JSON file")
    add_mac_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    build = sub.add_parser("build", help="export the patched model to ONNX (+ TensorRT engine where available)")
    build.add_argument("--model", choices=("llama", "qwen2", "mistral"), required=True)
    src = build.add_mutually_exclusive_group(required=True)
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

    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
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
