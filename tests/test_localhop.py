"""The same-host hop (dflash_grpc.localhop; orchestrator.peers.LocalHopCall / open_local): the
same answers as gRPC, through the same checks (token, drain, stream limit, malformed and
oversized requests), a precise timeout, and an end that every connection sees."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from dflash_grpc import serving
from dflash_grpc.localhop import endpoint_path
from dflash_grpc.transport import REASON_KEY
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from orchestrator.peers import (ExchangeTimeout, HopFuture, HopRefused, LocalHopCall, StreamError, hop_unary, open_local,
                                open_stream)

METHOD = "/dflash_grpc.v1.DraftService/Propose"
TOKEN = "a-test-token-of-enough-characters-0123456789"


class Echo(draft_pb2_grpc.DraftServiceServicer):
    """Answers each item with the tree [root, committed_length]; session "slow" sleeps first,
    "abort" ends the call FAILED_PRECONDITION with a reason; records each stream's end."""

    def __init__(self):
        self.ended = threading.Event()
        self.gone = threading.Event()   # a unary call (Release of "wait") saw its client go

    def Release(self, request, context):
        """Unary (served on the hop since Prefill is): "abort" ends FAILED_PRECONDITION with a
        reason; "wait" waits until the client gives up (``is_active()`` False, at most 10 s)."""
        if "abort" in request.session_ids:
            serving.abort(context, grpc.StatusCode.FAILED_PRECONDITION, "no such thing", "SOME_REASON")
        if "sleep" in request.session_ids:
            time.sleep(0.5)
        if "wait" in request.session_ids:
            deadline = time.monotonic() + 10
            while context.is_active() and time.monotonic() < deadline:
                time.sleep(0.01)
            if not context.is_active():
                self.gone.set()
        return common_pb2.ReleaseResponse(released=len(request.session_ids))

    def Propose(self, requests, context):
        context.add_callback(self.ended.set)
        for req in requests:
            reply = draft_pb2.ProposeResponse(compute_s=0.001)
            for it in req.items:
                if it.session_id == "slow":
                    time.sleep(0.5)
                if it.session_id == "abort":
                    serving.abort(context, grpc.StatusCode.FAILED_PRECONDITION, "no such thing", "SOME_REASON")
                r = reply.results.add(session_id=it.session_id)
                r.tree.tokens.extend([it.root_token, it.committed_length])
                r.tree.parents.extend([-1, 0])
            yield reply


def _serve(**kw):
    echo = Echo()

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(echo, server)
        return ["dflash_grpc.v1.DraftService"]

    server, health, port = serving.make_server(add, "127.0.0.1:0", local_hop=True, **kw)
    return echo, server, health, port


@pytest.fixture
def hop():
    echo, server, health, port = _serve(max_workers=4)
    yield echo, server, health, port
    server.stop(None)
    serving.stop_local_hop(server)


def _request(sid: str = "s", root: int = 5, length: int = 9, pad: int = 0) -> draft_pb2.ProposeRequest:
    req = draft_pb2.ProposeRequest()
    it = req.items.add(session_id=sid, root_token=root, committed_length=length)
    if pad:
        it.features.data = b"\0" * pad
    return req


def _open(server, metadata=()):
    return open_local(serving.local_endpoint(server), METHOD, draft_pb2.ProposeResponse.FromString, metadata)


def test_same_answers_as_grpc(hop):
    _, server, _, port = hop
    endpoint = serving.local_endpoint(server)
    assert endpoint.startswith("unix:") and endpoint_path(endpoint) is not None
    call = _open(server)
    assert isinstance(call, LocalHopCall)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = draft_pb2_grpc.DraftServiceStub(channel)
    over_grpc = open_stream(channel, METHOD, stub.Propose, draft_pb2.ProposeResponse.FromString)
    for i in range(5):
        req = _request(f"s{i}", root=i, length=10 + i, pad=100 * i)
        assert call.exchange(req, timeout=5.0) == over_grpc.exchange(req, timeout=5.0)
    call.close()
    over_grpc.close()
    channel.close()


def test_item_abort_becomes_the_status_with_its_reason(hop):
    _, server, _, _ = hop
    call = _open(server)
    with pytest.raises(StreamError) as e:
        call.exchange(_request("abort"), timeout=5.0)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("dflash-reason", "SOME_REASON") in e.value.trailing_metadata()
    assert call.broken
    with pytest.raises(StreamError):   # every later exchange raises the same
        call.exchange(_request(), timeout=5.0)


