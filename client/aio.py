"""The asyncio client: :class:`AsyncClient` and the async iterator of one streamed call,
:class:`AsyncGenerationStream`. Same API as :mod:`client.sync`, with ``await`` / ``async for``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
from dflash_grpc.transport import open_aio_channel
from dflash_grpc.v1 import generation_pb2, generation_pb2_grpc

from client._connection import _Connection
from client.errors import from_rpc_error
from client.types import AcceptanceStats, GenerateRequest, GenerationChunk, GenerationResult, ServiceInfo, _Collector

__all__ = ["AsyncClient", "AsyncGenerationStream"]


class AsyncGenerationStream(AsyncIterator[GenerationChunk]):
    """Async iterator over the chunks of one ``Generate`` call (from :meth:`AsyncClient.stream`).

    After the last chunk, :attr:`result` holds the whole :class:`GenerationResult`. Iterating
    raises a :class:`~client.errors.DFlashError` when the call fails.
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


class AsyncClient(_Connection):
    """asyncio client of the ``GenerationService``, with the API of :class:`~client.Client`.

    Arguments (TLS included) and errors are those of :class:`~client.Client`. The channel is
    opened on first use, inside the running event loop. Use as an async context manager, or
    ``await client.close()``.
    """

    def _open(self) -> None:
        self._channel: grpc.aio.Channel | None = None
        self._stub_: generation_pb2_grpc.GenerationServiceStub | None = None

    @property
    def _stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        if self._stub_ is None:
            self._channel = open_aio_channel(self.address, self.tls)
            self._stub_ = generation_pb2_grpc.GenerationServiceStub(self._channel)
        return self._stub_

    def stream(self, prompt: str | None = None, *, request: GenerateRequest | None = None, timeout: float | None = None,
               **options: Any) -> AsyncGenerationStream:
        """Start a generation; ``async for chunk in client.stream(...)``.

        Arguments and errors are those of :meth:`Client.generate <client.Client.generate>`
        (argument errors are raised here, call errors while iterating). Must be called inside the
        running event loop. After the last chunk, ``stream.result`` holds the whole :class:`GenerationResult`.
        """
        req = GenerateRequest.of(prompt, request=request, **options).to_proto()
        return AsyncGenerationStream(self._stub.Generate(req, timeout=self._deadline(timeout)))

    async def generate(self, prompt: str | None = None, *, request: GenerateRequest | None = None,
                       timeout: float | None = None, **options: Any) -> GenerationResult:
        """Generate a completion and return it whole. See :meth:`Client.generate <client.Client.generate>`."""
        return await self.stream(prompt, request=request, timeout=timeout, **options).collect()

    async def stats(self, *, timeout: float | None = None) -> AcceptanceStats:
        """The server's global acceptance statistics (``GetStats``).

        Raises:
            DFlashError: the call failed (a subclass matching the gRPC status).
        """
        try:
            msg = await self._stub.GetStats(generation_pb2.GetStatsRequest(), timeout=self._deadline(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return AcceptanceStats.from_proto(msg)

    async def info(self, *, timeout: float | None = None) -> ServiceInfo:
        """What the server runs: target model, drafter state, version, scheduler (``Info``).

        Raises:
            DFlashError: the call failed (a subclass matching the gRPC status).
        """
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
