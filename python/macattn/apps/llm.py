"""The LLM API: text in, text out, as vLLM and TensorRT-LLM users write it (``LLM``, ``SamplingParams``,
``RequestOutput`` / ``CompletionOutput``, the names of both), over the in-flight batching engine.

    from macattn import LLM, SamplingParams
    llm = LLM("builtin")                                  # or a transformers model directory
    for out in llm.generate(["The gospel of", "In the beginning"], SamplingParams(max_tokens=16)):
        print(out.prompt, "->", out.outputs[0].text, out.outputs[0].finish_reason)

Prompts: a string (tokenized with the model's tokenizer; the built-in checkpoint ships its own), a token id
list, a dict ``{"prompt": text}`` (vLLM's ``TextPrompt``) or ``{"prompt_token_ids": ids}`` (``TokensPrompt``),
or a list of any of these. ``generate`` and ``chat`` always return a list, one ``RequestOutput`` per prompt (a
single prompt gives a list of one), as vLLM and TensorRT-LLM do. ``chat`` renders conversations with the
tokenizer's chat template (the built-in one: ``macattn.models.checkpoint``).

``SamplingParams`` takes the field names of both (``SamplingParams`` doc: every field and its range). Greedy
iff ``temperature == 0`` or ``top_k == 1``, or nothing asks for sampling (``SamplingParams()``: greedy, as in
TensorRT-LLM); any ``temperature > 0`` samples (with ``top_k`` / ``top_p`` / ``min_p`` cuts when given).
Fields of either API that this engine does not implement and that would change the output are accepted only
at their neutral value; another value raises ``ValueError("not supported by this engine: ...")``. Stop
strings and stop token ids end a request after the step that produced them (its slot is freed at once); the
text is cut before the stop string unless ``include_stop_str_in_output``. ``n > 1`` samples the prompt ``n``
times as forked requests sharing its prefilled KV (``RequestOutput.outputs[i]``, seeds ``seed + i``).

One engine loop (a daemon thread started on first use) runs the engine's steps for every caller:
``generate`` / ``chat`` (blocking, a batch, an optional tqdm bar), ``generate_async`` (a ``RequestHandle``:
``result()``, ``aresult()``, iteration over streamed ``RequestOutput`` snapshots, ``async for``, ``abort()``),
from any number of threads; requests submitted while others run join the next step (in-flight batching).
``shutdown()`` (or ``with LLM(...)``) stops the loop and aborts what is left.
"""
from __future__ import annotations

import asyncio
import math
import queue
import random
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from macattn.core.validation import all_ints
from macattn.methods.mac.config import MacConfig
from macattn.runtime.engine_args import EngineArgs
from macattn.runtime.sampling import DIVISOR_RANGE, MAX_LOGIT_BIAS, MAX_SEED, MAX_STOP_TOKEN_IDS
from macattn.runtime.sampling import SamplingConfig as EngineSampling
from macattn.runtime.word_lists import with_bans

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestHandle", "RequestError", "REFUSED"]

# fields of vLLM's / TensorRT-LLM's SamplingParams this engine does not implement, accepted only at these
# values (they leave the output as it is); another value raises "not supported by this engine: name=value"
REFUSED: dict[str, tuple] = {
    "use_beam_search": (False,), "beam_width": (None, 1), "length_penalty": (None, 1.0),
    "early_stopping": (None, False), "beam_search_diversity_rate": (None, 0.0), "beam_width_array": (None,),
    "no_repeat_ngram_size": (None, 0), "top_p_min": (None,), "top_p_reset_ids": (None,), "top_p_decay": (None,),
    "bad": (None, []), "bad_words": (None, []), "allowed_token_ids": (None,), "embedding_bias": (None,),
    "logits_processor": (None,), "logits_processors": (None, []), "apply_batched_logits_processor": (False,),
    "guided_decoding": (None,), "structured_outputs": (None,), "lookahead_config": (None,),
    "return_context_logits": (False,), "exclude_input_from_output": (True,), "return_encoder_output": (False,),
    "additional_model_outputs": (None,), "spaces_between_special_tokens": (True,), "return_log_probs": (False,),
    "extra_args": (None,), "flat_logprobs": (False,), "return_perf_metrics": (False, True),
}
# older spellings (TensorRT-LLM's deprecated names) -> the field
_ALIASES = {"max_new_tokens": "max_tokens", "random_seed": "seed", "min_length": "min_tokens"}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same(value, neutral) -> bool:
    """``value`` is the neutral value ``neutral`` (numbers by value, ``True`` never equal to ``1``)."""
    if value is neutral:
        return True
    if neutral is None or value is None or isinstance(value, bool) != isinstance(neutral, bool):
        return False
    return (type(value) is type(neutral) or (_is_real(value) and _is_real(neutral))) and value == neutral


def _real(name: str, value, lo: float, hi: float, what: str, *, lo_open: bool = False, none: bool = False):
    """``value`` as a float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``; None when ``none``), else a
    ``ValueError`` naming ``name`` and ``what`` (the range in words)."""
    if value is None and none:
        return None
    ok = _is_real(value) and math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def _int(name: str, value, lo: int, what: str, *, none: bool = True, hi: int | None = None):
    if value is None and none:
        return None
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