def test_timeout_closes_the_stream_and_the_service_sees_its_end(hop):
    echo, server, _, _ = hop
    call = _open(server)
    t0 = time.perf_counter()
    with pytest.raises(ExchangeTimeout):
        call.exchange(_request("slow"), timeout=0.05)
    assert time.perf_counter() - t0 < 0.4   # within ms of the deadline, not after the reply
    assert call.broken
    assert echo.ended.wait(5.0)   # the servicer's call ended (its callbacks ran): no lease held


def test_token_is_checked_as_on_grpc():
    echo, server, _, _ = _serve(auth_token=TOKEN)
    try:
        # as a gRPC stream: it opens, and its first exchange is refused before the method runs
        call = _open(server, metadata=(("authorization", "Bearer wrong-token-wrong-token-wrong-token"),))
        with pytest.raises(StreamError) as e:
            call.exchange(_request(), timeout=5.0)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not echo.ended.is_set()   # the servicer never ran
        call = _open(server, metadata=(("authorization", serving.bearer(TOKEN)),))
        assert call.exchange(_request(), timeout=5.0).results[0].tree.tokens[:] == [5, 9]
        call.close()
    finally:
        server.stop(None)
        serving.stop_local_hop(server)


def test_oversized_and_malformed_requests_end_their_own_stream_only():
    _, server, _, _ = _serve(max_receive_bytes=2000)
    try:
        other = _open(server)
        big = _open(server)
        with pytest.raises(StreamError) as e:
            big.exchange(_request(pad=5000), timeout=5.0)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        bad = _open(server)
        bad._conn.send_bytes(b"\xff\xff\xff garbage")
        assert bad._conn.poll(5.0)
        with pytest.raises(StreamError) as e:
            bad.exchange(_request(), timeout=5.0)   # the status answer of the garbage is read first
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert other.exchange(_request(), timeout=5.0).results[0].session_id == "s"
    finally:
        server.stop(None)
        serving.stop_local_hop(server)


def test_stream_limit_and_unknown_method(hop):
    _, server, _, _ = hop   # max_workers=4: four streams at once
    calls = [_open(server) for _ in range(4)]
    for c in calls:
        c.exchange(_request(), timeout=5.0)   # each stream holds its worker once it runs
    with pytest.raises(StreamError) as e:
        _open(server).exchange(_request(), timeout=5.0)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    calls[0].close()
    deadline = time.monotonic() + 5
    while True:   # the closed stream's worker comes back
        try:
            call = _open(server)
            call.exchange(_request(), timeout=5.0)
            call.close()
            break
        except StreamError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with pytest.raises(StreamError) as e:
        open_local(serving.local_endpoint(server), "/dflash_grpc.v1.DraftService/NoSuchMethod",
                   draft_pb2.DrafterInfo.FromString)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


RELEASE = "/dflash_grpc.v1.DraftService/Release"


def test_unary_call_answers_as_grpc_and_sees_its_client_go(hop):
    """A unary method (the target's Prefill goes this way) over the hop: the reply gRPC gives,
    the handler's status with its reason, and a client that times out ends the call for the
    handler (``is_active()`` False), as a cancelled gRPC call does."""
    echo, server, _, port = hop
    endpoint = serving.local_endpoint(server)
    req = common_pb2.ReleaseRequest(session_ids=["a", "b", "c"])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        over_grpc = draft_pb2_grpc.DraftServiceStub(ch).Release(req, timeout=5)
    over_hop = hop_unary(endpoint, RELEASE, req, common_pb2.ReleaseResponse.FromString, 5.0)
    assert over_hop == over_grpc and over_hop.released == 3
    with pytest.raises(StreamError) as e:
        hop_unary(endpoint, RELEASE, common_pb2.ReleaseRequest(session_ids=["abort"]),
                  common_pb2.ReleaseResponse.FromString, 5.0)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no such thing" in e.value.details()
    assert dict(e.value.trailing_metadata()).get(REASON_KEY) == "SOME_REASON"
    t0 = time.monotonic()
    with pytest.raises(ExchangeTimeout):
        hop_unary(endpoint, RELEASE, common_pb2.ReleaseRequest(session_ids=["wait"]),
                  common_pb2.ReleaseResponse.FromString, 0.3)
    assert time.monotonic() - t0 < 3
    assert echo.gone.wait(5), "the handler did not see its client go"
    # a hop not on this host: None (the caller uses gRPC)
    assert hop_unary("unix:/nonexistent/hop.sock#00", RELEASE, req, common_pb2.ReleaseResponse.FromString, 1.0) is None


