"""Fuzzing every RPC's request message, internal and public (issue 22): TargetService (Info,
Prefill, Verify, Release), DraftService (Info, Propose, Release), GenerationService (Generate,
GetStats, Info).

The target and the draft service run in this process on the tiny model (reference engines,
context 64, :data:`SLOTS` slots each) behind a shared token; the orchestrator, for the public
service, runs in this process too, against them. Each hypothesis example is a short random
program of calls: random field values, sizes and sequences (Verify and Propose streams of several
messages that follow the sessions the example opened, or do not; session ids that collide with a
live session of another owner; trees with random parents; features of random shapes, dtypes and
bytes; huge, negative and NaN numbers; repeated ids), each call with random owner metadata
(``dflash-owner`` / ``dflash-owner-epoch``: none, named, new epochs that supersede older ones,
duplicates) and, now and then, a missing or wrong token. Random bytes and mutated messages go to
every method as well. Generate requests come from the strategy of tests/test_fuzz_api.py (which
fuzzes them through an orchestrator process; here the point is what they do to the services and
to a live session beside them).

After every example:

* both services answer health and Info (nothing crashed; every call has a deadline, so nothing
  hung);
* no call ended INTERNAL or UNKNOWN, and no ``ItemStatus.code`` of an item is INTERNAL or UNKNOWN;
* the sessions the example opened (as its replies say) are released by their owner, and then
  every slot but the live session's is free again on both services;
* the live session, opened before the fuzz by its own owner on both services, takes one step
  (every few examples a speculative one: Propose, then Verify of the drafter's tree) and still
  decodes exactly like target-only greedy decoding of its prompt, its drafter session proposing
  exactly the trees of an untouched reference drafter fed the same features.

Examples are derandomized (the same programs on every run): about 330 examples, 1,200 calls and
1,100 items; the module runs in about 40 s on a busy 2-core CPU (torch on one thread, as is
fastest for these tiny shapes). What an example draws never depends on what the services
answered (hypothesis replays examples and requires it): choices among the sessions an example
opened are drawn as indexes, and a stream that failed still draws its remaining messages. Two
bugs it found have tests of their own at the end.
"""

from __future__ import annotations

import contextlib
import queue
import random
import time
import uuid

import grpc
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dflash_grpc.transport import GRPC_OPTIONS, reason_of  # noqa: E402
from dflash_grpc.v1 import (common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc,  # noqa: E402
                            target_pb2, target_pb2_grpc)
from dflash_grpc.wire import tensor_from_proto  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from runtime.owners import EPOCH_KEY, OWNER_KEY  # noqa: E402
from runtime.tree import tree_depths  # noqa: E402
from tests.conftest import draft_in_process, orchestrator_in_process  # noqa: E402
from tests.test_fuzz_api import requests as generate_requests  # noqa: E402

VOCAB = 300
HIDDEN = 64
CONTEXT = 64
SLOTS = 6
TOKEN = "fuzz-rpc-shared-token-0123456789"
AUTH = ("authorization", f"Bearer {TOKEN}")
LIVE_ID = "live"
LIVE_NAME = "live-owner"
LIVE_MD = (AUTH, (OWNER_KEY, LIVE_NAME), (EPOCH_KEY, "live-epoch"))
ORCH_NAME = "orchestrator-beside-the-fuzz"
RESERVED_NAMES = {LIVE_NAME, ORCH_NAME}
LIVE_PROMPT = [5, 17, 42, 9, 100, 7, 250, 3]
CALL_TIMEOUT = 30.0
#: deadline of the live session's long-lived streams; they are opened again after half of it
LIVE_STREAM_S = 600.0
#: a spec step (Propose + Verify) of the live session every this many examples, else a plain one
SPEC_EVERY = 3

#: Statuses that are server bugs (DEADLINE_EXCEEDED: a call hung for CALL_TIMEOUT seconds).
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
       grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DATA_LOSS}
BAD_ITEM = {grpc.StatusCode.INTERNAL.value[0], grpc.StatusCode.UNKNOWN.value[0]}
OK_ITEM = 0

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])

TARGET_METHODS = {"Info": ("unary", target_pb2.TargetInfoRequest, common_pb2.ModelInfo),
                  "Prefill": ("unary", target_pb2.PrefillRequest, target_pb2.PrefillResponse),
                  "Verify": ("stream", target_pb2.VerifyRequest, target_pb2.VerifyResponse),
                  "Release": ("unary", common_pb2.ReleaseRequest, common_pb2.ReleaseResponse)}
DRAFT_METHODS = {"Info": ("unary", draft_pb2.DrafterInfoRequest, draft_pb2.DrafterInfo),
                 "Propose": ("stream", draft_pb2.ProposeRequest, draft_pb2.ProposeResponse),
                 "Release": ("unary", common_pb2.ReleaseRequest, common_pb2.ReleaseResponse)}
GENERATION_METHODS = {"Generate": ("server_stream", generation_pb2.GenerateRequest, generation_pb2.GenerateResponse),
                      "GetStats": ("unary", generation_pb2.GetStatsRequest, generation_pb2.AcceptanceStats),
                      "Info": ("unary", generation_pb2.ServiceInfoRequest, generation_pb2.ServiceInfo)}


# --------------------------------------------------------------------------------------------
# Calls and checks


def event(what: str) -> None:
    """``hypothesis.event`` (statistics of ``--hypothesis-show-statistics``), a no-op outside a
    hypothesis test."""
    with contextlib.suppress(hypothesis.errors.InvalidArgument):
        hypothesis.event(what)


def refused(e: grpc.RpcError, what: object) -> grpc.StatusCode:
    """A call's error: never one of :data:`BAD`."""
    code = e.code()
    assert code not in BAD, f"{code.name}: {e.details()!r} for {str(what)[:500]}"
    event(f"refused: {code.name} {reason_of(e)}")
    return code


def check_item_status(status: common_pb2.ItemStatus, what: object) -> int:
    assert status.code not in BAD_ITEM, f"item status {status.code} {status.reason}: {status.message!r} for {str(what)[:500]}"
    if status.code:
        assert status.reason, f"item refused without a reason: {status}"
        event(f"item refused: {status.reason}")
    return status.code


class Stream:
    """One bidirectional stream driven a message at a time (each message may depend on the
    previous replies): ``send(msg)`` -> reply, or a ``grpc.RpcError`` (checked by the caller)."""

    def __init__(self, method, metadata, timeout: float = CALL_TIMEOUT):
        self._q: queue.Queue = queue.Queue()
        self._replies = method(iter(self._q.get, None), metadata=metadata, timeout=timeout)
        self.opened = time.monotonic()

    def send(self, msg):
        self._q.put(msg)
        return next(self._replies)

    def finish(self) -> None:
        """Half-close and read the end of the stream (raises its error, if any)."""
        self._q.put(None)
        for _ in self._replies:
            raise AssertionError("a reply without a request")

    def cancel(self) -> None:
        self._q.put(None)
        self._replies.cancel()


