"""An OpenAI-compatible server over the LLM API (``macattn serve --model DIR``, like ``trtllm-serve``
and ``vllm serve``; FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``, and ``usage`` token counts),
``GET /health``, ``GET /metrics`` (Prometheus text: requests and errors by endpoint, generated tokens,
TTFT / inter-token latency / end-to-end histograms, requests running).

Requests are checked before anything runs: an unknown field, a wrong type or range, an empty or
too long prompt, or another model name is a 400 (404 for the model) whose message names the field;
other streams go on undisturbed. A client that disconnects mid-stream aborts its request, which
frees its slot at once. Sampling: ``temperature`` 0 is greedy; otherwise tokens are drawn from the
distribution cut by ``top_p`` (default 1) and ``top_k`` (an extension; default none). Chat prompts
use the tokenizer's chat template, or — for a tokenizer without one, like the built-in checkpoint's —
``<|role|>\\n{content}\\n`` per message followed by ``<|assistant|>\\n``.
"""
from __future__ import annotations

import json
import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from macattn.apps.llm import LLM, RequestOutput, SamplingParams

__all__ = ["build_app", "chat_prompt"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: Literal[1] = 1
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0
    user: str | None = None
    reuse_prefix: bool = False        # macattn: load the prompt's KV from the server's prefix store

    def params(self, default_max_tokens: int, *, logprobs: int | None = None,
               max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens or self.max_tokens or default_max_tokens,
                              temperature=self.temperature,
                              top_p=self.top_p if self.top_p is not None else (1.0 if self.temperature > 0 else None),
                              top_k=self.top_k, seed=self.seed, stop=self.stop or None, logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The prompt text of a chat (module doc)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class _Metrics:
    def __init__(self, llm: LLM) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("macattn_requests", "Requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.tokens = Counter("macattn_generated_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("macattn_time_to_first_token_seconds", "Time to first token", registry=r)
        self.itl = Histogram("macattn_inter_token_latency_seconds", "Mean gap between tokens of a request", registry=r)
        self.e2e = Histogram("macattn_e2e_request_latency_seconds", "Request latency", registry=r)
        self.running = Gauge("macattn_requests_running", "Requests in flight", registry=r)
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

    def finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.tokens.inc(m.get("num_generated_tokens", 0))
        for hist, key in ((self.ttft, "ttft_s"), (self.itl, "inter_token_latency_s"), (self.e2e, "e2e_s"),
                          (self.mac_hit, "mac_hit_rate"), (self.mac_skip, "mac_kv_skip")):
            if m.get(key) is not None:
                hist.observe(m[key])


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": None}})


def build_app(llm: LLM, model_name: str, *, default_max_tokens: int = 16) -> FastAPI:
    """The FastAPI application serving ``llm`` as ``model_name``."""
    app = FastAPI(title="macattn OpenAI-compatible server")
    metrics = _Metrics(llm)
    tok = llm.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p != "body")
        metrics.requests.labels(request.url.path, "400").inc()
        return _error(400, f"{field}: {first['msg']}", field)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "macattn"}]}

    def submit(endpoint: str, req: _Sampling, prompt, logprobs: int | None, max_tokens: int | None):
        if req.model != model_name:
            metrics.requests.labels(endpoint, "404").inc()
            return None, _error(404, f"model: {req.model!r} is not served here (serving {model_name!r})", "model")
        try:
            handle = llm.generate_async(prompt, req.params(default_max_tokens, logprobs=logprobs, max_tokens=max_tokens),
                                        reuse_prefix=req.reuse_prefix)
        except (ValueError, TypeError) as exc:
            metrics.requests.labels(endpoint, "400").inc()
            message = str(exc)     # "<field>: ..." or "<field> must be ...": the field leads the message
            return None, _error(400, message, message.split()[0].rstrip(":"))
        metrics.running.inc()
        return handle, None

    def usage(out: RequestOutput) -> dict:
        n, m = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def done(endpoint: str, out: RequestOutput) -> None:
        metrics.running.dec()
        metrics.requests.labels(endpoint, "200").inc()
        metrics.finished(out)

    async def stream(endpoint: str, request: Request, handle, head: dict, piece):
        sent, last = "", None
        try:
            async for snap in handle:
                last = snap
                if await request.is_disconnected():
                    handle.abort()
                    return
                text = snap.outputs[0].text
                delta, sent = text[len(sent):], text
                finish = snap.outputs[0].finish_reason if snap.finished else None
                if delta or finish:
                    yield f"data: {json.dumps({**head, 'choices': [piece(delta, finish)]})}\n\n"
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(last)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:                     # a client gone mid-stream: its request stops, its slot is freed
            handle.abort()
            if last is not None and last.finished:
                done(endpoint, last)
            else:
                metrics.running.dec()
                metrics.requests.labels(endpoint, "499").inc()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        endpoint = "/v1/completions"
        handle, err = submit(endpoint, req, req.prompt, req.logprobs, None)
        if err is not None:
            return err
        head = {"id": f"cmpl-{handle.request_id}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        if req.stream:
            return StreamingResponse(stream(endpoint, request, handle, head,
                                            lambda d, f: {"index": 0, "text": d, "finish_reason": f, "logprobs": None}),
                                     media_type="text/event-stream")
        out = await _result(handle)
        done(endpoint, out)
        comp = out.outputs[0]
        logprobs = None
        if comp.logprobs is not None:
            logprobs = {"tokens": [tok.decode([t]) for t in comp.token_ids],
                        "token_logprobs": [lp[t] for t, lp in zip(comp.token_ids, comp.logprobs)],
                        "top_logprobs": [{tok.decode([t]): v for t, v in lp.items()} for lp in comp.logprobs]}
        return {**head, "choices": [{"index": 0, "text": comp.text, "finish_reason": comp.finish_reason,
                                     "logprobs": logprobs}], "usage": usage(out)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        endpoint = "/v1/chat/completions"
        prompt = chat_prompt(tok, [m.model_dump() for m in req.messages])
        handle, err = submit(endpoint, req, prompt, None, req.max_completion_tokens)
        if err is not None:
            return err
        head = {"id": f"chatcmpl-{handle.request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name}
        if req.stream:
            head = {**head, "object": "chat.completion.chunk"}
            return StreamingResponse(stream(endpoint, request, handle, head,
                                            lambda d, f: {"index": 0, "delta": {"role": "assistant", "content": d},
                                                          "finish_reason": f}),
                                     media_type="text/event-stream")
        out = await _result(handle)
        done(endpoint, out)
        comp = out.outputs[0]
        return {**head, "choices": [{"index": 0, "message": {"role": "assistant", "content": comp.text},
                                     "finish_reason": comp.finish_reason}], "usage": usage(out)}

    return app


async def _result(handle) -> RequestOutput:
    last = None
    try:
        async for snap in handle:
            last = snap
    finally:
        handle.abort()
    return last