def test_draining_refuses_and_stop_ends_every_connection(hop):
    _, server, health, _ = hop
    endpoint = serving.local_endpoint(server)
    path = endpoint_path(endpoint)[0]
    open_call = _open(server)
    open_call.exchange(_request(), timeout=5.0)
    serving.start_draining(server, health)
    with pytest.raises(StreamError) as e:
        _open(server).exchange(_request(), timeout=5.0)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    serving.stop_local_hop(server)
    with pytest.raises(grpc.RpcError) as e:
        open_call.exchange(_request(), timeout=5.0)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not os.path.exists(path)
    assert endpoint_path(endpoint) is None   # a client now finds no hop (as on another host)
    assert open_local(endpoint, METHOD, draft_pb2.ProposeResponse.FromString) is None


def test_another_services_socket_is_refused(hop):
    _, server, _, _ = hop
    endpoint = serving.local_endpoint(server)
    forged = endpoint.rsplit("#", 1)[0] + "#0123456789abcdef"
    with pytest.raises(StreamError) as e:
        open_local(forged, METHOD, draft_pb2.ProposeResponse.FromString)
    assert "another service" in e.value.details()


def test_connections_beyond_the_cap_are_refused_at_once():
    from multiprocessing.connection import Client

    _, server, _, _ = _serve(max_workers=1)   # at most 1 + 8 connections
    try:
        path = endpoint_path(serving.local_endpoint(server))[0]
        idle = [Client(path, family="AF_UNIX") for _ in range(9)]   # connected, never a hello
        time.sleep(0.2)
        with pytest.raises(StreamError) as e:
            _open(server)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for c in idle:
            c.close()
    finally:
        server.stop(None)
        serving.stop_local_hop(server)


def test_on_sent_runs_once_between_the_send_and_the_reply(hop):
    """Every stream kind calls ``on_sent`` once per exchange, after the request left and before
    the reply is read (the scheduler hands tokens to handlers there), failures included."""
    echo, server, _, port = hop
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = draft_pb2_grpc.DraftServiceStub(channel)
    for call in (_open(server), open_stream(channel, METHOD, stub.Propose, draft_pb2.ProposeResponse.FromString),
                 open_stream(channel, METHOD, stub.Propose, draft_pb2.ProposeResponse.FromString, direct=False)):
        marks = []
        t0 = time.perf_counter()
        reply = call.exchange(_request("slow"), timeout=5.0, on_sent=lambda: marks.append(time.perf_counter()))
        assert reply.results[0].session_id == "slow"
        assert len(marks) == 1 and marks[0] - t0 < 0.4   # before the 0.5 s the reply took
        with pytest.raises(grpc.RpcError):
            call.exchange(_request("abort"), timeout=5.0, on_sent=lambda: marks.append(0.0))
        call.close()
        with pytest.raises(grpc.RpcError):   # a closed stream: called all the same
            call.exchange(_request(), timeout=5.0, on_sent=lambda: marks.append(0.0))
        assert len(marks) == 3
    channel.close()


@pytest.mark.parametrize("size", [0, 100, 16383, 16384, 1 << 20])
def test_send_frame_is_one_frame_of_tag_and_data(size):
    """A reply goes out as one ``recv_bytes`` frame of its tag and bytes, small or large (the
    large ones are written without joining them first)."""
    import socket
    from multiprocessing.connection import Connection

    from dflash_grpc.localhop import REPLY, send_frame

    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    data = os.urandom(size)
    done = threading.Thread(target=send_frame, args=(sender, REPLY, data))
    done.start()
    assert receiver.recv_bytes() == REPLY + data
    done.join()
    sender.close()
    receiver.close()


