"""The LLM API: text in, text out, with TensorRT-LLM's LLM API names (``tensorrt_llm.LLM``,
``SamplingParams``, ``RequestOutput`` / ``CompletionOutput``) over the in-flight batching engine.

    from macattn import LLM, SamplingParams
    llm = LLM("builtin")                                  # or a transformers model directory
    for out in llm.generate(["The gospel of", "In the beginning"], SamplingParams(max_tokens=16)):
        print(out.prompt, "->", out.outputs[0].text, out.outputs[0].finish_reason)

Prompts are strings (tokenized with the model's tokenizer; the built-in checkpoint ships its own) or
token id lists. ``SamplingParams`` takes TensorRT-LLM's field names; sampling is greedy unless
``temperature`` / ``top_k`` / ``top_p`` ask otherwise (``temperature=0`` is greedy too). Fields we do
not implement are accepted at their neutral values; another value raises ``ValueError`` naming the
field. Stop strings and extra stop token ids end a request after the step that produced them (its
slot is freed at once); the text is cut before the stop string unless ``include_stop_str_in_output``.

One engine loop (a daemon thread started on first use) runs the engine's steps for every caller:
``generate`` (blocking, a batch), ``generate_async`` (a ``RequestHandle``: ``result()``, iteration over
streamed ``RequestOutput`` snapshots, ``async for``, ``abort()``), from any number of threads; requests
submitted while others run join the next step (in-flight batching). ``shutdown()`` (or ``with LLM(...)``)
stops the loop and aborts what is left.
"""
from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from macattn.methods.mac.config import MacConfig
from macattn.runtime.completion_setup import completion_method
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine
from macattn.runtime.sampling import SamplingParams as EngineSampling

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestHandle"]

# fields accepted only at these neutral values (name -> values that mean "off")
_NEUTRAL: dict[str, tuple] = {
    "n": (1,), "best_of": (None, 1), "use_beam_search": (False,), "repetition_penalty": (None, 1.0),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "length_penalty": (None,),
    "min_tokens": (None, 0, 1), "min_p": (None, 0.0), "bad": (None,), "bad_token_ids": (None,),
    "prompt_logprobs": (None,), "return_context_logits": (False,), "exclude_input_from_output": (True,),
    "embedding_bias": (None,), "logits_processor": (None,), "guided_decoding": (None,),
    "truncate_prompt_tokens": (None,), "no_repeat_ngram_size": (None,), "beam_width_array": (None,),
}


