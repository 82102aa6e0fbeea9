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

from macattn.methods.mac.config import MacConfig

from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.engine_dir import read_engine_dir
from macattn.runtime.sampling import SamplingParams

__all__ = ["ModelRunner"]

_BEAM_KWARGS = ("num_beams", "num_return_sequences")


class ModelRunner:
    def __init__(self, engine: LLMEngine, a3=None) -> None:
        self.engine = engine
        self.a3 = a3                 # default macattn.methods.a3.reference.A3Config of chunked (``documents``) calls
        self._chunk_stores: dict = {}

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, model_or_dir, mac_config: MacConfig | None = None, *,
                runtime_config: RuntimeConfig | None = None, torch_dtype: torch.dtype | None = None,
                a3=None, method: str = "mac", method_config=None, method_kwargs: dict | None = None,
                **runtime_kwargs) -> "ModelRunner":
        """model_or_dir: a transformers ``*ForCausalLM`` (bound in place) or a directory /
        hub name for ``AutoModelForCausalLM.from_pretrained``. mac_config None = MAC off.
        method / method_config / method_kwargs: the attention method (``LLMEngine``).
        a3: ``macattn.methods.a3.reference.A3Config``, the default KV fusion of ``generate(..., documents=...)``."""
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
        return cls(LLMEngine(model, mac_config, runtime_config, method=method, method_config=method_config,
                             method_kwargs=method_kwargs), a3=a3)

    @classmethod
    def from_dir(cls, engine_dir, *, mac_config: MacConfig | None = None,
                 runtime_config: RuntimeConfig | None = None, a3=None, **runtime_kwargs) -> "ModelRunner":
        """Load ``engine_dir`` (``manifest.json`` + ``hf/``); ``mac_config`` overrides the manifest's."""
        manifest = read_engine_dir(engine_dir)
        return cls.from_hf(manifest.hf_dir, mac_config or manifest.mac_config,
                           runtime_config=runtime_config, a3=a3, **runtime_kwargs)

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
                 documents=None, question_ids=None, a3=None, **kwargs):
        """batch_input_ids: list of 1-D integer tensors ``[seq_len]`` (int32/int64).

        Chunked RAG prompts (A3 KV fusion, ``docs/a3.md``): ``documents`` is a list with one
        entry per request, each a list of 1-D token id tensors (the document chunks, reused from
        the chunk KV store); ``question_ids`` a list of one 1-D tensor per request. Request ``i``'s
        prompt is then ``batch_input_ids[i]`` (the system prompt, may be empty) + the chunks of
        ``documents[i]`` in order + ``question_ids[i]``, and ``output_ids`` holds that whole prompt.
        ``a3`` (``macattn.methods.a3.reference.A3Config``) overrides the runner's default (``A3Config()`` if none)."""
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
        rag = self._rag_prompts(batch_input_ids, documents, question_ids, a3)
        seqs = []
        for i, ids in enumerate(batch_input_ids):
            try:
                seqs.append(self.engine.make_request(ids if rag is None else rag[i][0].tokens(), sampling_config))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"batch_input_ids[{i}]: {exc}") from None
            if rag is not None:
                seqs[-1].rag = rag[i]
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

    def _rag_prompts(self, batch_input_ids, documents, question_ids, a3):
        """``[(RagPrompt, A3Config, ChunkKVStore | None)]`` per request, or None without documents."""
        if documents is None:
            if question_ids is not None or a3 is not None:
                raise ValueError("question_ids / a3 need documents (chunked prompts)")
            return None
        from macattn.methods.a3.config import A3Config

        from macattn.runtime.a3_assembly import RagPrompt
        n = len(batch_input_ids)
        for name, arg in (("documents", documents), ("question_ids", question_ids)):
            if not isinstance(arg, (list, tuple)) or len(arg) != n:
                raise ValueError(f"{name} must be a list with one entry per request ({n}), got "
                                 f"{type(arg).__name__}{'' if not isinstance(arg, (list, tuple)) else f' of {len(arg)}'}")
        config = a3 if a3 is not None else (self.a3 if self.a3 is not None else A3Config())
        if not isinstance(config, A3Config):
            raise TypeError(f"a3 must be an A3Config, got {type(config).__name__}")
        store = self._chunk_store(config)
        out = []
        for i in range(n):
            try:
                out.append((RagPrompt(batch_input_ids[i], list(documents[i]), question_ids[i]), config, store))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"request {i} (documents[{i}] / question_ids[{i}]): {exc}") from None
        return out

    def _chunk_store(self, config):
        if config.store_dir is None:
            return None
        key = (config.store_dir, config.store_max_bytes)
        if key not in self._chunk_stores:
            from macattn.runtime.chunk_store import ChunkKVStore, model_fingerprint

            self._chunk_stores[key] = ChunkKVStore(config.store_dir, model_id=model_fingerprint(self.engine.model),
                                                   max_bytes=config.store_max_bytes)
        return self._chunk_stores[key]

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