@pytest.mark.parametrize("sizes", [[0, 3], [5000, 0, 9000, 4000], [1 << 20, 7, 0, 300_000], [700] * 1500])
def test_send_buffers_is_one_frame_of_them_all(sizes):
    """The orchestrator's Propose goes out in pieces (its head, then each item's feature rows as
    views of the Verify reply): one ``recv_bytes`` frame of them all, in order, whatever their
    sizes and count (more than one writev takes)."""
    import socket
    from multiprocessing.connection import Connection

    from dflash_grpc.localhop import send_buffers

    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    whole = os.urandom(sum(sizes) + 10)
    view, pieces, o = memoryview(whole), [], 5
    for i, n in enumerate(sizes):
        pieces.append(view[o:o + n] if i % 2 else bytes(view[o:o + n]))
        o += n
    done = threading.Thread(target=send_buffers, args=(sender, pieces))
    done.start()
    assert receiver.recv_bytes() == whole[5:5 + sum(sizes)]
    done.join()
    sender.close()
    receiver.close()


def test_recv_frame_reads_what_recv_bytes_reads():
    """recv_frame (the orchestrator's replies, the services' requests) reads each frame's bytes
    as recv_bytes does, small or large, frame after frame of one connection; refuses a frame
    over its maxsize as recv_bytes does; EOFError at a clean end, OSError in a cut frame."""
    import socket
    import struct
    from multiprocessing.connection import Connection

    from dflash_grpc.localhop import recv_frame, send_buffers, widen

    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    widen(sender)
    widen(receiver)
    frames = [b"", b"x", os.urandom(16384), os.urandom(1 << 16), os.urandom(3 << 20), os.urandom(100)]

    def send():
        for f in frames:
            if len(f) > 1 << 20:   # (a view of another format: sent as its bytes)
                send_buffers(sender, [f[:6], memoryview(f)[6:].cast("H")])
            elif len(f) > 16384:
                send_buffers(sender, [f[:5], memoryview(f)[5:]])
            else:
                sender.send_bytes(f)
        sender.send_bytes(b"y" * 200)   # over maxsize below
        sender.close()

    done = threading.Thread(target=send)
    done.start()
    got = [recv_frame(receiver) for _ in frames]
    assert [bytes(g) for g in got] == frames and all(isinstance(g, memoryview) for g in got)
    with pytest.raises(OSError, match="bad message length"):
        recv_frame(receiver, 100)
    left = b""
    while len(left) < 200:   # (the refused frame's bytes, left unread)
        left += os.read(receiver.fileno(), 200 - len(left))
    with pytest.raises(EOFError):
        recv_frame(receiver)
    done.join()
    receiver.close()

    a, b = socket.socketpair()   # a frame cut short by the other side's end
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    os.write(sender.fileno(), struct.pack("!i", 1000) + b"z" * 10)
    sender.close()
    with pytest.raises(OSError, match="end of file"):
        recv_frame(receiver)
    receiver.close()


def test_widen_raises_the_socket_buffers_within_the_kernel_cap():
    """widen asks for SOCKET_BUFFER_BYTES each way (a tick's 1.5 MB of rows in one write where
    the kernel allows it); never lowers what is set."""
    import socket
    from multiprocessing.connection import Connection

    from dflash_grpc.localhop import SOCKET_BUFFER_BYTES, widen

    a, b = socket.socketpair()
    before = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    conn = Connection(a.detach())
    widen(conn)
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        after = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    try:
        cap = int(open("/proc/sys/net/core/wmem_max").read())
    except OSError:
        cap = 0
    assert after >= before
    if cap > before:   # (Linux doubles what it is asked for, up to twice the cap)
        assert after >= min(2 * SOCKET_BUFFER_BYTES, 2 * cap) // 2 + 1
    conn.close()
    b.close()


def test_widen_leaves_a_pipe_alone():
    """widen on a connection that is not a socket (a pipe) changes nothing and leaks no
    descriptor."""
    from multiprocessing.connection import Connection

    from dflash_grpc.localhop import widen

    r, w = os.pipe()
    conn = Connection(r)
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    widen(conn)
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before
    conn.close()
    os.close(w)


def test_spinning_sides_answer_the_same_and_still_time_out(hop, monkeypatch):
    """With SPIN_S set (DFLASH_HOP_SPIN_US), both sides poll their socket before blocking: the
    answers are the same, and a deadline shorter than the spin still times out on time."""
    from dflash_grpc import localhop

    monkeypatch.setattr(localhop, "SPIN_S", 0.02)
    _, server, _, _ = hop
    call = _open(server)
    for i in range(3):
        r = call.exchange(_request(f"s{i}", root=i, length=10 + i), timeout=5.0)
        assert isinstance(r, draft_pb2.ProposeResponse) and len(r.results) == 1
    t0 = time.perf_counter()
    with pytest.raises(ExchangeTimeout):
        call.exchange(_request("slow"), timeout=0.005)
    assert time.perf_counter() - t0 < 0.3


