"""The built-in trained checkpoint: a small LLaMA trained by ``training/train_tiny_llama.py``.

It lives in ``macattn/data/tiny_llama/`` (config.json, bf16 safetensors shards + index, tokenizer.json with
tokenizer_config.json / special_tokens_map.json, train_log.json, heldout.txt) and loads with plain
``transformers`` (``AutoModelForCausalLM`` / ``AutoTokenizer`` of the directory).

``tokenizer_config.json``: BOS ``<|bos|>`` (0), EOS ``<|eos|>`` (1), pad ``<|pad|>`` (2), no BOS added on
encode, and a chat template. The model was trained on plain documents (``training/DATA.md``), so there is no
chat format of its own: the template is the role-tagged one the OpenAI server documents, ``<|role|>\n{content}\n``
per message (roles system, developer, user, assistant, tool; content parts of type text joined by newlines)
then ``<|assistant|>\n`` with ``add_generation_prompt``. Inside content every ``<|`` is written ``< |``, so
no message can forge a role marker or a special token; an unknown role or a non-text part raises.

Sources of its training text: ``training/DATA.md``; licenses of the held-out text it ships: ``NOTICE.txt``
beside it.
"""
from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["BUILTIN_CHECKPOINT_DIR", "SPECIAL_TOKENS", "TRAIN_HINT", "builtin_checkpoint_available", "heldout_text",
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


SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
"""The checkpoint's special tokens (ids 0, 1, 2; ``tokenizer_config.json`` names them too)."""


def load_tokenizer(path: str | Path | None = None):
    """The checkpoint's byte-level BPE tokenizer: ``AutoTokenizer`` of the directory when it ships a
    ``tokenizer_config.json`` (the built-in one does: BOS / EOS / pad and the chat template, so any
    transformers-based tool reads the same tokenizer), else a ``PreTrainedTokenizerFast`` over
    ``tokenizer.json`` with ``SPECIAL_TOKENS`` (a checkpoint fresh from ``training/``). Neither adds BOS
    when encoding (the prompts of every test and benchmark are encoded so)."""
    d = _check_dir(path)
    if (d / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), **SPECIAL_TOKENS)


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
