"""The same-host hop: a service's streaming methods over a Unix socket, beside its gRPC port
(docs/ARCHITECTURE.md, "The same-host hop").

Why: one exchange on a gRPC stream costs grpcio's Python machinery a few thread hand-offs on
each side; measured on an H100 host, a bare echo over a bidirectional stream takes 175-200 us
per exchange and the same bytes over a Unix socket 40 us (``tools/gpu_run.sh hostprof``). A
speculative step makes one or two such exchanges, each on the critical path of every token.

What it is: the service's own gRPC method handlers, reached through the same interceptors as its
gRPC port (token check, drain gate, stream limit, malformed requests as INVALID_ARGUMENT), over a
socket in a directory only the service's user may enter. A client opens a connection per stream,
sends a hello naming the method and carrying the call's metadata (owner, token), and then
exchanges messages: each request is a protobuf message's bytes; each answer is one tag byte and a
payload: ``0x00`` + the reply message, or ``0x01`` + the call's final status as JSON (code,
details, trailing metadata), after which the connection closes. Frames are
:mod:`multiprocessing.connection`'s (a length prefix and the bytes; ``recv_bytes`` only, nothing
is ever unpickled). The service advertises the socket in its Info (``ModelInfo.local_endpoint``,
``unix:PATH#NONCE``); a client on another host does not find the path and keeps gRPC, and the
nonce in the hello's answer proves that the socket belongs to the service that gave the Info.

Stream-stream methods (Verify, Propose) are served as above. A unary-unary method (the target's
Prefill) takes one connection per call: the hello, one request, one answer (the reply, or the
call's status), then the connection closes; while the call runs, the server reads the client's
closing of its side (a timeout, a cancel) as the call's end (:class:`UnaryContext`:
``is_active()`` turns False), as gRPC cancels a call. Anything else is refused UNIMPLEMENTED.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Sequence

import grpc

from dflash_grpc.transport import REASON_KEY

log = logging.getLogger("dflash_grpc.localhop")

#: Tag byte of an answer carrying a reply message.
REPLY = b"\x00"
#: Tag byte of an answer carrying the call's final status (JSON); the connection then closes.
STATUS = b"\x01"
#: Most bytes of a hello (the method name and the call's metadata).
MAX_HELLO_BYTES = 64 << 10
#: Seconds a new connection has to send its hello.
HELLO_TIMEOUT_S = 5.0
#: Prefix of an advertised endpoint.
SCHEME = "unix:"


class HopAborted(Exception):
    """Raised by :meth:`LocalContext.abort`: the call ends with ``code`` and ``details`` (and
    the trailing metadata set before; its reason code: :attr:`reason`)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()):
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, tuple(trailing)

    @property
    def reason(self) -> str:
        """The reason code of the trailing metadata (:data:`dflash_grpc.transport.REASON_KEY`), or ``""``."""
        return next((str(v) for k, v in self.trailing if k == REASON_KEY), "")


class Frames:
    """A reply already in wire form, for the same-host hop only: ``buffers`` (bytes-like,
    contiguous) whose concatenation is the serialised reply message, sent one after the other
    (:func:`send_buffers`, one ``writev``) without joining them; ``keep``: what must stay alive
    until they are sent (e.g. the tensors that the buffers view). A servicer yields one only where
    its context says the hop serves it (:attr:`LocalContext.accepts_frames`): the target's
    columnar Verify reply, whose feature rows (about 1.5 MB a tick at 64 streams) then go from
    the engine's tensors to the socket without being copied into a message, out of it and into
    its serialisation (issue 23)."""

    __slots__ = ("buffers", "keep")

    def __init__(self, buffers: list, keep=None):
        self.buffers = buffers
        self.keep = keep


