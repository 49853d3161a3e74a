"""Python SDK of dflash-grpc: a typed client of the public ``GenerationService``.

Synchronous use::

    from client import Client

    with Client("127.0.0.1:50051") as c:
        result = c.generate("def fib(n):", max_tokens=64)
        print(result.text)
        print(result.stats.format())

        stream = c.stream(messages=[{"role": "user", "content": "Hi!"}])
        for chunk in stream:
            print(chunk.text, end="", flush=True)
        print(stream.result.stats.tau)

The same with asyncio (:class:`AsyncClient`)::

    async with AsyncClient("127.0.0.1:50051") as c:
        result = await c.generate("def fib(n):")
        async for chunk in c.stream("def fib(n):"):
            ...

Every gRPC failure is raised as a :class:`DFlashError` subclass chosen by the status code
(:func:`from_rpc_error`), e.g. :class:`InvalidArgumentError` or :class:`DeadlineExceededError`.

This module imports neither torch nor the services: it needs only ``grpcio`` and the stubs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from dflash_grpc.transport import GRPC_OPTIONS, TlsConfig, TlsError, open_aio_channel, open_channel
from dflash_grpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

__all__ = [
    "AcceptanceStats",
    "AsyncClient",
    "AsyncGenerationStream",
    "CancelledError",
    "Client",
    "DEFAULT_ADDRESS",
    "DFlashError",
    "DeadlineExceededError",
    "DrafterStatus",
    "FailedPreconditionError",
    "GenerationChunk",
    "GenerationResult",
    "GenerationStream",
    "InternalError",
    "InvalidArgumentError",
    "ModelInfo",
    "NotFoundError",
    "ResourceExhaustedError",
    "SchedulerStatus",
    "ServiceInfo",
    "TlsConfig",
    "UnavailableError",
    "build_request",
    "from_rpc_error",
]

DEFAULT_ADDRESS = "127.0.0.1:50051"

# The project's message-size limits (``dflash_grpc.transport``, torch-free): at most 256 MiB per
# message sent or received, set explicitly on every channel; a larger one fails the call with
# RESOURCE_EXHAUSTED (:class:`ResourceExhaustedError`).
_CHANNEL_OPTIONS = GRPC_OPTIONS


def _tls_config(tls: bool, ca: str | None, cert: str | None, key: str | None, server_name: str | None) -> TlsConfig | None:
    """The channel TLS of :class:`Client`'s TLS arguments (None: plaintext); files read now."""
    if not (tls or ca or cert or key or server_name):
        return None
    try:
        return TlsConfig(cert=cert, key=key, ca=ca, server_name=server_name).check()
    except TlsError as e:
        raise InvalidArgumentError(str(e)) from e


# --------------------------------------------------------------------------------------------
# Errors