def test_spin_wait_returns_at_the_event_or_after_its_time():
    import select
    import socket as _socket

    from dflash_grpc.localhop import spin_wait

    a, b = _socket.socketpair()
    try:
        p = select.poll()
        p.register(a.fileno(), select.POLLIN)
        t0 = time.perf_counter()
        assert spin_wait(p, 0.01) is False and time.perf_counter() - t0 >= 0.01
        b.send(b"x")
        t0 = time.perf_counter()
        assert spin_wait(p, 5.0) is True and time.perf_counter() - t0 < 1.0
    finally:
        a.close()
        b.close()


def test_spin_for_device_polls_on_cuda_only_unless_the_environment_says(monkeypatch):
    """The services and the orchestrator poll the hop for CUDA_SPIN_S on a CUDA engine and not on
    a CPU one (whose compute needs every core); DFLASH_HOP_SPIN_US overrides either way."""
    from dflash_grpc import localhop

    monkeypatch.setattr(localhop, "SPIN_S", localhop.SPIN_S)
    monkeypatch.delenv("DFLASH_HOP_SPIN_US", raising=False)
    assert localhop.spin_for_device("cuda:0") == localhop.CUDA_SPIN_S == localhop.SPIN_S > 0
    assert localhop.spin_for_device("cpu") == 0.0 == localhop.SPIN_S
    monkeypatch.setenv("DFLASH_HOP_SPIN_US", "250")
    assert localhop.spin_for_device("cpu") == pytest.approx(250e-6)
    monkeypatch.setenv("DFLASH_HOP_SPIN_US", "0")
    assert localhop.spin_for_device("cuda") == 0.0


def test_a_hop_servers_spin_is_asked_before_each_wait(hop, monkeypatch):
    """A HopServer with ``spin`` set (serving.set_local_hop_spin) asks it before each wait for a
    stream's next request and polls for the window it gives (0: blocks at once), in place of
    SPIN_S; the answers are those of a hop without it."""
    from dflash_grpc import localhop

    monkeypatch.setattr(localhop, "SPIN_S", 0.0)
    windows = []
    monkeypatch.setattr(localhop, "spin_wait", lambda poller, seconds: windows.append(seconds) or False)
    _, server, _, _ = hop
    asked = []

    def spin():
        asked.append(1)
        return 0.004 if len(asked) % 2 else 0.0
    serving.set_local_hop_spin(server, spin)
    call = _open(server)
    for i in range(4):
        r = call.exchange(_request(f"s{i}", root=i, length=10 + i), timeout=5.0)
        assert isinstance(r, draft_pb2.ProposeResponse) and r.results[0].session_id == f"s{i}"
    deadline = time.monotonic() + 5.0
    while len(asked) < 5 and time.monotonic() < deadline:   # (the wait after the fourth reply)
        time.sleep(0.002)
    assert len(asked) == 5                      # before each of the four requests and the wait after
    assert windows == [0.004] * 3               # only the non-zero windows (1st, 3rd, 5th) polled
    serving.set_local_hop_spin(server, None)    # back to SPIN_S (0: never polls)
    for name in ("t", "u"):                     # (the wait before "t" was asked already; the one before "u" is not)
        call.exchange(_request(name), timeout=5.0)
    assert len(asked) == 5 and windows == [0.004] * 3


def test_quiet_spin_polls_on_cuda_while_quiet_unless_the_environment_says(monkeypatch):
    """The target's hop spin: CUDA_SPIN_S while its quiet() holds, 0 when not; none (SPIN_S as
    set) on a CPU engine or where DFLASH_HOP_SPIN_US is set."""
    from dflash_grpc import localhop

    monkeypatch.delenv("DFLASH_HOP_SPIN_US", raising=False)
    state = {"quiet": True}
    spin = localhop.quiet_spin("cuda:0", lambda: state["quiet"])
    assert spin() == localhop.CUDA_SPIN_S > 0
    state["quiet"] = False
    assert spin() == 0.0
    assert localhop.quiet_spin("cpu", lambda: True) is None
    monkeypatch.setenv("DFLASH_HOP_SPIN_US", "100")
    assert localhop.quiet_spin("cuda:0", lambda: True) is None


