"""``ModelRunner``: TensorRT-LLM's runner interface over the in-flight batching engine.

``generate`` takes TensorRT-LLM's argument names (``batch_input_ids``, ``max_new_tokens``,
``end_id``, ``pad_id``, ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``random_seed``,
``streaming``, ``return_dict``, ``output_sequence_lengths``, ``output_log_probs``,
``output_cum_log_probs``, ``output_generation_logits``); every other keyword of TensorRT-LLM's
runners (≤ 1.2) is accepted at its neutral value and refused by name otherwise. It returns the
upstream format, on the engine's device:

* ``output_ids``: int32 ``[batch, 1, max_input_len + max_new_tokens]`` — prompt followed by
  the generated tokens, padded with ``end_id`` (``pad_id`` without one; the end token itself is
  not emitted);
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


class _Extras:
    """Per-request log probabilities and logits rows of the generated tokens (when asked), from the
    engine's ``StepOutput.logits``."""

    def __init__(self, seqs, max_new_tokens: int, vocab: int, log_probs: bool, logits: bool) -> None:
        self.row = {s.request_id: i for i, s in enumerate(seqs)}
        self.want_lp, self.want_logits = log_probs, logits
        n = len(seqs)
        self.lp = torch.zeros(n, 1, max_new_tokens, dtype=torch.float32) if log_probs else None
        self.logits = torch.zeros(n, 1, max_new_tokens, vocab, dtype=torch.float32) if logits else None
        self.count = [0] * n

    def record(self, step) -> None:
        b = self.row.get(step.request_id)
        if b is None or step.token is None or step.logits is None or not (self.want_lp or self.want_logits):
            return
        row, j = step.logits.float(), self.count[b]
        if self.want_lp:
            self.lp[b, 0, j] = float(torch.log_softmax(row, -1)[step.token])
        if self.want_logits:
            self.logits[b, 0, j] = row.cpu()
        self.count[b] += 1

    def tensors(self, log_probs: bool, cum_log_probs: bool, logits: bool) -> dict:
        out = {}
        if log_probs:
            out["log_probs"] = self.lp.clone()
        if cum_log_probs:
            out["cum_log_probs"] = self.lp.sum(-1)
        if logits:
            out["generation_logits"] = self.logits.clone()
        return out


def _on(out, device):
    """``out`` (a tensor or a dict of them) on the engine's ``device``, as upstream returns them."""
    if isinstance(out, dict):
        return {k: v.to(device) for k, v in out.items()}
    return out.to(device)

# TensorRT-LLM (<= 1.2) runner keywords we do not implement, with the values that mean "off": accepted
# at those (examples/run.py passes most of them on every call), refused by name otherwise
_UPSTREAM_NEUTRAL: dict[str, tuple] = {
    "num_beams": (None, 1), "num_return_sequences": (None, 1), "top_p_min": (None,), "top_p_reset_ids": (None,),
    "top_p_decay": (None,), "min_tokens": (None, 0, 1), "beam_search_diversity_rate": (None, 0.0),
    "repetition_penalty": (None, 1.0), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
    "length_penalty": (None, 1.0), "early_stopping": (None, 1), "no_repeat_ngram_size": (None,),
    "min_p": (None, 0.0), "beam_width_array": (None,), "stop_words_list": (None,), "bad_words_list": (None,),
    "lora_uids": (None,), "prompt_table": (None,), "prompt_tasks": (None,), "input_token_extra_ids": (None,),
    "max_attention_window_size": (None,), "sink_token_length": (None,), "position_ids": (None,),
    "encoder_input_ids": (None,), "encoder_input_features": (None,), "encoder_output_lengths": (None,),
    "cross_attention_masks": (None,), "mrope_params": (None,), "lookahead_config": (None,),
    "stopping_criteria": (None,), "logits_processor_names": (None,), "return_all_generated_tokens": (False,),
    "language_adapter_uids": (None,), "mm_embedding_offloading": (False,), "medusa_choices": (None,),
    "eagle_choices": (None,), "draft_tokens_list": (None,), "draft_logits_list": (None,),
    "skip_cross_attn_blocks": (None,),
}


