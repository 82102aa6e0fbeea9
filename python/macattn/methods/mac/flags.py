"""MAC's command-line flags, one definition for every tool that takes them (``macattn generate``,
``macattn-trtllm-build``, …): ``--per-layer`` (a ``MacConfig`` JSON) as the base, then ``--tau`` /
``--window`` / ``--band`` / ``--min-context`` on top of its global values (the graph builds refuse a
``min_context`` above 0: ``MacConfig.require_from_first_step``)."""
from __future__ import annotations

import argparse
from dataclasses import replace

from macattn.methods.mac.config import MacConfig

__all__ = ["MAC_FLAGS", "add_mac_flags", "mac_config_from_args"]

MAC_FLAGS = ("--tau", "--window", "--band", "--min-context", "--per-layer")
_D = MacConfig()


def add_mac_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tau", type=float, default=None, help=f"match threshold in [0, 1) (default {_D.tau})")
    p.add_argument("--window", type=int, default=None, help=f"ring capacity K >= 1 (default {_D.window})")
    p.add_argument("--band", type=int, default=None, help=f"rectification band r >= 0 (default {_D.band})")
    p.add_argument("--min-context", dest="min_context", type=int, default=None,
                   help=f"MAC engages at decode positions >= this; below, full attention (default {_D.min_context})")
    p.add_argument("--per-layer", default=None, help="MacConfig JSON (from macattn tune) with per-layer overrides")


def mac_config_from_args(args: argparse.Namespace) -> MacConfig:
    """The ``MacConfig`` of parsed flags: the ``--per-layer`` file (or the defaults), then the
    explicit ``--tau`` / ``--window`` / ``--band`` / ``--min-context`` on its global values (overrides kept)."""
    base = MacConfig.load(args.per_layer) if args.per_layer else MacConfig()
    kw = {k: getattr(args, k, None) for k in ("tau", "window", "band", "min_context")
          if getattr(args, k, None) is not None}
    return replace(base, **kw) if kw else base