@dataclass(frozen=True, init=False)
class SamplingParams:
    """One request's sampling and output options, with vLLM's and TensorRT-LLM's field names (older
    TensorRT-LLM spellings ``max_new_tokens`` / ``random_seed`` / ``min_length`` accepted). Each is validated
    on construction (``ValueError`` naming the field and its range); an unknown name raises ``TypeError``;
    fields in ``REFUSED`` are accepted only at their neutral values.

    Length and number: ``max_tokens`` int >= 1, or None = the rest of the context (``max_seq_len`` minus the
    prompt); default 32. ``min_tokens`` int in [0, max_tokens]: the end token and ``stop_token_ids`` are banned
    and stop strings not checked before that many tokens. ``n`` int >= 1: sequences sampled from the prompt
    (forked requests; ``RequestOutput.outputs[i]``). ``best_of``: None or ``n`` (more is not supported).

    Sampling (greedy iff ``temperature == 0`` or ``top_k == 1``, or none of ``temperature`` > 0, ``top_k`` > 1,
    ``top_p`` in (0, 1] is given): ``temperature`` 0 or a float in [1e-6, 1e6]
    (``DIVISOR_RANGE``; None: 1.0 once sampling). ``top_k`` int >= -1
    (-1 / 0 / None: no cut). ``top_p`` float in [0, 1] (0 / 1 / None: no cut). ``min_p`` float in [0, 1]
    (0 = off). ``seed`` int in [0, 2^63 - 1] (None: ``EngineArgs.seed``'s generator, else a fresh seed); a
    request's tokens depend only on its seed and prompt, never on the batch. ``presence_penalty`` /
    ``frequency_penalty`` float in [-2, 2] (0 = off; OpenAI's, over the generated tokens).
    ``repetition_penalty`` float in [1e-6, 1e6] (1 = off; over prompt and generated tokens). ``logit_bias``: a mapping
    token id (int >= 0) -> bias (float in [-100, 100]), at most 64 entries. ``bad_token_ids``: token ids never
    generated (TensorRT-LLM's).

    Stopping: ``stop`` a string or a list of non-empty strings; ``stop_token_ids`` ints >= 0 (at most 16; the
    token is kept in the output); ``include_stop_str_in_output``; ``ignore_eos`` (no end token);
    ``end_id`` (TensorRT-LLM: the end token; None = the tokenizer's EOS); ``pad_id``.

    Outputs: ``logprobs`` int >= 0 or None: each generated token's log probability plus the ``k`` most likely
    tokens' (the model's log-softmax before penalties and bias). ``prompt_logprobs`` int >= 0 or None: the same
    for every prompt token given its prefix (``RequestOutput.prompt_logprobs``; position 0 is None).
    ``return_generation_logits``: every step's logits ``[V]`` fp32. ``truncate_prompt_tokens`` int >= 1:
    keep the prompt's last k tokens. ``detokenize`` / ``skip_special_tokens`` / ``add_special_tokens``:
    tokenizer behaviour."""

    max_tokens: int | None = 32
    min_tokens: int = 0
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    end_id: int | None = None
    pad_id: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_generation_logits: bool = False
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    add_special_tokens: bool = True

    def __init__(self, **kwargs: Any) -> None:
        known = type(self).__dataclass_fields__
        for old, new in _ALIASES.items():
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"SamplingParams got both {old!r} and {new!r} (the same field)")
                kwargs[new] = kwargs.pop(old)
        for name, value in kwargs.items():
            if name in known:
                continue
            if name not in REFUSED:
                raise TypeError(f"SamplingParams got an unknown field {name!r}")
            if not any(_same(value, v) for v in REFUSED[name]):
                raise ValueError(f"not supported by this engine: {name}={value!r} (accepted: {list(REFUSED[name])})")
        for name, f in known.items():
            object.__setattr__(self, name, kwargs.get(name, f.default))
        self._validate()

    def _validate(self) -> None:
        _int("max_tokens", self.max_tokens, 1, "an int >= 1 or None (the rest of the context)")
        hi = self.max_tokens
        _int("min_tokens", self.min_tokens, 0, f"an int in [0, max_tokens={hi}]" if hi else "an int >= 0",
             none=False, hi=hi)
        _int("n", self.n, 1, "an int >= 1", none=False)
        if self.best_of is not None and self.best_of != self.n:
            if not _is_int(self.best_of) or self.best_of < self.n:
                raise ValueError(f"best_of must be None or an int >= n={self.n}, got {self.best_of!r}")
            raise ValueError(f"not supported by this engine: best_of={self.best_of} > n={self.n} (best_of must be "
                             "None or n)")
        lo, hi = DIVISOR_RANGE
        if not (_is_real(self.temperature) and self.temperature == 0):
            _real("temperature", self.temperature, lo, hi, f"0 (greedy), a float in [{lo:g}, {hi:g}] or None", none=True)
        _int("top_k", self.top_k, -1, "an int in [-1, 2^63 - 1] (-1 or 0: no cut; 1: greedy) or None", hi=(1 << 63) - 1)
        _real("top_p", self.top_p, 0.0, 1.0, "a float in [0, 1] (0 or 1: no cut) or None", none=True)
        _real("min_p", self.min_p, 0.0, 1.0, "a float in [0, 1] (0 = off)")
        _int("seed", self.seed, 0, "an int in [0, 2^63 - 1] or None", hi=MAX_SEED)
        for name in ("presence_penalty", "frequency_penalty"):
            _real(name, getattr(self, name), -2.0, 2.0, "a float in [-2, 2] (0 = off)")
        _real("repetition_penalty", self.repetition_penalty, lo, hi, f"a float in [{lo:g}, {hi:g}] (1 = off)")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name, most in (("stop_token_ids", MAX_STOP_TOKEN_IDS), ("bad_token_ids", MAX_LOGIT_BIAS)):
            ids = getattr(self, name)
            if ids is None:
                continue
            bad = isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__")
            ids = [] if bad else list(ids)
            if bad or any(not _is_int(i) or i < 0 for i in ids) or len(ids) > most:
                raise ValueError(f"{name} must be a list of at most {most} ints >= 0, got {getattr(self, name)!r}")
            object.__setattr__(self, name, list(dict.fromkeys(ids)))
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s
                                                                                 for s in stops)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        for name in ("end_id", "pad_id"):
            _int(name, getattr(self, name), 0, "an int >= 0 or None")
        for name in ("logprobs", "prompt_logprobs"):
            _int(name, getattr(self, name), 0, "an int >= 0 (the top-k per position) or None")
        _int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, "an int >= 1 or None")
        for name in ("include_stop_str_in_output", "ignore_eos", "return_generation_logits", "detokenize",
                     "skip_special_tokens", "add_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def greedy(self) -> bool:
        """The module doc's rule: ``temperature == 0`` or ``top_k == 1``, or no field asks for sampling."""
        if self.temperature == 0 or self.top_k == 1:
            return True
        asks = ((self.temperature is not None and self.temperature > 0) or (self.top_k or 0) > 1
                or (self.top_p is not None and self.top_p > 0))
        return not asks

    def engine_params(self, eos_id: int | None, *, max_new_tokens: int | None = None,
                      seed: int | None = None) -> EngineSampling:
        """The engine's per-request parameters (``macattn.runtime.sampling.SamplingParams``): ``max_new_tokens``
        replaces ``max_tokens`` (required when it is None), ``seed`` is used when the request gives none."""
        if max_new_tokens is None:
            if self.max_tokens is None:
                raise ValueError("max_tokens=None (the rest of the context) needs the prompt: pass max_new_tokens")
            max_new_tokens = self.max_tokens
        greedy = self.greedy
        temperature = 1.0 if greedy or self.temperature is None else self.temperature
        params = EngineSampling(
            max_new_tokens=max_new_tokens,
            end_id=None if self.ignore_eos else (self.end_id if self.end_id is not None else eos_id),
            temperature=float(temperature), top_k=1 if greedy else max(self.top_k or 0, 0),
            top_p=0.0 if greedy else (1.0 if not self.top_p else float(self.top_p)),
            random_seed=self.seed if self.seed is not None else seed, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias, min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()), prompt_logprobs=self.prompt_logprobs)
        return with_bans(params, self.bad_token_ids or ())


