"""An OpenAI-compatible server over the LLM API (``macattn serve --model DIR``, like ``trtllm-serve``
and ``vllm serve``; FastAPI + uvicorn).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` as server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info`` (vLLM's: lm-eval's remote tokenizer reads it), ``GET /version``,
``GET /health``, ``GET /metrics`` (Prometheus text: ``macattn_*`` and vLLM's ``vllm:*`` names, one
registry per app).

Requests (``openai_protocol``: the fields used, accepted and logged, accepted only at a neutral value,
refused) are checked before anything runs; every problem of a request is listed in one 400 whose
``param`` names the fields (a model other than the served one is a 404). A field that would change
the output and that the LLM API cannot do yet is refused with ``not supported by this server: X``.

* ``prompt``: a string, a list of strings, a token id list or a list of token id lists: one choice per
  prompt and per ``n`` (``index`` = prompt * n + sample). ``max_tokens`` omitted: the rest of the
  context (``max_seq_len`` - prompt length). ``echo`` puts the prompt before the text (and its
  log-probabilities before the tokens' with ``logprobs``; ``max_tokens: 0`` with ``echo`` scores the
  prompt only). ``prompt_logprobs`` (vLLM's): ``{token id: {logprob, rank, decoded_token}}`` per prompt
  position.
* chat: ``content`` a string or a list of parts (text parts joined by newlines; image / audio / file
  parts refused by name), roles ``system`` / ``developer`` / ``user`` / ``assistant``
  (``content: null`` allowed) / ``tool``, ``name``. The prompt is the tokenizer's chat template, or, for a
  tokenizer without one, ``<|role|>\\n{content}\\n`` per message followed by ``<|assistant|>\\n``.
  ``logprobs: true`` with ``top_logprobs``.
* sampling: ``temperature`` 0 is greedy, otherwise tokens are drawn (``top_p`` default 1, ``top_k``,
  ``min_p``, penalties, ``logit_bias``, ``seed``); stop strings, ``stop_token_ids``, ``ignore_eos``,
  ``min_tokens``, ``include_stop_str_in_output``, ``skip_special_tokens``.
* streaming: one choice per chunk, log-probabilities kept; text is held back while it ends in an
  unfinished UTF-8 character or a possible start of a stop string (what was sent is never taken back).
  A ``choices: []`` chunk with ``usage`` ends the stream only with ``stream_options.include_usage``
  (``continuous_usage_stats``: usage in every chunk). A client that disconnects aborts its requests,
  which frees their slots at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import inspect
import json
import logging
import re
import time
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from macattn.apps.llm import LLM, RequestError, RequestOutput, SamplingParams
from macattn.apps.serving.openai_protocol import (NOT_SUPPORTED, GenRequest, Problems, parse_chat, parse_completion,
                                                  parse_detokenize, parse_tokenize)

__all__ = ["build_app", "chat_prompt", "server_version", "server_config", "max_prompt_chars"]

logger = logging.getLogger("macattn.serve")


def server_version() -> str:
    try:
        from importlib.metadata import version

        return version("macattn")
    except Exception:   # noqa: BLE001 - not installed as a distribution
        return "0.1.0"


def chat_prompt(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict | None = None) -> str:
    """The prompt text of a chat (module doc): the tokenizer's chat template (or ``chat_template``),
    else ``<|role|>\\n{content}\\n`` per message (``name: `` before the content of a named one) and
    ``<|assistant|>\\n`` (``continue_final_message``: the last message left open instead)."""
    if chat_template or getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(chat_template_kwargs or {}))
    text = "".join(f"<|{m['role']}|>\n" + (f"{m['name']}: " if m.get("name") else "") + f"{m['content']}\n"
                   for m in messages)
    if continue_final_message:
        return text[:-1]
    return text + "<|assistant|>\n" if add_generation_prompt else text


def chat_special_tokens(tokenizer, chat_template: str | None, asked: bool | None) -> bool:
    """Whether a chat prompt's text is encoded with the tokenizer's special tokens: as ``asked`` (the request's
    ``add_special_tokens``), else only without a chat template (a template writes its own)."""
    if asked is not None:
        return asked
    return not (chat_template or getattr(tokenizer, "chat_template", None))


# --- the LLM API's sampling fields -----------------------------------------------------------------

def _llm_fields(cls) -> set[str]:
    """The keyword fields ``cls`` (the LLM API's ``SamplingParams`` / ``RequestOutput``) implements."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {n for n, p in inspect.signature(cls).parameters.items() if p.kind is not p.VAR_KEYWORD}


_ENGINE_REFUSAL = "not supported by this engine: "


def _llm_error(message: str, default: str) -> tuple[str, str]:
    """``(param, message)`` of an LLM API error: the field it names first (``"top_p must be ..."``,
    ``"prompt: ..."``, ``"not supported by this engine: best_of=3 ..."``), its refusals in the server's words."""
    if message.startswith(_ENGINE_REFUSAL):
        message = f"{NOT_SUPPORTED}: {message[len(_ENGINE_REFUSAL):]}"
        m = re.match(r"([A-Za-z_]\w*)", message[len(NOT_SUPPORTED) + 2:])
    else:
        m = re.match(r"([A-Za-z_][\w.\[\]]*)(?::| must | is |=)", message)
    return (m.group(1) if m else default), message


# --- log-probabilities -----------------------------------------------------------------------------

def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (printable bytes map to themselves, the others to 256+)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_decoder()


def _entry(e) -> dict[int, float] | None:
    """One position's log-probabilities as ``{token id: logprob}`` (values may be Logprob-like objects)."""
    if e is None:
        return None
    return {int(k): float(getattr(v, "logprob", v)) for k, v in e.items()}


class _Tokens:
    """Token strings and bytes of the served tokenizer (cached), for log-probabilities."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._str: dict[int, str] = {}

    def text(self, t: int) -> str:
        s = self._str.get(t)
        if s is None:
            s = self._str[t] = self.tok.decode([t])
        return s

    def bytes(self, t: int) -> list[int]:
        piece = self.tok.convert_ids_to_tokens(t) if hasattr(self.tok, "convert_ids_to_tokens") else None
        if isinstance(piece, str) and piece and all(c in _BYTES for c in piece) and "\ufffd" in self.text(t):
            return [_BYTES[c] for c in piece]       # a byte-level piece of a character
        return list(self.text(t).encode("utf-8"))

    def name(self, t: int, as_ids: bool) -> str:
        return f"token_id:{t}" if as_ids else self.text(t)

    def _top(self, e: dict[int, float], k: int) -> list[tuple[int, float]]:
        """The ``k`` most likely of one position's entries (``e``: the token and the engine's top-k)."""
        return sorted(e.items(), key=lambda kv: -kv[1])[:k]

    def completion(self, ids, entries, k: int, *, as_ids: bool, offset: int = 0, prompt_ids=None,
                   prompt_entries=None):
        """OpenAI's completions ``logprobs`` (tokens, token_logprobs, top_logprobs: the token and the ``k`` most
        likely, text_offset); with ``prompt_ids`` the prompt's positions first (position 0 has none)."""
        tokens, lps, tops, offsets = [], [], [], []
        pairs = []
        if prompt_ids is not None:
            pairs += [(t, prompt_entries[i] if prompt_entries and i < len(prompt_entries) else None)
                      for i, t in enumerate(prompt_ids)]
        pairs += list(zip(ids, entries or [None] * len(ids)))
        for t, e in pairs:
            tokens.append(self.name(t, as_ids))
            offsets.append(offset)
            offset += len(self.text(t))
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(e.get(t))
            top: dict[str, float] = {}
            for i, v in ([(t, e[t])] if t in e else []) + self._top(e, k):
                key = self.name(i, as_ids)
                top[key] = max(v, top.get(key, v))      # two ids may decode to one string: keep the larger
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, ids, entries, k: int, *, as_ids: bool) -> list[dict]:
        """OpenAI's chat ``logprobs.content`` items of ``ids``."""
        return [{"token": self.name(t, as_ids), "logprob": e.get(t), "bytes": self.bytes(t),
                 "top_logprobs": [{"token": self.name(i, as_ids), "logprob": v, "bytes": self.bytes(i)}
                                  for i, v in self._top(e, k)]}
                for t, e in zip(ids, entries or [])]

    def vllm_prompt(self, prompt_ids, prompt_entries, k: int) -> list:
        """vLLM's ``prompt_logprobs``: per prompt position None (position 0) or ``{id: {logprob, rank,
        decoded_token}}`` for the prompt token and the ``k`` most likely (rank 1 = most likely; None for a
        prompt token outside them, whose rank the engine does not report)."""
        out = []
        for i, t in enumerate(prompt_ids):
            e = prompt_entries[i] if prompt_entries and i < len(prompt_entries) else None
            if e is None:
                out.append(None)
                continue
            top = self._top(e, k)
            ranks = {j: r + 1 for r, (j, _) in enumerate(top)}
            keep = dict(top)
            if t in e:
                keep[t] = e[t]
            out.append({str(j): {"logprob": v, "rank": ranks.get(j), "decoded_token": self.text(j)}
                        for j, v in keep.items()})
        return out


