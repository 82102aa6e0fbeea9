"""The OpenAI request vocabulary of ``macattn serve``: which fields a request may carry, how each is
checked, and what the server does with it (``openai_server`` runs the requests).

Every field of a request falls in one of four groups (``FIELDS`` below lists them all):

* used: the prompt / messages, the sampling and stopping parameters, ``n``, log-probabilities,
  ``echo``, streaming options (OpenAI's and vLLM's names). A sampling field whose value is not its
  neutral one goes to the LLM API's ``SamplingParams``; where that has no such field yet, the request
  is refused with ``not supported by this server: <field>`` (never silently ignored).
* accepted and logged: fields that do not change the output (``user``, ``metadata``, ``store``,
  ``service_tier``, ``request_id``, ``priority``, ...).
* neutral only: fields this server does not implement, accepted at their neutral value (``null``,
  ``false``, ``[]``, ``{"type": "text"}``, ...); any other value is refused by name
  (``tools``, ``response_format`` json modes, guided decoding, ``suffix``, beam search, images, ...).
* unknown: any other name is refused (a misspelt ``max_token`` must not turn into a default).

Types are strict: ``"5"`` or ``true`` is not an int, ``1`` is not a bool (a JSON number is a float).
All the problems of a request are reported together in one 400 (``Problems``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from macattn.core.validation import all_ints

__all__ = ["Problems", "GenRequest", "FIELDS", "NOT_SUPPORTED", "MAX_LOGPROBS", "parse_completion", "parse_chat",
           "parse_tokenize", "parse_detokenize", "chat_messages"]

NOT_SUPPORTED = "not supported by this server"
MAX_LOGPROBS = 20
"""Top log-probabilities per position at most (``logprobs``, ``top_logprobs``, ``prompt_logprobs``), as vLLM."""
_MAX_SEED = 1 << 63


class Problems:
    """The problems found in one request: ``(param, message)`` pairs, reported together."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, param: str, message: str) -> None:
        self.items.append((param, f"{param}: {message}"))

    def unsupported(self, param: str, what: str | None = None) -> None:
        self.items.append((param, f"{NOT_SUPPORTED}: {what or param}"))

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def message(self) -> str:
        return "; ".join(m for _, m in self.items)

    @property
    def param(self) -> str | None:
        params = list(dict.fromkeys(p for p, _ in self.items))
        return ", ".join(params) if params else None


# --- strict scalar readers -------------------------------------------------------------------

def _kind(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _show(v: Any) -> str:
    s = repr(v) if not isinstance(v, str) else f'"{v}"'
    return s if len(s) <= 40 else s[:37] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict, name: str, p: Problems, default: Any = None, *, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        p.add(name, f"must be an integer, got {_kind(v)} {_show(v)}")
        return default
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        p.add(name, f"must be an integer {rng}, got {v}")
        return default
    return v


def _float(body: dict, name: str, p: Problems, default: Any = None, *, lo: float | None = None,
           hi: float | None = None, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        p.add(name, f"must be a number, got {_kind(v)} {_show(v)}")
        return default
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    if bad_lo or (hi is not None and v > hi):
        rng = (f"{'>' if lo_open else '>='} {lo:g}" if hi is None else
               f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if lo is not None else f"<= {hi:g}")
        p.add(name, f"must be a number {rng}, got {v}")
        return default
    return float(v)


def _bool(body: dict, name: str, p: Problems, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        p.add(name, f"must be a boolean, got {_kind(v)} {_show(v)}")
        return default
    return v


def _str(body: dict, name: str, p: Problems, default: Any = None):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        p.add(name, f"must be a string, got {_kind(v)} {_show(v)}")
        return default
    return v


def _ids(v: Any) -> bool:
    """A list of token ids (integers >= 0), possibly empty; a 32K-id prompt in ~1 ms (``all_ints``, ``min``)."""
    return isinstance(v, list) and all_ints(v) and (not v or min(v) >= 0)


def _token_ids(v: Any) -> bool:
    return bool(v) and _ids(v)


# --- the field groups ------------------------------------------------------------------------

# accepted, do not change the output: logged
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "priority", "request_id",
            "cache_salt", "prompt_cache_key", "safety_identifier", "include_reasoning"}


def _neutral_none(v) -> bool:
    return v is None


def _neutral_empty(v) -> bool:
    return v is None or v == [] or v == {}


# accepted only at these neutral values; another value is refused by name
_NEUTRAL_BOTH = {
    "use_beam_search": lambda v: v in (None, False),
    "length_penalty": lambda v: v is None or (_is_num(v) and v == 1),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "allowed_token_ids": _neutral_none,
    "bad_words": _neutral_empty,
    "guided_json": _neutral_none, "guided_regex": _neutral_none, "guided_choice": _neutral_none,
    "guided_grammar": _neutral_none, "structural_tag": _neutral_none, "guided_decoding_backend": _neutral_none,
    "guided_whitespace_pattern": _neutral_none, "structured_outputs": _neutral_none,
    "logits_processors": _neutral_none, "kv_transfer_params": _neutral_none, "vllm_xargs": _neutral_none,
    "mm_processor_kwargs": _neutral_empty, "verbosity": _neutral_none, "reasoning_effort": _neutral_none,
    "prediction": _neutral_none, "web_search_options": _neutral_none,
}
_NEUTRAL_COMPLETION = {"suffix": lambda v: v in (None, ""), "prompt_embeds": _neutral_none}
_NEUTRAL_CHAT = {
    "audio": _neutral_none, "functions": _neutral_empty, "function_call": lambda v: v in (None, "none"),
    "documents": _neutral_empty, "echo": lambda v: v in (None, False),
    "modalities": lambda v: v is None or v == ["text"],
}

# used by the server (checked in parse_*)
_USED_BOTH = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos",
              "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "stream", "stream_options",
              "prompt_logprobs", "response_format", "add_special_tokens", "return_tokens_as_token_ids",
              "truncate_prompt_tokens", "reuse_prefix"}
_USED_COMPLETION = {"prompt", "logprobs", "echo"}
_USED_CHAT = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
              "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"}