def test_the_scheduler_polls_the_hop_only_for_small_ticks(monkeypatch):
    """The orchestrator's exchanges poll the hop (SPIN_S) for ticks of at most SPIN_BATCH requests,
    and block at once for larger ones (its handler threads then need the GIL the poller takes);
    a LocalHopCall with spin_s set uses it instead of the module's."""
    from dflash_grpc import localhop
    from orchestrator import scheduler as S

    monkeypatch.setattr(localhop, "SPIN_S", 0.003)
    sched = S.Scheduler.__new__(S.Scheduler)   # hop_spin reads nothing of the instance
    assert [sched.hop_spin(n) for n in (1, S.SPIN_BATCH, S.SPIN_BATCH + 1, 64)] == [0.003, 0.003, 0.0, 0.0]
    call = LocalHopCall.__new__(LocalHopCall)
    call.spin_s = None
    spun = []
    monkeypatch.setattr(localhop, "spin_wait", lambda poller, seconds: spun.append(seconds) or False)
    import socket as _socket

    a, b = _socket.socketpair()
    try:
        call._conn, call._poller = a, None
        assert call._ready(0.01) is False and spun == [0.003]    # the module's window
        call.spin_s = 0.0
        assert call._ready(0.01) is False and spun == [0.003]    # none: blocked at once
        call.spin_s = 0.001
        b.send(b"x")
        assert call._ready(0.01) is True and spun == [0.003, 0.001]
    finally:
        a.close()
        b.close()


def _hop_future(endpoint, ids, timeout, fallback=None):
    return HopFuture(lambda deadline, on_open: hop_unary(endpoint, RELEASE, common_pb2.ReleaseRequest(session_ids=ids),
                                                         common_pb2.ReleaseResponse.FromString,
                                                         deadline - time.monotonic(), (), on_open),
                     fallback or (lambda deadline: "fallback"), timeout)


