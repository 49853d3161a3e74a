"""The blocking client: :class:`Client` and the iterator of one streamed call, :class:`GenerationStream`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
from dflash_grpc.transport import open_channel
from dflash_grpc.v1 import generation_pb2, generation_pb2_grpc

from client._connection import _Connection
from client.errors import from_rpc_error
from client.types import AcceptanceStats, GenerateRequest, GenerationChunk, GenerationResult, ServiceInfo, _Collector

__all__ = ["Client", "GenerationStream"]


class GenerationStream(Iterator[GenerationChunk]):
    """Iterator over the chunks of one streaming ``Generate`` call (from :meth:`Client.stream`).

    After the last chunk, :attr:`result` holds the whole :class:`GenerationResult` (stats
    included). :meth:`cancel` (or leaving a ``with`` block early) cancels the call.

    Iterating raises a :class:`~client.errors.DFlashError` when the call fails, and
    :class:`~client.errors.InternalError` when the stream ends without a final message.
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


class Client(_Connection):
    """Blocking client of the orchestrator's ``GenerationService``.

    Args:
        address: ``host:port`` of the orchestrator (default ``127.0.0.1:50051``).
        timeout: default deadline of every call, in seconds (None: no deadline). A per-call
            ``timeout`` overrides it; an expired deadline raises :class:`DeadlineExceededError`.
        tls: connect over TLS (implied by any ``tls_*`` argument). Default: plaintext.
        tls_ca: PEM file of the CA the server's certificate must chain to (None: the system's roots).
        tls_cert, tls_key: PEM files of a client certificate and its key, for a server that
            requires mutual TLS (give both).
        tls_server_name: name the server's certificate is checked against instead of the
            address's host (e.g. a certificate for ``orchestrator.internal`` reached by IP).

    Messages are limited to 256 MiB each way (a larger one: :class:`ResourceExhaustedError`).
    Use as a context manager, or call :meth:`close`. One client may be shared between threads.

    Raises:
        InvalidArgumentError: only one of ``tls_cert`` / ``tls_key``, or a TLS file that cannot be read.
    """

    def _open(self) -> None:
        self._channel = open_channel(self.address, self.tls)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)

    def stream(self, prompt: str | None = None, *, request: GenerateRequest | None = None, timeout: float | None = None,
               **options: Any) -> GenerationStream:
        """Start a generation and return a :class:`GenerationStream` of its chunks.

        Arguments are those of :meth:`generate`. Argument errors are raised here; call errors
        surface while iterating. After the last chunk, ``stream.result`` holds the whole
        :class:`GenerationResult`.
        """
        req = GenerateRequest.of(prompt, request=request, **options).to_proto()
        return GenerationStream(self._stub.Generate(req, timeout=self._deadline(timeout)))

    def generate(self, prompt: str | None = None, *, request: GenerateRequest | None = None, timeout: float | None = None,
                 **options: Any) -> GenerationResult:
        """Generate a completion and return it whole.

        ``c.generate("def f(x):", max_tokens=64)``, ``c.generate(messages=[...], temperature=0.7)``,
        or with a prepared request: ``c.generate(request=GenerateRequest(tokens=ids, seed=1))``.

        Args:
            prompt: raw text, tokenized as is (or give ``tokens=`` / ``messages=`` as options).
            request: the whole request, instead of keyword options (``prompt``, when given, is
                its input: a request without one serves as a template of options).
            timeout: deadline of this call in seconds (None: the client's default).
            **options: the fields of :class:`GenerateRequest` (``tokens``, ``messages``,
                ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``,
                ``ignore_eos``, ``speculative``, ``tree_budget``, ``top_k_draft``, ``max_depth``,
                ``request_id``), with its defaults.

        Raises:
            TypeError: an unknown option (every unknown one is named), or ``request`` together
                with keyword options.
            InvalidArgumentError: not exactly one input, or a bad value (checked before any call).
            DFlashError: the call failed: a subclass matching the gRPC status, e.g.
                :class:`InvalidArgumentError`, :class:`DeadlineExceededError`, :class:`UnavailableError`.
        """
        return self.stream(prompt, request=request, timeout=timeout, **options).collect()

    def stats(self, *, timeout: float | None = None) -> AcceptanceStats:
        """The server's global acceptance statistics (``GetStats``).

        Raises:
            DFlashError: the call failed (a subclass matching the gRPC status).
        """
        try:
            msg = self._stub.GetStats(generation_pb2.GetStatsRequest(), timeout=self._deadline(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return AcceptanceStats.from_proto(msg)

    def info(self, *, timeout: float | None = None) -> ServiceInfo:
        """What the server runs: target model, drafter state, version, scheduler (``Info``).

        Raises:
            DFlashError: the call failed (a subclass matching the gRPC status).
        """
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