def stub_call(fn, request, metadata, what=None):
    """``fn(request)`` with ``metadata``: the reply, or None when refused (with an allowed status)."""
    try:
        return fn(request, metadata=metadata, timeout=CALL_TIMEOUT)
    except grpc.RpcError as e:
        refused(e, what if what is not None else request)
        return None


# --------------------------------------------------------------------------------------------
# Strategies

INT32 = (-(2**31), 2**31 - 1)
int32 = st.integers(*INT32)
printable = st.characters(min_codepoint=32, max_codepoint=126)
odd_ints = st.one_of(st.integers(-3, 70), st.sampled_from([INT32[0], INT32[1], 2**20, -(2**20), VOCAB, VOCAB - 1]), int32)
odd_tokens = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, VOCAB + 3), st.integers(-3, -1), int32)
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def usually(valid, odd, odds: int = 8):
    """``valid`` (odds - 1) times in ``odds``, else ``odd``."""
    return st.integers(0, odds - 1).flatmap(lambda i: odd if i == 0 else valid)


@st.composite
def metadata(draw) -> tuple:
    """Call metadata: usually the right token, sometimes none, a wrong one or two; an owner that
    is anonymous, one of two fuzz names with a few epochs (a new one frees the older epochs'
    sessions), a random name, a name or an epoch alone, or the owner key twice. Never the live
    session's owner nor the orchestrator's."""
    md = []
    auth = draw(usually(st.just(0), st.integers(1, 5), 12))
    if auth == 0:
        md.append(AUTH)
    elif auth == 1:
        md.append(("authorization", "Bearer wrong-token-0123456789abcdef"))
    elif auth == 2:
        md += [AUTH, AUTH]
    elif auth == 3:
        md.append(("authorization", f"bearer {TOKEN}"))   # the scheme is case-insensitive: accepted
    elif auth == 4:
        md.append(("authorization", draw(st.text(printable, max_size=60))))
    who = draw(st.integers(0, 9))
    name_st = st.text(printable, min_size=1, max_size=300).filter(lambda s: s[:256].strip() not in RESERVED_NAMES)
    if 1 <= who <= 5:
        md += [(OWNER_KEY, draw(st.sampled_from(["fuzz-a", "fuzz-b"]))),
               (EPOCH_KEY, draw(st.one_of(st.sampled_from(["e1", "e2"]), st.uuids().map(lambda u: u.hex))))]
    elif who == 6:
        md += [(OWNER_KEY, draw(name_st)), (EPOCH_KEY, draw(st.text(printable, max_size=300)))]
    elif who == 7:
        md.append((OWNER_KEY, draw(st.sampled_from(["fuzz-a", "fuzz-c"]))))
    elif who == 8:
        md.append((EPOCH_KEY, draw(st.text(printable, max_size=20))))
    elif who == 9:
        md += [(OWNER_KEY, "fuzz-a"), (OWNER_KEY, "fuzz-b"), (EPOCH_KEY, "e1")]
    return tuple(md)


def pick(draw, seq: list, default=None):
    """An element of ``seq`` (``default`` if empty), by an index drawn the same way whatever
    ``seq`` holds: what an example draws never depends on what the services answered (hypothesis
    replays examples and insists on that)."""
    i = draw(st.integers(0, 255))
    return seq[i % len(seq)] if seq else default


def one_of_pool(pool: list[str]):
    """An id of ``pool`` (:func:`pick`'s way)."""
    return st.integers(0, 255).map(lambda i: pool[i % len(pool)])


def next_metadata(data, previous: tuple | None, opened: dict) -> tuple:
    """The metadata of an example's next call: usually that of a caller that opened a session in
    the example (``opened``: id -> metadata) or of the previous call, else new. (Every choice is
    drawn whatever the example opened.)"""
    callers = sorted(set(opened.values()))
    reuse, again, caller = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 2)), pick(data.draw, callers)
    fresh = data.draw(metadata(), label="metadata")
    if caller is not None and reuse:
        return caller
    if previous is not None and again:
        return previous
    return fresh


def session_ids(pool: list[str]):
    """Mostly one of a few ids (collisions within an example; the sessions the example opened),
    sometimes the live session's, the empty id or any text."""
    return usually(one_of_pool(pool), st.one_of(st.just(LIVE_ID), st.just(""), st.text(max_size=40),
                                                st.text(min_size=200, max_size=2000)), 6)


TARGET_IDS = ["a", "b", "c", "d"]
DRAFT_IDS = ["p", "q", "r"]


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    if draw(st.integers(0, 3)):
        return s   # greedy, server-picked seed
    s.temperature = draw(usually(st.one_of(st.just(0.0), st.floats(0.1, 2.0)), floats32, 3))
    s.top_k = draw(usually(st.integers(0, 50), odd_ints, 3))
    s.top_p = draw(usually(st.one_of(st.just(0.0), st.floats(0.05, 1.0)), floats32, 3))
    seed = draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))
    if seed is not None:
        s.seed = seed
    return s


@st.composite
def prefill_item(draw, pool=TARGET_IDS) -> target_pb2.PrefillItem:
    n = draw(usually(st.integers(1, 10), st.sampled_from([0, CONTEXT - 2, CONTEXT - 1, CONTEXT, CONTEXT + 5, 300]), 12))
    tokens = draw(st.lists(usually(st.integers(0, VOCAB - 1), odd_tokens, 4), min_size=n, max_size=n)
                  if draw(st.integers(0, 11)) == 0 else st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    layers = draw(usually(st.sampled_from([[], [], [0, 1, 2], [1], [3, 0]]),
                          st.one_of(st.lists(odd_ints, max_size=8), st.just(list(range(4)) * 250), st.just([0, 0])), 12))
    return target_pb2.PrefillItem(session_id=draw(session_ids(pool)), prompt_tokens=tokens, sampling=draw(sampling()),
                                  feature_layer_ids=layers)


@st.composite
def good_prefill_item(draw, pool=TARGET_IDS) -> target_pb2.PrefillItem:
    """A prompt the target takes (unless its id is taken): valid tokens and layers, greedy or
    sampled."""
    s = common_pb2.SamplingParams()
    if draw(st.integers(0, 3)) == 0:
        s.temperature, s.top_k, s.top_p = draw(st.floats(0.5, 1.5)), draw(st.integers(0, 20)), draw(st.floats(0.5, 1.0))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    return target_pb2.PrefillItem(session_id=draw(st.sampled_from(pool)), sampling=s,
                                  prompt_tokens=draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)),
                                  feature_layer_ids=draw(st.sampled_from([[], [0, 1, 2], [1], [3, 0]])))


