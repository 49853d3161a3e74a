"""The OpenAI-compatible HTTP front door (docs/ARCHITECTURE.md, "HTTP front door").

``python -m orchestrator ... --http-port 8000`` (or ``dflash-grpc serve --http-port 8000``) serves,
beside the gRPC ``GenerationService`` and in the same process:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, ``stream: true`` as server-sent events
  (``data: {...}`` chunks ending in ``data: [DONE]``; ``stream_options.include_usage`` adds the
  usage chunk);
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (the process's Prometheus registry).

Every request goes through the gRPC servicer's own ``Generate`` (:class:`GenerationServicer`) with a
stand-in for the gRPC call context, so the checks, limits, scheduler admission, stop strings,
statistics and metrics are those of the gRPC API, and the text is the same for the same request.
Each generation runs on its own thread (as a gRPC stream does); at most ``max_streams`` at once,
one more is 429 (reason ``STREAMS_BUSY``).

OpenAI's parameters map to ours: ``max_tokens`` / ``max_completion_tokens``, ``temperature``
(OpenAI's default 1.0 when absent), ``top_p``, ``top_k`` (``-1`` or ``0``: off), ``seed``, ``stop``
(a string or a list), ``n`` (1 only). Refused with 400: ``logprobs`` / ``top_logprobs``, ``echo``,
``best_of`` > 1, ``suffix``, non-zero penalties, ``logit_bias``, ``tools``, a non-text
``response_format``, several prompts. Extensions (``extra_body`` of the ``openai`` SDK):
``ignore_eos`` (bool) and ``dflash`` = ``{"speculative": bool, "tree_budget", "top_k",
"max_depth"}``. The final response (or the chunk carrying ``finish_reason``) has ``usage`` and the
extension field ``dflash``: the request's speculative statistics (``tau``, ``accepted_per_position``,
...; :func:`dflash_stats`).

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; ``code`` is our
reason code (:class:`runtime.errors.Reason`) where there is one. Status: 400 bad parameters (and a
prompt of more tokens than the context), 401 missing or wrong API key, 404 unknown model or path,
413 a body larger than ``max_body_bytes`` (refused from its ``Content-Length``, or as soon as the
bytes read pass it, never read whole) or a prompt over ``--max-prompt-chars`` /
``--max-request-bytes``, 429 queue full (``Retry-After``), 503 the target down or the orchestrator
stopping. An error after a stream started comes as one ``data: {"error": ...}`` event before
``[DONE]``. A client that disconnects cancels its request: the scheduler releases its sessions at
the next tick, as for a cancelled gRPC call.

FastAPI and uvicorn are imported here only; ``python -m orchestrator`` imports this module only when
``--http-port`` is given.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from dflash_grpc.localhop import HopAborted, LocalContext
from dflash_grpc.transport import MAX_MESSAGE_BYTES, REASON_KEY, TlsConfig
from dflash_grpc.v1 import generation_pb2, target_pb2
from orchestrator.servicer import GenerationServicer, RequestError
from runtime.errors import Reason

log = logging.getLogger(__name__)

#: A JSON body may take this many times ``max_request_bytes`` (JSON escapes a character in up to
#: 12 bytes, ``"\\ud83d\\ude00"``, where the gRPC message takes at most 4)
BODY_BYTES_PER_REQUEST_BYTE = 3
#: seconds a client is told to wait before retrying a 429 (``Retry-After``)
RETRY_AFTER_S = 1
_FINISH = {generation_pb2.FINISH_REASON_EOS: "stop", generation_pb2.FINISH_REASON_STOP: "stop",
           generation_pb2.FINISH_REASON_LENGTH: "length", generation_pb2.FINISH_REASON_CONTEXT: "length"}


class HttpError(Exception):
    """A request refused with HTTP ``status`` and OpenAI's error body (``type``, ``param``,
    ``code``); ``headers`` go on the response (e.g. ``Retry-After``)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type, param, code, headers or {}

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def http_error(code: grpc.StatusCode, message: str, reason: str = "", chat: bool = True) -> HttpError:
    """The HTTP error of a gRPC status ``code`` with reason ``reason`` (docs/ARCHITECTURE.md,
    "Errors"): INVALID_ARGUMENT and FAILED_PRECONDITION 400; RESOURCE_EXHAUSTED 429 for
    ``QUEUE_FULL`` / ``STREAMS_BUSY`` (with ``Retry-After``), 400 for ``PROMPT_TOO_LONG`` (the
    prompt's tokens do not fit the context), else 503; UNAVAILABLE 503; DEADLINE_EXCEEDED 504;
    UNAUTHENTICATED 401; PERMISSION_DENIED 403; NOT_FOUND 404; anything else 500. ``chat``: the
    request was a chat completion (a too-long prompt names ``messages``, else ``prompt``)."""
    reason = reason or None
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        return HttpError(400, message, "invalid_request_error", code=reason)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if reason in (Reason.QUEUE_FULL, Reason.STREAMS_BUSY):
            return HttpError(429, message, "rate_limit_exceeded", code=reason, headers={"Retry-After": str(RETRY_AFTER_S)})
        if reason == Reason.PROMPT_TOO_LONG:
            return HttpError(400, message, "invalid_request_error", param="messages" if chat else "prompt", code=reason)
        return HttpError(503, message, "server_error", code=reason)
    status = {grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
              grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
              grpc.StatusCode.NOT_FOUND: 404}.get(code, 500)
    return HttpError(status, message, "server_error" if status >= 500 else "invalid_request_error", code=reason)