class LocalContext:
    """The part of ``grpc.ServicerContext`` the project's servicers and interceptors use, for a
    call that does not travel over gRPC (the same-host hop, the in-process target, the HTTP front
    door): metadata, ``abort`` (raises :class:`HopAborted`), trailing metadata, callbacks run once
    when the call ends (:meth:`end`, from any thread; one added after the end runs at once, as
    grpc runs it for a call already over), ``is_active``, ``peer``."""

    #: the caller sends a :class:`Frames` reply as its buffers (True only on the hop's own contexts)
    accepts_frames = False

    def __init__(self, metadata: Sequence[tuple[str, str]] = (), peer: str = "local"):
        self._metadata = tuple(metadata)
        self._peer = peer
        self.trailing: tuple = ()
        self.code: grpc.StatusCode | None = None   # set_code / set_details (a unary handler's status)
        self.details: str | None = None
        self._callbacks: list[Callable[[], Any]] = []
        self._lock = threading.Lock()
        self.active = True

    def invocation_metadata(self):
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def set_trailing_metadata(self, md) -> None:
        self.trailing = tuple(md)

    def set_code(self, code: grpc.StatusCode) -> None:
        """The status a handler that then raises ends with (as the generated servicers' defaults
        set UNIMPLEMENTED); read by the hop's unary calls."""
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def abort(self, code: grpc.StatusCode, details: str):
        raise HopAborted(code, details, self.trailing)

    def add_callback(self, fn: Callable[[], Any]) -> bool:
        with self._lock:
            if self.active:
                self._callbacks.append(fn)
                return True
        fn()
        return False

    def is_active(self) -> bool:
        return self.active

    def time_remaining(self):
        return None

    def end(self) -> None:
        """The call is over: run the callbacks once (idempotent, any thread)."""
        with self._lock:
            self.active = False
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one callback's failure must not skip the others
                log.exception("call-end callback failed")


class UnaryContext(LocalContext):
    """The context of a unary call on the hop: active until the call ends or the client closes
    its side of the connection (after its one request it sends nothing more, so a readable
    socket means its end: a timeout or a cancel). A servicer that checks ``is_active()`` after
    its work, as the target's Prefill does before it keeps the sessions it opened, sees a call
    the client gave up as gRPC shows a cancelled one."""

    def __init__(self, conn: Connection, metadata: Sequence[tuple[str, str]] = (), peer: str = "local"):
        super().__init__(metadata, peer)
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN | select.POLLHUP)

    def is_active(self) -> bool:
        if not self.active:
            return False
        try:
            gone = bool(self._poller.poll(0))
        except OSError:
            gone = True
        if gone:
            self.end()
        return not gone


_Details = collections.namedtuple("_Details", ("method", "invocation_metadata"))


def resolve(interceptors: Sequence[grpc.ServerInterceptor], handlers: Sequence[grpc.GenericRpcHandler],
            method: str, metadata: tuple) -> grpc.RpcMethodHandler | None:
    """The method handler a gRPC server with ``interceptors`` (outermost first) and generic
    ``handlers`` would run for ``method`` called with ``metadata`` (None: no such method)."""
    details = _Details(method, tuple(metadata))

    def base(d):
        for h in handlers:
            found = h.service(d)
            if found is not None:
                return found
        return None

    def chain(i: int):
        if i == len(interceptors):
            return base
        return lambda d: interceptors[i].intercept_service(chain(i + 1), d)

    return chain(0)(details)


def send_frame(conn: Connection, tag: bytes, data: bytes) -> None:
    """Send ``tag + data`` as one frame of :mod:`multiprocessing.connection` (what ``recv_bytes``
    reads), without joining them into a new bytes object: a Verify reply carries every item's
    feature rows (about 1.5 MB at 64 streams), and the join was a copy of all of them per tick."""
    send_buffers(conn, (tag, data))


#: most buffers one ``writev`` takes (POSIX guarantees 16; Linux takes 1024)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16


def send_buffers(conn: Connection, buffers) -> None:
    """Send the concatenation of ``buffers`` (bytes-like, contiguous) as one frame of
    :mod:`multiprocessing.connection` (what ``recv_bytes`` reads), written from each buffer in
    turn (``writev``), not joined first: the orchestrator's Propose carries the feature rows of
    every item straight from the Verify reply that brought them (issue 23)."""
    views = [b if type(b) is bytes or (type(b) is memoryview and b.format == "B" and b.c_contiguous)
             else memoryview(b).cast("B") for b in buffers]   # (as they come where they are bytes already)
    n = sum(map(len, views))
    if n <= 16384:
        conn.send_bytes(b"".join(views))
        return
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    bufs = [memoryview(header), *(v for v in views if len(v))]
    fd = conn.fileno()
    while bufs:
        sent = os.writev(fd, bufs[:_IOV_MAX])
        while bufs and sent >= len(bufs[0]):
            sent -= len(bufs[0])
            bufs.pop(0)
        if bufs and sent:
            bufs[0] = memoryview(bufs[0])[sent:]   # (a view: a bytes piece is not copied)


