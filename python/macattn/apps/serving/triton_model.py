"""Triton Python-backend model serving macattn with in-flight batching (copied as ``1/model.py``).

One engine per model instance, driven by one loop thread: ``execute`` parses requests and
hands them to the loop; the loop validates them (a bad request gets an error response
naming the parameter and touches nothing else), admits them between steps, and streams
tokens back. Decoupled: one response per generated token, the last flagged final — or, with
the optional input ``stream`` false (what the ensemble sends unless asked to stream), one final
response with every token. Not decoupled: ``execute`` waits and returns all generated tokens at
once. ``stop_words`` (TensorRT-LLM's ``[2, N]`` word list) ends a request once its output ends
with one of them (the word is kept); ``bad_words`` other than none are refused.

With the ``role`` parameter ``preprocessing`` / ``postprocessing`` the same file serves the
ensemble's text stages (``macattn.apps.serving.triton_text``).

The Python backend stub ignores ``PYTHONPATH``: the ``sys_path`` parameter (written by
``macattn triton-repo``) lists the site-packages to add. It is read from this model's
``config.pbtxt`` when this file is imported, before numpy, torch or macattn are.
"""
import json
import os
import queue
import re
import site
import sys
import threading


def _add_site_dirs(dirs):
    before = list(sys.path)
    for d in dirs:
        if d not in before:
            site.addsitedir(d)                       # processes .pth files (editable installs)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before                     # the project's packages win over the system's


def _config_parameter(name):
    """The string value of parameter ``name`` in ``../config.pbtxt`` (protobuf text escapes undone)."""
    cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config.pbtxt")
    with open(cfg, encoding="utf-8") as f:
        text = f.read()
    m = re.search(r'key:\s*"' + re.escape(name) + r'"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', text)
    if m is None:
        return None
    raw, out, i = m.group(1), bytearray(), 0
    while i < len(raw):
        if raw[i] == "\\" and re.match(r"[0-7]{3}", raw[i + 1:i + 4]):
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        elif raw[i] == "\\":
            out += raw[i + 1].encode()
            i += 2
        else:
            out += raw[i].encode()
            i += 1
    return out.decode("utf-8")


_add_site_dirs(json.loads(_config_parameter("sys_path") or "[]"))

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_OPTIONAL = {"end_id": int, "temperature": float, "top_k": int, "top_p": float, "random_seed": int,
             "reuse_prefix": bool}


