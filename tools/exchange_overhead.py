"""Cost of one :class:`orchestrator.peers.StreamCall` exchange against an instant peer.

    python tools/exchange_overhead.py [N] [ROUNDS]     # default 3000 exchanges, 5 rounds

An echo DraftService (every ProposeRequest answered at once with an empty ProposeResponse) runs in
a child process, so the figures are the orchestrator side's cost of one round trip on one open
stream: microseconds per exchange with no timeout, and with a timeout (the deadline watch armed on
every exchange, as the scheduler does). The rounds alternate the two and the best round of each is
printed (the machine's noise only ever adds). Then the same for ``StreamCall`` alone over a fake
call whose reply is the request itself (no gRPC, no thread): its own bookkeeping per exchange.
"""

from __future__ import annotations

import subprocess
import sys
import time

sys.path[:0] = [".", "proto"]

from dflash_grpc import serving  # noqa: E402
from dflash_grpc.v1 import draft_pb2, draft_pb2_grpc  # noqa: E402


class FakeCall:
    """A stream-stream call stand-in: each ``next`` takes the next request and returns it."""

    def __init__(self, requests, timeout=None):
        self._requests = requests

    def __next__(self):
        return next(self._requests)

    def cancel(self):
        pass


class Echo(draft_pb2_grpc.DraftServiceServicer):
    def Propose(self, requests, context):
        for _ in requests:
            yield draft_pb2.ProposeResponse()


def serve() -> None:
    def add(s):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(Echo(), s)
        return ["dflash_grpc.v1.DraftService"]

    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=4)
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(None)


def main() -> None:
    from orchestrator.peers import StreamCall

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    sys.setswitchinterval(0.001)  # as the orchestrator's main sets it
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with serving.channel(f"127.0.0.1:{port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            req = draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(session_id="s", root_token=1, committed_length=1)])
            best = {"no timeout": float("inf"), "timeout 0.5 s": float("inf")}
            for _ in range(rounds):
                for name, timeout in (("no timeout", None), ("timeout 0.5 s", 0.5)):
                    call = StreamCall(stub.Propose)
                    for _ in range(200):  # warm up
                        call.exchange(req, timeout)
                    t0 = time.perf_counter()
                    for _ in range(n):
                        call.exchange(req, timeout)
                    best[name] = min(best[name], (time.perf_counter() - t0) / n)
                    call.close()
            for name, s in best.items():
                print(f"{name:>14}: {s * 1e6:7.1f} us per exchange (best of {rounds} rounds of {n})")
        best = {"no timeout": float("inf"), "timeout 0.5 s": float("inf")}
        for _ in range(rounds):
            for name, timeout in (("no timeout", None), ("timeout 0.5 s", 0.5)):
                call = StreamCall(FakeCall)
                t0 = time.perf_counter()
                for _ in range(n * 10):
                    call.exchange(req, timeout)
                best[name] = min(best[name], (time.perf_counter() - t0) / (n * 10))
                call.close()
        for name, s in best.items():
            print(f"{name:>14}: {s * 1e6:7.2f} us per exchange, StreamCall alone (fake call)")
    finally:
        child.stdin.close()
        child.wait(10)


if __name__ == "__main__":
    serve() if sys.argv[1:2] == ["--serve"] else main()