def _prompt_entries(out: RequestOutput, n_prompt: int) -> list | None:
    """The LLM API's prompt log-probabilities of ``out`` aligned to the prompt (entry 0 None)."""
    raw = getattr(out, "prompt_logprobs", None)
    if raw is None:
        return None
    entries = [_entry(e) for e in raw]
    if len(entries) == n_prompt - 1:
        entries = [None, *entries]
    return entries


# --- metrics ---------------------------------------------------------------------------------------

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _Metrics:
    def __init__(self, llm: LLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("macattn_requests", "Requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.tokens = Counter("macattn_generated_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("macattn_time_to_first_token_seconds", "Time to first token", registry=r)
        self.itl = Histogram("macattn_inter_token_latency_seconds", "Mean gap between tokens of a request", registry=r)
        self.e2e = Histogram("macattn_e2e_request_latency_seconds", "Request latency", registry=r)
        self.running = Gauge("macattn_requests_running", "HTTP requests in flight", registry=r)
        self.finished_by = Counter("macattn_requests_finished", "Generation requests by final state (stop, length, "
                                   "abort: the client left, error: the engine failed it)", ["reason"], registry=r)
        # read at scrape time (plain ints of the engine; no lock needed for a gauge)
        sched, blocks = llm.engine.scheduler, llm.engine.executor.blocks
        Gauge("macattn_requests_waiting", "Requests queued for a slot", registry=r).set_function(
            lambda: len(sched.waiting))
        Gauge("macattn_kv_blocks_in_use", "Paged KV blocks held by requests", registry=r).set_function(
            lambda: blocks.num_blocks - blocks.num_free)
        share = [i / 10 for i in range(11)]
        self.mac_hit = Histogram("macattn_mac_hit_rate", "Per request: share of MAC matches that hit",
                                 buckets=share, registry=r)
        self.mac_skip = Histogram("macattn_mac_kv_skip", "Per request: mean share of the prefix a step skipped",
                                  buckets=share, registry=r)
        # vLLM's names (its dashboards read these), labelled by model_name as vLLM labels them
        m = ["model_name"]

        def gauge(name, doc, fn):
            Gauge(name, doc, m, registry=r).labels(model_name).set_function(fn)

        gauge("vllm:num_requests_running", "Requests in the engine's running set (holding a slot)",
              lambda: len(sched.running))
        gauge("vllm:num_requests_waiting", "Requests waiting for a slot", lambda: len(sched.waiting))
        r.register(_PrefixCacheCounters(llm.engine, model_name))
        r.register(_PrefixStoreCounters(llm.engine))
        usage = lambda: (blocks.num_blocks - blocks.num_free) / blocks.num_blocks   # noqa: E731
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100 percent)", usage)
        gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (1 = 100 percent; vLLM's older name)", usage)
        self.v_prompt = Counter("vllm:prompt_tokens", "Prefilled prompt tokens", m, registry=r).labels(model_name)
        self.v_gen = Counter("vllm:generation_tokens", "Generated tokens", m, registry=r).labels(model_name)
        self.v_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                 m + ["finished_reason"], registry=r)
        self.model_name = model_name

        def hist(name, doc, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.v_ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", _LATENCY)
        # as vLLM v1 observes them: every gap between a sequence's tokens (its older name alongside), and the mean
        # per finished request under its own name
        self.v_itl = hist("vllm:inter_token_latency_seconds", "Gap between consecutive tokens of a sequence",
                          _LATENCY)
        self.v_tpot = hist("vllm:time_per_output_token_seconds", "Gap between consecutive tokens of a sequence "
                           "(vLLM's older name of vllm:inter_token_latency_seconds)", _LATENCY)
        self.v_req_tpot = hist("vllm:request_time_per_output_token_seconds",
                               "Per request: mean gap between the tokens after the first", _LATENCY)
        self.v_e2e = hist("vllm:e2e_request_latency_seconds", "Request latency", _LATENCY)
        self.v_req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request", _TOKENS)
        self.v_req_gen = hist("vllm:request_generation_tokens", "Generated tokens per request", _TOKENS)
        self.v_max_tokens = hist("vllm:request_params_max_tokens", "max_tokens per request", _TOKENS)
        self.v_n = hist("vllm:request_params_n", "n per request", (1, 2, 5, 10, 20))

    def ended(self, endpoint: str, status: str, reason: str, n: int = 1) -> None:
        """A request that did not finish (``status`` 499: the client left, 500: the engine failed it): out of
        the running gauge, counted by status and by ``reason`` (``abort`` / ``error``) per choice."""
        self.running.dec()
        self.requests.labels(endpoint, status).inc()
        self.finished_by.labels(reason).inc(n)

    def submitted(self, n: int, max_tokens: int) -> None:
        self.v_n.observe(n)
        self.v_max_tokens.observe(max_tokens)

    def finished(self, out: RequestOutput) -> None:
        m = out.metrics
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.tokens.inc(generated)
        self.v_gen.inc(generated)
        self.v_prompt.inc(len(out.prompt_token_ids))
        self.v_req_prompt.observe(len(out.prompt_token_ids))
        self.v_req_gen.observe(generated)
        for c in out.outputs:
            self.v_success.labels(self.model_name, c.finish_reason or "abort").inc()
            self.finished_by.labels(c.finish_reason or "abort").inc()
        for hist, key in ((self.ttft, "ttft_s"), (self.itl, "inter_token_latency_s"), (self.e2e, "e2e_s"),
                          (self.mac_hit, "mac_hit_rate"), (self.mac_skip, "mac_kv_skip"), (self.v_ttft, "ttft_s"),
                          (self.v_req_tpot, "inter_token_latency_s"), (self.v_e2e, "e2e_s")):
            if m.get(key) is not None:
                hist.observe(m[key])
        for gap in m.get("inter_token_latencies_s") or ():
            self.v_itl.observe(gap)
            self.v_tpot.observe(gap)


class _PrefixCacheCounters:
    """The engine's prefix-cache counters (``LLMEngine.prefix_cache_stats``, prompt tokens), read at scrape time:
    ``macattn_prefix_cache_{queries,hits}_total`` and vLLM's ``vllm:prefix_cache_{queries,hits}_total``."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        stats = self.engine.prefix_cache_stats
        for name, value, doc in (("prefix_cache_queries", stats.queries, "Prompt tokens looked up in the prefix cache"),
                                 ("prefix_cache_hits", stats.hits, "Prompt tokens served from the prefix cache")):
            yield CounterMetricFamily(f"macattn_{name}", doc, value=value)
            vllm = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            vllm.add_metric([self.model_name], value)
            yield vllm


class _PrefixStoreCounters:
    """The persisted prefix store's counters (``ChunkKVStore``: hits, misses, entries quarantined as corrupt or
    unreadable, writes dropped), read at scrape time as ``macattn_prefix_store_*_total``; nothing when the
    engine's method keeps no store (``prefix_store`` unset)."""

    FIELDS = (("hits", "Prompts whose KV was loaded from the prefix store"),
              ("misses", "reuse_prefix prompts the prefix store did not hold"),
              ("quarantined", "Prefix-store entries that failed a check, moved aside and recomputed"),
              ("write_failures", "Prefix-store writes dropped (a full disk, a failed write)"))

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        store = getattr(self.engine.method, "store", None)
        if store is None:
            return
        for name, doc in self.FIELDS:
            yield CounterMetricFamily(f"macattn_prefix_store_{name}", doc, value=getattr(store, name))


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": code}})


# --- one request's jobs ----------------------------------------------------------------------------

@dataclass
class _Job:
    """One submitted LLM API request: prompt ``prompt_index``; its outputs are choices ``first``, ``first + 1``, ..."""

    prompt_index: int
    first: int
    handle: object
    prompt_text: str
    prompt_ids: list[int]
    emits_eos: bool = False


@dataclass
class _Choice:
    """A streamed choice: what was sent so far."""

    text: str = ""
    tokens: int = 0
    started: bool = False
    done: bool = False


def _stable(text: str, stops: list[str]) -> str:
    """The part of an unfinished text that can be sent: without a trailing unfinished UTF-8 character
    or a trailing piece that may begin a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, end), 0, -1):
            if text.endswith(s[:n], 0, end):
                hold = max(hold, n)
                break
    return text[:end - hold]


def max_prompt_chars(tokenizer, max_seq_len: int) -> int:
    """The longest prompt text that can fit ``max_seq_len`` tokens: ``max_seq_len`` times the longest token
    of ``tokenizer`` (in characters of its vocabulary; a byte-level piece has one character per byte, which
    decodes to at most one character). A longer text is refused before it is tokenised."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    longest = max((len(piece) for piece in vocab), default=0) or 64
    return max_seq_len * longest


class _Server:
    def __init__(self, llm: LLM, model_name: str, default_max_tokens: int | None) -> None:
        self.llm, self.model_name, self.default_max_tokens = llm, model_name, default_max_tokens
        self.tok = llm.tokenizer
        self.tokens = _Tokens(self.tok)
        self.metrics = _Metrics(llm, model_name)
        self.max_seq_len = llm.engine.config.max_seq_len
        self.max_chars = max_prompt_chars(self.tok, self.max_seq_len)

    def check_chars(self, where: str, chars: int, p: Problems) -> bool:
        """Whether a text of ``chars`` characters may fit the context (``max_prompt_chars``); else a problem
        naming the limit."""
        if chars <= self.max_chars:
            return True
        p.add(where, f"too long: {chars} characters > the limit of {self.max_chars} (no text of more characters "
                     f"fits max_seq_len={self.max_seq_len} tokens); nothing was tokenised")
        return False

    # -- request -> jobs --------------------------------------------------------------------------
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def prompts(self, req: GenRequest, p: Problems) -> list[tuple[str, list[int]]]:
        """(text, token ids) per prompt; a token-id prompt's text is decoded only for ``echo``, its one reader."""
        if req.endpoint == "chat":
            if not self.check_chars("messages", sum(len(m.get("content") or "") for m in req.messages), p):
                return []
            try:
                text = chat_prompt(self.tok, req.messages, add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message,
                                   chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs)
            except Exception as exc:   # noqa: BLE001 - a template's own error (roles out of order, ...)
                p.add("messages", f"the chat template refused them: {exc}")
                return []
            if not self.check_chars("messages", len(text), p):
                return []
            add = chat_special_tokens(self.tok, req.chat_template, req.add_special_tokens)
            prompts = [(text, self._encode(text, add))]
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            many = len(req.prompts) > 1
            if not all(self.check_chars(f"prompt[{i}]" if many else "prompt", len(x), p)
                       for i, x in enumerate(req.prompts) if isinstance(x, str)):
                return []
            prompts = [(x, self._encode(x, add)) if isinstance(x, str) else (self._echo_text(req, x), x)
                       for x in req.prompts]
        k = req.truncate_prompt_tokens
        if k is not None:       # vLLM's: keep the last k tokens (echo shows what the model saw)
            prompts = [(text, ids) if len(ids) <= k else (self._echo_text(req, ids[-k:]), ids[-k:])
                       for text, ids in prompts]
        return prompts

    def _echo_text(self, req: GenRequest, ids: list[int]) -> str:
        return self.tok.decode(ids) if req.echo else ""      # a 32K-id prompt decodes in ~17 ms

    def sampling(self, req: GenRequest, max_tokens: int, p: Problems, *, n: int | None, seed_offset: int,
                 prompt_logprobs: int | None) -> SamplingParams | None:
        fields = _llm_fields(SamplingParams)
        kw = {"max_tokens": max_tokens, **req.sampling}
        if req.logprobs is not None:
            kw["logprobs"] = req.logprobs
        if prompt_logprobs is not None:
            kw["prompt_logprobs"] = prompt_logprobs
        if n is not None and n > 1:
            kw["n"] = n
        if seed_offset and "seed" in kw:
            kw["seed"] = (kw["seed"] + seed_offset) % (1 << 63)
        if self._emits_eos(kw):
            kw["ignore_eos"] = True    # one token: the end token is emitted as that token (``_emits_eos``)
        missing = [k for k in kw if k not in fields]
        for k in missing:
            if k == "prompt_logprobs" and req.prompt_logprobs is None:     # asked for by echo + logprobs
                p.unsupported("echo", "echo with logprobs (prompt log-probabilities)")
            else:
                p.unsupported(k)
        if missing:
            return None
        try:
            return SamplingParams(**kw)
        except (TypeError, ValueError) as exc:
            p.items.append(_llm_error(str(exc), "sampling"))
            return None

    def _emits_eos(self, kw: dict) -> bool:
        """Whether a request generating one token runs with the end token emitted: the LLM API drops a
        generated end token, vLLM and OpenAI return it (with its log-probability; its text is empty). Scoring
        clients (lm-eval: ``echo``, ``max_tokens: 1``, then ``token_logprobs[ctx:-1]``) count on exactly one
        generated token. With one token to generate, ``ignore_eos`` samples the same token and keeps it; the
        choice still finishes with ``"stop"`` when it is the end token."""
        return (kw["max_tokens"] == 1 and not kw.get("ignore_eos") and not kw.get("min_tokens")
                and getattr(self.tok, "eos_token_id", None) is not None)

    def finish(self, job: "_Job", comp) -> tuple[str | None, int | str | None]:
        """``(finish_reason, stop_reason)`` of a choice (the end token of ``_emits_eos`` is a ``"stop"``)."""
        if job.emits_eos and comp.finish_reason is not None and comp.token_ids and \
                comp.token_ids[-1] == self.tok.eos_token_id:
            return "stop", None
        return comp.finish_reason, comp.stop_reason

    def submit(self, req: GenRequest) -> tuple[list[_Job], Problems]:
        """Validate the whole request and submit its jobs (all or none)."""
        p = Problems()
        prompts = self.prompts(req, p)
        if p:
            return [], p
        native_n = "n" in _llm_fields(SamplingParams)       # else the server samples n requests (seed + j)
        plan = []     # (prompt index, first choice, text, ids, SamplingParams)
        for i, (text, ids) in enumerate(prompts):
            room = self.max_seq_len - len(ids)
            if req.max_tokens is not None and room >= 1 and req.max_tokens > room:
                p.add("max_tokens", f"must be an int in [1, {room}] for this prompt ({len(ids)} tokens; "
                                    f"max_seq_len={self.max_seq_len}), got {req.max_tokens}")
                continue
            if req.max_tokens is not None:
                max_tokens = max(req.max_tokens, 1)
            elif self.default_max_tokens is not None:
                max_tokens = min(self.default_max_tokens, max(room, 1))
            else:
                max_tokens = room
            if max_tokens < 1:
                where = "messages" if req.endpoint == "chat" else ("prompt" if len(prompts) == 1 else f"prompt[{i}]")
                p.add(where, f"too long: {len(ids)} tokens leave no room to generate (max_seq_len={self.max_seq_len})")
                continue
            samples = [(0, req.n)] if native_n else [(j, 1) for j in range(req.n)]
            for j, n in samples:
                sp = self.sampling(req, max_tokens, p, n=n, seed_offset=j,
                                   prompt_logprobs=req.scored_prompt_logprobs)
                if sp is None:
                    break
                plan.append((i, i * req.n + j, text, ids, sp))
            if p:
                break
        if p:
            return [], p
        jobs = []
        # a request that does not stream needs the final output only (the LLM API's ``streaming``, when it has it)
        streaming = ({"streaming": req.stream} if "streaming" in inspect.signature(self.llm.generate_async).parameters
                     else {})
        for i, first, text, ids, sp in plan:
            try:
                handle = self.llm.generate_async(ids, sp, reuse_prefix=req.reuse_prefix, **streaming)
            except (ValueError, TypeError, RuntimeError) as exc:
                message = str(exc)
                where = "messages" if req.endpoint == "chat" else ("prompt" if len(prompts) == 1 else f"prompt[{i}]")
                if message.startswith("prompt: "):
                    message = f"{where}: {message[len('prompt: '):]}"
                p.items.append(_llm_error(message, where))
                continue
            jobs.append(_Job(i, first, handle, text, ids, emits_eos=sp.ignore_eos and not req.sampling.get("ignore_eos")))
        if p:
            for job in jobs:
                job.handle.abort(wait=False)
            return [], p
        self.metrics.submitted(req.n, plan[0][4].max_tokens if plan else 0)
        return jobs, p

    # -- responses --------------------------------------------------------------------------------
    def completion_choice(self, req: GenRequest, job: _Job, comp, prompt_entries, hide: bool) -> dict:
        ids, entries = ([], []) if hide else (comp.token_ids, comp.logprobs)
        text = ("" if hide else comp.text)
        logprobs = None
        if req.logprobs is not None:
            logprobs = self.tokens.completion(ids, entries, req.logprobs, as_ids=req.tokens_as_ids,
                                              prompt_ids=job.prompt_ids if req.echo else None,
                                              prompt_entries=prompt_entries)
        finish, stop = self.finish(job, comp)
        choice = {"index": job.first + comp.index, "text": (job.prompt_text if req.echo else "") + text,
                  "logprobs": logprobs, "finish_reason": "length" if hide else finish,
                  "stop_reason": None if hide else stop}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = (self.tokens.vllm_prompt(job.prompt_ids, prompt_entries, req.prompt_logprobs)
                                         if prompt_entries is not None else None)
        return choice

    def chat_choice(self, req: GenRequest, job: _Job, comp) -> dict:
        logprobs = None
        if req.logprobs is not None:
            logprobs = {"content": self.tokens.chat(comp.token_ids, comp.logprobs, req.logprobs,
                                                    as_ids=req.tokens_as_ids), "refusal": None}
        finish, stop = self.finish(job, comp)
        return {"index": job.first + comp.index, "message": {"role": "assistant", "content": comp.text},
                "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}

    def done(self, endpoint: str, outs) -> None:
        self.metrics.running.dec()
        self.metrics.requests.labels(endpoint, "200").inc()
        for out in outs:
            self.metrics.finished(out)

    async def respond(self, endpoint: str, request: Request, req: GenRequest, jobs: list[_Job]) -> dict | None:
        """The response of a request that does not stream (None: the client went away; its requests were
        aborted, which freed their slots)."""
        gathered = asyncio.ensure_future(asyncio.gather(*(_result(j.handle) for j in jobs)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({gathered, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not gathered.done():
            for j in jobs:
                j.handle.abort(wait=False)
            await gathered
            self.metrics.ended(endpoint, "499", "abort", _choices(req, jobs))
            return None
        results = gathered.result()
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            self.metrics.ended(endpoint, "500", "error", _choices(req, jobs))
            raise failed[0]
        self.done(endpoint, results)
        outs = {id(j): r for j, r in zip(jobs, results)}
        hide = req.echo and req.max_tokens == 0
        head = _head(endpoint, jobs, self.model_name)
        choices = []
        prompt_lps = None
        for j in jobs:
            out = outs[id(j)]
            if req.endpoint == "completions":
                entries = (_prompt_entries(out, len(j.prompt_ids))
                           if req.scored_prompt_logprobs is not None else None)
                choices += [self.completion_choice(req, j, c, entries, hide) for c in out.outputs]
            else:
                choices += [self.chat_choice(req, j, c) for c in out.outputs]
                if req.prompt_logprobs is not None and prompt_lps is None:
                    entries = _prompt_entries(out, len(j.prompt_ids))
                    prompt_lps = (self.tokens.vllm_prompt(j.prompt_ids, entries, req.prompt_logprobs)
                                  if entries is not None else None)
        choices.sort(key=lambda c: c["index"])
        body = {**head, "choices": choices, "usage": _usage(jobs, results, hide)}
        if req.endpoint == "chat" and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_lps
        return body

    async def stream(self, endpoint: str, request: Request, req: GenRequest, jobs: list[_Job]):
        head = _head(endpoint, jobs, self.model_name, chunk=True)
        chat = req.endpoint == "chat"
        hide = req.echo and req.max_tokens == 0
        stops = req.stop_strings
        states: dict[int, _Choice] = {}
        last: dict[int, RequestOutput] = {}
        extra = {"usage": None} if req.include_usage else {}

        def event(choice: dict, usage: dict | None = None) -> str:
            body = {**head, "choices": [choice], **extra}
            if req.continuous_usage:
                body["usage"] = usage or _usage(jobs, list(last.values()), hide)
            return f"data: {json.dumps(body)}\n\n"

        finished_ok = failed = False
        try:
            if chat:     # OpenAI's first chunk of each choice: the role
                for idx in range(req.n):
                    states[idx] = _Choice(started=True)
                    yield event({"index": idx, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
            async for job, snap in _merge(jobs):
                last[id(job)] = snap
                if await request.is_disconnected():
                    return
                for comp in snap.outputs:
                    idx = job.first + comp.index
                    st = states.setdefault(idx, _Choice())
                    if st.done:
                        continue
                    finish, stop = self.finish(job, comp)
                    if finish == "abort":
                        continue
                    ids = [] if hide else comp.token_ids[st.tokens:]
                    entries = [] if hide or comp.logprobs is None else comp.logprobs[st.tokens:]
                    text_now = "" if hide else comp.text
                    stable = text_now if finish is not None else _stable(text_now, stops)
                    delta = stable[len(st.text):] if stable.startswith(st.text) else ""
                    if finish is not None and not stable.startswith(st.text):
                        delta = stable[len(st.text):]          # cannot take back what was sent
                    if not (delta or ids or finish or (req.echo and not st.started)):
                        continue
                    if chat:
                        choice = {"index": idx, "delta": {"content": delta} if delta or not finish else {},
                                  "logprobs": None, "finish_reason": finish, "stop_reason": stop}
                        if req.logprobs is not None and ids:
                            choice["logprobs"] = {"content": self.tokens.chat(ids, entries, req.logprobs,
                                                                              as_ids=req.tokens_as_ids)}
                    else:
                        lead_text, logprobs = "", None
                        offset = len(st.text) + (len(job.prompt_text) if req.echo else 0)
                        if not st.started and req.echo:
                            lead_text = job.prompt_text
                            offset = 0
                        if req.logprobs is not None:
                            p_ids = p_entries = None
                            if not st.started and req.echo:
                                p_ids = job.prompt_ids
                                p_entries = _prompt_entries(snap, len(job.prompt_ids))
                            logprobs = self.tokens.completion(ids, entries, req.logprobs, as_ids=req.tokens_as_ids,
                                                              offset=offset,
                                                              prompt_ids=p_ids, prompt_entries=p_entries)
                        choice = {"index": idx, "text": lead_text + delta, "logprobs": logprobs,
                                  "finish_reason": "length" if hide and finish else finish,
                                  "stop_reason": None if hide else stop}
                    st.started, st.text, st.tokens = True, st.text + delta, st.tokens + len(ids)
                    st.done = finish is not None
                    yield event(choice)
            if req.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(jobs, list(last.values()), hide)})}\n\n"
            yield "data: [DONE]\n\n"
            finished_ok = True
        except Exception as exc:   # noqa: BLE001 - the engine failed mid-stream: tell the client, then end
            failed = True
            logger.exception("stream failed")
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
            yield "data: [DONE]\n\n"
        finally:                     # a client gone mid-stream: its requests stop, their slots are freed
            for j in jobs:
                j.handle.abort(wait=False)
            if finished_ok and len(last) == len(jobs) and all(o.finished for o in last.values()):
                self.done(endpoint, list(last.values()))
            else:      # the server failed the stream (500) or the client left it (499)
                self.metrics.ended(endpoint, "500" if failed else "499", "error" if failed else "abort",
                                   _choices(req, jobs))


def _choices(req: GenRequest, jobs: list[_Job]) -> int:
    return len({j.prompt_index for j in jobs}) * req.n


def _usage(jobs: list[_Job], outs: list[RequestOutput], hide: bool) -> dict:
    """Prompt tokens once per prompt (not per sample), generated tokens of every choice;
    ``prompt_tokens_details.cached_tokens``: the prompt tokens served from the prefix cache (once per prompt, from
    the finished requests' ``num_cached_tokens``)."""
    seen, prompt = set(), 0
    for j in jobs:
        if j.prompt_index not in seen:
            seen.add(j.prompt_index)
            prompt += len(j.prompt_ids)
    gen = 0 if hide else sum(len(c.token_ids) for o in outs for c in o.outputs)
    prompt_of = {j.handle.request_id: j.prompt_index for j in jobs}
    cached: dict[int, int] = {}
    for o in outs:
        cached.setdefault(prompt_of.get(o.request_id), o.metrics.get("num_cached_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _head(endpoint: str, jobs: list[_Job], model: str, *, chunk: bool = False) -> dict:
    rid = jobs[0].handle.request_id if jobs else 0
    if endpoint == "/v1/completions":
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model,
                "system_fingerprint": None}
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": int(time.time()), "model": model, "system_fingerprint": None}


async def _merge(jobs: list[_Job]):
    """``(job, snapshot)`` of every job as they come (an engine error is raised here)."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(job: _Job) -> None:
        try:
            async for snap in job.handle:
                await queue.put((job, snap))
        except Exception as exc:   # noqa: BLE001 - handed to the reader
            await queue.put((job, exc))
        finally:
            await queue.put((job, end))

    tasks = [asyncio.create_task(pump(j)) for j in jobs]
    try:
        left = len(jobs)
        while left:
            job, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield job, item
    finally:
        for t in tasks:
            t.cancel()


async def _disconnected(request: Request, every: float = 0.25) -> None:
    """Returns once the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(every)


async def _result(handle) -> RequestOutput | BaseException:
    last = None
    try:
        async for snap in handle:
            last = snap
    except Exception as exc:   # noqa: BLE001 - reported by the caller
        return exc
    finally:
        handle.abort(wait=False)
    return last


# --- the HTTP server ----------------------------------------------------------------------------------

def server_config(app, host: str, port: int, *, grace_period: float = 10, timeout_keep_alive: int = 5,
                  limit_concurrency: int | None = None):
    """uvicorn's ``Config`` for ``app`` with the server's doors closed: ``timeout_keep_alive`` seconds for a
    connection to send a whole request head — from the moment it opens, and again after each response (uvicorn
    arms it only after a response: a client that connects and sends nothing, or a header a byte at a time,
    would hold its connection forever) —, at most ``limit_concurrency`` connections and requests at once
    (more get a 503; None: no cap), ``grace_period`` seconds for requests in flight on SIGTERM."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutH11(H11Protocol):
        """uvicorn's h11 protocol whose keep-alive timer also runs while the request head is awaited."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            # uvicorn cancels the timer on any byte; here only a complete request head does (``handle_events``)
            self.conn.receive_data(data)
            self.handle_events()

    return uvicorn.Config(app, host=host, port=port, http=HeadTimeoutH11, log_level="warning",
                          timeout_graceful_shutdown=grace_period, timeout_keep_alive=timeout_keep_alive,
                          limit_concurrency=limit_concurrency)


# --- the app ---------------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def _frozen_heap(app: FastAPI):
    """While serving, what existed at start-up (the model, the engine, the app) is frozen out of the collector's
    full passes (one took up to 200 ms in a small process, on a random request's path; vLLM freezes the same way);
    unfrozen at shutdown, so the process's objects are finalized as usual."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def build_app(llm: LLM, model_name: str, *, default_max_tokens: int | None = None) -> FastAPI:
    """The FastAPI application serving ``llm`` as ``model_name``. ``default_max_tokens``: the tokens a
    request without ``max_tokens`` generates at most (None: the rest of the context)."""
    app = FastAPI(title="macattn OpenAI-compatible server", version=server_version(), lifespan=_frozen_heap)
    srv = _Server(llm, model_name, default_max_tokens)
    metrics = srv.metrics
    tok = llm.tokenizer

    async def body_of(request: Request, endpoint: str):
        raw = await request.body()
        try:      # parsed off the event loop, as all per-request work in proportion to its size
            return await anyio.to_thread.run_sync(json.loads, raw or b"null"), None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            metrics.requests.labels(endpoint, "400").inc()
            return None, _error(400, f"body: not valid JSON ({exc})", "body")

    def refuse(endpoint: str, p: Problems) -> JSONResponse:
        metrics.requests.labels(endpoint, "400").inc()
        return _error(400, p.message, p.param)

    def wrong_model(endpoint: str, model: str | None) -> JSONResponse | None:
        if model is None or model == model_name:
            return None
        metrics.requests.labels(endpoint, "404").inc()
        return _error(404, f"model: {model!r} is not served here (serving {model_name!r})", "model",
                      "model_not_found")

    async def generate(request: Request, endpoint: str, parse):
        raw, err = await body_of(request, endpoint)
        if err is not None:
            return err
        req, p = parse(raw)
        if (resp := wrong_model(endpoint, req.model)) is not None:
            return resp
        if p:
            return refuse(endpoint, p)
        if req.ignored:
            logger.warning("%s: accepted and ignored (they do not change the output): %s", endpoint,
                           ", ".join(req.ignored))
        # tokenising (and the chat template) off the event loop: /health and the streams keep their latency
        jobs, p = await anyio.to_thread.run_sync(srv.submit, req)
        if p:
            return refuse(endpoint, p)
        metrics.running.inc()
        if req.stream:
            return StreamingResponse(srv.stream(endpoint, request, req, jobs), media_type="text/event-stream")
        try:
            body = await srv.respond(endpoint, request, req, jobs)
            return body if body is not None else Response(status_code=499)
        except RequestError as exc:     # the engine failed this request (the others went on)
            return _error(500, f"the engine failed: {exc}")
        except Exception as exc:   # noqa: BLE001 - the engine failed: a 500 naming it
            logger.exception("request failed")
            return _error(500, f"the engine failed: {exc}")
        except asyncio.CancelledError:   # the server stops and the grace period is over: say so, in JSON
            metrics.ended(endpoint, "503", "abort", _choices(req, jobs))
            return _error(503, "the server is shutting down: the request did not finish within the grace period",
                          code="shutting_down")
        finally:
            for j in jobs:
                j.handle.abort(wait=False)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions", parse_completion)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "/v1/chat/completions", parse_chat)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": server_version()}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "macattn", "root": model_name,
                "parent": None, "max_model_len": srv.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return _error(404, f"model: {model_id!r} is not served here (serving {model_name!r})", "model",
                          "model_not_found")
        return card()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        raw, err = await body_of(request, "/tokenize")
        if err is not None:
            return err
        req, p = parse_tokenize(raw)
        if (resp := wrong_model("/tokenize", req["model"])) is not None:
            return resp
        if not p and "messages" in req:
            try:
                text = chat_prompt(tok, req["messages"], add_generation_prompt=req["add_generation_prompt"],
                                   continue_final_message=req["continue_final_message"],
                                   chat_template=req["chat_template"],
                                   chat_template_kwargs=req["chat_template_kwargs"])
            except Exception as exc:   # noqa: BLE001
                p.add("messages", f"the chat template refused them: {exc}")
            add = chat_special_tokens(tok, req["chat_template"], req["add_special_tokens"])
        elif not p:
            text = req["prompt"]
            add = True if req["add_special_tokens"] is None else req["add_special_tokens"]
        if not p:
            srv.check_chars("messages" if "messages" in req else "prompt", len(text), p)
        if p:
            return refuse("/tokenize", p)
        ids = list(await anyio.to_thread.run_sync(functools.partial(tok.encode, text, add_special_tokens=add)))
        metrics.requests.labels("/tokenize", "200").inc()
        out = {"count": len(ids), "max_model_len": srv.max_seq_len, "tokens": ids}
        if req["return_token_strs"]:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        raw, err = await body_of(request, "/detokenize")
        if err is not None:
            return err
        req, p = parse_detokenize(raw)
        if (resp := wrong_model("/detokenize", req["model"])) is not None:
            return resp
        vocab = llm.engine.vocab_size
        bad = [t for t in req["tokens"] if t >= vocab]
        if bad:
            p.add("tokens", f"ids must be < the vocabulary size {vocab}, got {bad[:5]}")
        if p:
            return refuse("/detokenize", p)
        metrics.requests.labels("/detokenize", "200").inc()
        return {"prompt": await anyio.to_thread.run_sync(tok.decode, req["tokens"])}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        info = {"tokenizer_class": type(tok).__name__, "model_max_length": srv.max_seq_len,
                "chat_template": getattr(tok, "chat_template", None)}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            info[name] = value if value is None or isinstance(value, str) else str(value)
        return info

    return app