#: bytes a hop socket may hold in flight each way (``SO_SNDBUF`` / ``SO_RCVBUF``, :func:`widen`): a
#: tick's message of feature rows (about 1.5 MB at 64 streams) then goes in one ``writev`` and is read
#: in one or two ``readv``, not in ~200 KB pieces each a wake of the other side. The kernel caps it at
#: ``net.core.wmem_max`` / ``rmem_max`` (often 208 KB: no change there)
SOCKET_BUFFER_BYTES = 4 << 20

#: Seconds a side of the hop polls its socket without blocking before it blocks in the kernel,
#: when waiting for the other side's next message. A blocked thread is woken by the scheduler, on
#: a core that may have gone to a deep idle state, into cold caches; one that polls answers within
#: microseconds, at the price of a busy core for that long (one stream's step gap is ~1-3 ms). On
#: an H200 host it took the one-stream hop from 0.43-0.50 to 0.28-0.30 ms per step and the default
#: tree from 1,292-1,362 to 1,511-1,547 tok/s (benchmarks/gpu/step/run9). 0 here (block at once);
#: the draft service and the orchestrator turn it on for a CUDA engine (:func:`spin_for_device`),
#: the target service only while its step loop is quiet (:func:`quiet_spin`, :attr:`HopServer.spin`);
#: ``DFLASH_HOP_SPIN_US`` (microseconds) overrides them all. Read at call time.
def _env_spin() -> float | None:
    """``DFLASH_HOP_SPIN_US`` in seconds, or None where it is unset or empty."""
    env = os.environ.get("DFLASH_HOP_SPIN_US")
    return None if env in (None, "") else float(env) * 1e-6


SPIN_S = _env_spin() or 0.0

#: :data:`SPIN_S` for a CUDA engine (:func:`spin_for_device`): the polling window, seconds.
CUDA_SPIN_S = 3e-3


def spin_for_device(device: str) -> float:
    """Set :data:`SPIN_S` for a process whose engine (or whose target's) runs on ``device``
    (e.g. ``"cuda:0"``, ``"cpu"``): :data:`CUDA_SPIN_S` on CUDA, where a step is a few ms and a
    busy core is cheap beside the GPU's time, 0 elsewhere (a CPU engine needs every core);
    ``DFLASH_HOP_SPIN_US`` set in the environment wins. Returns the value set."""
    global SPIN_S
    env = _env_spin()
    SPIN_S = env if env is not None else (CUDA_SPIN_S if str(device).startswith("cuda") else 0.0)
    return SPIN_S


def quiet_spin(device: str, quiet: Callable[[], bool]) -> Callable[[], float] | None:
    """A :attr:`HopServer.spin` for a service whose other threads need the GIL at times (the
    target: its step loop runs prefill chunks beside the hop's streams): :data:`CUDA_SPIN_S`
    while ``quiet()`` holds (asked before each wait), else 0 (block at once). None, which leaves
    :data:`SPIN_S`, where ``DFLASH_HOP_SPIN_US`` is set (it wins in every process) or ``device``
    is not CUDA (a CPU engine needs every core). Why a spin pays: :data:`SPIN_S`'s comment."""
    if _env_spin() is not None or not str(device).startswith("cuda"):
        return None

    def spin() -> float:
        return CUDA_SPIN_S if quiet() else 0.0
    return spin


def spin_wait(poller, seconds: float) -> bool:
    """Poll ``poller`` (a ``select.poll`` with the socket registered) without blocking until it
    reports an event or ``seconds`` pass; returns whether it did (the caller then reads, or
    blocks as it would have)."""
    end = time.perf_counter() + seconds
    while True:
        if poller.poll(0):
            return True
        if time.perf_counter() >= end:
            return False