@st.composite
def prefill_request(draw, pool=TARGET_IDS) -> target_pb2.PrefillRequest:
    """Usually one or two prompts the target takes; else random items, and more of them."""
    if draw(st.booleans()):
        return target_pb2.PrefillRequest(items=[draw(good_prefill_item(pool)) for _ in range(draw(st.integers(1, 2)))])
    n = draw(usually(st.integers(1, 2), st.sampled_from([0, 3, SLOTS, 12]), 6))
    return target_pb2.PrefillRequest(items=[draw(prefill_item(pool)) for _ in range(n)])


@st.composite
def parents_for(draw, n: int) -> list[int]:
    """Parents of an ``n``-node tree: a chain, random earlier nodes (a valid tree), random ints,
    or the wrong length."""
    kind = draw(st.sampled_from(["chain", "chain", "random", "random", "random", "random", "odd", "length"]))
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "random":
        return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    if kind == "odd":
        return [draw(usually(st.integers(-1, max(0, n - 1)), int32, 3)) for _ in range(n)]
    return [-1] + [0] * max(0, n - 1 + draw(st.sampled_from([-2, -1, 1, 5])))


@st.composite
def verify_item(draw, pool=TARGET_IDS, roots: dict | None = None, greedy=None) -> target_pb2.VerifyItem:
    """A random tree for a random session; with a known root, usually rooted there; with
    ``greedy(session_id, n)`` (the target's next ``n`` greedy tokens, or None), sometimes a tree
    whose first branch the target accepts, in part or whole, the rest random."""
    known = sorted(roots or {})
    good = draw(st.booleans())   # a valid tree, for a session of the example if there is one
    sid = pick(draw, known, None)
    other = draw(session_ids(pool))
    sid = sid if good and sid is not None else other
    item = target_pb2.VerifyItem(session_id=sid)
    if not good and draw(st.integers(0, 9)) == 0:
        return item   # no tree
    if good:
        n = draw(st.integers(1, 10))
        tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    else:
        n = draw(usually(st.integers(1, 8), st.sampled_from([0, 33, 64, 65, 300])))
        tokens = draw(usually(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n),
                              st.lists(usually(st.integers(0, VOCAB - 1), odd_tokens, 4), min_size=n, max_size=n)))
        parents = draw(parents_for(n))
    use_root, want_right, wrong_last = draw(st.integers(0, 3)), draw(st.booleans()), draw(st.booleans())
    root = (roots or {}).get(sid)
    if tokens and root is not None and (good or use_root):
        tokens[0] = root
        right = greedy(sid, min(n - 1, 4)) if greedy is not None and n > 1 and want_right else None
        if right:   # nodes 1..m: a chain of the target's own choices (the last one sometimes wrong)
            m = len(right)
            tokens[1:m + 1] = right
            if wrong_last:
                tokens[m] = (tokens[m] + 1) % VOCAB
            parents[:m + 1] = list(range(-1, m))
            event("verify item with the target's choices")
    item.tree.tokens.extend(tokens)
    item.tree.parents.extend(parents)
    return item


@st.composite
def verify_request(draw, pool=TARGET_IDS, roots: dict | None = None, greedy=None) -> target_pb2.VerifyRequest:
    n = draw(usually(st.integers(1, 3), st.sampled_from([0, 8])))
    return target_pb2.VerifyRequest(items=[draw(verify_item(pool, roots, greedy)) for _ in range(n)])


_DTYPES = {common_pb2.DTYPE_F32: (torch.float32, 4), common_pb2.DTYPE_BF16: (torch.bfloat16, 2),
           common_pb2.DTYPE_F16: (torch.float16, 2)}


@st.composite
def features(draw, width: int) -> common_pb2.Tensor | None:
    """Features of random rows: none, valid ``[rows, width]`` tensors of random values (scaled
    normals, some NaN / inf / huge / subnormal entries, or raw random bytes), or a wrong shape,
    byte count, dtype, or an odd shape (negative, huge, zero-sized, many dimensions)."""
    kind = draw(st.sampled_from(["none", "valid", "valid", "valid", "valid", "shape", "bytes", "dtype", "odd_shape"]))
    if kind == "none":
        return None
    dtype = draw(st.sampled_from(sorted(_DTYPES)))
    torch_dtype, itemsize = _DTYPES[dtype]
    rows = draw(usually(st.integers(0, 4), st.sampled_from([CONTEXT - 8, CONTEXT + 1, 100])))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    if kind == "odd_shape":
        shape = draw(st.sampled_from([[2**62, 2**62, 0], [0, 2**63 - 1], [-1, width], [rows, -width], [], [1] * 70,
                                      [0] * 40, [2**31, width], [width], [rows, width, 1]]))
        numel = 1
        for d in shape:
            numel *= max(d, 0)
        nbytes = numel * itemsize if numel * itemsize < 1 << 16 else rng.randrange(0, 64)
        return common_pb2.Tensor(dtype=dtype, shape=shape, data=rng.randbytes(nbytes))
    values = "normal"
    if kind == "valid":
        values = draw(st.sampled_from(["normal", "normal", "special", "bytes"]))
    if values == "bytes":
        data = rng.randbytes(rows * width * itemsize)
    else:
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        t = torch.randn(rows, width, generator=gen) * draw(st.sampled_from([0.1, 1.0, 100.0]))
        if values == "special" and t.numel():
            for _ in range(draw(st.integers(1, 3))):
                t.view(-1)[rng.randrange(t.numel())] = draw(st.sampled_from(
                    [float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e-40, -0.0, 65504.0, 7e4]))
        data = t.to(torch_dtype).contiguous().view(torch.uint8).numpy().tobytes()
    shape = [rows, width]
    if kind == "shape":
        shape = draw(st.sampled_from([[rows, width + 1], [rows, width - 1], [rows * width], [1, rows, width],
                                      [width, rows]]))
        if shape[-1] == width + 1 or shape[-1] == width - 1:
            data = rng.randbytes(rows * shape[-1] * itemsize)
    elif kind == "bytes":
        data = data[: len(data) - draw(st.integers(1, itemsize))] if data else rng.randbytes(draw(st.integers(1, 7)))
        if draw(st.booleans()):
            data += rng.randbytes(draw(st.integers(1, 9)))
    elif kind == "dtype":
        dtype = draw(st.sampled_from([common_pb2.DTYPE_UNSPECIFIED, 4, 99, -1, INT32[1]]))
    return common_pb2.Tensor(dtype=dtype, shape=shape, data=data)


