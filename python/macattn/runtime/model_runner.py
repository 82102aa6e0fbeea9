"""``ModelRunner``: TensorRT-LLM's runner interface over the in-flight batching engine.

``generate`` takes TensorRT-LLM's argument names (``batch_input_ids``, ``max_new_tokens``,
``end_id``, ``pad_id``, ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``random_seed``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``min_p``, ``min_tokens``,
``stop_words_list``, ``bad_words_list``, ``streaming``, ``return_dict``, ``output_sequence_lengths``,
``output_log_probs``, ``output_cum_log_probs``, ``output_generation_logits``) as ``examples/run.py``
passes them; every other keyword of TensorRT-LLM's runners (≤ 1.2) is accepted at its neutral value and
refused by name otherwise. It returns the upstream format, on the engine's device:

* ``output_ids``: int32 ``[batch, 1, max_input_len + max_new_tokens]`` — prompt followed by
  the generated tokens, padded with ``end_id`` (``pad_id`` without one; the end token itself is
  not emitted);
* ``sequence_lengths`` (with ``output_sequence_lengths=True``): int32 ``[batch, 1]``, prompt
  + generated tokens;
* ``return_dict=False`` returns ``output_ids`` alone; ``streaming=True`` returns a generator
  yielding that result after every engine step.

Stop and bad words (``runtime/word_lists.py``: TensorRT-LLM's ``[batch, 2, N]`` offsets layout or
``ModelRunnerCpp``'s ``[batch][word][token]`` lists): a request whose tokens end with a stop word ends there
(the word kept, the rest padded, as upstream); a bad word is never completed — single-token bad words are
banned for the whole request through the sampler's bias table (``-inf``), a longer word's last token is banned
for the steps where the tokens so far end with the rest of it, decided on the host before each engine step
(the engine has no n-gram ban; not yet with the CUDA graph decoder, whose bias table is keyed per request).

All requests of a call are validated before any is queued, so a bad one raises
``ValueError`` / ``TypeError`` naming ``batch_input_ids[i]`` or the parameter.
"""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch

from macattn.methods.mac.config import MacConfig

from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.engine_args import EngineArgs
from macattn.runtime.engine_dir import read_engine_dir
from macattn.runtime.sampling import MAX_SEED, SamplingConfig
from macattn.runtime.word_lists import banned_next, ends_with_word, with_bans, words_per_request

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

def _per_request(value, b: int, n: int, name: str):
    """Request ``b``'s value of a keyword given as one value or one per request (list / 1-D tensor of ``n``)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist() if value.dim() else value.item()
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} must be one value or one per request ({n}), got {len(value)}")
        return value[b]
    return value


class _Words:
    """One request's stop words and bad words (``runtime/word_lists.py``) and its sampling parameters
    without bans (``base``); ``ban`` sets the request's parameters for its next step."""

    def __init__(self, seq, stops: list[list[int]], bads: list[list[int]]) -> None:
        self.base, self.stops, self.bads = seq.sampling, stops, bads
        self.dynamic = any(len(w) > 1 for w in bads)
        self.span = max((len(w) for w in stops + bads), default=1)
        self.banned: frozenset | None = None

    def tail(self, seq) -> list[int]:
        """The last tokens of ``seq`` (prompt and output) a word can span."""
        k = self.span
        out = seq.output[-k:]
        return (seq.prompt[-(k - len(out)):] + out) if len(out) < k else out

    def ban(self, seq) -> None:
        banned = frozenset(banned_next(self.tail(seq), self.bads))
        if banned != self.banned:
            seq.sampling, self.banned = with_bans(self.base, banned), banned