def _logit_bias(value) -> dict[int, float] | None:
    """``logit_bias`` as ``{token id: bias}`` (JSON's string keys of digits accepted), validated."""
    if value is None:
        return None
    what = f"logit_bias must map token ids (int >= 0) to biases (float in [-100, 100]), at most {MAX_LOGIT_BIAS}"
    if not isinstance(value, Mapping):
        raise ValueError(f"{what}; got {type(value).__name__} {value!r}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"{what}; got {len(value)} entries")
    out = {}
    for k, v in value.items():
        t = int(k) if isinstance(k, str) and k.isdigit() else k
        if not _is_int(t) or t < 0 or not _is_real(v) or not math.isfinite(v) or not -100 <= v <= 100:
            raise ValueError(f"{what}; got the entry {k!r}: {v!r}")
        out[t] = float(v)
    return out


@dataclass
class CompletionOutput:
    """One generated sequence: ``index`` (of the ``n``), ``text``, ``token_ids`` (stop tokens included; the
    end token is not emitted), ``logprobs`` (per token ``{token_id: logprob}``: the sampled token and the top
    ``SamplingParams.logprobs``), ``cumulative_logprob``, ``finish_reason`` (``"stop"`` / ``"length"`` /
    ``"abort"``), ``stop_reason`` (the stop string or stop token id that ended it; None for the end token),
    ``generation_logits`` ``[len(token_ids), V]`` fp32 when asked."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """``prompt`` (None for a token id prompt), ``prompt_token_ids``, ``outputs`` (``n`` ``CompletionOutput``s,
    index order), ``finished`` (all of them), ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``: per
    prompt position None for position 0, else ``{prompt token: logprob, top-k tokens: logprob}``), ``metrics``:
    ``ttft_s`` (submission to first token), ``inter_token_latency_s`` (mean gap between later tokens of a
    sequence) and ``inter_token_latencies_s`` (every such gap, the sequences one after another),
    ``e2e_s``, ``num_generated_tokens`` (all sequences) and the method's figures of the request (of its first
    sequence; MAC: ``mac_hit_rate``, the share of its (step, layer, head) matches that hit, and ``mac_kv_skip``,
    the mean share of the prefix a step skipped)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list | None = None


def _progress(use_tqdm, total: int, desc: str):
    """A tqdm bar over ``total`` requests, or None: ``use_tqdm`` True / False, a tqdm-like factory, or None
    (a bar exactly when stderr is a terminal)."""
    if use_tqdm is None:
        use_tqdm = sys.stderr.isatty()
    if not use_tqdm or not total:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, unit="req")
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)


_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all_ints(x)


def _prompt_list(prompts) -> list:
    """``prompts`` as a list of single prompts (module doc: one prompt, or a list of them)."""
    if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is empty: give a prompt or a non-empty list of prompts")
        return list(prompts)
    raise TypeError(f"prompts must be a string, a token id list, a dict with 'prompt' or 'prompt_token_ids', or "
                    f"a list of them; got {type(prompts).__name__}")