@dataclass(frozen=True, init=False)
class SamplingParams:
    """TensorRT-LLM's ``SamplingParams`` fields this API implements (the others in ``_NEUTRAL``).

    max_tokens: tokens to generate (>= 1). temperature: None = 1.0, 0 = greedy, else > 0.
    top_k / top_p: None = 0 (no cut); greedy iff ``top_k == 1`` or both are 0 (TensorRT-LLM's rule).
    seed: sampling seed (None: drawn per request). end_id: stop token (None: the tokenizer's EOS;
    ``ignore_eos`` disables it). pad_id: kept for the servers' padding. stop / stop_token_ids: more
    stop conditions. logprobs: None, or k >= 0: each generated token's log probability plus the
    ``k`` most likely tokens'. return_generation_logits: keep every step's logits ``[V]`` fp32.
    detokenize / skip_special_tokens / add_special_tokens: tokenizer behaviour."""

    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    end_id: int | None = None
    pad_id: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    return_generation_logits: bool = False
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    add_special_tokens: bool = True

    def __init__(self, **kwargs: Any) -> None:
        known = type(self).__dataclass_fields__
        for name, value in kwargs.items():
            if name in known:
                continue
            if name not in _NEUTRAL:
                raise TypeError(f"SamplingParams got an unknown field {name!r}")
            if value not in _NEUTRAL[name]:
                raise ValueError(f"{name}={value!r} is not supported (accepted: {list(_NEUTRAL[name])})")
        for name, f in known.items():
            object.__setattr__(self, name, kwargs.get(name, f.default))
        self._validate()

    def _validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
            raise ValueError(f"temperature must be a finite float >= 0 or None, got {t!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0):
            raise ValueError(f"top_p must be a float in [0, 1] or None, got {self.top_p!r}")
        for name in ("top_k", "seed", "end_id", "pad_id", "logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {v!r}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        ids = self.stop_token_ids or []
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def engine_params(self, eos_id: int | None) -> EngineSampling:
        """The engine's per-request sampling parameters (``macattn.runtime.sampling.SamplingParams``)."""
        greedy = self.temperature == 0
        return EngineSampling(max_new_tokens=self.max_tokens,
                              end_id=None if self.ignore_eos else (self.end_id if self.end_id is not None else eos_id),
                              temperature=1.0 if greedy or self.temperature is None else float(self.temperature),
                              top_k=1 if greedy else (self.top_k or 0), top_p=0.0 if greedy else float(self.top_p or 0.0),
                              random_seed=self.seed)


@dataclass
class CompletionOutput:
    """One generated sequence: ``text``, ``token_ids`` (the stop tokens included; the end token is
    not emitted), ``logprobs`` (per token ``{token_id: logprob}``: the sampled token and the top
    ``SamplingParams.logprobs``), ``cumulative_logprob``, ``finish_reason`` (``"stop"`` / ``"length"``),
    ``stop_reason`` (the stop string or stop token id that ended it; None for the end token),
    ``generation_logits`` ``[len(token_ids), V]`` fp32 when asked."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: torch.Tensor | None = None


@dataclass
class RequestOutput:
    """``prompt`` (None for a token id prompt), ``prompt_token_ids``, ``outputs`` (one
    ``CompletionOutput``), ``finished``, ``metrics``: ``ttft_s`` (submission to first token),
    ``inter_token_latency_s`` (mean gap between later tokens), ``e2e_s``, ``num_generated_tokens`` and
    the method's figures of the request (MAC: ``mac_hit_rate``, the share of its (step, layer, head)
    matches that hit, and ``mac_kv_skip``, the mean share of the prefix a step skipped)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict = field(default_factory=dict)


class LLM:
    """model: ``"builtin"`` (the packaged trained checkpoint and its tokenizer), a transformers
    model directory, or a ``*ForCausalLM`` object (then ``tokenizer`` is required). method: the
    attention method (``"mac"``, ``"full"``, …). mac: a ``MacConfig``, a per-layer file from
    ``macattn tune``, ``"off"``, or None (MAC's defaults). dtype: ``"auto"`` or a torch dtype;
    device, max_batch_size, max_seq_len, quantization, use_cuda_graphs (None: on CUDA), max_num_batched_tokens
    (the token budget of one engine step; None: 8192 on CUDA, whole prompts on the CPU), tensor_parallel_size (ranks the model is
    sharded over, ``runtime/tensor_parallel.py``): the runtime's (``RuntimeConfig``).

    Retrieval-completion (``method="completion"``): ``completion`` its ``CompletionConfig`` (default: the
    exhaustive selector; with ``kv_offload`` the page selector ``"quest"``), ``completion_maps`` the distilled
    feature maps (a ``save_feature_maps`` directory, a ``CompletionFeatureMaps``, or None: the untrained
    Performer initialisation). ``kv_offload="host"``: the prompt KV lives in host memory and each step
    fetches the pages it selects (``macattn.methods.completion.offload``; sizes in ``offload``, an
    ``OffloadConfig``, capacity checked here); ``prefix_store``: a directory where prompts' KV persist
    (model identity and sha256 checked on load), used by ``generate(..., reuse_prefix=True)``."""

    def __init__(self, model: Any = "builtin", *, tokenizer: Any = None, method: str = "mac", mac: Any = None,
                 dtype: Any = "auto", device: str = "cpu", max_batch_size: int = 8, max_seq_len: int | None = None,
                 quantization: str | None = None, use_cuda_graphs: bool | None = None,
                 max_num_batched_tokens: int | None = None, tensor_parallel_size: int = 1, completion: Any = None,
                 completion_maps: Any = None, kv_offload: str | None = None, offload: Any = None,
                 prefix_store: Any = None) -> None:
        self._engine_loop: _EngineLoop | None = None
        hf, tok = self._load(model, tokenizer, dtype)
        self.tokenizer = tok
        mac_config = None
        if method == "mac":
            mac_config = (mac if isinstance(mac, MacConfig) else MacConfig(enabled=False) if mac == "off"
                          else MacConfig() if mac is None else MacConfig.load(mac))
        elif mac is not None:
            raise ValueError(f"mac is MAC's configuration; method={method!r} takes none")
        rc = RuntimeConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len, device=device,
                           use_cuda_graphs=device.startswith("cuda") if use_cuda_graphs is None else use_cuda_graphs,
                           quantization=quantization, max_num_batched_tokens=max_num_batched_tokens,
                           tensor_parallel_size=tensor_parallel_size)
        engine_method, method_config, method_kwargs = completion_method(
            hf, method, completion=completion, maps=completion_maps, kv_offload=kv_offload, offload=offload,
            prefix_store=prefix_store)
        self.engine = LLMEngine(hf, mac_config, rc, method=engine_method, method_config=method_config,
                                method_kwargs=method_kwargs)

    @staticmethod
    def _load(model, tokenizer, dtype):
        torch_dtype = None if dtype == "auto" else dtype
        if isinstance(model, str) and model == "builtin":
            from macattn.models.checkpoint import load_builtin_checkpoint

            hf, tok = load_builtin_checkpoint(dtype=torch_dtype or torch.float32)
            return hf, tokenizer or tok
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch_dtype or "auto",
                                                      attn_implementation="sdpa").eval()
            return hf, tokenizer or AutoTokenizer.from_pretrained(str(model))
        if tokenizer is None:
            raise ValueError("tokenizer is required when model is a model object")
        return (model.to(torch_dtype) if torch_dtype is not None else model), tokenizer

    # --- generation -------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 reuse_prefix: bool = False):
        """``prompts``: a string, a token id list, or a list of either. Returns one ``RequestOutput``
        per prompt (a single one for a single prompt). Every request is validated before any runs.
        ``reuse_prefix``: load each prompt's KV from the ``prefix_store`` when it is there (skipping its
        prefill; ``RequestOutput.metrics["prefix_reused"]``), else prefill and persist it."""
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                              and all(isinstance(t, int) for t in prompts))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise ValueError("prompts must be a non-empty string, token id list, or list of them")
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"sampling_params must be one SamplingParams or one per prompt ({len(batch)}), "
                             f"got {len(params)}")
        requests = [self._request(p, sp if sp is not None else SamplingParams(), index=i, reuse_prefix=reuse_prefix)
                    for i, (p, sp) in enumerate(zip(batch, params))]
        handles = [self._loop().submit(*r) for r in requests]
        try:
            outputs = [h.result() for h in handles]
        finally:   # an interrupted wait leaves no request of this call behind
            for h in handles:
                h.abort()
        return outputs[0] if single else outputs

    def generate_async(self, prompt, sampling_params: SamplingParams | None = None, *,
                       reuse_prefix: bool = False) -> "RequestHandle":
        """Submit one prompt (validated now) and return at once; see ``RequestHandle`` (``reuse_prefix``:
        as ``generate``)."""
        return self._loop().submit(*self._request(prompt, sampling_params or SamplingParams(),
                                                  reuse_prefix=reuse_prefix))

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
        if self._engine_loop is None:
            self._engine_loop = _EngineLoop(self)
        return self._engine_loop

    def _request(self, prompt, sp: SamplingParams, *, index: int | None = None, reuse_prefix: bool = False):
        """Validate one request (errors name ``prompts[index]`` / ``sampling_params[index]``, or
        ``prompt`` / ``sampling_params`` for a single one) and build its sequence and output."""
        where, sp_where = (("prompt", "sampling_params") if index is None
                           else (f"prompts[{index}]", f"sampling_params[{index}]"))
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"{sp_where} must be a macattn SamplingParams, got {type(sp).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where} is empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=sp.add_special_tokens)
        else:
            ids = prompt
        try:
            seq = self.engine.make_request(ids, sp.engine_params(self.tokenizer.eos_token_id), reuse_prefix=reuse_prefix)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        out = RequestOutput(seq.request_id, prompt if isinstance(prompt, str) else None, list(seq.prompt),
                            [CompletionOutput(0, logprobs=[] if sp.logprobs is not None else None,
                                              cumulative_logprob=0.0 if sp.logprobs is not None else None)])
        return seq, sp, out


