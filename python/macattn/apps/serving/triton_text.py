"""The text stages of the Triton ensemble in TensorRT-LLM backend conventions (``preprocessing``
-> the engine model -> ``postprocessing``), run by ``triton_model.py`` when its ``role``
parameter names one of them. Tokenizer: ``tokenizer_dir`` (a transformers tokenizer directory, or
a directory with only ``tokenizer.json`` such as the built-in checkpoint's).

``preprocessing`` inputs (TensorRT-LLM's names): ``QUERY`` STRING ``[1]``, ``REQUEST_OUTPUT_LEN``
INT64 ``[1]``; optional ``BAD_WORDS_DICT`` / ``STOP_WORDS_DICT`` STRING ``[-1]``, ``END_ID`` INT64 /
``PAD_ID`` INT32 ``[1]``, ``STREAM`` BOOL ``[1]``. Outputs: ``INPUT_ID`` INT64 ``[-1]``,
``REQUEST_OUTPUT_LEN`` INT64 ``[1]``, ``OUT_END_ID`` INT64 / ``OUT_PAD_ID`` INT32 ``[1]`` (the tokenizer's
EOS / pad when not given), ``STOP_WORDS_IDS`` / ``BAD_WORDS_IDS`` INT32 ``[2, -1]`` (TensorRT-LLM's
word-list layout: row 0 the words' token ids back to back, row 1 each word's end offset, ``-1``
padded), ``OUT_STREAM`` BOOL ``[1]`` (False when not given).

``postprocessing``: ``TOKENS_BATCH`` INT64 ``[-1]`` -> ``OUTPUT`` STRING ``[1]`` (special tokens
skipped). A streamed request is decoded response by response, as TensorRT-LLM's postprocessing
does: a character split across two responses' tokens comes out as replacement characters.

Errors name the ensemble's input (``text_input``, ``max_tokens``, ...), which is what a client sent.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from macattn.runtime.word_lists import parse_word_list  # noqa: F401  (the serving models' parser)

__all__ = ["TextStage", "load_tokenizer_dir", "word_list", "parse_word_list"]

ROLES = ("preprocessing", "postprocessing")


def load_tokenizer_dir(path: str | Path):
    """A transformers tokenizer directory, or one holding only ``tokenizer.json`` (the built-in checkpoint)."""
    path = Path(path)
    if (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    if (path / "tokenizer.json").is_file():
        from macattn.models.checkpoint import load_tokenizer

        return load_tokenizer(path)
    raise FileNotFoundError(f"tokenizer_dir {path} holds neither tokenizer_config.json nor tokenizer.json")


def word_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's ``[2, N]`` int32 layout of token-id words (``[[0], [-1]]`` for none)."""
    flat = [t for w in words for t in w]
    ends = np.cumsum([len(w) for w in words]).tolist()
    n = max(len(flat), len(ends), 1)
    out = np.full((2, n), -1, dtype=np.int32)
    out[0, :] = 0
    out[0, :len(flat)] = flat
    out[1, :len(ends)] = ends
    return out


class TextStage:
    """One text stage (``role`` in ``ROLES``) over ``pb_utils`` (the Python backend's module)."""

    def __init__(self, role: str, params: dict, pb_utils) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if "tokenizer_dir" not in params:
            raise ValueError(f"the {role} model needs a tokenizer_dir parameter")
        self.role, self.pb = role, pb_utils
        self.tok = load_tokenizer_dir(params["tokenizer_dir"])

    def execute(self, requests):
        out = []
        for request in requests:
            try:
                tensors = self._pre(request) if self.role == "preprocessing" else self._post(request)
                out.append(self.pb.InferenceResponse(tensors))
            except (ValueError, TypeError, UnicodeDecodeError) as exc:
                out.append(self.pb.InferenceResponse(error=self.pb.TritonError(str(exc))))
        return out

    # --- helpers ---------------------------------------------------------------------------
    def _get(self, request, name):
        t = self.pb.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    def _scalar(self, request, name, label, cast):
        arr = self._get(request, name)
        if arr is None:
            return None
        arr = arr.reshape(-1)
        if arr.size != 1:
            raise ValueError(f"{label} must hold exactly one value, got {arr.size}")
        return cast(arr[0].item())

    def _strings(self, request, name) -> list[str]:
        arr = self._get(request, name)
        if arr is None:
            return []
        out = []
        for v in arr.reshape(-1).tolist():
            s = v.decode("utf-8") if isinstance(v, bytes) else str(v)
            if s:
                out.append(s)
        return out

    # --- preprocessing ---------------------------------------------------------------------
    def _pre(self, request):
        pb = self.pb
        q = self._get(request, "QUERY")
        texts = [] if q is None else q.reshape(-1).tolist()
        if len(texts) != 1:
            raise ValueError(f"text_input must hold exactly one string, got {len(texts)}")
        text = texts[0].decode("utf-8") if isinstance(texts[0], bytes) else str(texts[0])
        if not text:
            raise ValueError("text_input is empty: a prompt needs at least one token")
        ids = self.tok.encode(text)
        max_tokens = self._scalar(request, "REQUEST_OUTPUT_LEN", "max_tokens", int)
        if max_tokens is None or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens}")
        end_id = self._scalar(request, "END_ID", "end_id", int)
        end_id = self.tok.eos_token_id if end_id is None else end_id
        pad_id = self._scalar(request, "PAD_ID", "pad_id", int)
        pad_id = (self.tok.pad_token_id if self.tok.pad_token_id is not None else end_id) if pad_id is None else pad_id
        stream = self._scalar(request, "STREAM", "stream", bool)
        words = {key: [self.tok.encode(w, add_special_tokens=False) for w in self._strings(request, name)]
                 for key, name in (("stop_words", "STOP_WORDS_DICT"), ("bad_words", "BAD_WORDS_DICT"))}
        return [pb.Tensor("INPUT_ID", np.asarray(ids, dtype=np.int64)),
                pb.Tensor("REQUEST_OUTPUT_LEN", np.asarray([max_tokens], dtype=np.int64)),
                pb.Tensor("OUT_END_ID", np.asarray([-1 if end_id is None else end_id], dtype=np.int64)),
                pb.Tensor("OUT_PAD_ID", np.asarray([-1 if pad_id is None else pad_id], dtype=np.int32)),
                pb.Tensor("STOP_WORDS_IDS", word_list(words["stop_words"])),
                pb.Tensor("BAD_WORDS_IDS", word_list(words["bad_words"])),
                pb.Tensor("OUT_STREAM", np.asarray([bool(stream)], dtype=np.bool_))]

    # --- postprocessing --------------------------------------------------------------------
    def _post(self, request):
        tokens = self._get(request, "TOKENS_BATCH")
        ids = [] if tokens is None else tokens.reshape(-1).tolist()
        text = self.tok.decode(ids, skip_special_tokens=True)
        return [self.pb.Tensor("OUTPUT", np.asarray([text.encode("utf-8")], dtype=np.object_))]
