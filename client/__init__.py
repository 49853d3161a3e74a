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

Generation options are the fields of :class:`GenerateRequest`, given as keywords or as a ready
``request=GenerateRequest(...)``. Every gRPC failure is raised as a :class:`DFlashError` subclass
chosen by the status code (:func:`from_rpc_error`), e.g. :class:`InvalidArgumentError` or
:class:`DeadlineExceededError`; ``err.reason`` is the server's structured reason code.

Modules: :mod:`client.types` (request and result types), :mod:`client.errors`, :mod:`client.sync`
(:class:`Client`), :mod:`client.aio` (:class:`AsyncClient`). The package imports neither torch
nor the services: it needs only ``grpcio`` and the stubs (``dflash_grpc``).
"""

from dflash_grpc.transport import TlsConfig

from client._connection import DEFAULT_ADDRESS
from client.aio import AsyncClient, AsyncGenerationStream
from client.errors import (
    CancelledError,
    DeadlineExceededError,
    DFlashError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    from_rpc_error,
)
from client.sync import Client, GenerationStream
from client.types import (
    AcceptanceStats,
    DrafterStatus,
    GenerateRequest,
    GenerationChunk,
    GenerationResult,
    ModelInfo,
    SchedulerStatus,
    ServiceInfo,
    build_request,
)

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
    "GenerateRequest",
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