def _record(tokenizer, step, sp: SamplingParams, out: RequestOutput, times: list) -> str | None:
    """Fold one ``StepOutput`` into ``out``: token, logprobs / logits, text, stop conditions. Returns the
    finish reason when the request ends here (the caller then frees it and sets ``out``'s metrics)."""
    comp = out.outputs[0]
    if step.token is not None:
        times.append(time.perf_counter())
        comp.token_ids.append(step.token)
        if sp.logprobs is not None or sp.return_generation_logits:
            _logits(step, sp, comp)
    reason, stop = ("stop", None) if step.finish_reason == "end_id" else (step.finish_reason, None)
    if step.token is not None and sp.stop_token_ids and step.token in sp.stop_token_ids:
        reason, stop = "stop", step.token
    text = tokenizer.decode(comp.token_ids, skip_special_tokens=sp.skip_special_tokens) \
        if sp.detokenize else ""
    for s in sp.stop_strings:
        at = text.find(s)
        if at >= 0:
            text, reason, stop = text[:at + (len(s) if sp.include_stop_str_in_output else 0)], "stop", s
            break
    comp.text = text
    if reason is not None:
        comp.finish_reason, comp.stop_reason, out.finished = reason, stop, True
    return reason


def _finish_metrics(seq, out: RequestOutput, times: list, start: float) -> None:
    """``out.metrics`` of a finished request (latencies and the method's figures of ``seq``)."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    out.metrics = {"ttft_s": times[0] - start if times else None,
                   "inter_token_latency_s": sum(gaps) / len(gaps) if gaps else None,
                   "e2e_s": time.perf_counter() - start, "num_generated_tokens": len(out.outputs[0].token_ids),
                   **seq.metrics}


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
    """One submitted request: ``result(timeout)`` blocks for the final ``RequestOutput``; iterating
    (``for`` or ``async for``) yields a snapshot after every generated token, the last one finished;
    ``abort()`` ends it now and frees its slot (a client that went away). ``request_id`` is the engine's."""

    def __init__(self, loop: "_EngineLoop", request_id: int) -> None:
        self._loop, self.request_id = loop, request_id
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

    def result(self, timeout: float | None = None) -> RequestOutput:
        while self._final is None:
            if self._next(timeout) is None:
                break
        return self._final

    def __iter__(self):
        while (item := self._next()) is not None:
            yield item

    async def __aiter__(self):
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

    def abort(self) -> None:
        self._loop.abort(self.request_id)


