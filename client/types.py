"""The SDK's data types: what a call returns (results, stream chunks, statistics, service info)
and :class:`GenerateRequest`, the one description of a generation request.

:class:`GenerateRequest` holds the input (``prompt``, ``tokens`` or ``messages``) and every
generation option with its default; it checks each value when it is built (a value that cannot
be sent raises :class:`~client.errors.InvalidArgumentError`) and :meth:`GenerateRequest.to_proto`
is the one conversion to the wire message. :meth:`Client.generate <client.Client.generate>` and
the other generation methods take its fields as keyword options, or a ready ``request=``.

Result types mirror their proto messages field for field (``from_proto`` builds them).
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import operator
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar

from dflash_grpc.v1 import common_pb2, generation_pb2

from client.errors import InternalError, InvalidArgumentError

__all__ = [
    "AcceptanceStats",
    "DrafterStatus",
    "GenerateRequest",
    "GenerationChunk",
    "GenerationResult",
    "ModelInfo",
    "SchedulerStatus",
    "ServiceInfo",
    "build_request",
]

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
    draft_device_s: float = 0.0
    verify_device_s: float = 0.0

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
    local_endpoint: str = ""
    weight_bytes: int = 0

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
        if self.weight_bytes:
            parts.append(f"weights {self.weight_bytes / 2**20:.0f} MiB")
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
    #: feature rows the drafter read from the target's feature ring, not through the orchestrator
    ring_rows: int = 0
    #: counters since the orchestrator started (proto comments): drafter sessions recomputed and
    #: given up, requests started plainly and demoted, items without a drafter slot, missed
    #: Propose deadlines
    refeatures: int = 0
    drafter_sessions_given_up: int = 0
    admitted_plain: int = 0
    demoted: int = 0
    no_drafter_slot: int = 0
    draft_deadline_misses: int = 0
    #: seconds of the scheduler's loop iterations that ticked, wall and CPU, and of their exchanges
    #: (proto comments): wall less exchanges is the orchestrator's own part of the ticks
    tick_seconds: float = 0.0
    tick_cpu_seconds: float = 0.0
    exchange_seconds: float = 0.0
    exchange_cpu_seconds: float = 0.0
    #: seconds the ticks' Verify / Propose items waited in the services' queues before their steps
    verify_queue_seconds: float = 0.0
    propose_queue_seconds: float = 0.0

    #: the fields that count since start (:func:`bench.serving.run_concurrency` reports their change per level)
    COUNTERS: ClassVar[tuple[str, ...]] = ("ticks", "draft_fallbacks", "ring_rows", "refeatures",
                                           "drafter_sessions_given_up", "admitted_plain", "demoted",
                                           "no_drafter_slot", "draft_deadline_misses", "tick_seconds",
                                           "tick_cpu_seconds", "exchange_seconds", "exchange_cpu_seconds",
                                           "verify_queue_seconds", "propose_queue_seconds")

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
            counted = [(s.draft_deadline_misses, "Propose deadlines missed"), (s.refeatures, "drafter sessions recomputed"),
                       (s.drafter_sessions_given_up, "given up"), (s.admitted_plain, "requests started plainly"),
                       (s.demoted, "demoted"), (s.no_drafter_slot, "items without a drafter slot")]
            if any(n for n, _ in counted):
                lines.append("           since start: " + ", ".join(f"{n} {what}" for n, what in counted if n))
        return "\n".join(lines)



# --------------------------------------------------------------------------------------------
# Requests

_INT32 = (-(2**31), 2**31 - 1)
_UINT64 = (0, 2**64 - 1)


def _bad(name: str, value: Any, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"bad request argument: {name}={value!r} is not {what}")


def _int(name: str, value: Any, bounds: tuple[int, int] = _INT32) -> int:
    """``value`` as an int within ``bounds`` (any integer type but bool)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise _bad(name, value, "an integer") from None
    if not bounds[0] <= value <= bounds[1]:
        raise _bad(name, value, f"in [{bounds[0]}, {bounds[1]}]")
    return value


def _opt_int(name: str, value: Any, bounds: tuple[int, int] = _INT32) -> int | None:
    return None if value is None else _int(name, value, bounds)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(name, value, "a number")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise _bad(name, value, "a bool")


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _bad(name, value, "a string")
    return value