FIELDS = {
    "completions": {"used": sorted(_USED_BOTH | _USED_COMPLETION), "accepted_logged": sorted(_IGNORED),
                    "neutral_only": sorted({**_NEUTRAL_BOTH, **_NEUTRAL_COMPLETION})},
    "chat": {"used": sorted(_USED_BOTH | _USED_CHAT), "accepted_logged": sorted(_IGNORED),
             "neutral_only": sorted({**_NEUTRAL_BOTH, **_NEUTRAL_CHAT})},
}
"""Per endpoint: the fields used, accepted and logged, and accepted only at a neutral value (the module doc)."""


def _screen(body: dict, used: set, neutral: dict, p: Problems) -> list[str]:
    """Unknown fields and non-neutral unsupported values -> problems; returns the ignored fields present."""
    ignored = []
    for name, value in body.items():
        if name in used:
            continue
        if name in _IGNORED:
            ignored.append(name)
        elif name in neutral:
            if not neutral[name](value):
                p.unsupported(name)
        else:
            p.add(name, "unknown field")
    return ignored


# --- requests --------------------------------------------------------------------------------

@dataclass
class GenRequest:
    """One checked completion or chat request. ``prompts``: text or token ids, one per prompt (a chat
    request has one, its messages for the template in ``messages``). ``sampling``: the non-neutral
    sampling fields by the LLM API's ``SamplingParams`` names (``max_tokens`` is set by the server).
    ``logprobs``: top-k per generated token (None: none). ``prompt_logprobs``: vLLM's field, top-k per
    prompt token (None: none; ``echo`` with ``logprobs`` asks the engine for them too,
    ``scored_prompt_logprobs``)."""

    endpoint: str
    model: str | None
    prompts: list = field(default_factory=list)
    messages: list[dict] | None = None
    n: int = 1
    max_tokens: int | None = None
    sampling: dict = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    tokens_as_ids: bool = False
    reuse_prefix: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    ignored: list[str] = field(default_factory=list)

    @property
    def scored_prompt_logprobs(self) -> int | None:
        """The prompt log-probabilities the engine computes: ``prompt_logprobs``, or ``logprobs`` with ``echo``."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def stop_strings(self) -> list[str]:
        s = self.sampling.get("stop")
        return [s] if isinstance(s, str) else list(s or [])


def _common(body: dict, r: GenRequest, p: Problems) -> None:
    """The fields both endpoints share."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        p.add("model", f"must be a string, got {_kind(model)} {_show(model)}")
        model = None
    r.model = model
    r.max_tokens = _int(body, "max_tokens", p, lo=0 if r.endpoint == "completions" else 1)
    r.n = _int(body, "n", p, 1, lo=1, hi=128)
    best_of = _int(body, "best_of", p, lo=1)
    if best_of is not None and best_of != r.n:
        p.unsupported("best_of", f"best_of ({best_of}) other than n ({r.n})")
    s = r.sampling
    temperature = _float(body, "temperature", p, 1.0, lo=0.0)
    top_p = _float(body, "top_p", p, lo=0.0, hi=1.0)
    top_k = _int(body, "top_k", p, lo=-1)
    s["temperature"] = temperature
    if top_k is not None and top_k > 0:
        s["top_k"] = top_k
    if temperature > 0:          # OpenAI's defaults sample: top_p 1 = no cut
        s["top_p"] = 1.0 if top_p is None else top_p
    elif top_p is not None:
        s["top_p"] = top_p
    seed = _int(body, "seed", p)
    if seed is not None:
        if not -_MAX_SEED <= seed < _MAX_SEED:
            p.add("seed", f"must be an integer in [-2^63, 2^63 - 1], got {seed}")
        else:
            s["seed"] = seed % _MAX_SEED
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            if stop:
                s["stop"] = stop
        elif isinstance(stop, list) and all(isinstance(x, str) and x for x in stop):
            if stop:
                s["stop"] = list(stop)
        else:
            p.add("stop", f"must be a string or a list of non-empty strings, got {_show(stop)}")
    # sampling fields sent to SamplingParams only when not neutral (the server refuses them by name
    # when the LLM API lacks them)
    for name, value, neutral in (
            ("presence_penalty", _float(body, "presence_penalty", p, 0.0, lo=-2.0, hi=2.0), 0.0),
            ("frequency_penalty", _float(body, "frequency_penalty", p, 0.0, lo=-2.0, hi=2.0), 0.0),
            ("repetition_penalty", _float(body, "repetition_penalty", p, 1.0, lo=0.0, lo_open=True), 1.0),
            ("min_p", _float(body, "min_p", p, 0.0, lo=0.0, hi=1.0), 0.0),
            ("min_tokens", _int(body, "min_tokens", p, 0, lo=0), 0),
            ("ignore_eos", _bool(body, "ignore_eos", p, False), False),
            ("include_stop_str_in_output", _bool(body, "include_stop_str_in_output", p, False), False),
            ("skip_special_tokens", _bool(body, "skip_special_tokens", p, True), True)):
        if value != neutral:
            s[name] = value
    if r.max_tokens is not None and s.get("min_tokens", 0) > max(r.max_tokens, 1):
        p.add("min_tokens", f"must be <= max_tokens ({r.max_tokens}), got {s['min_tokens']}")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not _ids(ids):
            p.add("stop_token_ids", f"must be a list of token ids (integers >= 0), got {_show(ids)}")
        elif ids:
            s["stop_token_ids"] = list(ids)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            p.add("logit_bias", f"must be an object mapping token ids to biases, got {_kind(bias)}")
        else:
            parsed = {}
            for k, v in bias.items():
                if not (isinstance(k, str) and k.isdigit()):
                    p.add(f"logit_bias.{k}", "keys must be token ids (strings of digits)")
                elif not _is_num(v) or not -100 <= v <= 100:
                    p.add(f"logit_bias.{k}", f"must be a number in [-100, 100], got {_show(v)}")
                else:
                    parsed[int(k)] = float(v)
            if parsed:
                s["logit_bias"] = parsed
    r.stream = _bool(body, "stream", p, False)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            p.add("stream_options", f"must be an object, got {_kind(so)}")
        else:
            for k in so:
                if k not in ("include_usage", "continuous_usage_stats"):
                    p.add(f"stream_options.{k}", "unknown field")
            r.include_usage = _bool(so, "include_usage", p, False)
            r.continuous_usage = _bool(so, "continuous_usage_stats", p, False)
            if not r.stream and (r.include_usage or r.continuous_usage):
                p.add("stream_options", "needs stream: true")
    r.prompt_logprobs = _int(body, "prompt_logprobs", p, lo=0, hi=MAX_LOGPROBS)
    if r.prompt_logprobs is not None and r.stream:
        p.add("prompt_logprobs", "is not available with stream: true")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            p.add("response_format", f'must be an object with a "type", got {_show(rf)}')
        elif rf["type"] != "text":
            p.unsupported("response_format", f"response_format {rf['type']}")
    if "add_special_tokens" in body:
        r.add_special_tokens = _bool(body, "add_special_tokens", p)
    r.truncate_prompt_tokens = _int(body, "truncate_prompt_tokens", p, lo=1)
    r.tokens_as_ids = _bool(body, "return_tokens_as_token_ids", p, False)
    r.reuse_prefix = _bool(body, "reuse_prefix", p, False)