class _Pending:
    """One request in flight: the Triton ``request`` (asked whether it was cancelled), where its
    tokens go; ``stream`` False sends them in one final response; ``stop`` the token-id words that
    end it."""

    def __init__(self, request, sender=None):
        self.request = request
        self.sender = sender          # decoupled: the response sender
        self.stream = True
        self.stop = []
        self.tokens = []
        self.error = None
        self.done = threading.Event()

    def stopped_by(self, token) -> bool:
        """Whether the output so far plus ``token`` ends with a stop word."""
        out = self.tokens + [token]
        return any(len(out) >= len(w) and out[-len(w):] == w for w in self.stop)


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        _add_site_dirs(json.loads(params.get("sys_path", "[]")))
        self.text = None
        if params.get("role", "engine") != "engine":
            from macattn.apps.serving.triton_text import TextStage

            self.text = TextStage(params["role"], params, pb_utils)
            return
        import torch

        from macattn.runtime.engine_args import EngineArgs

        threads = int(params.get("torch_num_threads", "0"))
        if threads > 0:
            torch.set_num_threads(threads)
        self.torch = torch
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.engine = EngineArgs.from_json(params["engine_args"]).build_engine()
        # A3 chunked prompts (optional input rag_lengths): fusion config from the a3_config parameter
        from macattn.methods.a3.config import A3Config
        from macattn.runtime.chunk_store import ChunkKVStore, model_fingerprint

        self.a3 = A3Config(**json.loads(params["a3_config"])) if "a3_config" in params else A3Config()
        self.chunk_store = None if self.a3.store_dir is None else ChunkKVStore(
            self.a3.store_dir, model_id=model_fingerprint(self.engine.model), max_bytes=self.a3.store_max_bytes)
        self.inbox = queue.Queue()
        self.stopping = threading.Event()
        self.loop = threading.Thread(target=self._loop, name="macattn-engine", daemon=True)
        self.loop.start()

    # --- request parsing (execute thread) ----------------------------------------------------
    def _parse(self, request):
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1)
        kwargs = {"max_new_tokens": int(pb_utils.get_input_tensor_by_name(request, "max_new_tokens")
                                        .as_numpy().reshape(-1)[0])}
        for name, cast in _OPTIONAL.items():
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None:
                arr = t.as_numpy().reshape(-1)
                if arr.size != 1:
                    raise ValueError(f"{name} must hold exactly one value, got {arr.size}")
                kwargs[name] = cast(arr[0].item())
        if kwargs.get("end_id", 0) < 0:                # the ensemble's "no end token"
            del kwargs["end_id"]
        elif kwargs.get("end_id", 0) >= self.engine.vocab_size:
            raise ValueError(f"end_id must be an int in [0, {self.engine.vocab_size - 1}] (vocab_size="
                             f"{self.engine.vocab_size}), or negative for none, got {kwargs['end_id']}")
        rag = pb_utils.get_input_tensor_by_name(request, "rag_lengths")
        if rag is not None:
            kwargs["rag_lengths"] = rag.as_numpy().reshape(-1).tolist()
        return self.torch.from_numpy(ids.astype(np.int64, copy=False).copy()), kwargs

    def _parse_delivery(self, request, p):
        from macattn.apps.serving.triton_text import parse_word_list

        stream = pb_utils.get_input_tensor_by_name(request, "stream")
        if stream is not None:
            arr = stream.as_numpy().reshape(-1)
            if arr.size != 1:
                raise ValueError(f"stream must hold exactly one value, got {arr.size}")
            p.stream = bool(arr[0])
        for name in ("stop_words", "bad_words"):
            t = pb_utils.get_input_tensor_by_name(request, name)
            words = [] if t is None else parse_word_list(t.as_numpy(), name)
            if name == "bad_words" and words:
                raise ValueError("bad_words is not supported by macattn (send none)")
            if name == "stop_words":
                p.stop = words

    def execute(self, requests):
        if self.text is not None:
            return self.text.execute(requests)
        pending = []
        for request in requests:
            p = _Pending(request, request.get_response_sender() if self.decoupled else None)
            try:
                ids, kwargs = self._parse(request)
                self._parse_delivery(request, p)
            except Exception as exc:                   # noqa: BLE001 - reported to the client
                self._fail(p, f"bad request: {exc}", invalid=True)
            else:
                self.inbox.put((ids, kwargs, p))
            pending.append(p)
        if self.decoupled:
            return None
        responses = []
        for p in pending:
            p.done.wait()
            if p.error is not None:
                responses.append(pb_utils.InferenceResponse(error=p.error if isinstance(p.error, pb_utils.TritonError)
                                                             else pb_utils.TritonError(p.error)))
            else:
                responses.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("output_ids", np.asarray(p.tokens, dtype=np.int64))]))
        return responses

    # --- delivery ------------------------------------------------------------------------------
    def _fail(self, p, message, invalid=False, code=None):
        """End ``p`` with ``message``: an invalid request (``invalid``: HTTP 400 / gRPC INVALID_ARGUMENT, the
        backend's INVALID_ARG code), ``code`` (a ``TritonError`` code) or a server fault (500)."""
        code = pb_utils.TritonError.INVALID_ARG if invalid else code
        p.error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        if p.sender is not None:
            p.sender.send(pb_utils.InferenceResponse(error=p.error), flags=_FINAL)
        p.done.set()

    def _deliver(self, p, token, finished):
        if token is not None:
            p.tokens.append(token)
        if p.sender is not None:
            if not p.stream:
                if finished:
                    resp = pb_utils.InferenceResponse([pb_utils.Tensor("output_ids", np.asarray(p.tokens, np.int64))])
                    p.sender.send(resp, flags=_FINAL)
            elif token is not None:
                resp = pb_utils.InferenceResponse([pb_utils.Tensor("output_ids", np.asarray([token], np.int64))])
                p.sender.send(resp, flags=_FINAL if finished else 0)
            elif finished:
                p.sender.send(flags=_FINAL)
        if finished:
            p.done.set()

    # --- the engine loop (one thread owns the engine) -------------------------------------------
    def _loop(self):
        live = {}
        while not self.stopping.is_set():
            try:
                block = not self.engine.has_unfinished()
                while True:
                    ids, kwargs, p = self.inbox.get(block=block, timeout=0.05 if block else None)
                    block = False
                    try:
                        rid = self._add_request(ids, kwargs)
                    except (ValueError, TypeError, NotImplementedError) as exc:
                        self._fail(p, str(exc), invalid=True)
                    else:
                        live[rid] = p
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            self._drop_cancelled(live)
            try:
                outputs = self.engine.step()
            except Exception as exc:                   # noqa: BLE001 - fail everything in flight
                for rid, p in list(live.items()):
                    self.engine.abort(rid)
                    self._fail(p, f"engine step failed: {exc!r}")
                live.clear()
                continue
            for o in outputs:
                p = live.get(o.request_id)
                if p is None:
                    continue
                if o.finish_reason == "error":             # the engine failed this request alone
                    self._fail(p, f"request {o.request_id} failed: {o.error}")
                    del live[o.request_id]
                    self.engine.requests.pop(o.request_id, None)
                    continue
                if not o.finished and p.stop and o.token is not None and p.stopped_by(o.token):
                    self.engine.abort(o.request_id)          # a stop word: this token is the last
                    o = type(o)(o.request_id, o.token, True, "stop")
                try:
                    self._deliver(p, o.token, o.finished)
                except Exception as exc:               # noqa: BLE001 - e.g. the client went away
                    pb_utils.Logger.log_warn(f"macattn: dropping request {o.request_id}: {exc!r}")
                    self.engine.abort(o.request_id)
                    p.error = f"delivery failed: {exc!r}"
                    p.done.set()
                    o = type(o)(o.request_id, None, True, "aborted")
                if o.finished:
                    del live[o.request_id]
                    self.engine.requests.pop(o.request_id, None)

    def _drop_cancelled(self, live):
        """Abort the requests whose client cancelled them or went away (a cancelled or closed gRPC
        stream, Triton's request cancellation): their work stops before the next step."""
        for rid, p in list(live.items()):
            if p.request.is_cancelled():
                pb_utils.Logger.log_warn(f"macattn: request {rid} cancelled by its client after "
                                         f"{len(p.tokens)} tokens")
                self.engine.abort(rid)
                self.engine.requests.pop(rid, None)
                del live[rid]
                try:
                    self._fail(p, f"request {rid} cancelled", code=pb_utils.TritonError.CANCELLED)
                except Exception:                      # noqa: BLE001 - the client is gone: nothing to tell
                    p.done.set()

    def _add_request(self, ids, kwargs):
        rag = kwargs.pop("rag_lengths", None)
        if rag is None:
            return self.engine.add_request(ids, **kwargs)
        from macattn.runtime.a3_assembly import split_rag_prompt

        prompt = split_rag_prompt(ids, rag)
        seq = self.engine.make_request(ids, **kwargs)
        seq.rag = (prompt, self.a3, self.chunk_store)
        self.engine.submit(seq)
        return seq.request_id

    def finalize(self):
        if self.text is not None:
            return
        self.stopping.set()
        self.loop.join(timeout=10)
