"""The public ``GenerationService``: validates requests, hands them to the batching scheduler
(:mod:`orchestrator.scheduler`), streams text.

Status codes (docs/ARCHITECTURE.md, "Errors"), each with a reason code
(:class:`runtime.errors.Reason`) in the trailing metadata ``dflash-reason``
(:data:`dflash_grpc.transport.REASON_KEY`) so that clients branch on it, not on the message:

* INVALID_ARGUMENT: token ids outside the vocabulary (``INVALID_TOKEN``), bad sampling values
  (``INVALID_SAMPLING``), an empty prompt, bad options or a number past its bound
  (:data:`LIMITS`) (``INVALID_ARGUMENT``);
* FAILED_PRECONDITION: the configured drafter was built for another target
  (``DRAFTER_MISMATCH``);
* RESOURCE_EXHAUSTED: the prompt does not fit the context, or is too large before tokenizing:
  more characters than ``--max-prompt-chars``, more chat messages or role characters than
  :data:`LIMITS`, more bytes than ``--max-request-bytes`` (``PROMPT_TOO_LONG``); the server's
  queue is full (``QUEUE_FULL``). A request message larger than ``--max-request-bytes`` that
  arrives over gRPC is refused by grpc itself before decoding (RESOURCE_EXHAUSTED, no reason);
* UNAVAILABLE: the target is down, did not answer or lost the session (``TARGET_UNAVAILABLE``),
  the orchestrator is stopping (``SHUTTING_DOWN``);
* a status the target gave a request (e.g. out of memory) passes on with the target's reason.

Sizes are checked before tokenizing (:meth:`GenerationServicer._check_size`): tokenizing is
linear in the text but not free (a 20 MB prompt took 22 s and 2.7 GB), and it would run before
the token-count check could refuse the prompt.

Input text: a raw ``prompt`` is tokenized with special-token parsing, so ``"<|im_start|>"`` in it
is that control token (the caller writes the whole prompt, markup included). A ``chat`` is
rendered with the model's chat template and its messages' text is tokenized as plain text
(:meth:`runtime.tokenizer.GGUFTokenizer.encode_chat`): only the template's own markup yields
control tokens, so a message cannot open a turn of another role.

A failing drafter is never an error: the request continues autoregressively (a warning in the
log and ``draft_fallbacks`` counted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import time
import uuid

import grpc

from dflash_grpc.defaults import REQUEST_LIMITS
from dflash_grpc.transport import abort
from dflash_grpc.v1 import common_pb2, draft_pb2, generation_pb2, generation_pb2_grpc
from orchestrator import metrics
from orchestrator.config import OrchestratorConfig
from orchestrator.detok import TextStream
from orchestrator.events import LoopWaker
from orchestrator.peers import DraftPeer, TargetPeer, drafter_mismatch
from orchestrator.scheduler import FINISH_CONTEXT, FINISH_EOS, Failure, Rejected, Request, Scheduler
from orchestrator.stats import GlobalStats
from runtime.errors import Reason
from runtime.sampling import MIN_TEMPERATURE

log = logging.getLogger(__name__)

VERSION = "0.1.0"

#: Bounds of client-supplied numbers (beyond them: INVALID_ARGUMENT), shared with the clients:
#: :data:`dflash_grpc.defaults.REQUEST_LIMITS`.
LIMITS = REQUEST_LIMITS
_FINISH = {FINISH_EOS: generation_pb2.FINISH_REASON_EOS, FINISH_CONTEXT: generation_pb2.FINISH_REASON_CONTEXT}


class RequestError(Exception):
    """A request refused before generation starts: status ``code``, reason code ``reason``
    (default: INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: Reason = Reason.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code
        self.reason = reason


def default_tree(config: OrchestratorConfig | None = None) -> draft_pb2.TreeParams:
    """The tree a request gets when it asks for none: ``tree_budget``, ``draft_top_k`` and
    ``max_depth`` of ``config`` (default: :class:`OrchestratorConfig`'s defaults)."""
    cfg = config or OrchestratorConfig
    return draft_pb2.TreeParams(budget=cfg.tree_budget, top_k=cfg.draft_top_k, max_depth=cfg.max_depth)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Serves Generate / GetStats / Info over a target and an optional drafter.

    Args:
        target: the target service peer (its Info must be reachable at construction).
        draft: the draft service peer (may have no address).
        tokenizer: a ``GGUFTokenizer`` of the same model (its fingerprint must equal the target's).
        default_max_tokens: used when a request leaves ``max_tokens`` at 0.
        tree: default tree request (``budget``, ``top_k``, ``max_depth``); None:
            :func:`default_tree` (the config's defaults).
        scheduler: None: a :class:`Scheduler` with the config's defaults over the target's slots.
        max_prompt_chars: most characters of a prompt (or of a chat's roles and contents);
            0: :meth:`OrchestratorConfig.prompt_chars_for` the target's context.
        max_request_bytes: most bytes of a request message (``ByteSize()``); 0:
            :meth:`OrchestratorConfig.request_bytes_for` ``max_prompt_chars``. Serve with
            ``make_server(..., max_receive_bytes=servicer.max_request_bytes)`` so that grpc refuses
            larger messages before decoding them.

    Raises:
        ValueError: the tokenizer does not match the target (fingerprints differ).
    """

    def __init__(self, target: TargetPeer, draft: DraftPeer, tokenizer, default_max_tokens: int = OrchestratorConfig.max_tokens,
                 tree: draft_pb2.TreeParams | None = None, scheduler: Scheduler | None = None, *,
                 max_prompt_chars: int = OrchestratorConfig.max_prompt_chars,
                 max_request_bytes: int = OrchestratorConfig.max_request_bytes):
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.target_info = target.info()
        if tokenizer.fingerprint != self.target_info.tokenizer_fingerprint:
            raise ValueError("the orchestrator's tokenizer does not match the target's (fingerprints differ)")
        self.default_max_tokens = default_max_tokens
        self.tree = tree or default_tree()
        self.scheduler = scheduler or Scheduler(target, draft, max_sessions=OrchestratorConfig.sessions_for(
            OrchestratorConfig.max_sessions, self.target_info.max_sessions))
        self.stats = GlobalStats()
        self.max_prompt_chars = OrchestratorConfig.prompt_chars_for(max_prompt_chars, self.target_info.max_context)
        self.max_request_bytes = OrchestratorConfig.request_bytes_for(max_request_bytes, self.max_prompt_chars)

    # ------------------------------------------------------------------ validation
    def _check_size(self, req: generation_pb2.GenerateRequest) -> None:
        """Refuse a request too large to tokenize, counting characters and bytes only (no
        tokenizing): the whole message (``max_request_bytes``), a raw prompt's characters, a
        chat's message count, each role's and content's characters and their sum
        (``max_prompt_chars``). RESOURCE_EXHAUSTED, reason PROMPT_TOO_LONG; the message names
        the limit."""
        def refuse(message: str) -> RequestError:
            return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, Reason.PROMPT_TOO_LONG)

        size = req.ByteSize()
        if size > self.max_request_bytes:
            raise refuse(f"request of {size} bytes is larger than the orchestrator's max_request_bytes "
                         f"{self.max_request_bytes}")
        limit = self.max_prompt_chars
        which = req.WhichOneof("input")
        if which == "prompt" and len(req.prompt) > limit:
            raise refuse(f"prompt of {len(req.prompt)} characters is longer than the orchestrator's "
                         f"max_prompt_chars {limit}")
        if which == "chat":
            messages = req.chat.messages
            if len(messages) > LIMITS["chat_messages"]:
                raise refuse(f"chat of {len(messages)} messages has more than {LIMITS['chat_messages']} (chat_messages)")
            total = 0
            for i, m in enumerate(messages):
                if len(m.role) > LIMITS["chat_role_chars"]:
                    raise refuse(f"chat message {i}: role of {len(m.role)} characters is longer than "
                                 f"{LIMITS['chat_role_chars']} (chat_role_chars)")
                if len(m.content) > limit:
                    raise refuse(f"chat message {i}: content of {len(m.content)} characters is longer than the "
                                 f"orchestrator's max_prompt_chars {limit}")
                total += len(m.role) + len(m.content)
            if total > limit:
                raise refuse(f"chat of {total} characters (roles and contents) is longer than the orchestrator's "
                             f"max_prompt_chars {limit}")

    def _prompt_ids(self, req: generation_pb2.GenerateRequest) -> list[int]:
        """The request's prompt as token ids: a raw ``prompt`` with special-token parsing (its
        ``"<|im_end|>"`` is that control token), ``prompt_tokens`` as given (checked against the
        vocabulary), a ``chat`` through the template with the messages' text as plain text
        (``encode_chat``). Call :meth:`_check_size` first."""
        which = req.WhichOneof("input")
        if which == "prompt":
            if not req.prompt:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True)
        elif which == "prompt_tokens":
            ids = list(req.prompt_tokens.ids)
            vocab = self.target_info.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"token id {bad[0]} outside the vocabulary [0, {vocab})",
                                   Reason.INVALID_TOKEN)
        elif which == "chat":
            if not req.chat.messages:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "chat has no messages")
            messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
            try:  # the messages' special-token text stays text: no role injection
                ids = self.tokenizer.encode_chat(messages, add_generation_prompt=req.chat.add_generation_prompt)
            except Exception as e:  # template errors are the caller's (bad roles, ...) or the model's
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"chat template failed: {e}") from e
        else:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no input: set prompt, prompt_tokens or chat")
        if not ids:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if len(ids) >= self.target_info.max_context:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prompt of {len(ids)} tokens does not fit the context of {self.target_info.max_context}",
                               Reason.PROMPT_TOO_LONG)
        return ids

    @staticmethod
    def _check_sampling(s: common_pb2.SamplingParams) -> None:
        if not (math.isfinite(s.temperature) and s.temperature >= 0):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"temperature must be finite and >= 0, got {s.temperature}",
                               Reason.INVALID_SAMPLING)
        if 0.0 < s.temperature < MIN_TEMPERATURE:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {s.temperature}",
                               Reason.INVALID_SAMPLING)
        if s.top_k < 0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"top_k must be >= 0, got {s.top_k}", Reason.INVALID_SAMPLING)
        if not (0.0 <= s.top_p <= 1.0):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"top_p must be in [0, 1], got {s.top_p}", Reason.INVALID_SAMPLING)

    def _plan(self, req: generation_pb2.GenerateRequest) -> tuple[bool, draft_pb2.TreeParams]:
        """Whether the request may draft, and its tree (defaults overridden by the request)."""
        spec = req.speculative
        tree = draft_pb2.TreeParams()
        tree.CopyFrom(self.tree)
        for field, name in (("tree_budget", "budget"), ("top_k", "top_k"), ("max_depth", "max_depth")):
            if spec.HasField(field):
                value = getattr(spec, field)
                if not 0 <= value <= LIMITS[field]:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"speculative.{field} must be in [0, {LIMITS[field]}], got {value}")
                setattr(tree, name, value)
        if (spec.HasField("enabled") and not spec.enabled) or self.draft.address is None:
            return False, tree
        info = self.draft.state()
        if info is None:
            return True, tree  # unreachable now: autoregressive until it is back
        why = drafter_mismatch(info, self.target_info, self.draft.address)
        if why is not None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{why}; serve a matching drafter or disable speculation for this request", Reason.DRAFTER_MISMATCH)
        return True, tree

    def _check_bounds(self, req: generation_pb2.GenerateRequest) -> int:
        """Bound the request's own numbers; returns its ``max_tokens`` (default applied)."""
        limit = self.target_info.max_context
        if not 0 <= req.max_tokens <= limit:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens must be in [0, {limit}] (the context), got {req.max_tokens}")
        if len(req.stop) > LIMITS["stop_strings"] or any(len(x) > LIMITS["stop_chars"] for x in req.stop):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"at most {LIMITS['stop_strings']} stop strings of at most {LIMITS['stop_chars']} characters")
        if len(req.request_id) > LIMITS["request_id_chars"]:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id longer than {LIMITS['request_id_chars']} characters")
        return req.max_tokens or self.default_max_tokens

    # ------------------------------------------------------------------ RPCs
    def open(self, request: generation_pb2.GenerateRequest) -> "Responses":
        """Check ``request`` (sizes before tokenizing), tokenize it and hand it to the scheduler.

        The part of ``Generate`` before any message, shared by this servicer's ``Generate``, the
        asyncio server's (:class:`AioGenerationServicer`, which runs it on a worker thread: it
        tokenizes) and the HTTP front door through ``Generate``.

        Returns:
            the request's :class:`Responses` (its scheduler request: ``.req``).

        Raises:
            RequestError: the request is refused (counted in the requests metric): its status
                code and reason.
        """
        t0 = time.monotonic()
        try:
            self._check_size(request)             # before any tokenizing
            self._check_sampling(request.sampling)
            max_tokens = self._check_bounds(request)
            prompt = self._prompt_ids(request)
            speculative, tree = self._plan(request)
        except RequestError as e:
            metrics.REQUESTS.labels(outcome=e.code.name).inc()
            raise
        rid = "".join(c for c in request.request_id if c.isalnum() or c in "-_.") or "req"
        req = Request(session_id=f"{rid}-{uuid.uuid4().hex[:12]}", prompt=prompt, sampling=request.sampling,
                      max_tokens=max_tokens, tree=tree, speculative=speculative,
                      eos=frozenset() if request.ignore_eos else frozenset(self.tokenizer.eos_token_ids))
        req.stats.prompt_tokens = len(prompt)
        try:
            self.scheduler.submit(req)
        except Rejected as e:
            metrics.REQUESTS.labels(outcome=e.code.name).inc()
            raise RequestError(e.code, str(e), e.reason) from None
        return Responses(self, req, list(request.stop), t0)

    def Generate(self, request, context):
        try:
            out = self.open(request)
        except RequestError as e:
            abort(context, e.code, str(e), str(e.reason))
        req = out.req
        # a client that goes away (cancel, deadline) frees the sessions on the next tick; one that
        # went away while the request was opened (grpc then runs no callback) at once
        cancelled = lambda: self.scheduler.close(req, Failure(grpc.StatusCode.CANCELLED, "cancelled"))  # noqa: E731
        if not context.add_callback(cancelled):
            cancelled()
        events = req.events
        event = None   # taken from the queue and not handled yet
        note = getattr(self.scheduler, "note_message", None)   # (the CPU cost of each message, for its adaptive hold)
        try:
            while True:
                if event is None:
                    event = events.get()
                cpu = time.thread_time()
                if isinstance(event, Failure):
                    if out.failed(event):
                        return
                    abort(context, event.code, event.message, str(event.reason))
                message, done, event = out.message(event)
                if message is not None:
                    yield message
                    if note is not None:   # (resumed by grpc once the message is sent: the send included)
                        note(time.thread_time() - cpu)
                if done:
                    break
        finally:
            self.scheduler.close(req)
        yield out.last()

    def GetStats(self, request, context):
        return self.stats.snapshot()

    def Info(self, request, context):
        info = self.draft.state()
        status = generation_pb2.DrafterStatus(
            available=info is not None,
            compatible=info is not None and drafter_mismatch(info, self.target_info) is None,
            address=self.draft.address or "",
            detail=self.draft.detail,
        )
        if info is not None:
            status.model.CopyFrom(info.model)
        return generation_pb2.ServiceInfo(target=self.target_info, drafter=status, version=VERSION, scheduler=self.scheduler.status())


class Responses:
    """The Generate messages of one request the scheduler took (:meth:`GenerationServicer.open`),
    built from its events (``Tokens``, ``Failure``: :mod:`orchestrator.scheduler`) by whichever
    handler streams them: a thread's (``GenerationServicer.Generate``) or a coroutine's
    (:class:`AioGenerationServicer`).

    Args:
        servicer: the servicer that admitted the request (tokenizer, stats).
        req: the scheduler's request.
        stop: the request's stop strings.
        t0: ``time.monotonic()`` when the request arrived (its wall time in the stats).
    """

    def __init__(self, servicer: GenerationServicer, req: Request, stop: list[str], t0: float):
        self.servicer = servicer
        self.req = req
        self.text = TextStream(servicer.tokenizer.decode, stop)
        self.t0 = t0
        self.finish = generation_pb2.FINISH_REASON_LENGTH
        self.first = True

    def failed(self, event: Failure) -> bool:
        """Count the request's ``Failure`` in the metrics; True when it is a cancellation (the
        handler then returns quietly), False when the handler must end the call with the event's
        status and reason."""
        metrics.REQUESTS.labels(outcome=event.code.name).inc()
        return event.code == grpc.StatusCode.CANCELLED

    def message(self, event) -> tuple[generation_pb2.GenerateResponse | None, bool, object]:
        """The message for ``event`` (``Tokens``) and every ``Tokens`` event queued behind it (ticks
        that came while the last message was being sent, or were held).

        With stop strings each event is pushed through the text stream on its own, as if sent
        alone (a stop string ends the message there); without, all at once (one decode: the same
        text, :class:`~orchestrator.detok.TextStream`).

        Returns:
            ``(message or None when there is nothing to send, whether the request is done, the
            event taken from the queue and not handled yet: a ``Failure`` or None)``.
        """
        req, text = self.req, self.text
        stats, stops, events = req.stats, text.has_stops, req.events
        deltas, ids, done = [], [], False
        while True:
            stats.generated_tokens += len(event.tokens)
            if stops:
                deltas.append(text.push(event.tokens))
            ids += event.tokens
            if event.finish in _FINISH:
                self.finish = _FINISH[event.finish]
            if text.stopped:
                self.finish = generation_pb2.FINISH_REASON_STOP
            done = event.finish is not None or text.stopped
            event = None
            if done:
                break
            try:
                event = events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, Failure):
                break   # handled after this message
        delta = "".join(deltas) if stops else text.push(ids)
        message = None
        if delta or ids or self.first:
            message = generation_pb2.GenerateResponse(text=delta, token_ids=ids,
                                                      prompt_tokens=len(req.prompt) if self.first else 0)
            self.first = False
        return message, done, event

    def last(self) -> generation_pb2.GenerateResponse:
        """The request's last message (the text held back, the finish reason, its stats), once the
        scheduler is done with it; its stats go into the servicer's and the metrics."""
        stats = self.req.stats
        stats.wall_time_s = time.monotonic() - self.t0
        self.servicer.stats.add(stats)
        metrics.observe_request(stats)
        return generation_pb2.GenerateResponse(text=self.text.finish(), finished=True, finish_reason=self.finish,
                                               stats=stats.to_proto())


class AioGenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """The GenerationService of a :class:`GenerationServicer` for gRPC's asyncio server
    (:func:`dflash_grpc.aio_serving.make_aio_server`; the orchestrator's default, ``--grpc-server aio``).

    ``Generate`` is a coroutine on the server's event loop instead of a thread per stream: the
    checks and tokenizing (:meth:`GenerationServicer.open`) run on a small pool of worker threads,
    then the request's events are awaited (:meth:`orchestrator.events.Events.next`, woken once
    per batch of the scheduler's hand-overs) and streamed. The same messages, statuses and stats as
    the thread-per-stream server's ``Generate``; gRPC's asyncio send path costs about half the host
    time per message (``tools/grpc_stream_cost.py``). The adaptive hold's message cost
    (:meth:`Scheduler.note_message`) is the loop thread's CPU time per message sent, averaged over
    :data:`METER_MESSAGES` messages (everything else the loop does, e.g. refusing calls, counts
    in it too).

    Args:
        servicer: the servicer whose checks, scheduler and stats it uses.
        open_workers: threads that run :meth:`GenerationServicer.open` (tokenizing): that many
            requests are checked and tokenized at once, the next wait (``python -m orchestrator``:
            ``--max-workers``' streams, at most 32).
    """

    #: messages per measurement of the loop's CPU time per message
    METER_MESSAGES = 32

    def __init__(self, servicer: GenerationServicer, open_workers: int = 8):
        self.servicer = servicer
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, int(open_workers)), thread_name_prefix="generate-open")
        self._waker: LoopWaker | None = None
        self._note = getattr(servicer.scheduler, "note_message", None)
        self._sent = 0
        self._cpu0 = 0.0

    def _waker_of(self, loop: asyncio.AbstractEventLoop) -> LoopWaker:
        if self._waker is None or self._waker.loop is not loop:
            self._waker = LoopWaker(loop)
        return self._waker

    def _meter(self) -> None:
        """One message sent: every :data:`METER_MESSAGES`, the loop thread's CPU per message to the
        scheduler's adaptive hold."""
        if self._note is None:
            return
        if self._sent == 0:
            self._cpu0 = time.thread_time()
        self._sent += 1
        if self._sent > self.METER_MESSAGES:
            now = time.thread_time()
            self._note((now - self._cpu0) / (self._sent - 1))
            self._sent = 0

    async def _open(self, request) -> Responses:
        """:meth:`GenerationServicer.open` on a worker thread. When the client goes away first, a
        job not started yet never runs; one running is left to finish and its request, if the
        scheduler took it, is closed at once (no handler reads its events; its sessions are
        freed on the next tick)."""
        svc = self.servicer
        job = self._pool.submit(svc.open, request)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            cancelled = metrics.REQUESTS.labels(outcome=grpc.StatusCode.CANCELLED.name)
            if job.cancel():   # never ran
                cancelled.inc()
            else:   # running: a refusal is counted by open() itself; an admitted request is closed here
                def close(done: concurrent.futures.Future) -> None:
                    if done.cancelled():
                        return
                    error = done.exception()
                    if error is None:
                        cancelled.inc()
                        svc.scheduler.close(done.result().req)
                    elif not isinstance(error, RequestError):
                        log.error("opening a request whose client left failed", exc_info=error)

                job.add_done_callback(close)
            raise

    async def Generate(self, request, context):
        svc = self.servicer
        waker = self._waker_of(asyncio.get_running_loop())
        try:
            out = await self._open(request)
        except RequestError as e:
            await abort(context, e.code, str(e), str(e.reason))
            return
        req = out.req
        events = req.events
        event = None   # taken from the queue and not handled yet
        try:
            while True:
                if event is None:
                    event = await events.next(waker)
                if isinstance(event, Failure):
                    if out.failed(event):
                        return
                    await abort(context, event.code, event.message, str(event.reason))
                    return
                message, done, event = out.message(event)
                if message is not None:
                    yield message
                    self._meter()
                if done:
                    break
        except (asyncio.CancelledError, GeneratorExit):   # the client went away (cancel, deadline)
            metrics.REQUESTS.labels(outcome=grpc.StatusCode.CANCELLED.name).inc()
            raise
        finally:
            svc.scheduler.close(req)
        yield out.last()

    async def GetStats(self, request, context):
        return self.servicer.GetStats(request, context)

    async def Info(self, request, context):
        return self.servicer.Info(request, context)

    def close(self) -> None:
        """Stop the worker threads (once the server has stopped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def serve_generation(servicer: GenerationServicer, address: str, grpc_server: str = OrchestratorConfig.grpc_server, *,
                     max_streams: int, tls=None, max_receive_bytes: int | None = None, reflection: bool = False):
    """Serve ``servicer``'s GenerationService on ``address`` as ``python -m orchestrator`` does:
    ``grpc_server`` ``"aio"`` through :class:`AioGenerationServicer` on
    :func:`dflash_grpc.aio_serving.make_aio_server` (its open workers: ``max_streams``, at most
    32), ``"threads"`` on :func:`dflash_grpc.serving.make_server` (``max_streams`` worker threads);
    at most ``max_streams`` Generate streams at once either way. ``tls``, ``max_receive_bytes`` and
    ``reflection`` as those functions take them.

    Returns:
        ``(server, health, port, close)``: the started server (stopped by the caller, e.g.
        :func:`dflash_grpc.serving.serve_forever`), its health servicer, the bound port, and
        ``close()`` to call once the server has stopped (the asyncio servicer's threads; nothing for
        the thread server).

    Raises:
        ValueError: ``grpc_server`` is neither ``"aio"`` nor ``"threads"``.
    """
    from dflash_grpc import serving

    if grpc_server not in ("aio", "threads"):
        raise ValueError(f"grpc_server must be 'aio' or 'threads', got {grpc_server!r}")
    aio = AioGenerationServicer(servicer, open_workers=min(32, max_streams)) if grpc_server == "aio" else None

    def add(server):
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(aio or servicer, server)
        return ["dflash_grpc.v1.GenerationService"]

    if aio is None:
        server, health, port = serving.make_server(add, address, max_workers=max_streams, tls=tls,
                                                   max_receive_bytes=max_receive_bytes, reflection=reflection)
        return server, health, port, lambda: None
    from dflash_grpc.aio_serving import make_aio_server

    try:
        server, health, port = make_aio_server(add, address, max_streams=max_streams, tls=tls,
                                               max_receive_bytes=max_receive_bytes, reflection=reflection)
    except BaseException:
        aio.close()
        raise
    return server, health, port, aio.close