class DFlashError(Exception):
    """A failed call. ``code`` is the :class:`grpc.StatusCode`, ``message`` the status details.

    ``str(err)`` is ``"<CODE>: <message>"``, e.g. ``"INVALID_ARGUMENT: empty prompt"``.
    """

    default_code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgumentError(DFlashError, ValueError):
    """INVALID_ARGUMENT: bad prompt, token id out of vocabulary, bad sampling values, ...

    Also raised by the client itself, before any call, for arguments it can check locally.
    """

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(DFlashError):
    """NOT_FOUND: an unknown session or resource."""

    default_code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(DFlashError):
    """FAILED_PRECONDITION: e.g. a drafter built for another target or vocabulary."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(DFlashError):
    """RESOURCE_EXHAUSTED: no free session slot, context full, or message too large."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(DFlashError):
    """UNAVAILABLE: the server (or a service behind it) cannot be reached."""

    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(DFlashError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's ``timeout`` passed before it finished."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(DFlashError):
    """CANCELLED: the call was cancelled (by the client or the server)."""

    default_code = grpc.StatusCode.CANCELLED


class InternalError(DFlashError):
    """INTERNAL (also UNKNOWN and DATA_LOSS): a server bug or a broken stream."""

    default_code = grpc.StatusCode.INTERNAL


_ERRORS: dict[grpc.StatusCode, type[DFlashError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,  # what grpcio sends for an unhandled server exception
    grpc.StatusCode.DATA_LOSS: InternalError,
}


def from_rpc_error(err: grpc.RpcError) -> DFlashError:
    """Map a :class:`grpc.RpcError` (sync or ``grpc.aio``) to the matching :class:`DFlashError`.

    Codes without a class of their own (UNIMPLEMENTED, PERMISSION_DENIED, ...) give a plain
    :class:`DFlashError` that still carries the code.
    """
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details = details_fn() if callable(details_fn) else None
    cls = _ERRORS.get(code, DFlashError)
    return cls(details or code.name.lower().replace("_", " "), code)


# --------------------------------------------------------------------------------------------
# Results

_FINISH_REASONS = {
    generation_pb2.FINISH_REASON_EOS: "eos",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_CONTEXT: "context",
}


def _fields_from_proto(cls, msg) -> dict[str, Any]:
    """Keyword arguments for dataclass ``cls`` from the same-named scalar/repeated fields of ``msg``."""
    out = {}
    for f in dataclasses.fields(cls):
        v = getattr(msg, f.name)
        out[f.name] = v if isinstance(v, (int, float, str, bool)) else list(v)
    return out


@dataclass
class AcceptanceStats:
    """Acceptance statistics of one request or of the whole server (proto ``AcceptanceStats``).

    Attributes mirror the proto fields; ``accepted_per_position[d-1]`` counts draft tokens
    accepted at depth ``d``, ``drafted_per_position[d-1]`` drafts that reached depth ``d``, and
    ``acceptance_length_histogram[t]`` verify forwards that emitted ``t`` tokens.
    """

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    mean_acceptance_length: float = 0.0
    acceptance_length_histogram: list[int] = field(default_factory=list)
    target_forwards: int = 0
    wall_time_s: float = 0.0
    decode_time_s: float = 0.0
    tokens_per_second: float = 0.0
    draft_fallbacks: int = 0
    autoregressive_steps: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    draft_compute_s: float = 0.0
    verify_compute_s: float = 0.0

    @classmethod
    def from_proto(cls, msg: generation_pb2.AcceptanceStats) -> AcceptanceStats:
        """Build from a ``dflash_grpc.v1.AcceptanceStats`` message."""
        return cls(**_fields_from_proto(cls, msg))

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens emitted per target verify forward."""
        return self.mean_acceptance_length

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens sent to verify (0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """``[accepted_per_position[d] / drafted_per_position[d]]`` per depth (0 where nothing was drafted)."""
        return [a / n if n else 0.0 for a, n in zip(self.accepted_per_position, self.drafted_per_position)]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON-serialisable)."""
        return dataclasses.asdict(self)

    def format(self) -> str:
        """Readable multi-line summary: tau, throughput, forwards, histogram, per-depth acceptance."""
        lines = [
            f"tau (mean acceptance length): {self.mean_acceptance_length:.3f} tokens/forward",
            f"tokens/s:                     {self.tokens_per_second:.1f}"
            f"  ({self.generated_tokens} tokens, decode {self.decode_time_s:.3f} s, wall {self.wall_time_s:.3f} s)",
            f"target forwards:              {self.target_forwards}"
            f"  (autoregressive {self.autoregressive_steps}, draft fallbacks {self.draft_fallbacks})",
            f"step split:                   draft {self.draft_compute_s:.3f} s, verify {self.verify_compute_s:.3f} s,"
            f" overhead {max(0.0, self.decode_time_s - self.draft_compute_s - self.verify_compute_s):.3f} s (gRPC, host, orchestrator)",
            f"drafts:                       {self.drafts}"
            f"  ({self.draft_tokens} draft tokens, {self.accepted_tokens} accepted, {100 * self.acceptance_rate:.1f}%)",
            f"requests:                     {self.requests}  (prompt tokens {self.prompt_tokens})",
        ]
        hist = self.acceptance_length_histogram
        total = sum(hist)
        if total:
            lines.append("acceptance length histogram (tokens per forward: forwards):")
            peak = max(hist)
            nonzero = [t for t, n in enumerate(hist) if n]
            for t in range(min(1, nonzero[0]), nonzero[-1] + 1):  # 1..longest, zeros between shown
                n = hist[t]
                bar = "#" * max(1 if n else 0, round(30 * n / peak))
                lines.append(f"  {t:3d}: {n:7d} {100 * n / total:5.1f}% {bar}")
        if self.drafted_per_position:
            lines.append("acceptance rate per draft position (accepted / drafted):")
            for d, (rate, a, n) in enumerate(
                zip(self.per_position_acceptance, self.accepted_per_position, self.drafted_per_position), start=1
            ):
                lines.append(f"  d={d:<3d} {rate:6.3f}  ({a}/{n})")
        return "\n".join(lines)


@dataclass
class GenerationChunk:
    """One streamed piece of a completion.

    ``text`` / ``token_ids`` are new since the previous chunk. The last chunk has
    ``finished=True``, a ``finish_reason`` (``"eos"``, ``"length"``, ``"stop"``, ``"context"``)
    and the request's ``stats``; ``prompt_tokens`` is set on the first chunk.
    """

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stats: AcceptanceStats | None = None
    prompt_tokens: int | None = None

    @classmethod
    def from_proto(cls, msg: generation_pb2.GenerateResponse) -> GenerationChunk:
        """Build from a ``GenerateResponse`` message."""
        return cls(
            text=msg.text,
            token_ids=list(msg.token_ids),
            finished=msg.finished,
            finish_reason=_FINISH_REASONS.get(msg.finish_reason),
            stats=AcceptanceStats.from_proto(msg.stats) if msg.HasField("stats") else None,
            prompt_tokens=msg.prompt_tokens or None,
        )


@dataclass
class GenerationResult:
    """A whole completion: its text and token ids (prompt excluded), why it stopped, the
    prompt length in tokens and the request's acceptance statistics."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    stats: AcceptanceStats

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable), ``stats`` included."""
        return dataclasses.asdict(self)


@dataclass
class ModelInfo:
    """What a model-serving process is and can do (proto ``ModelInfo``)."""

    model_name: str = ""
    architecture: str = ""
    vocab_size: int = 0
    tokenizer_fingerprint: str = ""
    model_fingerprint: str = ""
    block_size: int = 0
    max_context: int = 0
    max_tree_width: int = 0
    max_sessions: int = 0
    hidden_size: int = 0
    num_layers: int = 0
    features: list[str] = field(default_factory=list)
    device: str = ""
    max_tree_depth: int = 0
    graph_captures: int = 0
    free_slots: int = 0

    @classmethod
    def from_proto(cls, msg: common_pb2.ModelInfo) -> ModelInfo:
        """Build from a ``dflash_grpc.v1.ModelInfo`` message."""
        return cls(**_fields_from_proto(cls, msg))

    def format(self) -> str:
        """One line: name, architecture and sizes."""
        parts = [f"{self.model_name or '?'} ({self.architecture or '?'})", f"vocab {self.vocab_size}"]
        for label, value in [
            ("layers", self.num_layers),
            ("hidden", self.hidden_size),
            ("block", self.block_size),
            ("context", self.max_context),
            ("tree width", self.max_tree_width),
            ("tree depth", self.max_tree_depth),
            ("sessions", self.max_sessions),
        ]:
            if value:
                parts.append(f"{label} {value}")
        if self.device:
            parts.append(f"on {self.device}")
        return ", ".join(parts)


@dataclass
class DrafterStatus:
    """State of the drafter as the orchestrator sees it (proto ``DrafterStatus``)."""

    available: bool = False
    compatible: bool = False
    address: str = ""
    model: ModelInfo | None = None
    detail: str = ""

    @classmethod
    def from_proto(cls, msg: generation_pb2.DrafterStatus) -> DrafterStatus:
        """Build from a ``DrafterStatus`` message (``model`` is None when unset)."""
        return cls(
            available=msg.available,
            compatible=msg.compatible,
            address=msg.address,
            model=ModelInfo.from_proto(msg.model) if msg.HasField("model") else None,
            detail=msg.detail,
        )


@dataclass
class SchedulerStatus:
    """The orchestrator's batching scheduler now (proto ``SchedulerStatus``; all 0 from a server
    without one)."""

    active_sessions: int = 0
    queued_requests: int = 0
    max_sessions: int = 0
    max_queue: int = 0
    ticks: int = 0
    mean_batch: float = 0.0
    tree_budget_now: int = 0
    drafting: bool = False
    draft_fallbacks: int = 0

    @classmethod
    def from_proto(cls, msg: generation_pb2.SchedulerStatus) -> SchedulerStatus:
        """Build from a ``SchedulerStatus`` message."""
        return cls(**_fields_from_proto(cls, msg))


@dataclass
class ServiceInfo:
    """What the orchestrator serves: the target model, the drafter's state, the server version
    and its scheduler's state now."""

    target: ModelInfo
    drafter: DrafterStatus
    version: str = ""
    scheduler: SchedulerStatus = field(default_factory=SchedulerStatus)

    @classmethod
    def from_proto(cls, msg: generation_pb2.ServiceInfo) -> ServiceInfo:
        """Build from a ``ServiceInfo`` message."""
        return cls(
            target=ModelInfo.from_proto(msg.target),
            drafter=DrafterStatus.from_proto(msg.drafter),
            version=msg.version,
            scheduler=SchedulerStatus.from_proto(msg.scheduler),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)

    def format(self) -> str:
        """Readable multi-line summary."""
        d = self.drafter
        state = "available" if d.available else "unavailable"
        if d.available:
            state += ", compatible" if d.compatible else ", INCOMPATIBLE"
        lines = [
            f"version:  {self.version or '?'}",
            f"target:   {self.target.format()}",
        ]
        if self.target.features:
            lines.append(f"          features: {', '.join(self.target.features)}")
        lines.append(f"drafter:  {state}" + (f" at {d.address}" if d.address else ""))
        if d.model is not None:
            lines.append(f"          {d.model.format()}")
        if d.detail:
            lines.append(f"          {d.detail}")
        s = self.scheduler
        if s.max_sessions or s.ticks:
            lines.append(f"scheduler: {s.active_sessions}/{s.max_sessions} sessions, {s.queued_requests}/{s.max_queue} queued, "
                         f"{s.ticks} ticks, mean batch {s.mean_batch:.2f}, tree budget {s.tree_budget_now}, "
                         f"drafting {'yes' if s.drafting else 'no'}, fallbacks {s.draft_fallbacks}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Requests


def _chat_message(m: Any) -> generation_pb2.ChatMessage:
    if isinstance(m, generation_pb2.ChatMessage):
        return m
    if isinstance(m, Mapping):
        return generation_pb2.ChatMessage(role=m["role"], content=m["content"])
    role, content = m  # (role, content) pair
    return generation_pb2.ChatMessage(role=role, content=content)


def build_request(
    prompt: str | None = None,
    *,
    tokens: Sequence[int] | None = None,
    messages: Iterable[Any] | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int | None = None,
    stop: str | Iterable[str] = (),
    ignore_eos: bool = False,
    speculative: bool | None = None,
    tree_budget: int | None = None,
    top_k_draft: int | None = None,
    max_depth: int | None = None,
    request_id: str | None = None,
) -> generation_pb2.GenerateRequest:
    """Build a ``GenerateRequest``; the arguments are those of :meth:`Client.generate`.

    Raises:
        InvalidArgumentError: not exactly one of ``prompt``/``tokens``/``messages``, or a value
            that does not fit its field (e.g. a negative seed).
    """
    if sum(x is not None for x in (prompt, tokens, messages)) != 1:
        raise InvalidArgumentError("exactly one of prompt, tokens, messages must be given")
    if isinstance(stop, str):
        stop = [stop]
    try:
        req = generation_pb2.GenerateRequest(
            max_tokens=max_tokens,
            sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
            stop=list(stop),
            ignore_eos=ignore_eos,
            request_id=request_id or "",
        )
        if prompt is not None:
            req.prompt = prompt
        elif tokens is not None:
            req.prompt_tokens.ids.extend(tokens)
        else:
            req.chat.messages.extend(_chat_message(m) for m in messages)
            req.chat.add_generation_prompt = True
        if seed is not None:
            req.sampling.seed = seed
        spec = {"enabled": speculative, "tree_budget": tree_budget, "top_k": top_k_draft, "max_depth": max_depth}
        for name, value in spec.items():
            if value is not None:
                setattr(req.speculative, name, value)
    except (TypeError, ValueError, KeyError) as e:
        raise InvalidArgumentError(f"bad request argument: {e}") from e
    return req


class _Collector:
    """Accumulates streamed responses into a :class:`GenerationResult`."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.prompt_tokens = 0
        self.result: GenerationResult | None = None

    def add(self, msg: generation_pb2.GenerateResponse) -> GenerationChunk:
        chunk = GenerationChunk.from_proto(msg)
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.prompt_tokens:
            self.prompt_tokens = chunk.prompt_tokens
        if chunk.finished:
            self.result = GenerationResult(
                text="".join(self.text),
                token_ids=list(self.token_ids),
                finish_reason=chunk.finish_reason,
                prompt_tokens=self.prompt_tokens,
                stats=chunk.stats or AcceptanceStats(),
            )
        return chunk

    def end(self) -> None:
        if self.result is None:
            raise InternalError("the server ended the stream without a final message")


class GenerationStream(Iterator[GenerationChunk]):
    """Iterator over the chunks of one streaming ``Generate`` call (from :meth:`Client.stream`).

    After the last chunk, :attr:`result` holds the whole :class:`GenerationResult` (stats
    included). :meth:`cancel` (or leaving a ``with`` block early) cancels the call.
    """

    def __init__(self, call) -> None:
        self._call = call
        self._collector = _Collector()

    @property
    def result(self) -> GenerationResult | None:
        """The whole result once the final chunk has been read, else None."""
        return self._collector.result

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> GenerationChunk:
        if self._collector.result is not None:
            raise StopIteration
        try:
            msg = next(self._call)
        except StopIteration:
            self._collector.end()
            raise
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return self._collector.add(msg)

    def collect(self) -> GenerationResult:
        """Read the rest of the stream and return the whole result."""
        for _ in self:
            pass
        return self._collector.result

    def cancel(self) -> None:
        """Cancel the call (no effect once it has finished)."""
        self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class AsyncGenerationStream(AsyncIterator[GenerationChunk]):
    """Async iterator over the chunks of one ``Generate`` call (from :meth:`AsyncClient.stream`).

    After the last chunk, :attr:`result` holds the whole :class:`GenerationResult`.
    """

    def __init__(self, call) -> None:
        self._call = call
        self._collector = _Collector()

    @property
    def result(self) -> GenerationResult | None:
        """The whole result once the final chunk has been read, else None."""
        return self._collector.result

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._collector.result is not None:
            raise StopAsyncIteration
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        if msg is grpc.aio.EOF:
            self._collector.end()
            raise StopAsyncIteration
        return self._collector.add(msg)

    async def collect(self) -> GenerationResult:
        """Read the rest of the stream and return the whole result."""
        async for _ in self:
            pass
        return self._collector.result

    def cancel(self) -> None:
        """Cancel the call (no effect once it has finished)."""
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


# --------------------------------------------------------------------------------------------
# Clients


class Client:
    """Blocking client of the orchestrator's ``GenerationService``.

    Args:
        address: ``host:port`` of the orchestrator.
        timeout: default deadline of every call, in seconds (None: no deadline). A per-call
            ``timeout`` overrides it; an expired deadline raises :class:`DeadlineExceededError`.
        tls: connect over TLS (implied by any ``tls_*`` argument). Default: plaintext.
        tls_ca: PEM file of the CA the server's certificate must chain to (None: the system's roots).
        tls_cert, tls_key: PEM files of a client certificate and its key, for a server that
            requires mutual TLS (give both).
        tls_server_name: name the server's certificate is checked against instead of the
            address's host (e.g. a certificate for ``orchestrator.internal`` reached by IP).

    Messages are limited to 256 MiB each way (a larger one: :class:`ResourceExhaustedError`).
    Use as a context manager, or call :meth:`close`.

    Raises:
        InvalidArgumentError: only one of ``tls_cert`` / ``tls_key``, or a TLS file that cannot be read.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float | None = None, *, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None):
        self.address = address
        self.timeout = timeout
        self.tls = _tls_config(tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._channel = open_channel(address, self.tls)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        messages: Iterable[Any] | None = None,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 0.0,
        seed: int | None = None,
        stop: str | Iterable[str] = (),
        ignore_eos: bool = False,
        speculative: bool | None = None,
        tree_budget: int | None = None,
        top_k_draft: int | None = None,
        max_depth: int | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerationStream:
        """Start a generation and return a :class:`GenerationStream` of its chunks.

        Arguments are those of :meth:`generate`. Errors surface while iterating. After the
        last chunk, ``stream.result`` holds the whole :class:`GenerationResult`.
        """
        req = build_request(
            prompt, tokens=tokens, messages=messages, max_tokens=max_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, speculative=speculative,
            tree_budget=tree_budget, top_k_draft=top_k_draft, max_depth=max_depth, request_id=request_id,
        )  # fmt: skip
        return GenerationStream(self._stub.Generate(req, timeout=self._deadline(timeout)))

    def generate(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        messages: Iterable[Any] | None = None,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 0.0,
        seed: int | None = None,
        stop: str | Iterable[str] = (),
        ignore_eos: bool = False,
        speculative: bool | None = None,
        tree_budget: int | None = None,
        top_k_draft: int | None = None,
        max_depth: int | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerationResult:
        """Generate a completion and return it whole.

        Args:
            prompt: raw text, tokenized as is. Exactly one of ``prompt``, ``tokens``, ``messages``.
            tokens: prompt token ids.
            messages: chat messages (``{"role": ..., "content": ...}`` dicts or ``(role, content)``
                pairs), rendered with the model's chat template plus the generation prompt.
            max_tokens: most tokens to generate (0: server default).
            temperature: 0 is greedy; otherwise sampled, with ``top_k`` / ``top_p`` filters (0: off).
            seed: seed of the random stream (None: the server picks one).
            stop: stop strings (not included in the output).
            ignore_eos: keep generating past the end-of-sequence token.
            speculative: False for plain autoregressive decoding; None for the server default.
            tree_budget: most draft nodes per tree (None: server default).
            top_k_draft: candidates per draft depth (None: server default).
            max_depth: draft depth (None: server default).
            request_id: optional id echoed in the server logs.
            timeout: deadline of this call in seconds (None: the client's default).

        Raises:
            DFlashError: a subclass matching the gRPC status, e.g. :class:`InvalidArgumentError`,
                :class:`DeadlineExceededError`, :class:`UnavailableError`.
        """
        return self.stream(
            prompt, tokens=tokens, messages=messages, max_tokens=max_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, speculative=speculative,
            tree_budget=tree_budget, top_k_draft=top_k_draft, max_depth=max_depth, request_id=request_id,
            timeout=timeout,
        ).collect()  # fmt: skip

    def stats(self, *, timeout: float | None = None) -> AcceptanceStats:
        """The server's global acceptance statistics (``GetStats``)."""
        try:
            msg = self._stub.GetStats(generation_pb2.GetStatsRequest(), timeout=self._deadline(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return AcceptanceStats.from_proto(msg)

    def info(self, *, timeout: float | None = None) -> ServiceInfo:
        """What the server runs: target model, drafter state, version (``Info``)."""
        try:
            msg = self._stub.Info(generation_pb2.ServiceInfoRequest(), timeout=self._deadline(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return ServiceInfo.from_proto(msg)

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client of the ``GenerationService``, with the API of :class:`Client`.

    The channel is opened on first use, inside the running event loop. Use as an async
    context manager, or ``await client.close()``. Arguments (TLS included) are those of :class:`Client`.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float | None = None, *, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None):
        self.address = address
        self.timeout = timeout
        self.tls = _tls_config(tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._channel: grpc.aio.Channel | None = None
        self._stub_: generation_pb2_grpc.GenerationServiceStub | None = None

    @property
    def _stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        if self._stub_ is None:
            self._channel = open_aio_channel(self.address, self.tls)
            self._stub_ = generation_pb2_grpc.GenerationServiceStub(self._channel)
        return self._stub_

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        messages: Iterable[Any] | None = None,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 0.0,
        seed: int | None = None,
        stop: str | Iterable[str] = (),
        ignore_eos: bool = False,
        speculative: bool | None = None,
        tree_budget: int | None = None,
        top_k_draft: int | None = None,
        max_depth: int | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerationStream:
        """Start a generation; ``async for chunk in client.stream(...)``. See :meth:`Client.generate`.

        Must be called inside the running event loop. After the last chunk, ``stream.result``
        holds the whole :class:`GenerationResult`.
        """
        req = build_request(
            prompt, tokens=tokens, messages=messages, max_tokens=max_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, speculative=speculative,
            tree_budget=tree_budget, top_k_draft=top_k_draft, max_depth=max_depth, request_id=request_id,
        )  # fmt: skip
        return AsyncGenerationStream(self._stub.Generate(req, timeout=self._deadline(timeout)))

    async def generate(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        messages: Iterable[Any] | None = None,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 0.0,
        seed: int | None = None,
        stop: str | Iterable[str] = (),
        ignore_eos: bool = False,
        speculative: bool | None = None,
        tree_budget: int | None = None,
        top_k_draft: int | None = None,
        max_depth: int | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerationResult:
        """Generate a completion and return it whole. See :meth:`Client.generate`."""
        return await self.stream(
            prompt, tokens=tokens, messages=messages, max_tokens=max_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, speculative=speculative,
            tree_budget=tree_budget, top_k_draft=top_k_draft, max_depth=max_depth, request_id=request_id,
            timeout=timeout,
        ).collect()  # fmt: skip

    async def stats(self, *, timeout: float | None = None) -> AcceptanceStats:
        """The server's global acceptance statistics (``GetStats``)."""
        try:
            msg = await self._stub.GetStats(generation_pb2.GetStatsRequest(), timeout=self._deadline(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return AcceptanceStats.from_proto(msg)

    async def info(self, *, timeout: float | None = None) -> ServiceInfo:
        """What the server runs: target model, drafter state, version (``Info``)."""
        try:
            msg = await self._stub.Info(generation_pb2.ServiceInfoRequest(), timeout=self._deadline(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return ServiceInfo.from_proto(msg)

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub_ = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