def _rows(t: common_pb2.Tensor | None) -> int | None:
    """Rows of a feature tensor that decodes as ``[rows, W]``, None if it does not decode."""
    if t is None:
        return 0
    try:
        return int(tensor_from_proto(t).shape[0]) if len(t.shape) == 2 else None
    except Exception:  # noqa: BLE001
        return None


@st.composite
def propose_item(draw, width: int, pool=DRAFT_IDS, held: dict | None = None) -> draft_pb2.ProposeItem:
    sid = draw(session_ids(pool))
    item = draft_pb2.ProposeItem(session_id=sid)
    f = draw(features(width))
    if f is not None:
        item.features.CopyFrom(f)
    item.root_token = draw(usually(st.integers(0, VOCAB - 1), odd_tokens, 6))
    rows, h = _rows(f), (held or {}).get(sid, 0)
    if rows is not None and draw(st.integers(0, 3)):
        item.committed_length = h + rows
    else:
        item.committed_length = draw(odd_ints)
    tree = item.tree
    tree.budget = draw(usually(st.integers(0, 12), st.one_of(odd_ints, st.sampled_from([1024, 1025]))))
    tree.top_k = draw(usually(st.integers(0, 5), st.one_of(odd_ints, st.sampled_from([VOCAB, VOCAB + 1]))))
    tree.max_depth = draw(usually(st.integers(0, 7), st.one_of(odd_ints, st.sampled_from([8, 100]))))
    return item


@st.composite
def propose_request(draw, width: int, pool=DRAFT_IDS, held=None) -> draft_pb2.ProposeRequest:
    n = draw(usually(st.integers(1, 3), st.sampled_from([0, SLOTS + 2])))
    return draft_pb2.ProposeRequest(items=[draw(propose_item(width, pool, held)) for _ in range(n)])


@st.composite
def release_request(draw, pool=TARGET_IDS + DRAFT_IDS) -> common_pb2.ReleaseRequest:
    ids = draw(st.lists(session_ids(pool), max_size=draw(usually(st.just(4), st.just(300)))))
    return common_pb2.ReleaseRequest(session_ids=ids)


@st.composite
def mutated(draw, message) -> bytes:
    """``message`` serialized, then truncated, a byte flipped, random bytes inserted or appended,
    or left intact."""
    raw = bytearray(message.SerializeToString())
    kind = draw(st.sampled_from(["intact", "truncate", "flip", "insert", "append"]))
    if kind == "truncate" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif kind == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] ^= draw(st.integers(1, 255))
    elif kind == "insert":
        i = draw(st.integers(0, len(raw)))
        raw[i:i] = draw(st.binary(min_size=1, max_size=8))
    elif kind == "append":
        raw += draw(st.binary(min_size=1, max_size=16))
    return bytes(raw)


# --------------------------------------------------------------------------------------------
# The services, the live session and its references