def _body(body: Any, p: Problems) -> dict:
    if not isinstance(body, dict):
        p.add("body", f"must be a JSON object, got {_kind(body)}")
        return {}
    return body


def parse_completion(raw: Any) -> tuple[GenRequest, Problems]:
    """A ``/v1/completions`` body -> (request, problems)."""
    p = Problems()
    body = _body(raw, p)
    r = GenRequest("completions", None)
    r.ignored = _screen(body, _USED_BOTH | _USED_COMPLETION, {**_NEUTRAL_BOTH, **_NEUTRAL_COMPLETION}, p)
    _common(body, r, p)
    prompt = body.get("prompt")
    shape = ("must be a non-empty string, a list of non-empty strings, a token id list, or a list of "
             "token id lists")
    if prompt is None:
        p.add("prompt", "is required")
    elif isinstance(prompt, str):
        if prompt:
            r.prompts = [prompt]
        else:
            p.add("prompt", "is empty")
    elif isinstance(prompt, list) and prompt:
        if all_ints(prompt):
            if min(prompt) >= 0:
                r.prompts = [prompt]          # the body's own list: not copied
            else:
                p.add("prompt", "token ids must be integers >= 0")
        elif all(isinstance(x, str) for x in prompt):
            for i, x in enumerate(prompt):
                if not x:
                    p.add(f"prompt[{i}]", "is empty")
            r.prompts = list(prompt)
        elif all(isinstance(x, list) for x in prompt):
            for i, x in enumerate(prompt):
                if not _token_ids(x):
                    p.add(f"prompt[{i}]", "must be a non-empty list of token ids (integers >= 0)")
            r.prompts = list(prompt)
        else:
            p.add("prompt", f"{shape}; got a list mixing {sorted({_kind(x) for x in prompt})}")
    else:
        p.add("prompt", f"{shape}; got {_kind(prompt)} {_show(prompt)}")
    r.echo = _bool(body, "echo", p, False)
    r.logprobs = _int(body, "logprobs", p, lo=0, hi=MAX_LOGPROBS)
    if r.max_tokens == 0 and not r.echo:
        p.add("max_tokens", "must be an integer >= 1 (0 only with echo: true)")
    return r, p


