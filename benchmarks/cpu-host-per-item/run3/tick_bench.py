"""The scheduler's own work per item per tick, in process (issue 23; benchmarks/cpu-host-per-item/run3).

    PYTHONPATH=.:proto python benchmarks/cpu-host-per-item/run3/tick_bench.py [N] [TICKS]   # default 64 300

``Scheduler._tick`` over ``N`` drafting requests (SmolLM2's 5 x 576 bf16 feature rows, 3 draft tokens
accepted per tick, 16-node trees), its thread stopped, against instant streams: the Verify reply and
the Propose reply are built once and parsed every tick as the same-host hop's deserializers parse
them (``parse_verify_reply``, ``FromString``); the Propose goes out as the hop's wire pieces (not
sent). No sockets, no handler threads, no other process: what is left is the tick's Python, its
protobuf work and its memory (the histories grow as in a service). Prints the thread CPU
(``time.thread_time``) per item per tick: median, mean and least over ``TICKS`` ticks.

Environment: ``KEEP_VIEWS`` (e.g. 1000000: never compact the histories), ``TURNOVER`` (requests
replaced per tick, each a new one with a 20-row prompt: histories freed and re-grown as under
continuous batching). Runs on older checkouts too.
"""
import os
import statistics
import sys
import time

sys.path[:0] = [".", "proto"]
import ctypes  # noqa: E402

libc = ctypes.CDLL(None)
libc.mallopt(-3, 32 << 20)   # as serving.tune_malloc
libc.mallopt(-1, 256 << 20)
import orchestrator.scheduler as sched_mod  # noqa: E402
from dflash_grpc.columns import COLUMNAR, Rows, pack_i32  # noqa: E402
from dflash_grpc.v1 import common_pb2, draft_pb2, target_pb2  # noqa: E402
from orchestrator import messages, peers  # noqa: E402
from orchestrator.scheduler import Request, Scheduler  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
TICKS = int(sys.argv[2]) if len(sys.argv) > 2 else 300
W, ACC = 5 * 576, 3
ROWB = 2 * W
if os.environ.get("KEEP_VIEWS"):
    sched_mod.KEEP_VIEWS = int(os.environ["KEEP_VIEWS"])
TURNOVER = int(os.environ.get("TURNOVER", "0"))
INFO = common_pb2.ModelInfo(vocab_size=49152, max_context=8192, max_tree_width=64, max_tree_depth=32, max_sessions=256,
                            model_fingerprint="m", device="cuda:0", features=[COLUMNAR])
DINFO = draft_pb2.DrafterInfo(model=common_pb2.ModelInfo(vocab_size=49152, block_size=16, max_sessions=256, device="cuda:0",
                                                         features=[COLUMNAR]), target_fingerprint="m")


class Call(peers.LocalHopCall):
    """An instant stream: the request is written (as the hop would send it), the reply parsed."""

    def __init__(self, make):   # noqa: D107 - (no socket)
        self.make, self._error, self._closed = make, None, False

    def exchange(self, request, timeout=None, on_sent=None):
        if not hasattr(request, "pieces"):
            request.SerializeToString()
        if on_sent:
            on_sent()
        return self.make(request)


def verify_reply(n: int) -> bytes:
    r = target_pb2.VerifyResponse()
    c = r.columns
    c.accepted = pack_i32([ACC] * n)
    c.accepted_tokens = pack_i32(list(range(1, ACC + 1)) * n)
    c.bonus_tokens = pack_i32([7] * n)
    c.committed_lengths = pack_i32([100] * n)
    f = c.features
    f.rows = pack_i32([ACC + 1] * n)
    t = f.rows_data
    t.dtype = common_pb2.DTYPE_BF16
    t.shape.extend(((ACC + 1) * n, W))
    t.data = os.urandom(ROWB * (ACC + 1) * n)
    return r.SerializeToString()


def propose_reply(n: int) -> bytes:
    r = draft_pb2.ProposeResponse()
    tokens, parents = [], []
    for _ in range(n):
        tokens += [7] + list(range(1, 16))
        parents += [-1] + list(range(0, 15))
    r.trees.sizes, r.trees.tokens, r.trees.parents = pack_i32([16] * n), pack_i32(tokens), pack_i32(parents)
    return r.SerializeToString()


VR, PR, PROMPT = verify_reply(N), propose_reply(N), os.urandom(20 * ROWB)


class Target:
    stub = None

    def info(self):
        return INFO

    def verify_stream(self, timeout):
        return Call(lambda req: messages.parse_verify_reply(VR))


class Draft:
    address, stub = "x", None

    def state(self):
        return DINFO

    def layers(self):
        return [1, 8, 14, 20, 27]

    def mark_ok(self):
        pass

    def propose_stream(self, timeout):
        return Call(lambda req: draft_pb2.ProposeResponse.FromString(PR))


def new_request(sched: Scheduler, i: int) -> Request:
    r = Request(session_id=f"s{i}", prompt=[1] * 20, sampling=common_pb2.SamplingParams(), max_tokens=10**9,
                tree=draft_pb2.TreeParams(budget=15, top_k=4, max_depth=0), speculative=True)
    r.on_target, r.root, r.length, r.t_first = True, 7, 20, time.monotonic()
    sched._keep(r, Rows(common_pb2.DTYPE_BF16, W, 20, PROMPT))
    return r


def main() -> None:
    sched = Scheduler(Target(), Draft(), max_sessions=256, step_nodes=4096)
    sched._stop.set()
    sched._wake.set()
    sched._thread.join()
    sched.message_s = 200e-6   # the adaptive hold on, as under load
    batch = [new_request(sched, i) for i in range(N)]
    sched._active = batch
    for _ in range(5):
        sched._tick(batch)
    samples = []
    for k in range(TICKS):
        for j in range(TURNOVER):
            i = (k * TURNOVER + j) % N
            batch[i] = new_request(sched, i)
        t0 = time.thread_time()
        sched._tick(batch)
        samples.append(time.thread_time() - t0)
        if k % 10 == 9:
            for r in batch:   # (no handlers: their queues emptied here)
                while not r.events.empty():
                    r.events.get_nowait()
    us = [s / N * 1e6 for s in samples]
    print(f"N={N} us/item/tick median {statistics.median(us):.1f} mean {statistics.mean(us):.1f} min {min(us):.1f}")


if __name__ == "__main__":
    main()