def greedy(engine, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding: the first ``n`` tokens after ``prompt`` (prefill, then
    root-only verifies) on a reference engine of its own."""
    from runtime.sampling import Sampling

    sid = f"greedy-{uuid.uuid4().hex}"
    out = [engine.prefill(sid, list(prompt), Sampling.checked(0.0, 0, 0.0, 0), []).first_token]
    try:
        while len(out) < n and engine.sessions[sid].length < engine.max_context:
            out.append(engine.verify(sid, [out[-1]], [-1]).bonus_token)
    finally:
        engine.release([sid])
    return out


class Live:
    """The session of another owner that the fuzz must not disturb: opened on both services by
    :data:`LIVE_MD`, on long-lived streams of its own; :meth:`step` advances it and checks it."""

    def __init__(self, env: "Env"):
        from draft_service.servicer import DraftServiceServicer

        self.env = env
        self.expected = greedy(env.ref_target, LIVE_PROMPT, CONTEXT)
        # an untouched drafter of the same file, fed what the live drafter session is fed
        ref = DraftServiceServicer.from_paths(env.drafter_path, env.target_path, max_sessions=1, max_context=CONTEXT)
        ref.close()
        self.ref_drafter = ref.engine
        self.verify = self.propose = None
        self.steps = self.spec_steps = self.restarts = 0
        self.streams()
        self.start()

    def streams(self, force: bool = False) -> None:
        """(Re)open the live owner's Verify and Propose streams when ``force``d or half their
        deadline has passed."""
        if not force and self.verify is not None and time.monotonic() - self.verify.opened < LIVE_STREAM_S / 2:
            return
        for old in (self.verify, self.propose):
            if old is not None:
                old.cancel()
        self.verify = Stream(self.env.target.Verify, LIVE_MD, LIVE_STREAM_S)
        self.propose = Stream(self.env.draft.Propose, LIVE_MD, LIVE_STREAM_S)

    def start(self) -> None:
        item = target_pb2.PrefillItem(session_id=LIVE_ID, prompt_tokens=LIVE_PROMPT, feature_layer_ids=self.env.layers)
        res = self.env.target.Prefill(target_pb2.PrefillRequest(items=[item]), metadata=LIVE_MD, timeout=CALL_TIMEOUT).results[0]
        assert res.first_token == self.expected[0]
        self.root, self.length, self.emitted = res.first_token, res.committed_length, 1
        self.pending = [res.features]   # features the drafter has not been sent yet
        self._tree(7)   # the drafter session opens now: the id is never free for another owner

    def reset(self) -> None:
        """Start over after a failure (whatever state the services are in)."""
        self.env.tloop.release([LIVE_ID])
        self.env.dservicer.loop.release([LIVE_ID])
        self.ref_drafter.release([LIVE_ID])
        self.streams(force=True)
        self.start()

    def restart(self) -> None:
        assert self.env.target.Release(common_pb2.ReleaseRequest(session_ids=[LIVE_ID]), metadata=LIVE_MD,
                                       timeout=CALL_TIMEOUT).released == 1
        assert self.env.draft.Release(common_pb2.ReleaseRequest(session_ids=[LIVE_ID]), metadata=LIVE_MD,
                                      timeout=CALL_TIMEOUT).released == 1
        self.ref_drafter.release([LIVE_ID])
        self.restarts += 1
        self.start()

    def _tree(self, depth: int) -> tuple[list[int], list[int]]:
        """The live drafter session's tree (a chain or a DDTree, alternately), checked against the
        reference drafter's."""
        from draft_service.batched import DraftItem
        from orchestrator.scheduler import join_features

        feats = join_features(self.pending)
        budget, top_k = (0, 0) if self.spec_steps % 2 else (6, 3)
        item = draft_pb2.ProposeItem(session_id=LIVE_ID, root_token=self.root, committed_length=self.length,
                                     tree=draft_pb2.TreeParams(budget=budget, top_k=top_k, max_depth=depth))
        if feats is not None:
            item.features.CopyFrom(feats)
        (res,) = self.propose.send(draft_pb2.ProposeRequest(items=[item])).results
        assert res.status.code == OK_ITEM, f"the live drafter session was disturbed: {res.status}"
        (want,) = self.ref_drafter.propose_batch([DraftItem(LIVE_ID, tensor_from_proto(feats) if feats is not None else None,
                                                            self.root, self.length, budget, top_k, depth)])
        assert (list(res.tree.tokens), list(res.tree.parents)) == (want.tokens, want.parents), \
            "the live drafter session proposes other trees than an untouched drafter"
        self.pending = []
        return list(res.tree.tokens), list(res.tree.parents)

    def step(self, spec: bool) -> None:
        self.streams()
        room = CONTEXT - self.length - 1   # deepest node the context still takes
        if room < 0:
            self.restart()
            room = CONTEXT - self.length - 1
        tokens, parents = [self.root], [-1]
        if spec and room >= 1:
            tokens, parents = self._tree(min(7, room))
            self.spec_steps += 1
        item = target_pb2.VerifyItem(session_id=LIVE_ID, tree=common_pb2.TokenTree(tokens=tokens, parents=parents))
        (res,) = self.verify.send(target_pb2.VerifyRequest(items=[item])).results
        assert res.status.code == OK_ITEM, f"the live session was disturbed: {res.status}"
        got = list(res.accepted_tokens) + [res.bonus_token]
        want = self.expected[self.emitted:self.emitted + len(got)]
        assert got == want, f"the live session decodes {got}, target-only greedy decoding {want}"
        assert res.committed_length == self.length + len(got)
        self.root, self.length, self.emitted = res.bonus_token, res.committed_length, self.emitted + len(got)
        self.pending.append(res.features)
        self.steps += 1


class Env:
    """The services, stubs for them, the live session and the reference engine."""

    def __init__(self, target_path, drafter_path, tloop, tport, dservicer, dport):
        from target_service.__main__ import build_engine

        self.target_path, self.drafter_path = target_path, drafter_path
        self.tloop, self.tport, self.dservicer, self.dport = tloop, tport, dservicer, dport
        self.tchannel = grpc.insecure_channel(f"127.0.0.1:{tport}", options=GRPC_OPTIONS)
        self.dchannel = grpc.insecure_channel(f"127.0.0.1:{dport}", options=GRPC_OPTIONS)
        self.target = target_pb2_grpc.TargetServiceStub(self.tchannel)
        self.draft = draft_pb2_grpc.DraftServiceStub(self.dchannel)
        dinfo = self.draft.Info(draft_pb2.DrafterInfoRequest(), metadata=(AUTH,), timeout=CALL_TIMEOUT)
        self.layers = list(dinfo.target_layer_ids)
        assert dinfo.model.hidden_size == HIDDEN
        self.width = len(self.layers) * dinfo.model.hidden_size
        self.ref_target, _ = build_engine(target_path, max_sessions=1, max_context=CONTEXT)
        self._greedy: dict[tuple, list[int]] = {}
        self.live = Live(self)
        self.examples = 0
        self.calls = 0   # calls made (a stream message counts as one)
        self.items = 0   # items of the replies checked

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        if len(self._greedy.get(key, ())) < n:
            self._greedy[key] = greedy(self.ref_target, prompt, max(n, 8))
        return self._greedy[key][:n]

    def free_slots(self) -> tuple[int, int]:
        t = self.target.Info(target_pb2.TargetInfoRequest(), metadata=(AUTH,), timeout=CALL_TIMEOUT).free_slots
        d = self.draft.Info(draft_pb2.DrafterInfoRequest(), metadata=(AUTH,), timeout=CALL_TIMEOUT).model.free_slots
        return t, d

    def healthy(self) -> None:
        for ch in (self.tchannel, self.dchannel):
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def held(self) -> tuple[list[str], list[str]]:
        """Session ids the target and the drafter hold now (read on their loops)."""
        return (sorted(self.tloop.call(lambda: list(self.tloop.engine.sessions))),
                sorted(self.dservicer.loop.call(lambda: list(self.dservicer.engine.sessions))))

    def settle(self, ex: "Example", wait: float = 0.0) -> None:
        """After an example: both services alive; release what the example opened (by its owner);
        every slot but the live session's free (waiting up to ``wait`` seconds, for releases in
        flight elsewhere); one step of the live session."""
        self.healthy()
        for stub, opened in ((self.target, list(ex.t_open.items())), (self.draft, list(ex.d_open.items()) + ex.d_maybe)):
            for sid, md in opened:
                with contextlib.suppress(grpc.RpcError):   # UNAUTHENTICATED: that call opened nothing either
                    stub.Release(common_pb2.ReleaseRequest(session_ids=[sid]), metadata=md, timeout=CALL_TIMEOUT)
        want = ([LIVE_ID], [LIVE_ID])
        deadline = time.monotonic() + wait
        while self.held() != want and time.monotonic() < deadline:
            time.sleep(0.02)
        held = self.held()
        assert held == want, f"sessions leaked (target, drafter): {held}; the example opened {ex.t_open} {ex.d_open}"
        assert self.free_slots() == (SLOTS - 1, SLOTS - 1)
        self.examples += 1
        self.items += ex.items
        self.live.step(spec=self.examples % SPEC_EVERY == 0)

    def clean(self) -> None:
        """After a failure: free every session (trusted, on the loops) and start the live session
        over, so that the next example (and shrinking) starts clean."""
        held = self.held()
        self.tloop.release([sid for sid in held[0] if sid != LIVE_ID])
        self.dservicer.loop.release([sid for sid in held[1] if sid != LIVE_ID])
        self.live.reset()

    @contextlib.contextmanager
    def example(self, wait: float = 0.0):
        """One example: yields its :class:`Example`; then :meth:`settle` (or, when it failed,
        :meth:`clean`, so that the next one starts clean)."""
        ex = Example()
        try:
            yield ex
            self.settle(ex, wait)
        except BaseException:
            self.clean()
            raise

    def close(self) -> None:
        self.live.verify.cancel()
        self.live.propose.cancel()
        self.tchannel.close()
        self.dchannel.close()


class Example:
    """What one example opened (session id -> the metadata that opened it) and knows (roots,
    drafter rows held) on each service."""

    def __init__(self):
        self.t_open: dict[str, tuple] = {}
        self.d_open: dict[str, tuple] = {}
        self.roots: dict[str, int] = {}
        self.history: dict[str, list[int]] = {}   # greedy sessions: committed tokens + root
        self.d_held: dict[str, int] = {}
        self.d_maybe: list[tuple[str, tuple]] = []   # drafter sessions a cancelled message may have opened
        self.items = 0   # items sent in the replies seen (calls are counted apart)

    def prefilled(self, request: target_pb2.PrefillRequest, reply: target_pb2.PrefillResponse, md) -> None:
        assert len(reply.results) == len(request.items)
        self.items += len(request.items)
        for item, res in zip(request.items, reply.results):
            assert res.session_id == item.session_id and res.session_id != LIVE_ID
            assert res.committed_length == len(item.prompt_tokens) and 0 <= res.first_token < VOCAB
            if item.feature_layer_ids:
                assert list(res.features.shape) == [len(item.prompt_tokens), len(set(item.feature_layer_ids)) * HIDDEN]
            self.t_open[res.session_id] = md
            self.roots[res.session_id] = res.first_token
            if item.sampling.temperature == 0:
                self.history[res.session_id] = list(item.prompt_tokens) + [res.first_token]
            event("prefill item opened a session")

    def verified(self, request: target_pb2.VerifyRequest, reply: target_pb2.VerifyResponse) -> None:
        assert len(reply.results) == len(request.items)
        self.items += len(request.items)
        for item, res in zip(request.items, reply.results):
            assert res.session_id == item.session_id
            if check_item_status(res.status, item) == OK_ITEM:
                assert item.session_id != LIVE_ID, "a fuzz owner verified the live session"
                k = len(res.accepted_tokens)
                assert len(res.accepted_nodes) == k + 1 and res.accepted_nodes[0] == 0
                assert 0 <= res.bonus_token < VOCAB
                self.roots[item.session_id] = res.bonus_token
                if item.session_id in self.history:
                    self.history[item.session_id] += list(res.accepted_tokens) + [res.bonus_token]
                event("verify item ok, draft tokens accepted" if k else "verify item ok")
        for item in request.items:   # a root now unknown, if two items of one message named it
            if sum(i.session_id == item.session_id for i in request.items) > 1:
                self.roots.pop(item.session_id, None)
                self.history.pop(item.session_id, None)

    def continuation(self, env: "Env", sid: str, n: int) -> list[int] | None:
        """The target's next ``n`` greedy tokens after the root of ``sid`` (None: unknown)."""
        h = self.history.get(sid)
        if h is None or n < 1 or len(h) >= CONTEXT - 1:
            return None
        return env.greedy(h, n + 1)[:n]

    def proposed(self, request: draft_pb2.ProposeRequest, reply: draft_pb2.ProposeResponse, md) -> None:
        assert len(reply.results) == len(request.items)
        self.items += len(request.items)
        for item, res in zip(request.items, reply.results):
            assert res.session_id == item.session_id
            if check_item_status(res.status, item) != OK_ITEM:
                continue
            assert item.session_id != LIVE_ID, "a fuzz owner used the live drafter session"
            tokens, parents = list(res.tree.tokens), list(res.tree.parents)
            assert tokens and tokens[0] == item.root_token and all(0 <= t < VOCAB for t in tokens)
            depth = tree_depths(parents)
            assert len(parents) == len(tokens) and max(depth) <= 7
            self.d_open.setdefault(item.session_id, md)
            self.d_held[item.session_id] = item.committed_length
            event("propose item ok")

    def stream_cancelled(self) -> None:
        """A stream was cancelled with replies unread: what its items did is unknown."""
        self.roots.clear()
        self.history.clear()
        self.d_held.clear()


@contextlib.contextmanager
def target_service(model_path: str):
    """The target in this process as tests/conftest.py's ``target_in_process`` builds it, behind
    the token; yields ``(loop, port)`` (the loop: to free what a failed example leaked, so that
    the next one starts clean)."""
    from dflash_grpc.serving import make_server
    from runtime.step_loop import StepLoop
    from target_service.__main__ import build_engine
    from target_service.servicer import TargetServicer

    engine, info = build_engine(model_path, max_sessions=SLOTS, max_context=CONTEXT)
    loop = StepLoop(engine, name="fuzz-rpc-target")
    servicer = TargetServicer(loop, info)

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    try:
        server, _, port = make_server(add, "127.0.0.1:0", max_workers=8, auth_token=TOKEN)
        try:
            yield loop, port
        finally:
            server.stop(None)
    finally:
        loop.stop()


@pytest.fixture(scope="module")
def env(tiny_llama, tiny_drafter):
    assert tiny_llama.vocab == VOCAB
    with target_service(tiny_llama.path) as (tloop, tport), \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=SLOTS, max_context=CONTEXT, max_workers=8,
                             auth_token=TOKEN) as (dservicer, dport):
        e = Env(tiny_llama.path, tiny_drafter, tloop, tport, dservicer, dport)
        try:
            yield e
        finally:
            e.close()