def _content(msg: dict, i: int, p: Problems) -> str | None:
    """A message's text: a string, or the text parts of a list joined by newlines (other parts refused)."""
    c = msg.get("content")
    where = f"messages[{i}].content"
    if c is None:
        if msg.get("role") != "assistant":
            p.add(where, "is required (null only for an assistant message)")
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        p.add(where, f"must be a string or a list of content parts, got {_kind(c)}")
        return None
    texts = []
    for j, part in enumerate(c):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "refusal") and isinstance(part.get(kind), str):
            texts.append(part[kind])
        elif isinstance(kind, str) and kind not in ("text", "refusal"):
            p.unsupported(f"{where}[{j}]", f"{kind} content ({where}[{j}])")
        else:
            p.add(f"{where}[{j}]", f'must be an object {{"type": "text", "text": "..."}}, got {_show(part)}')
    return "\n".join(texts)


_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio", "function_call",
                 "reasoning_content", "reasoning"}


def chat_messages(raw: Any, p: Problems) -> list[dict]:
    """OpenAI chat messages -> ``[{"role", "content"[, "name"][, "tool_call_id"]}]`` for a chat template
    (``content`` a string: text parts joined by newlines, ``null`` of an assistant message ``""``)."""
    if not isinstance(raw, list) or not raw:
        p.add("messages", "must be a non-empty list of messages" if raw is not None else "is required")
        return []
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            p.add(f"messages[{i}]", f"must be an object, got {_kind(m)}")
            continue
        role = m.get("role")
        if role not in _ROLES:
            if role == "function":
                p.unsupported(f"messages[{i}].role", "the function role")
            else:
                p.add(f"messages[{i}].role", f"must be one of {', '.join(_ROLES)}, got {_show(role)}")
            continue
        for k in m:
            if k not in _MESSAGE_KEYS:
                p.add(f"messages[{i}].{k}", "unknown field")
        for k in ("tool_calls", "audio", "function_call"):
            if m.get(k) not in (None, []):
                p.unsupported(f"messages[{i}].{k}")
        text = _content(m, i, p)
        msg = {"role": role, "content": text}
        for k in ("name", "tool_call_id"):
            if m.get(k) is not None:
                if isinstance(m[k], str):
                    msg[k] = m[k]
                else:
                    p.add(f"messages[{i}].{k}", f"must be a string, got {_kind(m[k])}")
        out.append(msg)
    return out


