"""The built-in trained checkpoint: a small LLaMA trained by ``training/train_tiny_llama.py``.

It lives in ``macattn/data/tiny_llama/`` (config.json, bf16 safetensors shards + index,
tokenizer.json, train_log.json, heldout.txt) and loads with plain ``transformers``. Sources of its training
text: ``training/DATA.md``; licenses of the held-out text it ships: ``NOTICE.txt`` beside it.
"""
from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["BUILTIN_CHECKPOINT_DIR", "TRAIN_HINT", "builtin_checkpoint_available", "heldout_text",
           "load_builtin_checkpoint", "load_tokenizer"]

BUILTIN_CHECKPOINT_DIR = Path(__file__).resolve().parents[1] / "data" / "tiny_llama"
TRAIN_HINT = (
    "train it with: apt-get install -y bible-kjv bible-kjv-text fortunes fortunes-min dict-gcide dict-devil && "
    "python3 training/prep_data.py --out .data/tiny_llama && "
    "python3 training/train_tiny_llama.py --data .data/tiny_llama --out CKPT --time-budget 500 (one GPU), "
    "then copy CKPT/* into "
    f"{BUILTIN_CHECKPOINT_DIR}"
)
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # one file, or shards + index


def builtin_checkpoint_available(path: str | Path | None = None) -> bool:
    d = Path(path) if path is not None else BUILTIN_CHECKPOINT_DIR
    return not _missing(d)


def _missing(d: Path) -> list[str]:
    missing = [f for f in ("config.json", "tokenizer.json") if not (d / f).is_file()]
    if not any((d / f).is_file() for f in _WEIGHTS):
        missing.append(" or ".join(_WEIGHTS))
    return missing


def load_tokenizer(path: str | Path | None = None):
    """The checkpoint's byte-level BPE tokenizer as a ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    d = _check_dir(path)
    return PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>")


def _check_dir(path) -> Path:
    d = Path(path) if path is not None else BUILTIN_CHECKPOINT_DIR
    missing = _missing(d)
    if missing:
        raise FileNotFoundError(f"the trained checkpoint is not in {d} (missing {', '.join(missing)}); {TRAIN_HINT}")
    return d


def load_builtin_checkpoint(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32,
                            attn_implementation: str = "sdpa"):
    """Load ``(LlamaForCausalLM in eval mode on the CPU, tokenizer)`` from ``path`` (default: the
    packaged ``macattn/data/tiny_llama``). Weights are stored in bf16 and cast to ``dtype``.

    Raises FileNotFoundError (saying how to train it) when the weights are absent.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    from transformers import LlamaForCausalLM

    d = _check_dir(path)
    model = LlamaForCausalLM.from_pretrained(str(d), dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), load_tokenizer(d)


def heldout_text(path: str | Path | None = None) -> str:
    """Held-out text shipped with the checkpoint (``heldout.txt``: validation documents the model was
    not trained on), the haystack of ``macattn generate`` and ``macattn eval``."""
    return (_check_dir(path) / "heldout.txt").read_text(encoding="utf-8")