def _check_upstream_kwargs(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name not in _UPSTREAM_NEUTRAL:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        neutral = _UPSTREAM_NEUTRAL[name]
        lora_off = name == "lora_uids" and isinstance(value, (list, tuple)) and all(int(u) < 0 for u in value)
        if not lora_off and not any(value is v or (v is not None and value == v) for v in neutral):
            raise ValueError(f"{name}={value!r} is not supported (accepted: {list(neutral)})")


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
                tp_size: int | None = None, **runtime_kwargs) -> "ModelRunner":
        """model_or_dir: a transformers ``*ForCausalLM`` (bound in place; with ``tp_size`` > 1 it is only
        read: rank 0 slices it into the ranks' shards) or a directory / hub name for
        ``AutoModelForCausalLM.from_pretrained``. mac_config None = MAC off.
        method / method_config / method_kwargs: the attention method (``LLMEngine``).
        tp_size: ``RuntimeConfig.tensor_parallel_size`` (TensorRT-LLM's name; None = the config's).
        a3: ``macattn.methods.a3.reference.A3Config``, the default KV fusion of ``generate(..., documents=...)``."""
        if tp_size is not None:
            runtime_kwargs["tensor_parallel_size"] = tp_size
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
                 output_sequence_lengths: bool = False, output_log_probs: bool = False,
                 output_cum_log_probs: bool = False, output_generation_logits: bool = False,
                 sampling_config: SamplingParams | None = None, documents=None, question_ids=None, a3=None, **kwargs):
        """batch_input_ids: list of 1-D integer tensors ``[seq_len]`` (int32/int64).

        Chunked RAG prompts (A3 KV fusion, ``docs/a3.md``): ``documents`` is a list with one
        entry per request, each a list of 1-D token id tensors (the document chunks, reused from
        the chunk KV store); ``question_ids`` a list of one 1-D tensor per request. Request ``i``'s
        prompt is then ``batch_input_ids[i]`` (the system prompt, may be empty) + the chunks of
        ``documents[i]`` in order + ``question_ids[i]``, and ``output_ids`` holds that whole prompt.
        ``a3`` (``macattn.methods.a3.reference.A3Config``) overrides the runner's default (``A3Config()`` if none).

        ``temperature=0`` is greedy. ``output_log_probs`` / ``output_cum_log_probs`` /
        ``output_generation_logits`` add ``log_probs [batch, 1, max_new_tokens]`` (each generated token's
        log probability, 0 past the end), ``cum_log_probs [batch, 1]`` and ``generation_logits
        [batch, 1, max_new_tokens, vocab]`` fp32 to the dict. Other upstream keywords: see ``_UPSTREAM_NEUTRAL``."""
        _check_upstream_kwargs(kwargs)
        if not isinstance(batch_input_ids, (list, tuple)) or not batch_input_ids:
            raise ValueError("batch_input_ids must be a non-empty list of 1-D token id tensors")
        if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, int)):
            raise TypeError(f"pad_id must be an int or None, got {pad_id!r}")
        pad = end_id if end_id is not None else (pad_id if pad_id is not None else 0)   # upstream pads with end_id
        if sampling_config is None:
            greedy = temperature == 0
            sampling_config = SamplingParams(max_new_tokens=max_new_tokens, end_id=end_id,
                                             temperature=1.0 if greedy else temperature, top_k=1 if greedy else top_k,
                                             top_p=0.0 if greedy else top_p, random_seed=random_seed)
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
        extras = _Extras(seqs, sampling_config.max_new_tokens, self.vocab_size, output_log_probs or output_cum_log_probs,
                         output_generation_logits)
        gen = self._run(seqs, width, pad, return_dict, output_sequence_lengths, extras,
                        (output_log_probs, output_cum_log_probs, output_generation_logits))
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
        if self.engine.config.tensor_parallel_size > 1:
            from macattn.runtime.tensor_parallel import refuse_chunked_prompts

            refuse_chunked_prompts(self.engine.config.tensor_parallel_size)
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

    def _run(self, seqs, width, pad, return_dict, output_sequence_lengths, extras, wanted):
        try:
            while not all(s.finished for s in seqs):
                for step in self.engine.step():
                    extras.record(step)
                out = self._format(seqs, width, pad, return_dict, output_sequence_lengths)
                if return_dict:
                    out.update(extras.tensors(*wanted))
                yield _on(out, self.engine.config.device)
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