@pytest.fixture(scope="module")
def orch(env):
    """``(GenerationService stub, servicer)``: the orchestrator in this process against ``env``'s
    services, with the token and an owner name of its own."""
    md = [AUTH, (OWNER_KEY, ORCH_NAME), (EPOCH_KEY, uuid.uuid4().hex)]
    with orchestrator_in_process(env.target_path, env.tport, env.dport, max_sessions=SLOTS - 1, max_queue=8,
                                 metadata=md, step_timeout=30.0) as (servicer, port):
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
            yield generation_pb2_grpc.GenerationServiceStub(ch), servicer, ch


# --------------------------------------------------------------------------------------------
# The target service


def _stream(env: Env, ex: Example, data, method, md, draw_request, check, what: str, opens: bool = False) -> None:
    """A stream of a few messages, each drawn after the previous reply (``draw_request()``), its
    reply checked (``check(request, reply)``); sometimes cancelled with a reply unread (``opens``:
    the unread message may have opened drafter sessions). A stream that fails (an allowed status)
    still draws its remaining messages: what an example draws never depends on the answers."""
    n = data.draw(usually(st.integers(1, 4), st.sampled_from([0, 12])), label="messages")
    cancel_at = data.draw(usually(st.none(), st.integers(0, max(0, n - 1)), 6), label="cancel at")
    stream, alive = Stream(method, md), True
    for i in range(n):
        request = draw_request()
        if not alive:
            continue
        try:
            if cancel_at == i:
                stream._q.put(request)   # sent, its reply never read
                if opens:
                    ex.d_maybe += [(item.session_id, md) for item in request.items]
                stream.cancel()
                ex.stream_cancelled()
                event(f"{what} stream cancelled")
                return
            env.calls += 1
            check(request, stream.send(request))
            if i == n - 1:
                stream.finish()
        except grpc.RpcError as e:
            refused(e, f"{what} stream")
            stream.cancel()
            ex.stream_cancelled()
            alive = False
    if n == 0:
        try:
            stream.finish()
        except grpc.RpcError as e:
            refused(e, f"{what} stream")