def parse_chat(raw: Any) -> tuple[GenRequest, Problems]:
    """A ``/v1/chat/completions`` body -> (request, problems)."""
    p = Problems()
    body = _body(raw, p)
    r = GenRequest("chat", None)
    r.ignored = _screen(body, _USED_BOTH | _USED_CHAT, {**_NEUTRAL_BOTH, **_NEUTRAL_CHAT}, p)
    _common(body, r, p)
    r.messages = chat_messages(body.get("messages"), p)
    mct = _int(body, "max_completion_tokens", p, lo=1)
    if mct is not None:
        r.max_tokens = mct
    if _bool(body, "logprobs", p, False):
        r.logprobs = _int(body, "top_logprobs", p, 0, lo=0, hi=MAX_LOGPROBS)
    elif _int(body, "top_logprobs", p, 0, lo=0, hi=MAX_LOGPROBS):
        p.add("top_logprobs", "needs logprobs: true")
    tools = body.get("tools")
    if tools not in (None, []):
        p.unsupported("tools")
    tc = body.get("tool_choice")
    if tc not in (None, "none", "auto"):
        p.unsupported("tool_choice", f"tool_choice {_show(tc)}")
    r.add_generation_prompt = _bool(body, "add_generation_prompt", p, True)
    r.continue_final_message = _bool(body, "continue_final_message", p, False)
    if r.add_generation_prompt and r.continue_final_message and "add_generation_prompt" in body:
        p.add("continue_final_message", "cannot be used with add_generation_prompt: true")
    if r.continue_final_message:
        r.add_generation_prompt = False
    r.chat_template = _str(body, "chat_template", p)
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        p.add("chat_template_kwargs", f"must be an object, got {_kind(ctk)}")
    else:
        r.chat_template_kwargs = ctk or None
    return r, p


def parse_tokenize(raw: Any) -> tuple[dict, Problems]:
    """A ``/tokenize`` body (vLLM's): ``{"prompt": str}`` or ``{"messages": [...]}``, with ``model``,
    ``add_special_tokens``, ``add_generation_prompt``, ``return_token_strs``."""
    p = Problems()
    body = _body(raw, p)
    known = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs",
             "continue_final_message", "chat_template", "chat_template_kwargs"}
    for k in body:
        if k not in known:
            p.add(k, "unknown field")
    out = {"model": _str(body, "model", p), "return_token_strs": _bool(body, "return_token_strs", p, False),
           "add_generation_prompt": _bool(body, "add_generation_prompt", p, True),
           "continue_final_message": _bool(body, "continue_final_message", p, False),
           "chat_template": _str(body, "chat_template", p), "chat_template_kwargs": body.get("chat_template_kwargs"),
           "add_special_tokens": _bool(body, "add_special_tokens", p) if "add_special_tokens" in body else None}
    if ("prompt" in body) == ("messages" in body):
        p.add("prompt", "give exactly one of prompt and messages")
    elif "prompt" in body:
        out["prompt"] = _str(body, "prompt", p)
        if out["prompt"] is None:
            p.add("prompt", "must be a string")
    else:
        out["messages"] = chat_messages(body["messages"], p)
    return out, p


def parse_detokenize(raw: Any) -> tuple[dict, Problems]:
    """A ``/detokenize`` body: ``{"tokens": [int, ...]}`` (and ``model``)."""
    p = Problems()
    body = _body(raw, p)
    for k in body:
        if k not in ("model", "tokens"):
            p.add(k, "unknown field")
    tokens = body.get("tokens")
    if not _ids(tokens):
        p.add("tokens", f"must be a list of token ids (integers >= 0), got {_show(tokens)}")
        tokens = []
    return {"model": _str(body, "model", p), "tokens": tokens}, p
