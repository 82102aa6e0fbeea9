"""``macattn-trtllm-build``: TensorRT-LLM's ``trtllm-build`` with the MAC plugins swapped in.

``macattn-trtllm-build --plugin mac [--tau T --window K --band R --per-layer cfg.json] <trtllm-build flags>``

Our flags are split off (:func:`split_args`); every other argument goes unchanged to
``tensorrt_llm.commands.build.main``, whose ``parse_arguments()`` calls ``argparse``'s
``parse_args()`` with no argument list, i.e. reads ``sys.argv``: so we set ``sys.argv`` rather
than re-create their parser (its flags change between releases). Before that build,
:func:`install_patch` replaces the ``Attention`` class used by the decoder layers of the
TRT-LLM model definitions (``LLaMADecoderLayer`` for LLaMA and Mistral, ``QWenDecoderLayer``
for Qwen2) by a subclass that looks up ``mac::match`` / ``mac::attend`` in TensorRT's plugin
registry (registered by :func:`macattn.plugins.tensorrt_plugins.register_all`) and inserts them
into the generation-phase graph (``builder/trtllm_attention.py``: layout, extra I/O, limits).

Calls written against NVIDIA/TensorRT-LLM ``tensorrt_llm/commands/build.py`` at commit
008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc (``main()`` -> ``parse_arguments().parse_args()`` ->
``parallel_build`` -> ``MODEL_MAP[architecture].from_checkpoint``) and
``tensorrt_llm/models/llama/model.py`` at 027cd518e3b63809a5c5799187991e7f1164fb12 (module-level
``from ...layers import Attention``; ``LLaMADecoderLayer.__init__`` builds ``self.attention =
Attention(...)``) and ``tensorrt_llm/models/qwen/model.py`` at
04a2cacbfd3b9ac76191bd8498ad871607b63a04 (same pattern, ``QWenDecoderLayer``). Never built or run: see ``docs/tensorrt.md`` "TensorRT-LLM".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from macattn.builder.trtllm_attention import ATTEND_ID, MATCH_ID, layer_plugin_fields, make_mac_attention, plugin_fields
from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.flags import MAC_FLAGS, add_mac_flags, mac_config_from_args
from macattn.plugins.trt_compat import PLUGIN_VERSION, TensorRTVersionError, parse_version, split_id

__all__ = ["PLUGINS", "ARCH_TO_TRTLLM", "MATCH_ID", "ATTEND_ID", "split_args", "plugin_fields", "layer_plugin_fields",
           "patch_targets", "install_patch", "build_parser", "main"]

PLUGINS = ("mac",)
# HF architecture string -> (TRT-LLM module, model class, decoder-layer class). Mistral uses the
# LLaMA definition in TensorRT-LLM.
ARCH_TO_TRTLLM = {
    "LlamaForCausalLM": ("tensorrt_llm.models.llama.model", "LLaMAForCausalLM", "LLaMADecoderLayer"),
    "MistralForCausalLM": ("tensorrt_llm.models.llama.model", "LLaMAForCausalLM", "LLaMADecoderLayer"),
    "Qwen2ForCausalLM": ("tensorrt_llm.models.qwen.model", "QWenForCausalLM", "QWenDecoderLayer"),
}
_OURS = ("--plugin", *MAC_FLAGS)
# the first TensorRT-LLM release line without the TensorRT engine backend (main deleted it in July 2026)
TRTLLM_ENGINE_BACKEND_BEFORE = (1, 3)
_INSTALL_HINT = ("macattn-trtllm-build needs the `tensorrt_llm` package (TensorRT-LLM): "
                 "install the `tensorrt-llm` wheel from NVIDIA's package index (see TensorRT-LLM's installation guide)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="macattn-trtllm-build",
        description="Run TensorRT-LLM's trtllm-build with the MAC attention plugins (mac::match / mac::attend) "
                    "swapped into the LLaMA / Qwen2 / Mistral decoder layers.",
        epilog="Every other argument (e.g. --checkpoint_dir, --output_dir, --max_batch_size, "
               "--gpt_attention_plugin) is passed through unchanged to tensorrt_llm.commands.build.main.")
    p.add_argument("--plugin", choices=PLUGINS, required=True, help="which macattn plugin set to insert")
    add_mac_flags(p)
    return p


def split_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(ours, passthrough)``: our flags (``--flag value`` or ``--flag=value``) vs the rest, order kept.

    A repeated flag of ours stays repeated (argparse keeps the last); a flag of ours missing its
    value raises ``ValueError`` naming it. Everything after a bare ``--`` passes through.
    """
    ours: list[str] = []
    rest: list[str] = []
    i, argv = 0, list(argv)
    while i < len(argv):
        a = argv[i]
        if a == "--":
            rest.extend(argv[i + 1:])
            break
        name = a.split("=", 1)[0]
        if name in _OURS:
            if "=" in a:
                ours.append(a)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                ours.extend((a, argv[i + 1]))
                i += 1
            else:
                raise ValueError(f"{a} needs a value")
        else:
            rest.append(a)
        i += 1
    return ours, rest