def _verify_stream(env: Env, ex: Example, data, md) -> None:
    greedy = lambda sid, n: ex.continuation(env, sid, n)  # noqa: E731
    _stream(env, ex, data, env.target.Verify, md,
            lambda: data.draw(verify_request(sorted(ex.t_open) or TARGET_IDS, ex.roots, greedy), label="verify"),
            ex.verified, "verify")


@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_fuzz_target_service(env, data):
    """Random programs of Prefill, Verify streams, Release and Info on the target."""
    with env.example() as ex:
        md = None
        if data.draw(st.integers(0, 3), label="open sessions first"):   # sessions for the calls to work on
            md = data.draw(st.sampled_from([(AUTH,), (AUTH, (OWNER_KEY, "fuzz-a"), (EPOCH_KEY, "e1")),
                                            (AUTH, (OWNER_KEY, "fuzz-b"), (EPOCH_KEY, "e2"))]), label="opener")
            n = data.draw(st.integers(1, 3), label="sessions")
            request = target_pb2.PrefillRequest(items=[data.draw(good_prefill_item([sid]), label="prompt")
                                                       for sid in TARGET_IDS[:n]])
            reply = stub_call(env.target.Prefill, request, md)
            if reply is not None:
                ex.prefilled(request, reply, md)
        for _ in range(data.draw(st.integers(1, 4), label="calls")):
            md = next_metadata(data, md, ex.t_open)
            op = data.draw(st.sampled_from(["prefill", "prefill", "verify", "verify", "verify", "release", "info"]), label="op")
            event(f"target {op}")
            env.calls += 1
            if op == "prefill":
                request = data.draw(prefill_request(TARGET_IDS), label="prefill")
                reply = stub_call(env.target.Prefill, request, md)
                if reply is not None:
                    ex.prefilled(request, reply, md)
            elif op == "verify":
                _verify_stream(env, ex, data, md)
            elif op == "release":
                request = data.draw(release_request(TARGET_IDS + sorted(ex.t_open)), label="release")
                reply = stub_call(env.target.Release, request, md)
                if reply is not None:
                    assert 0 <= reply.released <= len(set(request.session_ids))
            else:
                reply = stub_call(env.target.Info, target_pb2.TargetInfoRequest(), md)
                if reply is not None:
                    assert reply.vocab_size == VOCAB and reply.max_context == CONTEXT and 0 <= reply.free_slots <= SLOTS


# --------------------------------------------------------------------------------------------
# The draft service


@settings(FUZZ, max_examples=90)
@given(data=st.data())
def test_fuzz_draft_service(env, data):
    """Random programs of Propose streams, Release and Info on the drafter."""
    with env.example() as ex:
        md = None
        for _ in range(data.draw(st.integers(1, 3), label="calls")):
            md = next_metadata(data, md, ex.d_open)
            op = data.draw(st.sampled_from(["propose", "propose", "propose", "release", "info"]), label="op")
            event(f"draft {op}")
            env.calls += 1
            if op == "propose":
                _propose_stream(env, ex, data, md)
            elif op == "release":
                request = data.draw(release_request(DRAFT_IDS + sorted(ex.d_open)), label="release")
                reply = stub_call(env.draft.Release, request, md)
                if reply is not None:
                    assert 0 <= reply.released <= len(set(request.session_ids))
            else:
                reply = stub_call(env.draft.Info, draft_pb2.DrafterInfoRequest(), md)
                if reply is not None:
                    assert reply.model.vocab_size == VOCAB and list(reply.target_layer_ids) == env.layers


def _propose_stream(env: Env, ex: Example, data, md) -> None:
    _stream(env, ex, data, env.draft.Propose, md,
            lambda: data.draw(propose_request(env.width, sorted(set(DRAFT_IDS) | set(ex.d_open)), ex.d_held), label="propose"),
            lambda request, reply: ex.proposed(request, reply, md), "propose", opens=True)


# --------------------------------------------------------------------------------------------
# Raw bytes and mutated messages to every method


@st.composite
def raw_message(draw, method: str, request_type, width: int) -> bytes:
    """Random bytes, or a message of the method's type (random fields) serialized and mutated."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=300))
    if request_type is target_pb2.PrefillRequest:
        msg = draw(prefill_request())
    elif request_type is target_pb2.VerifyRequest:
        msg = draw(verify_request())
    elif request_type is draft_pb2.ProposeRequest:
        msg = draw(propose_request(width))
    elif request_type is common_pb2.ReleaseRequest:
        msg = draw(release_request())
    elif request_type is generation_pb2.GenerateRequest:
        msg = draw(generate_requests())
    else:
        msg = request_type()
    return draw(mutated(msg))


def _raw_call(channel, path: str, kind: str, raws: list[bytes], md) -> list[bytes]:
    """Send raw request bytes; return the raw replies received (those before a refusal, which
    must have an allowed status, too)."""
    replies: list[bytes] = []
    try:
        if kind == "unary":
            replies.append(channel.unary_unary(path)(raws[0], metadata=md, timeout=CALL_TIMEOUT))
        elif kind == "server_stream":
            replies.extend(channel.unary_stream(path)(raws[0], metadata=md, timeout=CALL_TIMEOUT))
        else:
            replies.extend(channel.stream_stream(path)(iter(raws), metadata=md, timeout=CALL_TIMEOUT))
    except grpc.RpcError as e:
        refused(e, f"{path} {raws!r}")
    return replies


@FUZZ
@given(data=st.data())
def test_fuzz_raw_bytes_every_method(env, orch, data):
    """Random bytes and mutated messages as the request of every method of the three services;
    what a reply says was opened is released like any other example's."""
    stub, servicer, och = orch
    service = data.draw(st.sampled_from(["target", "draft", "generation"]), label="service")
    methods, channel, full = {"target": (TARGET_METHODS, env.tchannel, "dflash_grpc.v1.TargetService"),
                              "draft": (DRAFT_METHODS, env.dchannel, "dflash_grpc.v1.DraftService"),
                              "generation": (GENERATION_METHODS, och, "dflash_grpc.v1.GenerationService")}[service]
    name = data.draw(st.sampled_from(sorted(methods)), label="method")
    kind, request_type, reply_type = methods[name]
    event(f"raw {service}.{name}")
    md = data.draw(metadata(), label="metadata") if service != "generation" else ()
    n = data.draw(st.integers(1, 3)) if kind == "stream" else 1
    raws = [data.draw(raw_message(name, request_type, env.width), label="raw") for _ in range(n)]
    with env.example(wait=10.0 if service == "generation" else 0.0) as ex:   # the orchestrator releases asynchronously
        replies = _raw_call(channel, f"/{full}/{name}", kind, raws, md)
        env.calls += 1
        for raw in replies:
            reply = reply_type.FromString(raw)
            if reply_type is target_pb2.PrefillResponse:   # a message that still decodes may open sessions
                for res in reply.results:
                    ex.t_open[res.session_id] = md
            elif reply_type is draft_pb2.ProposeResponse:
                for res in reply.results:
                    check_item_status(res.status, "raw propose")
                    if res.status.code == OK_ITEM:
                        ex.d_open.setdefault(res.session_id, md)
            elif reply_type is target_pb2.VerifyResponse:
                for res in reply.results:
                    check_item_status(res.status, "raw verify")
                    assert not (res.session_id == LIVE_ID and res.status.code == OK_ITEM)
    _orchestrator_idle(servicer)