class _EngineLoop:
    """Two threads serve every handle (module doc). The engine thread steps the engine back to back
    (it is touched only under ``cv``'s lock) and hands each step's raw ``StepOutput``s to the output
    thread, which detokenizes, checks stop strings, builds the snapshots and streams them while the
    engine runs the next step (the host work of step n overlaps the GPU's step n + 1). A request that a
    stop string ends is freed through the engine lock right after; a step the engine ran for it
    meanwhile is dropped. A failing step fails every request in flight with its exception."""

    def __init__(self, llm: LLM) -> None:
        self.engine, self.tokenizer = llm.engine, llm.tokenizer     # not the LLM: it may be collected
        self.cv = threading.Condition()
        self.live: dict[int, tuple] = {}          # request_id -> (handle, seq, sp, out, token times, start)
        self.live_lock = threading.Lock()         # ``live`` is read by both threads
        self.stopped = False
        self._waiters = 0                         # callers waiting for ``cv`` (the loop then steps aside)
        self._waiters_lock = threading.Lock()
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()    # lists of StepOutput; None ends the thread
        self.thread = threading.Thread(target=self._run, name="macattn-engine-loop", daemon=True)
        self.out_thread = threading.Thread(target=self._emit, name="macattn-output", daemon=True)
        self.thread.start()
        self.out_thread.start()

    @contextmanager
    def _turn(self):
        """``cv``'s lock for a caller: a lock is not fair, and the loop re-takes it right after each step,
        so the loop yields it while someone waits (else an abort could wait for a long generation)."""
        with self._waiters_lock:
            self._waiters += 1
        try:
            with self.cv:
                yield
        finally:
            with self._waiters_lock:
                self._waiters -= 1

    def submit(self, seq, sp: SamplingParams, out: RequestOutput) -> RequestHandle:
        handle = RequestHandle(self, seq.request_id)
        with self._turn():
            if self.stopped:
                raise RuntimeError("the LLM was shut down")
            with self.live_lock:
                self.live[seq.request_id] = (handle, seq, sp, out, [], time.perf_counter())
            self.engine.submit(seq)
            self.cv.notify()
        return handle

    def _release(self, request_id: int) -> None:
        """Free a request's engine resources (no-op if it already finished)."""
        with self._turn():
            self.engine.abort(request_id)
            self.engine.requests.pop(request_id, None)

    def abort(self, request_id: int) -> None:
        with self.live_lock:
            entry = self.live.pop(request_id, None)
        self._release(request_id)
        if entry is not None and not entry[3].finished:
            entry[3].outputs[0].finish_reason = "abort"
            entry[3].finished = True
            entry[0]._push(_snapshot(entry[3]))

    def stop(self) -> None:
        with self._turn():
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
                while not self.engine.has_unfinished() and not self.stopped:
                    self.cv.wait()
                if self.stopped:
                    return
                try:
                    steps = self.engine.step()
                    if steps:
                        self._outputs.put(steps)
                except BaseException as exc:     # noqa: BLE001 - handed to every waiter
                    with self.live_lock:
                        failed, self.live = self.live, {}
                    for rid, (handle, *_rest) in failed.items():
                        self.engine.abort(rid)
                        self.engine.requests.pop(rid, None)
                        handle._push(exc)
            while self._waiters and not self.stopped:      # let waiting callers take the lock first
                time.sleep(0.0005)

    def _emit(self) -> None:
        while (steps := self._outputs.get()) is not None:
            for step in steps:
                with self.live_lock:
                    entry = self.live.get(step.request_id)
                if entry is None:
                    continue
                handle, seq, sp, out, times, start = entry
                if _record(self.tokenizer, step, sp, out, times) is None:
                    handle._push(_snapshot(out))
                    continue
                with self.live_lock:
                    self.live.pop(step.request_id, None)
                self._release(step.request_id)       # frees the slot now (the method's figures are final)
                _finish_metrics(seq, out, times, start)
                handle._push(_snapshot(out))