def test_hop_futures_run_at_once_and_cancel_ends_the_call(hop):
    """As gRPC's futures: twelve calls of 0.5 s each all answer within about 0.5 s (each on its
    own thread, not in waves), every failure is a grpc.RpcError, and ``cancel`` closes the call's
    connection (the handler sees its client go) and makes the result CANCELLED."""
    echo, server, _, _ = hop
    endpoint = serving.local_endpoint(server)
    t0 = time.monotonic()
    futs = [_hop_future(endpoint, ["sleep", f"s{i}"], 5.0) for i in range(12)]
    assert [f.result(10).released for f in futs] == [2] * 12
    assert time.monotonic() - t0 < 2.5, "the calls ran in waves"
    done = threading.Event()
    fut = _hop_future(endpoint, ["wait"], 30.0)
    fut.add_done_callback(lambda f: done.set())
    time.sleep(0.3)
    assert not fut.done() and fut.cancel()
    assert done.wait(5) and echo.gone.wait(5), "the handler did not see the cancelled call go"
    with pytest.raises(grpc.RpcError) as e:
        fut.result(1)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert not fut.cancel()   # (over already)
    late = _hop_future(endpoint, ["abort"], 5.0)
    with pytest.raises(grpc.RpcError) as e:
        late.result(5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_hop_future_falls_back_to_grpc_where_the_hop_cannot_take_the_call():
    """A hop not on this host (the call answers None) or one that refuses the hello
    (:class:`HopRefused`): the fallback (gRPC) answers, with the deadline set when the future was
    made; a fallback that raises something other than an RpcError still gives an RpcError."""
    assert HopFuture(lambda d, o: None, lambda d: ("grpc", round(d - time.monotonic())), 30.0).result(5) == ("grpc", 30)

    def refused(deadline, on_open):
        raise HopRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "all connections busy")

    assert HopFuture(refused, lambda d: "grpc", 5.0).result(5) == "grpc"

    def broken(deadline):
        raise ValueError("Cannot invoke RPC on closed channel!")

    with pytest.raises(grpc.RpcError) as e:
        HopFuture(lambda d, o: None, broken, 5.0).result(5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "closed channel" in e.value.details()


def test_hop_unary_timeout_covers_an_answer_that_stops_halfway(tmp_path):
    """A service that answers the hello, then sends the start of its reply and stalls: the call
    fails within its timeout (UNAVAILABLE) instead of blocking its thread."""
    import json
    import socket
    import struct
    from multiprocessing.connection import Connection

    from dflash_grpc.localhop import REPLY

    path = str(tmp_path / "hop.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    held = []

    def serve():
        s, _ = listener.accept()
        conn = Connection(s.detach())
        held.append(conn)
        conn.recv_bytes()                                    # the hello
        conn.send_bytes(REPLY + json.dumps({"nonce": "n0"}).encode())
        conn.recv_bytes()                                    # the request
        os.write(conn.fileno(), struct.pack("!i", 100) + REPLY + b"123456789")   # 10 of 100 bytes, then nothing

    threading.Thread(target=serve, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        hop_unary(f"unix:{path}#n0", RELEASE, common_pb2.ReleaseRequest(session_ids=["a"]),
                  common_pb2.ReleaseResponse.FromString, 1.0)
    assert time.monotonic() - t0 < 3.0
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    listener.close()


def test_a_hello_then_silence_does_not_hold_a_unary_connection(hop, monkeypatch):
    """A client that names a unary method and then sends nothing is closed after the hello's
    timeout, so silent clients cannot fill the hop's connections."""
    from dflash_grpc import localhop

    monkeypatch.setattr(localhop, "HELLO_TIMEOUT_S", 0.3)
    _, server, _, _ = hop
    call = open_local(serving.local_endpoint(server), RELEASE, common_pb2.ReleaseResponse.FromString)
    assert call._conn.poll(5.0), "the hop kept a silent unary connection open"
    with pytest.raises((EOFError, OSError)):
        call._conn.recv_bytes()
    call.close()


def test_target_prefill_goes_over_the_hop_and_to_grpc_where_the_hop_serves_no_unary(monkeypatch):
    """``TargetPeer.prefill_future``: over the target's hop where it offers one (the reply is the
    gRPC one, the call seen as from this host); a hop that answers UNIMPLEMENTED for unary methods
    (an older target) sends the call to gRPC and is not asked again; ``DFLASH_PREFILL_HOP=0``
    (``peers.PREFILL_HOP``) sends every call to gRPC."""
    from dflash_grpc import localhop
    from dflash_grpc.v1 import target_pb2, target_pb2_grpc
    from orchestrator import peers
    from orchestrator.peers import HopFuture, TargetPeer

    class FakeTarget(target_pb2_grpc.TargetServiceServicer):
        def __init__(self):
            self.local: list[bool] = []
            self.endpoint = ""

        def Info(self, request, context):
            return common_pb2.ModelInfo(local_endpoint=self.endpoint, max_sessions=4)

        def Prefill(self, request, context):
            self.local.append(isinstance(context, localhop.LocalContext))
            item = request.items[0]
            return target_pb2.PrefillResponse(results=[target_pb2.PrefillResult(
                session_id=item.session_id, first_token=len(item.prompt_tokens), committed_length=len(item.prompt_tokens))])

    fake = FakeTarget()

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(fake, server)
        return ["dflash_grpc.v1.TargetService"]

    server, _, port = serving.make_server(add, "127.0.0.1:0", local_hop=True)
    fake.endpoint = serving.local_endpoint(server)
    peer = TargetPeer(f"127.0.0.1:{port}")
    try:
        req = target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(session_id="a", prompt_tokens=[1, 2, 3])])
        fut = peer.prefill_future(req, 5.0)
        assert isinstance(fut, HopFuture) and fut.result(5).results[0].first_token == 3
        assert fake.local == [True]
        monkeypatch.setattr(peers, "PREFILL_HOP", False)
        assert not isinstance(peer.prefill_future(req, 5.0), HopFuture)
        monkeypatch.setattr(peers, "PREFILL_HOP", True)
        # an older hop: unary methods refused at the hello (UNIMPLEMENTED)
        old_resolve = localhop.resolve

        def streams_only(interceptors, handlers, method, metadata):
            h = old_resolve(interceptors, handlers, method, metadata)
            return h if h is not None and h.request_streaming else None

        monkeypatch.setattr(localhop, "resolve", streams_only)
        fut = peer.prefill_future(req, 5.0)
        assert fut.result(5).results[0].first_token == 3 and fake.local[-1] is False   # answered over gRPC
        assert not isinstance(peer.prefill_future(req, 5.0), HopFuture)              # not asked again
    finally:
        peer.close()
        server.stop(None)
        serving.stop_local_hop(server)