# TensorRT-LLM (<= 1.2) runner keywords we do not implement, with the values that mean "off": accepted
# at those (examples/run.py passes most of them on every call), refused by name otherwise
_UPSTREAM_NEUTRAL: dict[str, tuple] = {
    "num_beams": (None, 1), "num_return_sequences": (None, 1), "top_p_min": (None,), "top_p_reset_ids": (None,),
    "top_p_decay": (None,), "beam_search_diversity_rate": (None, 0.0), "length_penalty": (None, 1.0),
    "early_stopping": (None, 1), "no_repeat_ngram_size": (None,), "beam_width_array": (None,), "lora_uids": (None,),
    "prompt_table": (None,), "prompt_tasks": (None,), "input_token_extra_ids": (None,),
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
    def __init__(self, engine: LLMEngine, a3=None, *, seed: int | None = None) -> None:
        self.engine = engine
        self.a3 = a3                 # default macattn.methods.a3.reference.A3Config of chunked (``documents``) calls
        self._chunk_stores: dict = {}
        # ``EngineArgs.seed``: the seeds of requests that give no random_seed (None: fresh random ones)
        self._seeds = None if seed is None else random.Random(seed)

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, model_or_dir, mac_config: MacConfig | None = None, *,
                runtime_config: RuntimeConfig | None = None, torch_dtype: torch.dtype | None = None,
                a3=None, method: str = "mac", method_config=None, method_kwargs: dict | None = None,
                tp_size: int | None = None, **runtime_kwargs) -> "ModelRunner":
        """model_or_dir: a transformers ``*ForCausalLM`` (bound in place; with ``tp_size`` > 1 it is only
        read: rank 0 slices it into the ranks' shards) or a local model directory. Built through ``EngineArgs``
        (runtime keywords are its fields): mac_config None = MAC's defaults, ``MacConfig(enabled=False)`` = off.
        method / method_config / method_kwargs: the attention method (``LLMEngine``).
        tp_size: ``RuntimeConfig.tensor_parallel_size`` (TensorRT-LLM's name; None = the config's).
        a3: ``macattn.methods.a3.reference.A3Config``, the default KV fusion of ``generate(..., documents=...)``."""
        if tp_size is not None:
            runtime_kwargs["tensor_parallel_size"] = tp_size
        if runtime_config is not None and runtime_kwargs:
            raise TypeError("pass either runtime_config or runtime keyword arguments, not both")
        named = isinstance(model_or_dir, (str, Path))
        mac = mac_config.to_dict() if isinstance(mac_config, MacConfig) else mac_config
        base = {"model": str(model_or_dir)} if named else {}
        if torch_dtype is not None:
            base["dtype"] = str(torch_dtype).removeprefix("torch.")
        args = (EngineArgs.of_runtime(runtime_config, **base, method=method, mac=mac) if runtime_config is not None
                else EngineArgs.from_kwargs(**base, method=method, mac=mac, **runtime_kwargs))
        model = args.load_model(with_tokenizer=False)[0] if named else model_or_dir
        return cls(args.build_engine(model, method_config=method_config, method_kwargs=method_kwargs), a3=a3,
                   seed=args.seed)

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
                 random_seed=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
                 min_p=None, min_tokens=None, stop_words_list=None, bad_words_list=None, streaming: bool = False,
                 return_dict: bool = False, output_sequence_lengths: bool = False, output_log_probs: bool = False,
                 output_cum_log_probs: bool = False, output_generation_logits: bool = False,
                 sampling_config: SamplingConfig | None = None, documents=None, question_ids=None, a3=None, **kwargs):
        """batch_input_ids: list of 1-D integer tensors ``[seq_len]`` (int32/int64).

        Chunked RAG prompts (A3 KV fusion, ``docs/a3.md``): ``documents`` is a list with one
        entry per request, each a list of 1-D token id tensors (the document chunks, reused from
        the chunk KV store); ``question_ids`` a list of one 1-D tensor per request. Request ``i``'s
        prompt is then ``batch_input_ids[i]`` (the system prompt, may be empty) + the chunks of
        ``documents[i]`` in order + ``question_ids[i]``, and ``output_ids`` holds that whole prompt.
        ``a3`` (``macattn.methods.a3.reference.A3Config``) overrides the runner's default (``A3Config()`` if none).

        ``temperature=0`` is greedy, as are ``top_k=1`` and ``top_k=0`` with ``top_p=0`` (TensorRT-LLM's
        rule). ``random_seed``, ``repetition_penalty`` (> 0, 1 = off), ``presence_penalty`` /
        ``frequency_penalty`` (in [-2, 2], 0 = off), ``min_p`` (in [0, 1], 0 = off) and ``min_tokens`` (the
        end token is banned until the request generated that many; None = 0) take one value
        or one per request (a list or 1-D tensor); None = off (``random_seed`` None: ``EngineArgs.seed``'s
        generator, else a fresh seed). With ``sampling_config`` (the engine's ``SamplingConfig``) the
        penalties, ``min_p`` and ``min_tokens`` given here override its own. ``stop_words_list`` /
        ``bad_words_list``: module doc. ``output_log_probs`` / ``output_cum_log_probs`` /
        ``output_generation_logits`` add ``log_probs [batch, 1, max_new_tokens]`` (each generated token's
        log probability, 0 past the end), ``cum_log_probs [batch, 1]`` and ``generation_logits
        [batch, 1, max_new_tokens, vocab]`` fp32 to the dict. Other upstream keywords: see ``_UPSTREAM_NEUTRAL``."""
        _check_upstream_kwargs(kwargs)
        if not isinstance(batch_input_ids, (list, tuple)) or not batch_input_ids:
            raise ValueError("batch_input_ids must be a non-empty list of 1-D token id tensors")
        if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, int)):
            raise TypeError(f"pad_id must be an int or None, got {pad_id!r}")
        pad = end_id if end_id is not None else (pad_id if pad_id is not None else 0)   # upstream pads with end_id
        n = len(batch_input_ids)
        stops = words_per_request(stop_words_list, n, "stop_words_list", self.vocab_size)
        bads = words_per_request(bad_words_list, n, "bad_words_list", self.vocab_size)
        graphs = getattr(self.engine.executor, "decoder", None) is not None
        if graphs and any(len(w) > 1 for words in bads for w in words):
            raise NotImplementedError("bad_words_list: bad words of several tokens are not supported with the CUDA "
                                      "decoder yet (its bias table is written once per request, the ban changes per "
                                      "step); single-token bad words are")
        extra = {"repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
                 "frequency_penalty": frequency_penalty, "min_p": min_p, "min_tokens": min_tokens}
        if sampling_config is None:
            greedy = temperature == 0
            sampling_config = SamplingConfig(max_new_tokens=max_new_tokens, end_id=end_id,
                                             temperature=1.0 if greedy else temperature, top_k=1 if greedy else top_k,
                                             top_p=0.0 if greedy else top_p)
        params = [self._request_params(sampling_config, b, n, random_seed, extra) for b in range(n)]
        rag = self._rag_prompts(batch_input_ids, documents, question_ids, a3)
        seqs = []
        for i, ids in enumerate(batch_input_ids):
            try:
                seqs.append(self.engine.make_request(ids if rag is None else rag[i][0].tokens(), params[i]))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"batch_input_ids[{i}]: {exc}") from None
            if rag is not None:
                seqs[-1].rag = rag[i]
        words = [_Words(seq, stop, bad) if stop or bad else None for seq, stop, bad in zip(seqs, stops, bads)]
        for i, w in enumerate(words):
            if w is not None:
                try:
                    w.ban(seqs[i])          # the first token's bans (from the prompt's tail)
                except ValueError as exc:
                    raise ValueError(f"bad_words_list[{i}]: {exc}") from None
        for seq in seqs:
            self.engine.submit(seq)
        width = max(len(s.prompt) for s in seqs) + sampling_config.max_new_tokens
        extras = _Extras(seqs, sampling_config.max_new_tokens, self.vocab_size, output_log_probs or output_cum_log_probs,
                         output_generation_logits)
        gen = self._run(seqs, width, pad, return_dict, output_sequence_lengths, extras,
                        (output_log_probs, output_cum_log_probs, output_generation_logits), words)
        if streaming:
            return gen
        result = None
        for result in gen:
            pass
        return result

    def _request_params(self, base: SamplingConfig, b: int, n: int, random_seed, extra: dict) -> SamplingConfig:
        """Request ``b``'s sampling parameters: ``base`` with the per-request values of ``extra`` (the
        penalties, ``min_p``, ``min_tokens``; None = keep) and its seed (``random_seed``, else the runner's
        seed generator's next draw, else ``base``'s)."""
        kw = {k: v for k, v in ((k, _per_request(v, b, n, k)) for k, v in extra.items()) if v is not None}
        seed = _per_request(random_seed, b, n, "random_seed")
        if seed is None and base.random_seed is None and self._seeds is not None:
            seed = self._seeds.randint(0, MAX_SEED)
        if seed is not None:
            kw["random_seed"] = seed
        return dataclasses.replace(base, **kw) if kw else base

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

    def _run(self, seqs, width, pad, return_dict, output_sequence_lengths, extras, wanted, words):
        by_id = {s.request_id: (s, w) for s, w in zip(seqs, words) if w is not None}
        # bans of bad words spanning tokens are made from each request's tail before every step: serial steps
        sync = any(w.dynamic for _, w in by_id.values())
        try:
            while not all(s.finished for s in seqs):
                for seq, w in by_id.values():    # this step's bans of bad words (host side, from each tail)
                    if w.dynamic and not seq.finished:
                        w.ban(seq)
                for step in self.engine.step(sync=sync):
                    extras.record(step)
                    seq, w = by_id.get(step.request_id, (None, None))
                    if w is not None and w.stops and step.token is not None and not step.finished \
                            and ends_with_word(w.tail(seq), w.stops):    # a stop word: this token is the last
                        self.engine.abort(step.request_id)
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