class LLM:
    """model: ``"builtin"`` (the packaged trained checkpoint and its tokenizer; also ``"trained"``,
    ``"tiny-llama"``), a transformers model directory, or a ``*ForCausalLM`` object (then ``tokenizer`` is
    required: an object or a tokenizer directory). ``tokenizer``: a tokenizer object or directory (default: the
    model's). Every other keyword argument is an ``EngineArgs`` field (``macattn.runtime.engine_args``: the same
    options, defaults and meanings as ``macattn serve``'s flags and ``ModelRunner.from_hf``) — ``method``
    (``"mac"``, ``"full"``, ``"completion"``, ...), ``mac`` (None: MAC's defaults; ``"off"``; a ``MacConfig``;
    a per-layer file from ``macattn tune``), ``mac_tau`` / ``mac_window`` / ``mac_band``, ``dtype`` (``"auto"``,
    ``"bfloat16"``, ``"half"``, ... or a torch dtype), ``device``, ``max_batch_size``, ``max_seq_len``,
    ``max_num_batched_tokens``, ``use_cuda_graphs`` (None: on CUDA), ``quantization``,
    ``tensor_parallel_size``, ``trust_remote_code``, ``gpu_memory_utilization`` (on CUDA: the KV pool sized
    from free memory; unused on the CPU), ``enable_prefix_caching`` (None: on where the method supports it),
    ``seed`` (the seeds of requests that give none), retrieval-completion's ``completion_maps`` /
    ``completion_gate`` (a per-layer gate file from ``macattn tune --completion``) / ``kv_offload`` /
    ``prefix_store``.
    vLLM / TensorRT-LLM spellings: ``max_model_len`` = ``max_seq_len``, ``max_num_seqs`` = ``max_batch_size``,
    ``max_num_tokens`` = ``max_num_batched_tokens``, ``enforce_eager=True`` = ``use_cuda_graphs=False``.
    ``completion`` (a ``CompletionConfig``) and ``offload`` (an ``OffloadConfig``) are retrieval-completion's
    options as objects. An unknown keyword raises ``TypeError`` naming it.

    Retrieval-completion (``method="completion"``): the exhaustive selector by default (with ``kv_offload``
    the page selector ``"quest"``); ``kv_offload="host"``: the prompt KV lives in host memory and each step
    fetches the pages it selects (``macattn.methods.completion.offload``); ``prefix_store``: a directory where
    prompts' KV persist (model identity and sha256 checked on load), used by ``generate(..., reuse_prefix=True)``."""

    _SPELLINGS = {"max_model_len": "max_seq_len", "max_num_seqs": "max_batch_size",
                  "max_num_tokens": "max_num_batched_tokens"}

    def __init__(self, model: Any = "builtin", *, tokenizer: Any = None, completion: Any = None, offload: Any = None,
                 **engine_args: Any) -> None:
        self._engine_loop: _EngineLoop | None = None
        self._loop_lock = threading.Lock()
        for alias, name in self._SPELLINGS.items():
            if alias in engine_args:
                value = engine_args.pop(alias)
                if name in engine_args and engine_args[name] != value:
                    raise ValueError(f"{alias}={value!r} and {name}={engine_args[name]!r} name the same engine "
                                     "argument: give one")
                engine_args[name] = value
        if "enforce_eager" in engine_args:
            eager = engine_args.pop("enforce_eager")
            if not isinstance(eager, bool):
                raise TypeError(f"enforce_eager must be a bool, got {eager!r}")
            if eager:
                if engine_args.get("use_cuda_graphs"):
                    raise ValueError("enforce_eager=True contradicts use_cuda_graphs=True")
                engine_args["use_cuda_graphs"] = False
        if isinstance(engine_args.get("mac"), MacConfig):
            engine_args["mac"] = engine_args["mac"].to_dict()
        if isinstance(engine_args.get("dtype"), torch.dtype):
            engine_args["dtype"] = str(engine_args["dtype"]).removeprefix("torch.")
        if isinstance(tokenizer, (str, Path)):
            engine_args["tokenizer"] = str(tokenizer)
            tokenizer = None
        named = isinstance(model, (str, Path))
        self.args = EngineArgs.from_kwargs(**({"model": str(model)} if named else {}), **engine_args)
        if named:
            hf, tok = self.args.load_model(with_tokenizer=tokenizer is None)
        elif tokenizer is None and self.args.tokenizer is None:
            raise ValueError("tokenizer (an object or a tokenizer directory) is required when model is a model object")
        else:
            hf, tok = model, None
            if tokenizer is None:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(self.args.tokenizer, local_files_only=True,
                                                    trust_remote_code=self.args.trust_remote_code)
        self.tokenizer = tokenizer or tok
        self._seeds = None if self.args.seed is None else random.Random(self.args.seed)
        self._seeds_lock = threading.Lock()
        self.engine = self.args.build_engine(hf, completion=completion, offload=offload)

    # --- the tokenizer ----------------------------------------------------------------------
    def get_tokenizer(self):
        """The tokenizer prompts are encoded and outputs decoded with (vLLM's name)."""
        return self.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """Encode and decode with ``tokenizer`` from now on (requests already running keep the old one)."""
        self.tokenizer = tokenizer
        if self._engine_loop is not None:
            self._engine_loop.tokenizer = tokenizer

    # --- generation -------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: Any = None, lora_request: Any = None, *, reuse_prefix: bool = False) -> list[RequestOutput]:
        """``prompts``: one prompt (a string, a token id list, ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}``) or a list of them. ``sampling_params``: one for all or one per prompt
        (None: ``SamplingParams()``). Returns a list with one ``RequestOutput`` per prompt, always (a single
        prompt gives a list of one). Every request is validated before any runs. ``use_tqdm``: a progress bar
        over the requests (None: when stderr is a terminal; or a tqdm-like factory). ``lora_request``: only
        None. ``reuse_prefix``: load each prompt's KV from the ``prefix_store`` when it is there (skipping its
        prefill; ``RequestOutput.metrics["prefix_reused"]``), else prefill and persist it."""
        if lora_request is not None:
            raise ValueError(f"not supported by this engine: lora_request={lora_request!r}")
        batch = _prompt_list(prompts)
        params = self._params_list(sampling_params, len(batch))
        requests = [self._request(p, sp, index=i, reuse_prefix=reuse_prefix)
                    for i, (p, sp) in enumerate(zip(batch, params))]
        return self._run_batch(requests, use_tqdm, "Processed prompts")

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: Any = None, lora_request: Any = None, chat_template: str | None = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate the next message of one conversation (a list of ``{"role", "content"}`` dicts) or of each of
        a list of conversations: each is rendered with the tokenizer's chat template (or ``chat_template``;
        ``add_generation_prompt`` / ``continue_final_message`` / ``chat_template_kwargs`` as in
        ``apply_chat_template``), encoded without added special tokens (the template writes them) and generated
        as ``generate`` does (``RequestOutput.prompt`` is the rendered text). Returns a list, one
        ``RequestOutput`` per conversation."""
        if lora_request is not None:
            raise ValueError(f"not supported by this engine: lora_request={lora_request!r}")
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, Mapping) for m in messages):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)) and messages and all(isinstance(c, (list, tuple)) for c in messages):
            conversations = list(messages)
        else:
            raise TypeError("messages must be a conversation (a non-empty list of {'role', 'content'} dicts) or a "
                            "list of conversations")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the tokenizer has no chat template: pass chat_template= (a Jinja template)")
        prompts = []
        for i, conv in enumerate(conversations):
            where = "messages" if len(conversations) == 1 else f"messages[{i}]"
            if not conv or not all(isinstance(m, Mapping) for m in conv):
                raise TypeError(f"{where} must be a non-empty list of {{'role', 'content'}} dicts")
            try:
                text = self.tokenizer.apply_chat_template(
                    [dict(m) for m in conv], chat_template=template, tokenize=False,
                    add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                    **(chat_template_kwargs or {}))
            except Exception as exc:      # noqa: BLE001 - jinja's TemplateError and the template's own refusals
                raise ValueError(f"{where}: the chat template refused it: {exc}") from None
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        params = self._params_list(sampling_params, len(prompts))
        requests = [self._request(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, params))]
        return self._run_batch(requests, use_tqdm, "Processed chats")

    def generate_async(self, prompt, sampling_params: SamplingParams | None = None, *, streaming: bool = True,
                       reuse_prefix: bool = False) -> "RequestHandle":
        """Submit one prompt (any form ``generate`` takes; validated now) and return at once: a
        ``RequestHandle`` (``result()`` / ``await aresult()``: the final ``RequestOutput``; iteration: a snapshot
        after every generated token with ``streaming`` (TensorRT-LLM's argument; default True here), only the
        final one without; ``abort()``). ``reuse_prefix``: as ``generate``."""
        if not isinstance(streaming, bool):
            raise TypeError(f"streaming must be a bool, got {streaming!r}")
        if isinstance(prompt, (list, tuple)) and not _is_token_ids(prompt):
            raise TypeError("generate_async takes one prompt (a string, a token id list or a prompt dict), not a list")
        handle = self._loop().submit(self._request(prompt, sampling_params or SamplingParams(),
                                                   reuse_prefix=reuse_prefix))
        handle.streaming = streaming
        return handle

    def _params_list(self, sampling_params, n: int) -> list:
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * n)
        if len(params) != n:
            raise ValueError(f"sampling_params must be one SamplingParams or one per prompt ({n}), got {len(params)}")
        return [sp if sp is not None else SamplingParams() for sp in params]

    def _run_batch(self, requests: list, use_tqdm, desc: str) -> list[RequestOutput]:
        bar = _progress(use_tqdm, len(requests), desc)
        handles = []
        try:
            handles = [self._loop().submit(r) for r in requests]
            outputs = []
            for h in handles:
                outputs.append(h.result())
                if bar is not None:
                    bar.update(1)
            return outputs
        finally:   # an interrupted wait leaves no request of this call behind
            for h in handles:
                h.abort()
            if bar is not None:
                bar.close()

    def shutdown(self) -> None:
        """Stop the engine loop; requests still running are aborted (their handles end with
        ``finish_reason="abort"``). A later call starts a new loop."""
        loop, self._engine_loop = getattr(self, "_engine_loop", None), None
        if loop is not None:
            loop.stop()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:   # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _loop(self) -> "_EngineLoop":
        with self._loop_lock:         # callers on several threads at once start one loop
            if self._engine_loop is None:
                self._engine_loop = _EngineLoop(self)
            return self._engine_loop

    def _prompt_ids(self, prompt, sp: SamplingParams, where: str) -> tuple[str | None, list[int] | tuple[int, ...]]:
        """``(prompt text or None, token ids)`` of one prompt (``generate``'s forms); token ids given are passed on
        as they are, not copied (``LLMEngine.make_request`` keeps a copy of its own)."""
        if isinstance(prompt, Mapping):
            unknown = [k for k in prompt if k not in _PROMPT_KEYS]
            if unknown:
                raise ValueError(f"{where}: not supported by this engine: {unknown[0]!r} (a prompt dict takes "
                                 f"{list(_PROMPT_KEYS)})")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"{where}['prompt'] must be a string, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all_ints(ids):
                    raise TypeError(f"{where}['prompt_token_ids'] must be a list of ints")
                return text, ids
            if text is None:
                raise ValueError(f"{where} must have 'prompt' (text) or 'prompt_token_ids'")
            prompt = text
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where} is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=sp.add_special_tokens)
        if isinstance(prompt, (list, tuple)):
            return None, prompt
        raise TypeError(f"{where} must be a string, a token id list or a prompt dict, got {type(prompt).__name__}")

    def _request(self, prompt, sp: SamplingParams, *, index: int | None = None, reuse_prefix: bool = False):
        """Validate one request (errors name ``prompts[index]`` / ``sampling_params[index]``, or ``prompt`` /
        ``sampling_params`` for a single one) and build it (``_Request``)."""
        where, sp_where = (("prompt", "sampling_params") if index is None
                           else (f"prompts[{index}]", f"sampling_params[{index}]"))
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"{sp_where} must be a macattn SamplingParams, got {type(sp).__name__}")
        text, ids = self._prompt_ids(prompt, sp, where)
        if sp.truncate_prompt_tokens is not None:
            ids = ids[-sp.truncate_prompt_tokens:]
        vocab = self.engine.vocab_size
        if sp.logprobs is not None and sp.logprobs > vocab:
            raise ValueError(f"{sp_where}: logprobs must be an int in [0, vocab_size={vocab}], got {sp.logprobs}")
        bad = [t for t in sp.bad_token_ids or () if t >= vocab]
        if bad:
            raise ValueError(f"{sp_where}: bad_token_ids must lie in [0, {vocab - 1}], got {bad}")
        max_new = sp.max_tokens
        if max_new is None:
            max_new = self.engine.config.max_seq_len - len(ids)
            if max_new < 1:
                raise ValueError(f"{where}: {len(ids)} prompt tokens leave no room to generate "
                                 f"(max_seq_len={self.engine.config.max_seq_len})")
        seed = None
        if sp.seed is None and self._seeds is not None:
            with self._seeds_lock:
                seed = self._seeds.randint(0, MAX_SEED)
        try:
            esp = sp.engine_params(self.tokenizer.eos_token_id, max_new_tokens=max_new, seed=seed)
            seq = self.engine.make_request(ids, esp, reuse_prefix=reuse_prefix, n=sp.n)
        except (ValueError, TypeError, NotImplementedError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        ids_all = [seq.request_id] + [f.request_id for f in seq.forks]
        lp = sp.logprobs is not None
        out = RequestOutput(seq.request_id, text, list(seq.prompt),
                            [CompletionOutput(i, logprobs=[] if lp else None, cumulative_logprob=0.0 if lp else None)
                             for i in range(sp.n)])
        return _Request(seq, sp, out, ids_all)


class RequestError(RuntimeError):
    """Serving this request failed (the engine or its output raised for it); the other requests went on."""


class _Request:
    """One submitted prompt in the engine loop: its first sequence (``seq``; the others are its forks), the
    request ids of all ``n`` (index order), the ``RequestOutput`` being built and per-sequence state."""

    def __init__(self, seq, sp: SamplingParams, out: RequestOutput, ids: list[int]) -> None:
        self.seq, self.sp, self.out, self.ids = seq, sp, out, ids
        self.index = {rid: i for i, rid in enumerate(ids)}
        self.checked = [0] * len(ids)         # text offsets searched for stop strings, per sequence
        self.token_times: list[list[float]] = [[] for _ in ids]   # per sequence, as the output thread got them
        self.start = time.perf_counter()
        self.handle: RequestHandle | None = None

    @property
    def request_id(self) -> int:
        return self.seq.request_id


_REASONS = {"end_id": "stop", "stop_token_id": "stop", "length": "length", "aborted": "abort"}


def _record(tokenizer, step, req: _Request) -> str | None:
    """Fold one ``StepOutput`` into its sequence's ``CompletionOutput``: token, logprobs / logits, text, stop
    strings. Returns the finish reason when that sequence ends here (the caller then frees it)."""
    sp, out = req.sp, req.out
    i = req.index[step.request_id]
    comp = out.outputs[i]
    if out.prompt_logprobs is None and getattr(step, "prompt_logprobs", None) is not None:
        out.prompt_logprobs = list(step.prompt_logprobs)
    if step.token is not None:
        req.token_times[i].append(time.perf_counter())
        comp.token_ids.append(step.token)
        if sp.logprobs is not None or sp.return_generation_logits:
            _logits(step, sp, comp)
    reason = _REASONS.get(step.finish_reason, step.finish_reason)
    stop = step.token if step.finish_reason == "stop_token_id" else None
    text = tokenizer.decode(comp.token_ids, skip_special_tokens=sp.skip_special_tokens) if sp.detokenize else ""
    if sp.stop_strings and len(comp.token_ids) >= sp.min_tokens:
        # search the text this token added, the stop string's overlap with the text before and 3 characters
        # more (a character split over tokens decodes as up to 3 replacement characters until it completes)
        for s in sp.stop_strings:
            at = text.find(s, max(0, req.checked[i] - len(s) - 3))
            if at >= 0:
                text, reason, stop = text[:at + (len(s) if sp.include_stop_str_in_output else 0)], "stop", s
                break
    req.checked[i] = len(text)
    comp.text = text
    if reason is not None:
        comp.finish_reason, comp.stop_reason = reason, stop
    return reason


def _finish_metrics(req: _Request) -> None:
    """``out.metrics`` of a finished request (latencies and the method's figures of its first sequence)."""
    out = req.out
    first = min((seq[0] for seq in req.token_times if seq), default=None)
    gaps = tuple(b - a for seq in req.token_times for a, b in zip(seq, seq[1:]))
    out.metrics = {"ttft_s": None if first is None else first - req.start,
                   "inter_token_latency_s": sum(gaps) / len(gaps) if gaps else None,
                   "inter_token_latencies_s": gaps,
                   "e2e_s": time.perf_counter() - req.start,
                   "num_generated_tokens": sum(len(c.token_ids) for c in out.outputs), **req.seq.metrics}


def _logits(step, sp: SamplingParams, comp: CompletionOutput) -> None:
    """Append the step's generation logits and / or logprobs (``SamplingParams.logprobs``) to ``comp``."""
    row = step.logits.float()
    if sp.return_generation_logits:
        row_cpu = row.detach().cpu().unsqueeze(0)
        comp.generation_logits = row_cpu if comp.generation_logits is None else torch.cat(
            [comp.generation_logits, row_cpu])
    if sp.logprobs is not None:
        lp = torch.log_softmax(row, -1)
        top = lp.topk(sp.logprobs).indices.tolist() if sp.logprobs else []
        entry = {int(t): float(lp[t]) for t in [step.token, *top]}
        comp.logprobs.append(entry)
        comp.cumulative_logprob += entry[step.token]


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy a reader may keep while the request goes on (lists copied; logits tensors shared)."""
    outs = [replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))
            for c in out.outputs]
    return replace(out, outputs=outs, metrics=dict(out.metrics))


class RequestHandle:
    """One submitted request: ``result(timeout)`` blocks for the final ``RequestOutput`` (``await aresult()``
    from a coroutine); iterating (``for`` or ``async for``) yields a snapshot after every generated token, the
    last one finished (with ``streaming=False``: the final one only); ``abort()`` ends it now and frees its
    slots (a client that went away). ``request_id`` is the engine's (of its first sequence)."""

    def __init__(self, loop: "_EngineLoop", request_id: int) -> None:
        self._loop, self.request_id = loop, request_id
        self.streaming = True
        self._updates: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waker: tuple | None = None          # (event loop, asyncio.Event) of an ``async for``
        self._final: RequestOutput | None = None
        self._error: BaseException | None = None

    def _push(self, snapshot: RequestOutput | BaseException) -> None:
        """From the engine thread: queue ``snapshot`` and wake an ``async for`` reader if one waits."""
        with self._lock:
            self._updates.put(snapshot)
            waker = self._waker
        if waker is not None:
            waker[0].call_soon_threadsafe(waker[1].set)

    def _take(self, item) -> RequestOutput:
        if isinstance(item, BaseException):
            self._error = item
            raise item
        if item.finished:
            self._final = item
        return item

    def _next(self, timeout: float | None = None) -> RequestOutput | None:
        """The next snapshot, or None once the final one was handed out."""
        if self._final is not None or self._error is not None:
            if self._error is not None:
                raise self._error
            return None
        return self._take(self._updates.get(timeout=timeout))

    @property
    def finished(self) -> bool:
        return self._final is not None

    def result(self, timeout: float | None = None) -> RequestOutput:
        while self._final is None:
            if self._next(timeout) is None:
                break
        return self._final

    async def aresult(self) -> RequestOutput:
        """``result()`` for a coroutine (TensorRT-LLM's name): waits without holding a thread."""
        async for _ in self._stream():
            pass
        return self._final

    def __iter__(self):
        while (item := self._next()) is not None:
            if self.streaming or item.finished:
                yield item

    async def __aiter__(self):
        async for item in self._stream():
            if self.streaming or item.finished:
                yield item

    async def _stream(self):
        # woken from the engine thread through the event loop: no worker thread is held per stream
        # (``asyncio.to_thread`` per token would queue streams behind the executor's few threads)
        wake = asyncio.Event()
        with self._lock:
            self._waker = (asyncio.get_running_loop(), wake)
        try:
            while self._final is None and self._error is None:
                try:
                    item = self._updates.get_nowait()
                except queue.Empty:
                    wake.clear()
                    if self._updates.empty():
                        await wake.wait()
                    continue
                yield self._take(item)
            if self._error is not None:
                raise self._error
        finally:
            with self._lock:
                self._waker = None

    def abort(self, *, wait: bool = True) -> None:
        """End the request now and free its slots (``wait`` False: before the engine's next step, without waiting
        for the step in progress: what a server's event loop calls)."""
        self._loop.abort(self.request_id, wait=wait)


class _EngineLoop:
    """Two threads serve every handle (module doc). The engine thread steps the engine back to back and is the
    only thread that touches it: a submission, a release or an abort from any other thread goes into ``inbox``,
    which the engine thread applies between two steps, so no caller (the server's event loop, the output thread)
    ever waits for a step to end (a caller holding the engine's lock for a step stalled every stream it serves:
    ``benchmarks/notes/serving.md``, eighth pass). The engine thread hands each step's raw ``StepOutput``s to the
    output thread, which detokenizes, checks stop strings, builds the snapshots and streams them while the engine
    runs the next step (the host work of step n overlaps the GPU's step n + 1). A sequence that a stop string
    ends is freed right after (the output thread waits for that, so its final figures are the method's); a
    step the engine ran for it meanwhile is dropped. A request of ``n`` sequences finishes when all have. A
    request the engine fails (``StepOutput.finish_reason == "error"``) or whose output cannot be built ends with
    ``RequestError`` alone; a step that fails as a whole fails every request in flight with its exception."""

    def __init__(self, llm: LLM) -> None:
        self.engine, self.tokenizer = llm.engine, llm.tokenizer     # not the LLM: it may be collected
        self.cv = threading.Condition()           # guards ``inbox``, ``stopped``, ``ended``; wakes an idle loop
        self.inbox: list[tuple] = []              # (function, args, done event or None), applied by the loop
        self.live: dict[int, _Request] = {}       # request id (of every sequence) -> its request
        self.live_lock = threading.Lock()         # ``live`` is read by both threads
        self.stopped = False
        self.ended = False                        # the loop has returned: work is applied by its caller
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()    # lists of StepOutput; None ends the thread
        self.thread = threading.Thread(target=self._run, name="macattn-engine-loop", daemon=True)
        self.out_thread = threading.Thread(target=self._emit, name="macattn-output", daemon=True)
        self.thread.start()
        self.out_thread.start()

    def _apply(self, fn, *args, wait: bool = False) -> None:
        """Run ``fn(*args)`` on the engine in the engine thread, before its next step (``wait``: return once it
        ran); in the caller once the loop has ended."""
        done = threading.Event() if wait else None
        with self.cv:
            if not self.ended:
                self.inbox.append((fn, args, done))
                self.cv.notify()
                fn = None
        if fn is not None:
            fn(*args)
        elif done is not None:
            done.wait()

    def submit(self, req: _Request) -> RequestHandle:
        handle = req.handle = RequestHandle(self, req.request_id)
        with self.cv:
            if self.stopped:
                raise RuntimeError("the LLM was shut down")
            req.start = time.perf_counter()
            with self.live_lock:
                for rid in req.ids:
                    self.live[rid] = req
            self.inbox.append((self._admit, (req,), None))
            self.cv.notify()
        return handle

    def _admit(self, req: _Request) -> None:
        """In the engine thread: queue ``req``'s sequences in the engine (a failure ends that request alone)."""
        try:
            self.engine.submit(req.seq)
        except Exception as exc:   # noqa: BLE001
            with self.live_lock:
                for rid in req.ids:
                    self.live.pop(rid, None)
            req.handle._push(exc)

    def _free(self, request_ids) -> None:
        """In the engine thread: end and forget sequences (no-op for those already finished)."""
        for rid in request_ids:
            self.engine.abort(rid)
            self.engine.requests.pop(rid, None)

    def _release(self, request_ids, *, wait: bool = False) -> None:
        """Free sequences' engine resources (``_free``) before the engine's next step; ``wait``: return once freed."""
        self._apply(self._free, list(request_ids), wait=wait)

    def abort(self, request_id: int, *, wait: bool = False) -> None:
        with self.live_lock:
            req = self.live.get(request_id)
            if req is not None:
                for rid in req.ids:
                    self.live.pop(rid, None)
        if req is None:
            self._release([request_id], wait=wait)
            return
        self._release(req.ids, wait=wait)
        if not req.out.finished:
            for comp in req.out.outputs:
                if comp.finish_reason is None:
                    comp.finish_reason = "abort"
            req.out.finished = True
            req.handle._push(_snapshot(req.out))

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify()
        self.thread.join()
        self._outputs.put(None)
        self.out_thread.join()
        with self.live_lock:
            rids = list(self.live)
        for rid in rids:
            self.abort(rid)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.inbox and not self.engine.has_unfinished() and not self.stopped:
                    self.cv.wait()
                work, self.inbox = self.inbox, []
                if self.stopped:      # what was handed in is applied; later work runs in its caller
                    self._run_work(work)
                    self.ended = True
                    return
            self._run_work(work)
            if not self.engine.has_unfinished():
                continue
            try:
                steps = self.engine.step()
                for step in steps:           # the engine ended it: forget it here, nothing waits for that
                    if step.finished:
                        self.engine.requests.pop(step.request_id, None)
                if steps:
                    self._outputs.put(steps)
            except BaseException as exc:     # noqa: BLE001 - handed to every waiter
                with self.live_lock:
                    failed, self.live = self.live, {}
                self._free(list(failed))
                for req in {id(r): r for r in failed.values()}.values():
                    req.handle._push(exc)

    @staticmethod
    def _run_work(work: list[tuple]) -> None:
        for fn, args, done in work:
            try:
                fn(*args)
            finally:
                if done is not None:
                    done.set()

    def _fail(self, req: _Request, message: str) -> None:
        """End ``req`` (all its sequences) with ``RequestError(message)``; the other requests go on."""
        with self.live_lock:
            for rid in req.ids:
                self.live.pop(rid, None)
        self._release(req.ids)
        req.handle._push(RequestError(f"request {req.request_id} failed: {message}"))

    def _emit(self) -> None:
        while (steps := self._outputs.get()) is not None:
            for step in steps:
                with self.live_lock:
                    req = self.live.get(step.request_id)
                if req is None or req.out.outputs[req.index[step.request_id]].finished:
                    continue
                if step.finish_reason == "error":
                    self._fail(req, step.error)
                    continue
                try:
                    reason = _record(self.tokenizer, step, req)
                except Exception as exc:   # noqa: BLE001 - e.g. the tokenizer failed on this request's tokens
                    self._fail(req, f"{type(exc).__name__}: {exc}")
                    continue
                if reason is None:
                    req.handle._push(_snapshot(req.out))
                    continue
                if not step.finished:    # a stop string: free the slot now (before the method's figures are read)
                    self._release([step.request_id], wait=True)
                if not all(c.finished for c in req.out.outputs):
                    req.handle._push(_snapshot(req.out))
                    continue
                with self.live_lock:
                    for rid in req.ids:
                        self.live.pop(rid, None)
                req.out.finished = True
                _finish_metrics(req)
                req.handle._push(_snapshot(req.out))
