"""``macattn`` command line: ``macattn generate`` (the main job) and the project's other tools."""
from __future__ import annotations

import argparse
import sys

from .config import CONTEXT_HEAVY_TAU, MacConfig

__all__ = ["main"]


def _add_mac_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tau", type=float, default=CONTEXT_HEAVY_TAU, help="match threshold in [0, 1)")
    p.add_argument("--window", type=int, default=1024, help="ring capacity K (>= 1)")
    p.add_argument("--band", type=int, default=256, help="rectification band r (>= 0)")
    p.add_argument("--per-layer", default=None, help="JSON file of a MacConfig with per-layer overrides")


def mac_config_from_args(args) -> MacConfig:
    if args.per_layer:
        return MacConfig.load(args.per_layer)
    return MacConfig(window=args.window, band=args.band, tau=args.tau)


def _cmd_generate(args) -> int:
    from .generate import run_generate

    report = run_generate(family=args.model, context=args.context, new_tokens=args.tokens,
                          mac=mac_config_from_args(args), seed=args.seed, json_path=args.json)
    print(report.table())
    if args.json:
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="macattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=False)

    gen = sub.add_parser("generate", help="decode a long prompt with full attention and with MAC on the CPU")
    gen.add_argument("--model", choices=("llama", "qwen2", "mistral"), default="llama")
    gen.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    gen.add_argument("--tokens", type=int, default=64, help="tokens to decode")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", default=None, help="write the statistics to this JSON file")
    _add_mac_flags(gen)
    gen.set_defaults(func=_cmd_generate)
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
