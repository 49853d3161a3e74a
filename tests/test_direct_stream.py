"""``orchestrator.peers.DirectStreamCall``: the scheduler's streams with every exchange on the
caller's thread (no grpcio request-iterator or channel thread), under ``StreamCall``'s contract:

* exchanges in order; a precise per-exchange timeout that cancels the stream, whose late reply
  is never read as a later exchange's;
* a failed stream raises a ``grpc.RpcError`` with the peer's status and reason code, and so does
  every later exchange; an unreachable peer fails at once (UNAVAILABLE);
* the channel's metadata (the orchestrator's token and owner) travels with the stream;
* ``close`` frees the call (the channel then closes at once); ``open_stream`` falls back to
  ``StreamCall`` for channels it cannot drive.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from dflash_grpc import serving
from dflash_grpc.transport import reason_of
from dflash_grpc.v1 import draft_pb2, draft_pb2_grpc
from orchestrator.peers import DirectStreamCall, ExchangeTimeout, StreamCall, open_stream

METHOD = "/dflash_grpc.v1.DraftService/Propose"


class Drafter(draft_pb2_grpc.DraftServiceServicer):
    """Echoes each Propose's session ids once ``gate`` is set; a session id ``refuse`` ends the
    stream FAILED_PRECONDITION with reason LENGTH_MISMATCH; records the calls' metadata."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.metadata: list[dict] = []

    def Propose(self, requests, context):
        self.metadata.append(dict(context.invocation_metadata()))
        for req in requests:
            self.gate.wait(30)
            if any(x.session_id == "refuse" for x in req.items):
                context.set_trailing_metadata((("dflash-reason", "LENGTH_MISMATCH"),))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused")
            yield draft_pb2.ProposeResponse(results=[draft_pb2.ProposeResult(session_id=x.session_id) for x in req.items])


def _request(sid: str) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(session_id=sid, root_token=1, committed_length=1)])


@pytest.fixture()
def drafter():
    fake = Drafter()

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(fake, server)
        return ["dflash_grpc.v1.DraftService"]

    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=8, auth_token="s3cret-token-for-tests")
    saved = serving.client_metadata()
    serving.add_client_metadata([(serving.AUTH_METADATA_KEY, serving.bearer("s3cret-token-for-tests")),
                                 ("dflash-owner", "orch-test")])
    ch = serving.channel(f"127.0.0.1:{port}")   # as the orchestrator's peers open theirs
    try:
        yield fake, ch
    finally:
        fake.gate.set()
        ch.close()
        serving.set_client_metadata(saved)
        server.stop(None)


def _client_threads() -> set[threading.Thread]:
    """Live threads but the in-process server's workers."""
    return {t for t in threading.enumerate() if not t.name.startswith("ThreadPoolExecutor")}


def _open(ch, **kw) -> DirectStreamCall:
    call = open_stream(ch, METHOD, draft_pb2_grpc.DraftServiceStub(ch).Propose, draft_pb2.ProposeResponse.FromString, **kw)
    assert isinstance(call, DirectStreamCall)
    return call


def test_exchanges_carry_the_channels_metadata_and_run_on_the_callers_thread(drafter):
    fake, ch = drafter
    before = _client_threads()
    call = _open(ch)
    for sid in ("a", "b", "c"):
        assert call.exchange(_request(sid)).results[0].session_id == sid
    assert _client_threads() == before                               # no thread of its own without a timeout
    assert fake.metadata[0]["dflash-owner"] == "orch-test"          # and the token passed (not UNAUTHENTICATED)
    call.close()
    call.close()                                                      # idempotent
    with pytest.raises(grpc.RpcError):
        call.exchange(_request("after"))


def test_timeout_is_precise_and_the_late_reply_is_never_read(drafter):
    fake, ch = drafter
    call = _open(ch)
    assert call.exchange(_request("a"), 5.0).results[0].session_id == "a"
    fake.gate.clear()
    t0 = time.monotonic()
    with pytest.raises(ExchangeTimeout) as err:
        call.exchange(_request("late"), 0.05)
    assert 0.05 <= time.monotonic() - t0 < 0.1
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and call.broken
    with pytest.raises(grpc.RpcError):
        call.exchange(_request("after"), 1.0)                        # the timed-out stream is dead
    call.close()
    fake.gate.set()                                                   # the late reply is sent now ...
    call = _open(ch)
    assert call.exchange(_request("b"), 5.0).results[0].session_id == "b"   # ... and never read
    # a short deadline after a long one is still watched precisely (the watch thread is woken)
    assert call.exchange(_request("c"), 10.0).results[0].session_id == "c"
    fake.gate.clear()
    t0 = time.monotonic()
    with pytest.raises(ExchangeTimeout):
        call.exchange(_request("d"), 0.05)
    assert time.monotonic() - t0 < 0.1
    call.close()


def test_a_refused_stream_raises_its_status_and_reason_every_time(drafter):
    _, ch = drafter
    call = _open(ch)
    assert call.exchange(_request("a")).results[0].session_id == "a"
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as err:
            call.exchange(_request("refuse"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details() == "refused" and reason_of(err.value) == "LENGTH_MISMATCH"
    assert _open(ch).exchange(_request("b")).results[0].session_id == "b"   # the channel is fine


def test_an_unreachable_peer_fails_at_once_and_a_closed_channel_never_hangs():
    with serving.channel(f"127.0.0.1:{serving_free_port()}") as ch:
        call = _open(ch, direct=True)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            call.exchange(_request("a"), 5.0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 4
        idle = _open(ch)                                              # open, never used, never closed
    with pytest.raises(grpc.RpcError) as err:                         # the channel closed at once
        idle.exchange(_request("b"))
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


def test_close_while_an_exchange_waits_ends_it(drafter):
    fake, ch = drafter
    call = _open(ch)
    fake.gate.clear()
    threading.Timer(0.1, call.close).start()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        call.exchange(_request("waits"))
    assert err.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - t0 < 5


def test_open_stream_falls_back_to_grpcios_threaded_stream(drafter):
    _, ch = drafter
    stub = draft_pb2_grpc.DraftServiceStub(ch)
    before = _client_threads()
    plain = open_stream(ch, METHOD, stub.Propose, draft_pb2.ProposeResponse.FromString, direct=False)
    assert isinstance(plain, StreamCall) and plain.exchange(_request("a")).results[0].session_id == "a"
    assert _client_threads() > before                                # grpcio's request and channel threads
    plain.close()

    class Other(grpc.StreamStreamClientInterceptor):   # an interceptor DirectStreamCall cannot replay
        def intercept_stream_stream(self, continuation, details, request_iterator):
            return continuation(details, request_iterator)

    other = grpc.intercept_channel(ch, Other())
    call = open_stream(other, METHOD, draft_pb2_grpc.DraftServiceStub(other).Propose, draft_pb2.ProposeResponse.FromString)
    assert isinstance(call, StreamCall) and call.exchange(_request("b")).results[0].session_id == "b"
    call.close()


def serving_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