def mac_config(args: argparse.Namespace) -> MacConfig:
    """The MacConfig of the parsed flags (``macattn.methods.mac.flags.mac_config_from_args``)."""
    return mac_config_from_args(args)


def patch_targets(architectures: Sequence[str] | None = None) -> dict[str, tuple[str, str, str]]:
    """The TRT-LLM (module, model class, decoder class) patched for each HF architecture string."""
    if architectures is None:
        return dict(ARCH_TO_TRTLLM)
    unknown = [a for a in architectures if a not in ARCH_TO_TRTLLM]
    if unknown:
        raise ValueError(f"architecture(s) {unknown} not supported; accepted: {sorted(ARCH_TO_TRTLLM)}")
    return {a: ARCH_TO_TRTLLM[a] for a in architectures}


def install_patch(cfg: MacConfig, max_batch: int, first_layer: int = 0) -> list[str]:
    """Swap ``Attention`` in the TRT-LLM decoder modules for the MAC subclass; returns patched modules.

    The subclass (:func:`macattn.builder.trtllm_attention.make_mac_attention`) keeps TRT-LLM's
    forward for MAC-disabled layers and the context phase, and inserts ``mac::match`` /
    ``mac::attend`` (creators from TensorRT's plugin registry after ``register_all()``) for the
    generation tokens of MAC layers, with the rings as extra network I/O. ``max_batch`` (the
    build's ``--max_batch_size``) bounds the MAC dimension ranges. It also turns on TensorRT's
    ``ALIASED_PLUGIN_IO_10_03`` preview feature in TRT-LLM's builder config (``mac::attend``
    writes the rings in place). Written against TRT-LLM sources, never run here.
    """
    import importlib

    import tensorrt as trt
    import tensorrt_llm.builder as trtllm_builder
    from tensorrt_llm.layers import Attention

    from macattn.plugins.tensorrt_plugins import register_all

    register_all()
    reg = trt.get_plugin_registry()
    creators = {pid: reg.get_creator(split_id(pid)[1], PLUGIN_VERSION, split_id(pid)[0]) for pid in (MATCH_ID, ATTEND_ID)}
    missing = [k for k, v in creators.items() if v is None]
    if missing:
        raise RuntimeError(f"TensorRT plugin registry has no creator for {missing} after register_all()")

    MacAttention = make_mac_attention(Attention, cfg, creators, max_batch=max_batch, first_layer=first_layer)

    create = trtllm_builder.Builder.create_builder_config
    if not getattr(create, "_macattn_aliased_io", False):
        def create_builder_config(self, *args, **kwargs):
            config = create(self, *args, **kwargs)
            config.trt_builder_config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
            return config

        create_builder_config._macattn_aliased_io = True
        trtllm_builder.Builder.create_builder_config = create_builder_config

    patched = []
    for module_name, _model, _decoder in dict.fromkeys(ARCH_TO_TRTLLM.values()):
        mod = importlib.import_module(module_name)
        mod.Attention = MacAttention  # the decoder classes look up `Attention` in their module's globals
        patched.append(module_name)
    return patched


