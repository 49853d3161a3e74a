"""Transport settings of every gRPC server and channel of the project: message-size limits and TLS.

This module imports only ``grpc`` (not torch), so that the SDK (``client``) shares it with the
services.

**Message size.** Every server (:func:`dflash_grpc.serving.make_server`) and every channel (the
orchestrator's peers through :func:`dflash_grpc.serving.channel`, the SDK's ``Client`` and
``AsyncClient``) sets :data:`GRPC_OPTIONS`: at most :data:`MAX_MESSAGE_BYTES` (256 MiB) per
message, sent or received. gRPC's own defaults (4 MiB received, unlimited sent) are too small
for prompt features (``rows * N * hidden * 2`` bytes) and differ between the two directions. A
larger message fails its call with ``RESOURCE_EXHAUSTED``: the sender refuses to send it, or
the receiver refuses it after reading its length prefix.

**TLS.** :class:`TlsConfig` names PEM files. A server with a certificate and key serves TLS; with
a CA as well it requires client certificates signed by that CA (mutual TLS). A channel with a
CA trusts only that CA (without one: the system's roots); with a certificate and key as well it
presents them (mutual TLS); ``server_name`` overrides the name the server's certificate is
checked against (default: the host of the address). Plain connections stay the default on
loopback; the services refuse to listen on another interface without TLS unless ``--insecure``
is given (:func:`dflash_grpc.serving.server_tls_from_args`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from typing import Any

import grpc

#: Most bytes in one message, sent or received, on every channel and server of the project.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

#: Trailing-metadata key of a refused call's structured reason code (``runtime.errors.Reason``
#: names, e.g. ``NO_FREE_SLOT``): callers branch on it, never on the message text. Items of a
#: batched stream carry the same code in ``ItemStatus.reason``.
REASON_KEY = "dflash-reason"

#: Channel / server options that set :data:`MAX_MESSAGE_BYTES` in both directions.
GRPC_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

#: File names :meth:`TlsConfig.from_dir` reads (``dflash-grpc serve --tls-dir``).
TLS_DIR_FILES = {
    "ca": "ca.pem",
    "server_cert": "server.pem",
    "server_key": "server-key.pem",
    "client_cert": "client.pem",
    "client_key": "client-key.pem",
}


class TlsError(ValueError):
    """A TLS setting is incomplete or a PEM file cannot be read."""


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """PEM files of one side of a TLS connection (paths; read when credentials are built).

    Attributes:
        cert: certificate chain. Server: its certificate (required). Client: its client
            certificate, presented for mutual TLS (optional).
        key: private key of ``cert`` (given together with it).
        ca: CA certificates. Server: client certificates are required and checked against them
            (mutual TLS); None: no client certificate asked. Client: the roots the server's
            certificate is checked against; None: the system's roots.
        server_name: client only: the name the server's certificate must carry, instead of the
            host of the address (e.g. a certificate for ``target.internal`` reached by IP).

    Raises:
        TlsError: only one of ``cert`` / ``key`` given.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsError("a TLS certificate and its private key go together: give both or neither")

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], role: str, server_name: str | None = None) -> TlsConfig:
        """The files of :data:`TLS_DIR_FILES` in directory ``path`` for ``role``.

        ``"server"``: ``server.pem`` / ``server-key.pem``, client certificates required and
        checked against ``ca.pem``. ``"client"``: trusts ``ca.pem``, presents ``client.pem`` /
        ``client-key.pem``.
        """
        if role not in ("server", "client"):
            raise ValueError(f"role must be 'server' or 'client', not {role!r}")
        f = {k: os.path.join(os.fspath(path), v) for k, v in TLS_DIR_FILES.items()}
        return cls(cert=f[f"{role}_cert"], key=f[f"{role}_key"], ca=f["ca"], server_name=server_name)

    def _read(self, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise TlsError(f"cannot read TLS file {path}: {e.strerror or e}") from e
        if b"-----BEGIN" not in data:
            raise TlsError(f"TLS file {path} is not PEM (no -----BEGIN line)")
        return data

    def check(self) -> TlsConfig:
        """Read every file now (so a service fails at start, not at its first connection); returns self.

        Raises:
            TlsError: a file cannot be read or is not PEM.
        """
        for p in (self.cert, self.key, self.ca):
            self._read(p)
        return self

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials: ``cert``/``key``; client certificates required iff ``ca`` is set.

        Raises:
            TlsError: no certificate, or a file cannot be read.
        """
        if self.cert is None:
            raise TlsError("serving TLS needs a certificate and its private key")
        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))],
            root_certificates=self._read(self.ca),
            require_client_auth=self.ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials: trust ``ca`` (None: system roots), present ``cert``/``key`` if set."""
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca),
            private_key=self._read(self.key),
            certificate_chain=self._read(self.cert),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        """:data:`GRPC_OPTIONS`, plus the target-name override when ``server_name`` is set."""
        extra = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return [*GRPC_OPTIONS, *extra]


def open_channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A channel to ``address`` with :data:`GRPC_OPTIONS`: TLS per ``tls``, plain when None."""
    if tls is None:
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())


def open_aio_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """Like :func:`open_channel`, for ``grpc.aio`` (call inside the running event loop)."""
    import grpc.aio

    if tls is None:
        return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())


def is_loopback(host: str) -> bool:
    """True for ``localhost``, ``127.0.0.0/8`` and ``::1`` (brackets allowed); False for every other
    host, the wildcards ``0.0.0.0`` / ``::`` / ``""`` included."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def abort(context, code: grpc.StatusCode, message: str, reason: str = ""):
    """End the call of ``context`` with status ``code``, ``message`` and the reason code
    ``reason`` in its trailing metadata (:data:`REASON_KEY`; none when ``reason`` is empty).

    With a ``grpc.ServicerContext`` this raises (grpc's own abort) and never returns. With a
    ``grpc.aio.ServicerContext`` it returns the coroutine of the abort: ``await abort(...)``.
    """
    if reason:
        context.set_trailing_metadata(((REASON_KEY, str(reason)),))
    return context.abort(code, message)


def reason_of(error: Any) -> str:
    """The reason code a refused call carried (:data:`REASON_KEY` of its trailing metadata), or
    ``""`` when it carried none (an older peer, or a status grpc made itself: deadline,
    connection lost). ``error`` is a ``grpc.RpcError`` (a ``grpc.Call``), sync or ``grpc.aio``;
    anything without trailing metadata gives ``""``."""
    getter = getattr(error, "trailing_metadata", None)
    if getter is None:
        return ""
    try:
        md = getter()
    except Exception:  # noqa: BLE001 - a call object in an odd state: no reason
        return ""
    for key, value in md or ():
        if key == REASON_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""
