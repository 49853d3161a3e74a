"""What :class:`~client.Client` and :class:`~client.AsyncClient` share: the default address,
the TLS arguments and the per-call deadline."""

from __future__ import annotations

from dflash_grpc.defaults import DEFAULT_ADDRESS  # noqa: F401 (re-exported: the orchestrator on loopback)
from dflash_grpc.transport import TlsConfig, TlsError

from client.errors import InvalidArgumentError


class _Connection:
    """Address, default deadline and TLS settings of a client (see :class:`client.Client`).

    Raises:
        InvalidArgumentError: only one of ``tls_cert`` / ``tls_key``, or a TLS file that cannot be read.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float | None = None, *, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None):
        self.address = address
        self.timeout = timeout
        self.tls = _tls_config(tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._open()

    def _open(self) -> None:
        """Set up the channel (the sync client opens it now, the async one on first use)."""
        raise NotImplementedError

    def _deadline(self, timeout: float | None) -> float | None:
        """The deadline of one call: its own ``timeout``, else the client's."""
        return self.timeout if timeout is None else timeout


def _tls_config(tls: bool, ca: str | None, cert: str | None, key: str | None, server_name: str | None) -> TlsConfig | None:
    """The channel TLS of the clients' TLS arguments (None: plaintext); files read now."""
    if not (tls or ca or cert or key or server_name):
        return None
    try:
        return TlsConfig(cert=cert, key=key, ca=ca, server_name=server_name).check()
    except TlsError as e:
        raise InvalidArgumentError(str(e)) from e
