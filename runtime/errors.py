"""Errors the engines raise, with the status each maps to; the servicers turn them into gRPC
statuses (``grpc.StatusCode[error.code.name]``), so the engines never import grpc.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """Status of a refused request, named after the gRPC status it maps to."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    INTERNAL = "INTERNAL"


class EngineError(Exception):
    """A request the engine refuses; ``code`` says which status to answer with."""

    code = Code.INTERNAL

    def __init__(self, message: str, code: Code | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(EngineError):
    code = Code.INVALID_ARGUMENT


class SessionNotFound(EngineError):
    code = Code.NOT_FOUND


class ResourceExhausted(EngineError):
    code = Code.RESOURCE_EXHAUSTED


class FailedPrecondition(EngineError):
    code = Code.FAILED_PRECONDITION
