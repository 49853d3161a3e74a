"""Errors the engines raise, with the status each maps to and a structured reason code; the
servicers turn them into gRPC statuses (``grpc.StatusCode[error.code.name]``, the reason in
``ItemStatus.reason`` or in the trailing metadata key ``dflash-reason``; see
:mod:`runtime.status`), so the engines never import grpc.

This module imports nothing but the standard library: the orchestrator (which runs without
torch) uses :class:`Reason` too.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """Status of a refused request, named after the gRPC status it maps to."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class Reason(str, enum.Enum):
    """Why a request (or one item of it) was refused: a stable wire name, sent next to the status
    code (``ItemStatus.reason`` for an item of a batched stream message; trailing metadata
    ``dflash-reason`` for a refused call). Callers branch on the reason, never on the message
    text, which is for people and may change. The value of each member is its wire name.

    A receiver must accept names it does not know (a newer peer), and an empty reason (an older
    peer, or a status made by grpc itself, e.g. a deadline): treat both like the generic reason
    of the status code.
    """

    # -- generic, one per status code: the error has no more specific reason
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    """A request field is malformed or out of its bounds (INVALID_ARGUMENT)."""
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    """A limit other than the ones below was hit (RESOURCE_EXHAUSTED)."""
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    """The request does not fit the state it addresses (FAILED_PRECONDITION)."""
    INTERNAL = "INTERNAL"
    """A bug or an unexpected failure on the server (INTERNAL); logged there."""

    # -- malformed input (INVALID_ARGUMENT)
    INVALID_TOKEN = "INVALID_TOKEN"
    """A token id outside the vocabulary (prompt token, drafter root token)."""
    INVALID_TREE = "INVALID_TREE"
    """A malformed token tree (structure, width, depth, token ids), a missing tree, or a tree
    whose root is not the session's last token."""
    INVALID_SAMPLING = "INVALID_SAMPLING"
    """Sampling values out of range (temperature, top_k, top_p)."""
    INVALID_FEATURES = "INVALID_FEATURES"
    """Features that do not decode or have the wrong shape, dtype or non-finite values."""
    SESSION_EXISTS = "SESSION_EXISTS"
    """A prefill for a session id that is already live."""

    # -- sessions (NOT_FOUND)
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    """The session is not (or no longer) live: never opened, released, reaped, or the service
    restarted."""

    # -- ownership (PERMISSION_DENIED)
    NOT_OWNER = "NOT_OWNER"
    """The session belongs to another owner (``dflash-owner`` / ``dflash-owner-epoch`` metadata:
    another orchestrator, or an older start of this one); it was not touched (PERMISSION_DENIED;
    :mod:`runtime.owners`)."""

    # -- capacity (RESOURCE_EXHAUSTED)
    NO_FREE_SLOT = "NO_FREE_SLOT"
    """Every session slot is taken; retry once one is released."""
    CONTEXT_FULL = "CONTEXT_FULL"
    """The session's committed rows plus this step would pass its context."""
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    """The prompt leaves no room in the context (the orchestrator and the target), or, checked by
    the orchestrator before tokenizing, it is too large: more characters than ``--max-prompt-chars``
    (a raw prompt, or a chat's roles and contents together), more chat messages or role characters
    than ``REQUEST_LIMITS`` allows, a message larger than ``--max-request-bytes``."""
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    """The device ran out of memory serving this item."""
    QUEUE_FULL = "QUEUE_FULL"
    """The orchestrator's queue is full (``--max-queue``); retry later."""
    STREAMS_BUSY = "STREAMS_BUSY"
    """Every stream worker of the server is busy (``dflash_grpc.serving``); retry later."""

    # -- state mismatch (FAILED_PRECONDITION)
    LENGTH_MISMATCH = "LENGTH_MISMATCH"
    """The drafter's ``committed_length`` differs from its rows held plus rows sent."""
    DRAFTER_MISMATCH = "DRAFTER_MISMATCH"
    """The configured drafter was built for another target (orchestrator)."""
    RING_UNAVAILABLE = "RING_UNAVAILABLE"
    """The item's rows are in a feature ring the drafter cannot read (no ring sent, another GPU
    or host, a call not over the same-host hop: :mod:`runtime.feature_ring`); send them as bytes."""

    # -- access (UNAUTHENTICATED)
    UNAUTHENTICATED = "UNAUTHENTICATED"
    """An internal service's call without its orchestrator's token, or with a wrong one
    (``dflash_grpc.serving.make_server(auth_token=...)``)."""

    # -- availability (UNAVAILABLE)
    SHUTTING_DOWN = "SHUTTING_DOWN"
    """The service (its step loop, or the orchestrator's scheduler) is stopping."""
    TARGET_UNAVAILABLE = "TARGET_UNAVAILABLE"
    """The orchestrator's target service is down, did not answer in time, or lost the session
    (restarted)."""

    def __str__(self) -> str:
        return self.value


class EngineError(Exception):
    """A request the engine refuses.

    Attributes:
        code: the status to answer with (:class:`Code`); a default per subclass.
        reason: why (:class:`Reason`); a default per subclass, overridden by a raise site that
            callers must tell apart (``ResourceExhausted(..., reason=Reason.NO_FREE_SLOT)``).
    """

    code = Code.INTERNAL
    reason = Reason.INTERNAL

    def __init__(self, message: str, code: Code | None = None, reason: Reason | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if reason is not None:
            self.reason = Reason(reason)


class InvalidArgument(EngineError):
    """INVALID_ARGUMENT; reason INVALID_ARGUMENT unless the raise site names a closer one."""

    code = Code.INVALID_ARGUMENT
    reason = Reason.INVALID_ARGUMENT


class SessionNotFound(EngineError):
    """NOT_FOUND: the session is not live (reason SESSION_NOT_FOUND)."""

    code = Code.NOT_FOUND
    reason = Reason.SESSION_NOT_FOUND


class ResourceExhausted(EngineError):
    """RESOURCE_EXHAUSTED; reason RESOURCE_EXHAUSTED unless the raise site names a closer one
    (NO_FREE_SLOT, CONTEXT_FULL, PROMPT_TOO_LONG)."""

    code = Code.RESOURCE_EXHAUSTED
    reason = Reason.RESOURCE_EXHAUSTED


class FailedPrecondition(EngineError):
    """FAILED_PRECONDITION; reason FAILED_PRECONDITION unless the raise site names a closer one
    (LENGTH_MISMATCH)."""

    code = Code.FAILED_PRECONDITION
    reason = Reason.FAILED_PRECONDITION


class Unavailable(EngineError, RuntimeError):
    """UNAVAILABLE: the service is stopping (reason SHUTTING_DOWN). Also a ``RuntimeError``, what
    the step loop raised before it carried a status."""

    code = Code.UNAVAILABLE
    reason = Reason.SHUTTING_DOWN