# ------------------------------------------------------------------------------ one generation


_END = object()


class _Generation:
    """``servicer.Generate(request)`` on its own thread; its messages (``GenerateResponse``), then
    an :class:`HopAborted` if it failed, then :data:`_END`, are put on an asyncio queue of ``loop``.
    :meth:`cancel` ends the call as a client cancel does (the scheduler frees its sessions)."""

    def __init__(self, servicer: GenerationServicer, request: generation_pb2.GenerateRequest,
                 loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]):
        self.servicer, self.request, self.loop, self.on_exit = servicer, request, loop, on_exit
        self.ctx = LocalContext(peer="http")
        self.queue: asyncio.Queue = asyncio.Queue()

    def start(self) -> None:
        threading.Thread(target=self._run, name="http-generate", daemon=True).start()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server stopped): nobody reads any more
            pass

    def _run(self) -> None:
        gen = self.servicer.Generate(self.request, self.ctx)
        try:
            for message in gen:
                if not self.ctx.is_active():  # cancelled: close the generator, which closes the request
                    break
                self._put(message)
        except HopAborted as e:
            self._put(e)
        except Exception as e:  # noqa: BLE001 - never lose a request to a bug: INTERNAL, logged
            log.exception("http generation failed")
            self._put(HopAborted(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}",
                                 ((REASON_KEY, Reason.INTERNAL),)))
        finally:
            gen.close()
            self.ctx.end()
            self._put(_END)
            self.on_exit()

    def cancel(self) -> None:
        """The client went away: end the call (idempotent)."""
        self.ctx.end()

    async def next(self):
        """The next message, :class:`HopAborted` or :data:`_END`."""
        return await self.queue.get()


# ------------------------------------------------------------------------------ request parsing


def _get(body: dict, name: str, types: tuple, default=None):
    """``body[name]`` checked to be one of ``types`` (None or absent: ``default``); a bool is not
    a number. Raises :class:`HttpError` 400 naming the parameter."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        value = object()  # refuse below
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise HttpError(400, f"'{name}' must be {names}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise HttpError(400, f"'{name}' must be finite", param=name)
    return value


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """400 for OpenAI parameters this server does not implement (rather than ignoring them)."""
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise HttpError(400, "only n=1 is supported", param="n")
    if chat:
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            raise HttpError(400, "logprobs are not supported", param="logprobs")
        if body.get("tools") or body.get("functions"):
            raise HttpError(400, "tools and functions are not supported", param="tools")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
            raise HttpError(400, "only response_format {'type': 'text'} is supported", param="response_format")
    else:
        if body.get("logprobs") is not None:
            raise HttpError(400, "logprobs are not supported", param="logprobs")
        if body.get("echo"):
            raise HttpError(400, "echo is not supported", param="echo")
        if _get(body, "best_of", (int,), 1) != 1:
            raise HttpError(400, "only best_of=1 is supported", param="best_of")
        if body.get("suffix"):
            raise HttpError(400, "suffix is not supported", param="suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, (int, float), 0) != 0:
            raise HttpError(400, f"{name} is not supported (only 0)", param=name)
    if body.get("logit_bias"):
        raise HttpError(400, "logit_bias is not supported", param="logit_bias")


def _chat_messages(body: dict) -> list[generation_pb2.ChatMessage]:
    """``messages`` as our chat messages: ``content`` a string, a list of text parts (joined), or
    null (empty). Other part types are refused (400)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HttpError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise HttpError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise HttpError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append(generation_pb2.ChatMessage(role=m["role"], content=text))
    return out