def on_socket(conn: Connection, fn: Callable[[socket.socket], Any]) -> None:
    """``fn`` on a socket object for ``conn``'s socket (a duplicate descriptor of it, closed after);
    best effort: an ``OSError`` (a connection already closed, not a socket, ...) is ignored."""
    try:
        fd = os.dup(conn.fileno())
    except OSError:
        return
    try:
        s = socket.socket(fileno=fd)
    except OSError:   # (not a socket)
        os.close(fd)
        return
    try:
        fn(s)
    except OSError:
        pass
    finally:
        s.close()


def widen(conn: Connection, nbytes: int = SOCKET_BUFFER_BYTES) -> None:
    """Ask for ``nbytes`` of socket buffer each way on ``conn``'s socket (best effort: the kernel
    caps it; an error, e.g. not a socket, leaves it as it was)."""
    def grow(s: socket.socket) -> None:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            if s.getsockopt(socket.SOL_SOCKET, opt) < nbytes:
                s.setsockopt(socket.SOL_SOCKET, opt, nbytes)

    on_socket(conn, grow)


def recv_frame(conn: Connection, maxsize: int | None = None) -> memoryview:
    """One frame of :mod:`multiprocessing.connection` (what ``send_bytes`` or :func:`send_buffers`
    send): the bytes ``conn.recv_bytes(maxsize)`` returns, as a ``memoryview`` (format ``B``) of a
    new buffer of the frame's size, read straight into it (``readv``) and not zeroed first (numpy's
    ``empty`` where numpy is importable). ``recv_bytes`` reads a large frame in pieces, each into
    a new bytes object of the whole remaining size, copied again into a growing ``BytesIO`` (for
    the Verify reply of 64 streams, 1.5 MB a tick, about 0.5 ms of the orchestrator's CPU against
    0.3 here; a zeroed buffer costs another 0.2).

    Raises:
        EOFError: the other side closed the connection before the frame began.
        OSError: it closed during the frame ("got end of file during message"); a frame larger
            than ``maxsize`` ("bad message length": its bytes are left unread), or a socket error.
    """
    fd = conn.fileno()
    head = _read_exact(fd, 4, eof=EOFError)
    size, = struct.unpack("!i", head)
    if size == -1:
        size, = struct.unpack("!Q", _read_exact(fd, 8))
    if size < 0 or (maxsize is not None and size > maxsize):
        raise OSError("bad message length")
    return _read_exact(fd, size)


def _buffer(size: int) -> memoryview:
    """A writable ``memoryview`` (format ``B``) of ``size`` new bytes, not zeroed where numpy is
    importable (a zeroed bytearray of 1.5 MB costs ~0.2 ms to clear)."""
    if size >= 1 << 16:
        try:
            import numpy
        except ImportError:
            pass
        else:
            return memoryview(numpy.empty(size, numpy.uint8)).cast("B")
    return memoryview(bytearray(size))


def _read_exact(fd: int, size: int, eof=None) -> memoryview:
    """``size`` bytes from ``fd`` into a new buffer (:func:`_buffer`). ``eof``: raised when the
    stream ends before the first byte; after it, or with no ``eof``: OSError."""
    view = _buffer(size)
    got = 0
    while got < size:
        n = os.readv(fd, (view[got:],))
        if not n:
            if got == 0 and eof is not None:
                raise eof
            raise OSError("got end of file during message")
        got += n
    return view