def _passthrough(rest: Sequence[str], flag: str, kind=int):
    """The value of ``flag`` among the passthrough flags (last wins), ``None`` when absent."""
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument(flag, type=kind, default=None)
    return getattr(ours.parse_known_args(list(rest))[0], flag.lstrip("-"))


def checkpoint_pp_size(checkpoint_dir: str | None) -> int:
    """``mapping.pp_size`` of a TensorRT-LLM checkpoint directory's ``config.json`` (1 when absent)."""
    if checkpoint_dir is None:
        return 1
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        return 1          # trtllm-build reports the missing checkpoint itself
    return int(json.loads(path.read_text()).get("mapping", {}).get("pp_size", 1))


def require_trtllm_engine_backend():
    """``tensorrt_llm.commands.build`` if this TensorRT-LLM still has its TensorRT engine backend, else
    ``ImportError`` saying why: not installed, or a version without ``trtllm-build`` — TensorRT-LLM's main
    branch deleted that backend (``trtllm-build``, ``ModelRunner``, ``layers/``, ``models/``) in July 2026;
    1.2.x, the latest release on PyPI, still ships it, deprecated. The PyTorch backend's route is
    ``macattn.builder.trtllm_pytorch`` (written, never run; see docs/tensorrt.md)."""
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    version = getattr(tensorrt_llm, "__version__", "0")
    if parse_version(version)[:2] >= TRTLLM_ENGINE_BACKEND_BEFORE:
        raise TensorRTVersionError(
            f"macattn-trtllm-build needs TensorRT-LLM's TensorRT engine backend (trtllm-build), removed after 1.2.x; "
            f"found tensorrt_llm {version}: install tensorrt_llm < "
            f"{'.'.join(map(str, TRTLLM_ENGINE_BACKEND_BEFORE))} (its backend is deprecated there)")
    try:
        from tensorrt_llm.commands import build as trtllm_build
    except ImportError as exc:
        raise ImportError(f"tensorrt_llm {version} has no tensorrt_llm.commands.build (trtllm-build): its TensorRT "
                          f"engine backend is gone; use tensorrt_llm < 1.3 ({exc})") from exc
    return trtllm_build


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        build_parser().print_help()
        return 0
    try:
        ours, rest = split_args(argv)
    except ValueError as exc:
        build_parser().error(str(exc))
    args = build_parser().parse_args(ours)
    cfg = mac_config(args)
    workers = _passthrough(rest, "--workers") or 1
    if workers > 1:
        # trtllm-build's parallel_build spawns fresh processes for --workers > 1; our patch lives
        # only in this process, so those engines would be built without MAC.
        print(f"error: --workers {workers} is not supported (the Attention patch does not reach spawned "
              "build processes); use --workers 1", file=sys.stderr)
        return 2
    max_batch = _passthrough(rest, "--max_batch_size")
    if max_batch is None or max_batch < 1:
        # the MAC step inputs and rings are sized by it; trtllm-build's own default differs by release
        print("error: --plugin mac needs an explicit --max_batch_size N (N >= 1)", file=sys.stderr)
        return 2
    beams = _passthrough(rest, "--max_beam_width")
    if beams is not None and beams > 1:
        print(f"error: --max_beam_width {beams} is not supported with --plugin mac (one ring row per request; "
              "beams would share it)", file=sys.stderr)
        return 2
    pp = checkpoint_pp_size(_passthrough(rest, "--checkpoint_dir", str))
    if pp > 1:
        # the patched Attention sees only its stage-local layer index, not the stage's first layer
        print(f"error: pipeline parallelism (checkpoint mapping.pp_size = {pp}) is not supported with --plugin mac "
              "(the per-layer MAC config and rings are indexed by global layer); accepted: pp_size 1",
              file=sys.stderr)
        return 2
    try:
        trtllm_build = require_trtllm_engine_backend()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    install_patch(cfg, max_batch)
    sys.argv = ["trtllm-build", *rest]
    trtllm_build.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