def _prompt(body: dict, req: generation_pb2.GenerateRequest) -> None:
    """Set ``req``'s input from ``prompt``: a string, a list of token ids, or a one-element list of
    either (several prompts: 400)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not -(2**31) <= t < 2**31 for t in prompt):
            raise HttpError(400, "token ids must be 32-bit integers", param="prompt", code=Reason.INVALID_TOKEN.value)
        req.prompt_tokens.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise HttpError(400, "one prompt per request (a string or a list of token ids)", param="prompt")
    else:
        raise HttpError(400, "'prompt' must be a non-empty string or list of token ids", param="prompt")


def to_generate_request(body: Any, chat: bool, request_id: str) -> generation_pb2.GenerateRequest:
    """An OpenAI completions (``chat`` False) or chat completions body as our
    ``GenerateRequest``; the servicer's checks (bounds, sampling, sizes) come after.

    Raises:
        HttpError: 400 for a malformed body or an unsupported parameter.
    """
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    _refuse_unsupported(body, chat)
    req = generation_pb2.GenerateRequest(request_id=request_id)
    if chat:
        req.chat.messages.extend(_chat_messages(body))
        req.chat.add_generation_prompt = True
        max_tokens = _get(body, "max_completion_tokens", (int,))
        if max_tokens is None:
            max_tokens = _get(body, "max_tokens", (int,))
    else:
        _prompt(body, req)
        max_tokens = _get(body, "max_tokens", (int,))
    if max_tokens is not None:
        if not 1 <= max_tokens < 2**31:
            raise HttpError(400, "max_tokens must be at least 1", param="max_tokens")
        req.max_tokens = max_tokens
    s = req.sampling
    s.temperature = float(_get(body, "temperature", (int, float), 1.0))
    s.top_p = float(_get(body, "top_p", (int, float), 0.0))
    top_k = _get(body, "top_k", (int,), 0)
    if top_k < -1 or top_k >= 2**31:
        raise HttpError(400, "top_k must be -1 or 0 (off) or a positive number", param="top_k")
    s.top_k = max(top_k, 0)
    seed = _get(body, "seed", (int,))
    if seed is not None:
        if not 0 <= seed < 2**64:
            raise HttpError(400, "seed must be in [0, 2**64)", param="seed")
        s.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise HttpError(400, "'stop' must be a string or a list of strings", param="stop")
        req.stop.extend(x for x in stop if x)
    req.ignore_eos = bool(_get(body, "ignore_eos", (bool,), False))
    ext = body.get("dflash")
    if ext is not None:
        if not isinstance(ext, dict):
            raise HttpError(400, "'dflash' must be an object", param="dflash")
        spec = req.speculative
        enabled = _get(ext, "speculative", (bool,))
        if enabled is not None:
            spec.enabled = enabled
        for name in ("tree_budget", "top_k", "max_depth"):
            value = _get(ext, name, (int,))
            if value is not None:
                if not 0 <= value < 2**31:
                    raise HttpError(400, f"dflash.{name} must be >= 0", param=f"dflash.{name}")
                setattr(spec, name, value)
    return req


def dflash_stats(stats: generation_pb2.AcceptanceStats) -> dict:
    """The response's ``dflash`` extension field: the request's speculative statistics
    (``tau`` = mean tokens per target forward; ``accepted_per_position[d-1]`` draft tokens accepted
    at depth d of ``drafted_per_position[d-1]`` drafts that reached it; times in seconds)."""
    return {
        "tau": stats.mean_acceptance_length,
        "acceptance_rate": stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0,
        "accepted_per_position": list(stats.accepted_per_position),
        "drafted_per_position": list(stats.drafted_per_position),
        "drafts": stats.drafts,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "target_forwards": stats.target_forwards,
        "autoregressive_steps": stats.autoregressive_steps,
        "draft_fallbacks": stats.draft_fallbacks,
        "decode_time_s": stats.decode_time_s,
        "tokens_per_second": stats.tokens_per_second,
    }


def _usage(stats: generation_pb2.AcceptanceStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------ the app


def create_app(servicer: GenerationServicer, *, model_name: str | None = None, api_key: str | None = None,
               max_streams: int = 256, max_body_bytes: int | None = None) -> FastAPI:
    """The FastAPI app of the HTTP front door over ``servicer`` (in this process).

    Args:
        servicer: the orchestrator's gRPC servicer; every generation is its ``Generate``.
        model_name: the model id served (``GET /v1/models``; a request naming another is 404);
            default: the target's ``model_name``.
        api_key: when set, every ``/v1/`` call must carry ``Authorization: Bearer <api_key>``
            (else 401); ``/health`` and ``/metrics`` stay open. Compared in constant time, never logged.
        max_streams: most generations at once (threads); one more is 429 ``STREAMS_BUSY``.
        max_body_bytes: most bytes of a request body (default: :data:`BODY_BYTES_PER_REQUEST_BYTE`
            times the servicer's ``max_request_bytes``, at most 256 MiB); a larger one is 413 before
            it is read whole.
    """
    name = model_name or servicer.target_info.model_name or "dflash"
    limit = max_body_bytes or min(BODY_BYTES_PER_REQUEST_BYTE * servicer.max_request_bytes, MAX_MESSAGE_BYTES)
    key = api_key.encode("utf-8") if api_key else None
    streams = threading.BoundedSemaphore(max_streams)
    created = int(time.time())
    app = FastAPI(title="dflash-grpc", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, e: HttpError):
        return e.response()

    @app.exception_handler(404)
    async def _not_found(request: Request, e):
        return HttpError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    @app.exception_handler(405)
    async def _not_allowed(request: Request, e):
        return HttpError(405, f"method {request.method} not allowed on {request.url.path}").response()

    def check_key(request: Request) -> None:
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "replace"), key):
            raise HttpError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise HttpError(400, "bad Content-Length")
            if int(length) > limit:
                raise HttpError(413, f"body of {length} bytes is larger than {limit}", code=Reason.PROMPT_TOO_LONG.value)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"body larger than {limit} bytes", code=Reason.PROMPT_TOO_LONG.value)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except ValueError as e:
            raise HttpError(400, f"the body is not JSON: {e}") from None

    async def watch_disconnect(request: Request, gen: _Generation) -> None:
        while True:   # the body is read: receive() now returns only when the client goes away
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gen.cancel()
                return

    async def generate(request: Request, chat: bool):
        check_key(request)
        body = await read_json(request)
        if isinstance(body, dict) and body.get("model") not in (None, name):
            raise HttpError(404, f"the model {body.get('model')!r} does not exist (this server serves {name!r})",
                            param="model", code="model_not_found")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        greq = to_generate_request(body, chat, rid)
        try:
            servicer._check_size(greq)   # before tokenizing, as Generate does: 413 rather than 400
        except RequestError as e:
            raise HttpError(413, str(e), param="messages" if chat else "prompt", code=str(e.reason)) from None
        stream = bool(body.get("stream"))
        opts = body.get("stream_options")
        include_usage = stream and isinstance(opts, dict) and bool(opts.get("include_usage"))
        if not streams.acquire(blocking=False):
            raise http_error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {max_streams} generations in flight",
                             Reason.STREAMS_BUSY)
        gen = _Generation(servicer, greq, asyncio.get_running_loop(), streams.release)
        gen.start()
        watcher = asyncio.ensure_future(watch_disconnect(request, gen))
        try:
            first = await gen.next()
        except BaseException:
            gen.cancel()
            watcher.cancel()
            raise
        if isinstance(first, HopAborted) or first is _END:
            watcher.cancel()
            if first is _END:  # cancelled before anything came
                raise HttpError(499, "client closed the request", code="cancelled")
            raise http_error(first.code, str(first), first.reason, chat)
        if stream:
            watcher.cancel()   # from here StreamingResponse watches for the disconnect
            return StreamingResponse(_stream(gen, first, chat, rid, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await _whole(gen, first, chat, rid)
        finally:
            watcher.cancel()
            gen.cancel()

    async def _whole(gen: _Generation, message, chat: bool, rid: str) -> JSONResponse:
        text = []
        while True:
            if isinstance(message, HopAborted):
                raise http_error(message.code, str(message), message.reason, chat)
            if message is _END:
                raise HttpError(499, "client closed the request", code="cancelled")
            text.append(message.text)
            if message.finished:
                break
            message = await gen.next()
        finish = _FINISH.get(message.finish_reason, "stop")
        out = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": out, "logprobs": None, "finish_reason": finish}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                             "model": name, "choices": [choice], "usage": _usage(message.stats),
                             "dflash": dflash_stats(message.stats)})

    async def _stream(gen: _Generation, message, chat: bool, rid: str, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        now = int(time.time())
        extra = {"usage": None} if include_usage else {}

        def chunk(text: str | None, finish: str | None = None, **more) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": now, "model": name, "choices": [choice], **extra, **more}

        done = False
        try:
            if chat:
                first = chunk("")
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _sse(first)
            while True:
                if isinstance(message, HopAborted):
                    yield _sse(http_error(message.code, str(message), message.reason, chat).body())
                    break
                if message is _END:
                    break
                if message.text:
                    yield _sse(chunk(message.text))
                if message.finished:
                    yield _sse(chunk(None if chat else "", _FINISH.get(message.finish_reason, "stop"),
                                     dflash=dflash_stats(message.stats)))
                    if include_usage:
                        yield _sse({"id": rid, "object": obj, "created": now, "model": name, "choices": [],
                                    "usage": _usage(message.stats)})
                    break
                message = await gen.next()
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:   # the client went away (or the send failed): cancel, free the slot
                gen.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI's completions."""
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI's chat completions (the model's chat template)."""
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        """The one model served."""
        check_key(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "dflash-grpc",
                                            "max_model_len": servicer.target_info.max_context}]}

    @app.get("/health")
    async def health():
        """200 while requests are admitted and the target answers Info, else 503."""
        def probe() -> str | None:
            if not servicer.scheduler.admitting:
                return "orchestrator is shutting down"
            stub = getattr(servicer.target, "stub", None)
            if stub is not None:
                try:
                    stub.Info(target_pb2.TargetInfoRequest(), timeout=2.0)
                except grpc.RpcError as e:
                    return f"target unavailable: {e.code().name}"
            return None

        why = await asyncio.to_thread(probe)
        if why is not None:
            return HttpError(503, why, "server_error", code=Reason.TARGET_UNAVAILABLE.value
                             if why.startswith("target") else Reason.SHUTTING_DOWN.value).response()
        return {"status": "ok", "drafter": servicer.draft.state() is not None}

    @app.get("/metrics")
    async def metrics():
        """The process's Prometheus metrics (those of ``--metrics-port``)."""
        return Response(await asyncio.to_thread(generate_latest, REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app


class HttpServer:
    """The HTTP front door served by uvicorn on its own thread of this process.

    Args:
        servicer, model_name, api_key, max_streams, max_body_bytes: of :func:`create_app`.
        host, port: where to listen (port 0: a free one; :attr:`port` is the bound one).
        tls: serve HTTPS with the gRPC side's certificate and key; its ``ca`` set: client
            certificates required and checked against it (mutual TLS).
    """

    def __init__(self, servicer: GenerationServicer, host: str, port: int, *, tls: TlsConfig | None = None,
                 model_name: str | None = None, api_key: str | None = None, max_streams: int = 256,
                 max_body_bytes: int | None = None):
        import ssl

        app = create_app(servicer, model_name=model_name, api_key=api_key, max_streams=max_streams,
                         max_body_bytes=max_body_bytes)
        tls_kw = {}
        if tls is not None:
            tls_kw = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.ca:
                tls_kw.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        # log_config None: keep the process's (JSON) logging; no access log (quiet by default)
        self.config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off",
                                     timeout_graceful_shutdown=5, **tls_kw)
        self.server = uvicorn.Server(self.config)
        self.scheme = "https" if tls is not None else "http"
        self._thread: threading.Thread | None = None
        self.port = port

    def start(self, timeout: float = 30.0) -> int:
        """Bind, start serving on a thread and wait until it accepts connections; returns the port.

        Raises:
            OSError: the port cannot be bound.
            RuntimeError: the server did not start within ``timeout`` seconds.
        """
        sock = self.config.bind_socket()
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="http-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        log.info("http serving", extra={"port": self.port, "scheme": self.scheme})
        return self.port

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let responses in flight end (at most 5 s), stop the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