# --------------------------------------------------------------------------------------------
# The public service beside the live session


def _orchestrator_idle(servicer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = servicer.scheduler.status()
        if s.active_sessions == 0 and s.queued_requests == 0:
            return
        assert time.monotonic() < deadline, f"the scheduler still holds requests: {s}"
        time.sleep(0.02)


def _prompt_ids(servicer, req: generation_pb2.GenerateRequest) -> list[int] | None:
    which = req.WhichOneof("input")
    if which == "prompt_tokens":
        return list(req.prompt_tokens.ids)
    if which == "prompt":
        return servicer.tokenizer.encode(req.prompt, add_special_tokens=True)
    return None


@settings(FUZZ, max_examples=40)
@given(req=generate_requests(), cancel_after=usually(st.none(), st.integers(0, 3), 4))
def test_fuzz_generate_beside_a_live_session(env, orch, req, cancel_after):
    """Generate requests (tests/test_fuzz_api.py's strategy), some cancelled by the client after a
    few messages, through an orchestrator that shares the services with the live session: every
    answer a finished stream or an allowed refusal, greedy outputs those of target-only decoding,
    then GetStats and Info answer, the scheduler and every slot it used are free again."""
    stub, servicer, _ = orch
    env.calls += 3
    call = stub.Generate(req, timeout=CALL_TIMEOUT)
    msgs = []
    try:
        for m in call:
            msgs.append(m)
            if cancel_after is not None and len(msgs) > cancel_after:
                call.cancel()
    except grpc.RpcError as e:
        code = refused(e, req)
        assert code != grpc.StatusCode.UNAVAILABLE
        assert code != grpc.StatusCode.CANCELLED or cancel_after is not None
    else:
        assert msgs and msgs[-1].finished and not any(m.finished for m in msgs[:-1])
        event(f"finished: {generation_pb2.FinishReason.Name(msgs[-1].finish_reason)}")
    tokens = [t for m in msgs for t in m.token_ids]
    prompt = _prompt_ids(servicer, req)
    greedy_req = req.sampling.temperature == 0.0 and not req.stop
    if tokens and prompt is not None and greedy_req:
        assert tokens == env.greedy(prompt, len(tokens)), f"Generate is not target-only greedy decoding for {req}"
        event("greedy output checked")
    stats = stub.GetStats(generation_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT)
    assert stats.requests >= 0
    info = stub.Info(generation_pb2.ServiceInfoRequest(), timeout=CALL_TIMEOUT)
    assert info.target.vocab_size == VOCAB and info.drafter.available
    _orchestrator_idle(servicer)
    env.settle(Example(), wait=10.0)


def test_live_session_kept_decoding(env):
    """The fuzz ran (thousands of calls and items), and the live session went through it, one
    step per example (also after the fuzz: one more step)."""
    env.settle(Example())
    print(f"fuzz: {env.examples} examples, {env.calls} calls, {env.items} items; the live session: "
          f"{env.live.steps} steps ({env.live.spec_steps} speculative), {env.live.restarts} restarts")
    assert env.calls + env.items > 1500 and env.live.steps > 300 and env.live.spec_steps > 80


@pytest.mark.parametrize("item", [
    target_pb2.PrefillItem(session_id=LIVE_ID, prompt_tokens=[]),                                  # empty prompt
    target_pb2.PrefillItem(session_id=LIVE_ID, prompt_tokens=[1, 2], feature_layer_ids=[0, 0]),  # a layer twice
    target_pb2.PrefillItem(session_id=LIVE_ID, prompt_tokens=[1, VOCAB]),                        # outside the vocabulary
    target_pb2.PrefillItem(session_id=LIVE_ID, prompt_tokens=[1] * CONTEXT),                     # too long
    target_pb2.PrefillItem(session_id=LIVE_ID, prompt_tokens=[1, 2]),                            # the id is taken
], ids=["empty", "layer-twice", "token", "too-long", "exists"])
def test_refused_prefill_naming_a_live_session_leaves_it(env, item):
    """Found by this fuzzer: a Prefill refused by the reference engine's checks (empty prompt, a
    feature layer named twice, ...) for the id of a live session released that session (the step
    loop frees the session of a failed prefill job, and the checks ran inside the job)."""
    md = (AUTH, (OWNER_KEY, "fuzz-a"), (EPOCH_KEY, "e1"))
    with pytest.raises(grpc.RpcError) as ei:
        env.target.Prefill(target_pb2.PrefillRequest(items=[item]), metadata=md, timeout=CALL_TIMEOUT)
    assert ei.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    with env.example():
        pass   # the live session is still there, and decodes on


@pytest.mark.parametrize("shape", [[2**62, 2**62, 0], [0, 2**62, 2**62], [2**31] * 3 + [0]])
def test_huge_zero_sized_features_are_invalid_argument(env, shape):
    """Found by this fuzzer: features of a zero-sized shape whose other sizes multiply past int64
    failed the whole Propose stream with UNKNOWN (torch's 'Storage size calculation overflowed');
    they are the item's INVALID_FEATURES now, and the stream goes on."""
    md = (AUTH, (OWNER_KEY, "fuzz-a"), (EPOCH_KEY, "e1"))
    bad = draft_pb2.ProposeItem(session_id="p", root_token=1, committed_length=0,
                                features=common_pb2.Tensor(dtype=common_pb2.DTYPE_BF16, shape=shape))
    good = draft_pb2.ProposeItem(session_id="q", root_token=1, committed_length=0)
    with env.example() as ex:
        stream = Stream(env.draft.Propose, md)
        for _ in range(2):   # the stream survives the bad item
            request = draft_pb2.ProposeRequest(items=[bad, good])
            reply = stream.send(request)
            assert [r.status.reason for r in reply.results] == ["INVALID_FEATURES", ""]
            ex.proposed(request, reply, md)
            good.committed_length = 0
            good.session_id = "r" if good.session_id == "q" else "q"
        stream.finish()
