"""``ModelRunner``: TensorRT-LLM's runner interface over the in-flight batching engine.

``generate`` takes TensorRT-LLM's argument names (``batch_input_ids``, ``max_new_tokens``,
``end_id``, ``pad_id``, ``temperature``, ``top_k``, ``top_p``, ``random_seed``,
``streaming``, ``return_dict``, ``output_sequence_lengths``) and returns its format:

* ``output_ids``: int32 ``[batch, 1, max_input_len + max_new_tokens]`` — prompt followed by
  the generated tokens, padded with ``pad_id`` (the end token itself is not emitted);
* ``sequence_lengths`` (with ``output_sequence_lengths=True``): int32 ``[batch, 1]``, prompt
  + generated tokens;
* ``return_dict=False`` returns ``output_ids`` alone; ``streaming=True`` returns a generator
  yielding that result after every engine step.

All requests of a call are validated before any is queued, so a bad one raises
``ValueError`` / ``TypeError`` naming ``batch_input_ids[i]`` or the parameter.
"""
from __future__ import annotations

from pathlib import Path

import torch

from macattn.config import MacConfig

from .config import RuntimeConfig
from .engine import LLMEngine
from .engine_dir import read_engine_dir
from .sampling import SamplingParams

__all__ = ["ModelRunner"]

_BEAM_KWARGS = ("num_beams", "num_return_sequences")


class ModelRunner:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, model_or_dir, mac_config: MacConfig | None = None, *,
                runtime_config: RuntimeConfig | None = None, torch_dtype: torch.dtype | None = None,
                **runtime_kwargs) -> "ModelRunner":
        """model_or_dir: a transformers ``*ForCausalLM`` (patched in place) or a directory /
        hub name for ``AutoModelForCausalLM.from_pretrained``. mac_config None = MAC off."""
        if runtime_config is None:
            runtime_config = RuntimeConfig(**runtime_kwargs)
        elif runtime_kwargs:
            raise TypeError("pass either runtime_config or runtime keyword arguments, not both")
        model = model_or_dir
        if isinstance(model_or_dir, (str, Path)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model_or_dir), attn_implementation="sdpa",
                                                         dtype=torch_dtype or "auto")
        elif torch_dtype is not None:
            model = model.to(torch_dtype)
        return cls(LLMEngine(model, mac_config, runtime_config))

    @classmethod
    def from_dir(cls, engine_dir, *, mac_config: MacConfig | None = None,
                 runtime_config: RuntimeConfig | None = None, **runtime_kwargs) -> "ModelRunner":
        """Load ``engine_dir`` (``manifest.json`` + ``hf/``); ``mac_config`` overrides the manifest's."""
        manifest = read_engine_dir(engine_dir)
        return cls.from_hf(manifest.hf_dir, mac_config or manifest.mac_config,
                           runtime_config=runtime_config, **runtime_kwargs)

    # --- properties (TensorRT-LLM names) --------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_batch_size(self) -> int:
        return self.engine.config.max_batch_size

    @property
    def max_sequence_length(self) -> int:
        return self.engine.config.max_seq_len

    @property
    def num_layers(self) -> int:
        return self.engine.executor.num_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.executor.dtype

    @property
    def mac_config(self) -> MacConfig:
        return self.engine.mac_config

    # --- generation -----------------------------------------------------------------------
    def generate(self, batch_input_ids, *, max_new_tokens: int = 1, end_id: int | None = None,
                 pad_id: int | None = None, temperature: float = 1.0, top_k: int = 1, top_p: float = 0.0,
                 random_seed: int | None = None, streaming: bool = False, return_dict: bool = False,
                 output_sequence_lengths: bool = False, sampling_config: SamplingParams | None = None,
                 **kwargs):
        """batch_input_ids: list of 1-D integer tensors ``[seq_len]`` (int32/int64)."""
        for k in _BEAM_KWARGS:
            if k in kwargs and kwargs.pop(k) not in (None, 1):
                raise ValueError(f"{k} must be 1: beam search is not supported")
        if kwargs:
            raise TypeError(f"generate() got unsupported arguments {sorted(kwargs)}")
        if not isinstance(batch_input_ids, (list, tuple)) or not batch_input_ids:
            raise ValueError("batch_input_ids must be a non-empty list of 1-D token id tensors")
        if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, int)):
            raise TypeError(f"pad_id must be an int or None, got {pad_id!r}")
        pad = pad_id if pad_id is not None else (end_id if end_id is not None else 0)
        if sampling_config is None:
            sampling_config = SamplingParams(max_new_tokens=max_new_tokens, end_id=end_id, temperature=temperature,
                                             top_k=top_k, top_p=top_p, random_seed=random_seed)
        seqs = []
        for i, ids in enumerate(batch_input_ids):
            try:
                seqs.append(self.engine.make_request(ids, sampling_config))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"batch_input_ids[{i}]: {exc}") from None
        for seq in seqs:
            self.engine.submit(seq)
        width = max(len(s.prompt) for s in seqs) + sampling_config.max_new_tokens
        gen = self._run(seqs, width, pad, return_dict, output_sequence_lengths)
        if streaming:
            return gen
        result = None
        for result in gen:
            pass
        return result

    def _run(self, seqs, width, pad, return_dict, output_sequence_lengths):
        try:
            while not all(s.finished for s in seqs):
                self.engine.step()
                yield self._format(seqs, width, pad, return_dict, output_sequence_lengths)
        finally:   # a generator closed early aborts what it started
            for s in seqs:
                self.engine.abort(s.request_id)
                self.engine.requests.pop(s.request_id, None)

    @staticmethod
    def _format(seqs, width, pad, return_dict, output_sequence_lengths):
        out = torch.full((len(seqs), 1, width), pad, dtype=torch.int32)
        lengths = torch.zeros(len(seqs), 1, dtype=torch.int32)
        for b, s in enumerate(seqs):
            tokens = s.prompt + s.output
            out[b, 0, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            lengths[b, 0] = len(tokens)
        if not return_dict:
            return out
        result = {"output_ids": out}
        if output_sequence_lengths:
            result["sequence_lengths"] = lengths
        return result