def _sequence(name: str, value: Any) -> tuple:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise _bad(name, value, "a list")
    return tuple(value)


def _chat_message(m: Any) -> tuple[str, str]:
    """``(role, content)`` of a ``{"role", "content"}`` mapping, a pair or a ``ChatMessage``."""
    if isinstance(m, generation_pb2.ChatMessage):
        return m.role, m.content
    try:
        role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
    except (KeyError, TypeError, ValueError):
        raise _bad("messages", m, 'a {"role": ..., "content": ...} dict or a (role, content) pair') from None
    return _str("role", role), _str("content", content)


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request: the input and every option, checked when built.

    Give exactly one input: ``prompt``, ``tokens`` or ``messages`` (a request without one can be
    built, e.g. as a template of options, but not sent: :meth:`to_proto` refuses it). Only
    ``prompt`` may be positional. Lists are stored as tuples, so a request is immutable and
    hashable; :meth:`replace` gives a changed copy.

    Args:
        prompt: raw text, tokenized as is.
        tokens: prompt token ids.
        messages: chat messages, ``{"role": ..., "content": ...}`` dicts, ``(role, content)``
            pairs or ``ChatMessage`` protos (stored as ``(role, content)`` pairs); rendered with the
            model's chat template plus the generation prompt.
        max_tokens: most tokens to generate (0: the server's default). Default 128.
        temperature: 0 (default) is greedy; above 0 samples, with the ``top_k`` / ``top_p``
            filters (0: off).
        top_k: sampling top-k (0: off).
        top_p: sampling nucleus mass (0: off).
        seed: seed of the random stream, in [0, 2**64) (None: the server picks one).
        stop: a stop string or several (not included in the output).
        ignore_eos: keep generating past the end-of-sequence token.
        speculative: False for plain autoregressive decoding; None (default) for the server's default.
        tree_budget: most draft nodes per tree (None: the server's default).
        top_k_draft: draft candidates per depth (None: the server's default).
        max_depth: draft depth (None: the server's default).
        request_id: optional id echoed in the server logs.

    Integers must fit the wire's int32 (``seed``: uint64). The server checks the values' meaning
    (e.g. a negative temperature or a token id outside the vocabulary: ``INVALID_ARGUMENT``).

    Raises:
        InvalidArgumentError: more than one input, or a value of the wrong type or out of range.
        TypeError: an unknown field (the dataclass's own check; :meth:`replace` and the clients'
            keyword options name every unknown one).
    """

    prompt: str | None = None
    _: KW_ONLY
    tokens: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculative: bool | None = None
    tree_budget: int | None = None
    top_k_draft: int | None = None
    max_depth: int | None = None
    request_id: str | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.prompt, self.tokens, self.messages)) > 1:
            raise InvalidArgumentError("exactly one of prompt, tokens, messages must be given")
        stop = (self.stop,) if isinstance(self.stop, str) else _sequence("stop", self.stop)
        tokens = self.tokens
        if tokens is not None:
            tokens = tuple(_int("tokens", t) for t in _sequence("tokens", tokens))
        messages = self.messages
        if messages is not None:
            messages = tuple(_chat_message(m) for m in _sequence("messages", messages))
        values = {
            "prompt": None if self.prompt is None else _str("prompt", self.prompt),
            "tokens": tokens,
            "messages": messages,
            "max_tokens": _int("max_tokens", self.max_tokens),
            "temperature": _float("temperature", self.temperature),
            "top_k": _int("top_k", self.top_k),
            "top_p": _float("top_p", self.top_p),
            "seed": _opt_int("seed", self.seed, _UINT64),
            "stop": tuple(_str("stop", s) for s in stop),
            "ignore_eos": _bool("ignore_eos", self.ignore_eos),
            "speculative": None if self.speculative is None else _bool("speculative", self.speculative),
            "tree_budget": _opt_int("tree_budget", self.tree_budget),
            "top_k_draft": _opt_int("top_k_draft", self.top_k_draft),
            "max_depth": _opt_int("max_depth", self.max_depth),
            "request_id": None if self.request_id is None else _str("request_id", self.request_id),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)  # frozen: normalised once, here

    @classmethod
    def _check_names(cls, names: Iterable[str]) -> None:
        """Raise TypeError naming every one of ``names`` that is not a field (with close matches)."""
        unknown = [n for n in names if n not in _FIELDS]
        if unknown:
            hints = []
            for n in unknown:
                close = difflib.get_close_matches(n, _FIELDS, n=1)
                hints.append(f"{n!r} (did you mean {close[0]!r}?)" if close else repr(n))
            raise TypeError(f"unknown generation option{'s' if len(unknown) > 1 else ''}: {', '.join(hints)}; "
                            f"the options are {', '.join(_FIELDS)}")

    @classmethod
    def of(cls, prompt: str | None = None, *, request: GenerateRequest | None = None, **options: Any) -> GenerateRequest:
        """The request of a generation method's arguments: ``request`` (with ``prompt`` as its
        input when given) or, without one, ``GenerateRequest(prompt, **options)``.

        Raises:
            TypeError: both ``request`` and keyword options, ``request`` not a GenerateRequest,
                or an unknown option (every unknown one is named).
            InvalidArgumentError: a bad value, or ``prompt`` given to a request that has an input.
        """
        if request is None:
            cls._check_names(options)
            return cls(prompt, **options)
        if not isinstance(request, GenerateRequest):
            raise TypeError(f"request must be a GenerateRequest, not {type(request).__name__}")
        if options:
            raise TypeError(f"give generation options either as request= or as keywords, not both "
                            f"(got request= and {', '.join(sorted(options))})")
        return request if prompt is None else request.replace(prompt=prompt)

    def replace(self, **changes: Any) -> GenerateRequest:
        """A copy with ``changes`` applied (and checked), e.g. ``req.replace(prompt="...", seed=2)``.

        Raises:
            TypeError: an unknown field (every unknown one is named).
            InvalidArgumentError: a bad value.
        """
        self._check_names(changes)
        return dataclasses.replace(self, **changes)

    def to_proto(self) -> generation_pb2.GenerateRequest:
        """The wire message ``dflash_grpc.v1.GenerateRequest`` (the SDK's only conversion).

        Unset options stay unset on the wire (``seed``, and ``speculative`` as a whole when
        ``speculative``, ``tree_budget``, ``top_k_draft`` and ``max_depth`` are all None), so the
        server applies its defaults.

        Raises:
            InvalidArgumentError: no input (none of ``prompt``, ``tokens``, ``messages``).
        """
        if self.prompt is None and self.tokens is None and self.messages is None:
            raise InvalidArgumentError("exactly one of prompt, tokens, messages must be given")
        req = generation_pb2.GenerateRequest(
            max_tokens=self.max_tokens,
            sampling=common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p),
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            request_id=self.request_id or "",
        )
        if self.prompt is not None:
            req.prompt = self.prompt
        elif self.tokens is not None:
            req.prompt_tokens.ids.extend(self.tokens)
        else:
            req.chat.messages.extend(generation_pb2.ChatMessage(role=r, content=c) for r, c in self.messages)
            req.chat.add_generation_prompt = True
        if self.seed is not None:
            req.sampling.seed = self.seed
        spec = {"enabled": self.speculative, "tree_budget": self.tree_budget, "top_k": self.top_k_draft,
                "max_depth": self.max_depth}
        for name, value in spec.items():
            if value is not None:
                setattr(req.speculative, name, value)
        return req


_FIELDS = tuple(f.name for f in dataclasses.fields(GenerateRequest))


def build_request(prompt: str | None = None, **options: Any) -> generation_pb2.GenerateRequest:
    """The wire ``GenerateRequest`` of ``prompt`` and options: ``GenerateRequest(prompt, **options).to_proto()``.

    Raises:
        TypeError: an unknown option (every unknown one is named).
        InvalidArgumentError: not exactly one of ``prompt`` / ``tokens`` / ``messages``, or a bad value.
    """
    return GenerateRequest.of(prompt, **options).to_proto()


# --------------------------------------------------------------------------------------------
# Streams


class _Collector:
    """Accumulates streamed responses into a :class:`GenerationResult` (shared by the sync and
    async streams)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.prompt_tokens = 0
        self.result: GenerationResult | None = None

    def add(self, msg: generation_pb2.GenerateResponse) -> GenerationChunk:
        """Take one response; the chunk it carries (and, for the final one, set :attr:`result`)."""
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
        """The stream ended: raise InternalError when no final message came."""
        if self.result is None:
            raise InternalError("the server ended the stream without a final message")