def _status_frame(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> bytes:
    return STATUS + json.dumps({"code": code.value[0], "details": details,
                                "trailing": [[str(k), v if isinstance(v, str) else v.decode("utf-8", "replace")]
                                             for k, v in trailing]}).encode()


def parse_status(payload: bytes) -> tuple[grpc.StatusCode, str, tuple]:
    """``(code, details, trailing metadata)`` of a status answer's JSON payload (tag removed)."""
    body = json.loads(payload.decode("utf-8"))
    code = next((c for c in grpc.StatusCode if c.value[0] == body.get("code")), grpc.StatusCode.UNKNOWN)
    return code, str(body.get("details", "")), tuple((str(k), str(v)) for k, v in body.get("trailing", ()))


class HopServer:
    """Serve the stream-stream and unary-unary methods of a gRPC server's handlers on a Unix
    socket (module docstring). Made by :func:`dflash_grpc.serving.make_server` (``local_hop=True``).

    Args:
        interceptors: the gRPC server's interceptors, outermost first.
        handlers: its generic RPC handlers (the registered services).
        max_receive_bytes: most bytes of one request message; a larger one ends its call
            RESOURCE_EXHAUSTED (the length prefix is checked before the bytes are read).
        max_connections: most connections at a time; one more is answered RESOURCE_EXHAUSTED.

    Attributes:
        endpoint: ``unix:PATH#NONCE`` (empty until :meth:`start`).
        spin: None (a stream waits :data:`SPIN_S` for its next request before blocking) or a
            callable giving that window in seconds, asked before each wait (:func:`quiet_spin`).
    """

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor], handlers: Sequence[grpc.GenericRpcHandler],
                 *, max_receive_bytes: int, max_connections: int = 64):
        self.interceptors = list(interceptors)
        self.handlers = list(handlers)
        self.max_receive_bytes = int(max_receive_bytes)
        self.max_connections = int(max_connections)
        self.endpoint = ""
        self._dir: str | None = None
        self._sock: socket.socket | None = None
        self._nonce = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stopped = threading.Event()
        self.spin: Callable[[], float] | None = None

    def start(self) -> str:
        """Create the socket (in a new directory of mode 0700) and start accepting; returns
        :attr:`endpoint`."""
        self._dir = tempfile.mkdtemp(prefix="dflash-hop-")
        os.chmod(self._dir, 0o700)
        path = os.path.join(self._dir, "hop.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(64)
        self._sock = sock
        self.endpoint = f"{SCHEME}{path}#{self._nonce}"
        threading.Thread(target=self._accept, name="hop-accept", daemon=True).start()
        return self.endpoint

    def stop(self) -> None:
        """Stop accepting, end every connection (their calls see the stream end) and remove the
        socket's directory. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                s, _ = self._sock.accept()
            except OSError:
                return   # closed by stop()
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(s)
            if full:
                conn = Connection(s.detach())
                try:
                    conn.send_bytes(_status_frame(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                  f"all {self.max_connections} local connections are busy; retry later",
                                                  ((REASON_KEY, "STREAMS_BUSY"),)))
                except OSError:
                    pass
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(s,), name="hop-conn", daemon=True).start()

    def _serve(self, s: socket.socket) -> None:
        # the socket object stays open for stop()'s shutdown; the connection reads a dup of it
        conn = Connection(os.dup(s.fileno()))
        widen(conn)
        try:
            self._serve_conn(conn)
        except (OSError, EOFError):
            pass   # the client went away, or stop() ended the connection
        except Exception:  # noqa: BLE001 - one connection's failure must not end the others
            log.exception("local hop connection failed")
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(s)
            s.close()

    def _serve_conn(self, conn: Connection) -> None:
        if not conn.poll(HELLO_TIMEOUT_S):
            return
        try:
            hello = json.loads(conn.recv_bytes(MAX_HELLO_BYTES).decode("utf-8"))
            method = str(hello["method"])
            metadata = tuple((str(k), str(v)) for k, v in hello.get("metadata", ()))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            conn.send_bytes(_status_frame(grpc.StatusCode.INVALID_ARGUMENT, f"malformed hello: {e}"))
            return
        handler = resolve(self.interceptors, self.handlers, method, metadata)
        unary = handler is not None and not handler.request_streaming and not handler.response_streaming
        if handler is None or not (unary or (handler.request_streaming and handler.response_streaming)):
            conn.send_bytes(_status_frame(grpc.StatusCode.UNIMPLEMENTED, f"{method}: not served on the local hop"))
            return
        conn.send_bytes(REPLY + json.dumps({"nonce": self._nonce}).encode())
        if unary:
            self._serve_unary(conn, handler, method, metadata)
            return
        parse = handler.request_deserializer
        serialize = handler.response_serializer
        ctx = LocalContext(metadata, peer="unix:local-hop")
        ctx.accepts_frames = True   # (a Frames reply is sent as its buffers, below)
        limit = self.max_receive_bytes

        poller = None

        def requests() -> Iterator:
            nonlocal poller
            while True:
                fn = self.spin   # (read once: another thread may set it)
                spin = SPIN_S if fn is None else fn()
                if spin > 0:   # the next request, polled for before blocking (SPIN_S, or self.spin)
                    if poller is None:
                        poller = select.poll()
                        poller.register(conn.fileno(), select.POLLIN)
                    spin_wait(poller, spin)
                try:
                    raw = recv_frame(conn, limit)
                except EOFError:
                    return   # the client closed its side: the request stream ends
                except OSError as e:
                    if "bad message length" in str(e):
                        ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"request message larger than {limit} bytes")
                    return
                yield parse(raw) if parse is not None else raw   # (a view: the method decodes it, e.g. FromString)

        status = (grpc.StatusCode.OK, "", ())
        try:
            for reply in handler.stream_stream(requests(), ctx):
                if type(reply) is Frames:   # already wire bytes, in pieces
                    send_buffers(conn, (REPLY, *reply.buffers))
                    continue
                data = serialize(reply) if serialize is not None else reply
                send_frame(conn, REPLY, data)
        except HopAborted as e:
            status = (e.code, e.details, e.trailing)
        except (OSError, EOFError):
            status = None   # the client is gone: nothing to send
        except Exception as e:  # noqa: BLE001 - the handler failed: INTERNAL, as grpc answers
            log.exception("local hop handler failed", extra={"method": method})
            status = (grpc.StatusCode.UNKNOWN, f"Exception iterating responses: {e}", ())
        finally:
            ctx.end()
        if status is not None:
            try:
                conn.send_bytes(_status_frame(*status))
            except OSError:
                pass


    def _serve_unary(self, conn: Connection, handler: grpc.RpcMethodHandler, method: str, metadata: tuple) -> None:
        """One unary call on ``conn`` (module docstring): its request (within
        :data:`HELLO_TIMEOUT_S` of the hello, else the connection closes), the handler's reply or
        status as the answer; the connection then closes."""
        if not conn.poll(HELLO_TIMEOUT_S):
            return   # a hello and then nothing: its thread and connection slot are not held
        try:
            raw = recv_frame(conn, self.max_receive_bytes)
        except EOFError:
            return   # the client went away before its request
        except OSError as e:
            if "bad message length" in str(e):
                conn.send_bytes(_status_frame(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                              f"request message larger than {self.max_receive_bytes} bytes"))
            return
        ctx = UnaryContext(conn, metadata, peer="unix:local-hop")
        parse, serialize = handler.request_deserializer, handler.response_serializer
        try:
            try:
                request = parse(raw) if parse is not None else raw
            except Exception as e:  # noqa: BLE001 - as gRPC answers a request that does not decode
                raise HopAborted(grpc.StatusCode.INTERNAL, f"Exception deserializing request: {e}") from None
            reply = handler.unary_unary(request, ctx)
            answer = (REPLY, serialize(reply) if serialize is not None else reply)
        except HopAborted as e:
            answer = (_status_frame(e.code, e.details, e.trailing),)
        except Exception as e:  # noqa: BLE001 - the handler failed: as grpc answers
            if ctx.code is not None:   # (a status the handler set before it raised: e.g. UNIMPLEMENTED)
                answer = (_status_frame(ctx.code, ctx.details or "", ctx.trailing),)
            else:
                log.exception("local hop handler failed", extra={"method": method})
                answer = (_status_frame(grpc.StatusCode.UNKNOWN, f"Exception calling application: {e}"),)
        finally:
            ctx.end()
        try:
            send_buffers(conn, answer)   # (the reply's bytes are not copied behind its tag)
        except OSError:
            pass   # the client is gone


def endpoint_path(endpoint: str) -> tuple[str, str] | None:
    """``(path, nonce)`` of an advertised endpoint (``unix:PATH#NONCE``), or None when it is
    empty, of another form, or its path does not exist here (another host)."""
    if not endpoint.startswith(SCHEME):
        return None
    path, _, nonce = endpoint[len(SCHEME):].partition("#")
    if not path or not nonce or not os.path.exists(path):
        return None
    return path, nonce


__all__ = ["CUDA_SPIN_S", "Frames", "HopAborted", "HopServer", "LocalContext", "REPLY", "SPIN_S", "STATUS", "UnaryContext",
           "endpoint_path",
           "on_socket", "parse_status", "quiet_spin", "recv_frame", "resolve", "send_buffers", "send_frame", "spin_for_device",
           "spin_wait", "widen"]
