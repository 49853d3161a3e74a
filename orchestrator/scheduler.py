"""The orchestrator's batching scheduler (docs/ARCHITECTURE.md, "Serving many sessions").

One thread runs every request of the process. Each tick it gathers one item per active request
into **one** ``ProposeRequest`` (over one Propose stream to the draft service) and **one**
``VerifyRequest`` (over one Verify stream to the target), then hands every request its tokens::

    queue --admit--> prefill (unary, asynchronous) --> active --tick--> tokens to the handler
                                                          ^     |
                                                          +-----+  until EOS, max_tokens, stop
                                                                   string, cancel, deadline

Requests join and leave between ticks (continuous batching). A request's tokens do not depend
on its batch: each item is verified against its own session, the target's batched step is
batch-invariant, and the tree (whose size does depend on the batch) never changes the tokens,
only how many arrive per step.

Admission: at most ``max_sessions`` requests hold a session; up to ``max_queue`` more wait
(oldest first); beyond that :meth:`Scheduler.submit` raises :class:`Rejected`
(RESOURCE_EXHAUSTED, reason ``QUEUE_FULL``) at once. When the target refuses a prefill for want
of a slot (slots held by another client: reason ``NO_FREE_SLOT``), the request goes back to the
head of the queue. Refusals are told apart by their reason code (``ItemStatus.reason``, or the
trailing metadata of a refused call: :func:`dflash_grpc.transport.reason_of`), never by their
message text.

Faults: a drafter failure (RPC error, a missed deadline, or an item error) never fails a
request: the tick goes on with root-only trees (plain autoregressive decoding). A request keeps
only the feature rows its drafter session does not have yet (normally one tick's); when the
drafter is back, the target recomputes the rows of each lost session's committed tokens (a
prefill into a scratch session: :meth:`Scheduler._start_refeatures`), its drafter session is
re-created from them and speculation resumes. A target failure ends
every request of the batch with UNAVAILABLE (reason ``TARGET_UNAVAILABLE``) after the tokens
already delivered; the Verify stream is re-opened on the next tick, so a restarted target serves
new requests.

Drafter deadlines and circuit breaker (docs/ARCHITECTURE.md, same heading): a drafter that is
slow or stopped (not dead: its connection stays open) must not stall the ticks. Each Propose
exchange gets a deadline (:class:`orchestrator.peers.DraftDeadline`): ``draft_deadline_factor``
times the moving average of the drafter's successful round trips, clamped to
``[draft_deadline_min_ms, draft_deadline_ms]`` (``draft_deadline_ms`` until a round trip is
measured), plus ``draft_deadline_row_us`` per feature row of a new or re-created drafter session,
never more than ``step_timeout`` (the maximum and the per-row allowance default by the
drafter's device: :meth:`OrchestratorConfig.draft_deadline_for`). A miss (or a failed call)
makes that tick root-only for the requests it carried and opens the drafter's circuit
(:class:`orchestrator.peers.CircuitBreaker` in :class:`orchestrator.peers.DraftPeer`): no
Propose is sent, so ticks decode plainly at full speed with no wait, until the drafter answers a
background Info probe; the circuit is then half-open, the next tick sends one Propose, and its
answer in time closes the circuit. A stopped
drafter thus costs each stream one deadline, then nothing until it is back. The timed-out stream
is cancelled (its late reply can never pass for a later tick's) and a new one is opened when the
circuit lets a Propose through. The drafter may still hold the sessions of the lost exchange, in
an unknown state, so each affected request's drafter session is re-created under a new id
(``Request.draft_id``: ``session_id~generation``) and the old ids are released once the drafter
answers again (best effort; counted as held slots until answered, like every release). Deadline
misses and the circuit's state are counted in :mod:`orchestrator.metrics`
(``dflash_draft_deadline_misses_total``, ``dflash_draft_circuit``; misses are also fallbacks
with reason ``draft_deadline``) and shown in ``DrafterStatus.detail``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time

import grpc

from dflash_grpc import localhop
from dflash_grpc.columns import COLUMNAR, ColumnsError, Rows
from dflash_grpc.transport import reason_of
from dflash_grpc.v1 import common_pb2, draft_pb2, generation_pb2, target_pb2
from orchestrator import metrics
from orchestrator.config import OrchestratorConfig
from orchestrator.events import Events
from orchestrator.messages import (CheckedTrees, ProposeItems, RingRows, TreeChecker, join_rows, propose_results, verify_columns,
                                   verify_request)
from orchestrator.peers import (DirectStreamCall, DraftDeadline, DraftPeer, ExchangeTimeout, LocalHopCall, StreamCall,
                                StreamError, TargetPeer, drafter_mismatch, status_code)
from orchestrator.policy import BARE, DRAFT, PLAIN, DraftPolicy
from orchestrator.stats import AcceptanceStats
from runtime.errors import Reason
from runtime.tree import TreeError, tree_depths

log = logging.getLogger(__name__)

FINISH_EOS, FINISH_LENGTH, FINISH_CONTEXT = "eos", "length", "context"

#: the fewest items a Verify or Propose message carries as columns (where the peer reads them): below,
#: per item, which costs less for one or two items (tools/host_per_item.py, issue 23: at one item the
#: columnar Propose cost the draft service about 50 us more, at four items about 7 us less)
COLUMNS_FROM = 4

#: ticks a request's newest feature rows stay views of the Verify reply that brought them (the next
#: Propose sends them from there), before :meth:`Scheduler._compact` copies them out at once
KEEP_VIEWS = 8

#: most recomputes of lost drafter sessions' rows in flight on the target at once
#: (:meth:`Scheduler._start_refeatures`): each holds a target slot while its prefill runs
REFEATURES_AT_ONCE = 4

#: recomputes a request may try when the target fails them with one of :data:`_RETRIED`
REFEATURE_TRIES = 5

#: most drafter session ids kept for a later release (older ones are left to the drafter's idle reaper)
STALE_IDS = 4096
#: most bytes of feature rows beyond a step's worth (new, re-created or lagging drafter sessions: a prompt
#: or recomputed rows) that one Propose carries; the first such item always goes, the others past it decode
#: plainly this tick and go at a later one. Under a hundred or more streams every session may need its
#: rows at once (drafting resumes as the batch shrinks, or after a drafter failure: 128 sessions of
#: 230 rows of the shipped SmolLM2 pair's 5760-byte rows are 170 MB), which would stall the tick on the
#: drafter's eager appends and could pass the message limit (``dflash_grpc.transport.MAX_MESSAGE_BYTES``),
#: failing every time it is retried
RESYNC_BYTES = 32 << 20

def _spin_batch() -> int:
    """``DFLASH_HOP_SPIN_BATCH`` as an int (2 where unset or empty).

    Raises:
        ValueError: a value that is not an integer."""
    env = os.environ.get("DFLASH_HOP_SPIN_BATCH") or "2"
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"DFLASH_HOP_SPIN_BATCH must be an integer (requests), got {env!r}") from None


#: Most requests in a tick for which the scheduler's exchanges poll the same-host hop before
#: blocking (:meth:`Scheduler.hop_spin`); ``DFLASH_HOP_SPIN_BATCH`` sets another, for measuring.
SPIN_BATCH = _spin_batch()

#: a recompute that failed with one of these is tried again later (:meth:`Scheduler._collect_refeatures`)
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
            grpc.StatusCode.RESOURCE_EXHAUSTED)

#: a Release that failed with one of these may not have reached the service: it is sent again later
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.RESOURCE_EXHAUSTED)


class Rejected(Exception):
    """A request the scheduler will not take: ``code`` is its gRPC status, ``reason`` its
    :class:`~runtime.errors.Reason` (``QUEUE_FULL``, ``SHUTTING_DOWN``)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = ""):
        super().__init__(message)
        self.code = code
        self.reason = reason


@dataclasses.dataclass
class Tokens:
    """Event to a request's handler: new tokens; ``finish`` set on the last one."""

    tokens: list[int]
    finish: str | None = None


@dataclasses.dataclass
class Failure:
    """Event to a request's handler: the request ended with this status and reason code
    (a :class:`~runtime.errors.Reason` name, or ``""`` when there is none, e.g. CANCELLED)."""

    code: grpc.StatusCode
    message: str
    reason: str = ""


@dataclasses.dataclass(eq=False)
class Request:
    """One Generate call as the scheduler runs it.

    Args:
        session_id: the session's id on both services (unique per request).
        prompt: prompt token ids (already validated: in the vocabulary, shorter than the context).
        sampling: the target's sampling parameters.
        max_tokens: most tokens to emit (the prefill token included).
        tree: the tree the request asks for (``budget`` 0 = chain).
        speculative: the request allows drafting.
        eos: token ids that end the request (not emitted).
    """

    session_id: str
    prompt: list[int]
    sampling: common_pb2.SamplingParams
    max_tokens: int
    tree: draft_pb2.TreeParams
    speculative: bool = True
    eos: frozenset = frozenset()
    stats: AcceptanceStats = dataclasses.field(default_factory=lambda: AcceptanceStats(requests=1))
    events: Events = dataclasses.field(default_factory=Events)   # (its handler reads them: orchestrator.events)
    # runtime state, owned by the scheduler thread
    root: int = -1
    length: int = 0                 # L: committed rows on the target
    emitted: int = 0
    on_target: bool = False         # the target holds a session for it
    on_drafter: bool = False        # the drafter may hold a session for it (under draft_id)
    draft_gen: int = 0              # generation of its drafter session (draft_id); bumped to re-create it
    draft_synced: bool = False      # the drafter holds rows [0, L) of it
    # feature rows the drafter does not have yet: ``history`` holds the rows of committed positions
    # [rows_from, length), in order (Rows); a drafter session holds [0, rows_from) when synced
    history: list = dataclasses.field(default_factory=list)
    history_bytes: int = 0
    rows_from: int = 0
    # rows after ``history`` in the target's feature ring (RingRows, in one slot): ``ring_rows`` of
    # them, positions [length - ring_rows, length) of slot ``ring_slot`` (Scheduler._keep)
    ring_slot: int = -1
    ring_rows: int = 0
    keeping: bool = True            # rows are kept (False: its drafter session is lost, rows [0, L) to be
                                    # recomputed by the target first: Scheduler._start_refeatures)
    loose: int = 0                  # history[loose:] may be views of a Verify reply's buffer (Scheduler._keep)
    seq: list = dataclasses.field(default_factory=list)  # prompt + emitted tokens: [0, length) committed, then the root
    refeat_after: float = 0.0       # time.monotonic() before which no recompute of its rows is started
    refeat_tries: int = 0           # recomputes of its rows that failed
    t_first: float = 0.0
    tree_params: tuple | None = None   # (budget, top_k, max_depth or a large number) of ``tree``, once read
    flush_at: float = 0.0           # its tokens are handed to the handler from then on (stream_interval)
    enqueued: float = dataclasses.field(default_factory=time.monotonic)
    probe: bool = False             # started drafting where plain was expected faster (DraftPolicy.admit): never demoted
    closed: bool = False            # the handler is done with it (finished, cancelled, failed)
    ended: bool = False             # the scheduler sent its last event

    @property
    def draft_id(self) -> str:
        """The id of its session on the drafter: ``session_id``, then ``session_id~N`` once it has
        had to be re-created N times (the drafter may still hold the old one, in an unknown state)."""
        return f"{self.session_id}~{self.draft_gen}" if self.draft_gen else self.session_id


def trim_tree(tokens: list[int], parents: list[int], max_depth: int) -> tuple[list[int], list[int]]:
    """Drop the nodes deeper than ``max_depth`` (their subtrees too), re-indexing parents.

    Nodes come in topological order, so a kept node's parent is kept and already re-indexed.

    Raises:
        runtime.tree.TreeError: a malformed parent list (:func:`runtime.tree.tree_depths`).
    """
    depth = tree_depths(parents)
    new_index = [-1] * len(tokens)
    out_t, out_p = [], []
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        if depth[i] <= max_depth:
            new_index[i] = len(out_t)
            out_t.append(tok)
            out_p.append(-1 if i == 0 else new_index[par])
    return out_t, out_p


def fit_tree(tokens: list[int], parents: list[int], max_depth: int, width_cap: int) -> tuple[list[int], list[int], int]:
    """A drafter's tree made fit for verify: the nodes deeper than ``max_depth`` dropped
    (:func:`trim_tree`), then the first ``width_cap`` nodes kept (topological order: a prefix is
    a tree). Returns ``(tokens, parents, depth)``, ``depth`` the deepest kept node's.

    Raises:
        runtime.tree.TreeError: a malformed parent list (:func:`runtime.tree.tree_depths`).
    """
    depths = tree_depths(parents)
    if max(depths) > max_depth or len(tokens) != len(parents):   # (rare: the drafter was asked for max_depth)
        tokens, parents = trim_tree(tokens, parents, max_depth)   # (pairs nodes up as zip does)
        depths = tree_depths(parents) if parents else []          # (no tokens: no tree, as trim_tree gives)
    if len(tokens) > width_cap:
        tokens, parents, depths = tokens[:width_cap], parents[:width_cap], depths[:width_cap]
    return tokens, parents, max(depths) if depths else 0


def _owned(parts: list[Rows]) -> list[Rows]:
    """The rows of ``parts`` as bytes of their own: one entry (:func:`join_rows`), or one per
    entry where their dtypes or widths differ."""
    if not parts:
        return []
    try:
        joined = join_rows(parts)
    except ValueError:
        return [p if isinstance(p.data, bytes) else p._replace(data=bytes(p.data)) for p in parts]
    return [joined if isinstance(joined.data, bytes) else joined._replace(data=bytes(joined.data))]


def join_features(parts: list[common_pb2.Tensor]) -> common_pb2.Tensor | None:
    """The rows of ``parts`` in order, as one wire tensor (same dtype and width; None if empty)."""
    parts = [p for p in parts if p.data]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(p.dtype != first.dtype or list(p.shape[1:]) != list(first.shape[1:]) for p in parts):
        raise ValueError("feature tensors of different layouts")
    rows = sum(p.shape[0] for p in parts)
    return common_pb2.Tensor(dtype=first.dtype, shape=[rows, *first.shape[1:]], data=b"".join(p.data for p in parts))


def adaptive_budget(batch: int, step_nodes: int, want: int = OrchestratorConfig.tree_budget, min_nodes: int = 2) -> int:
    """Draft nodes per request for a tick of ``batch`` requests.

    The target's verify step costs about one decode step while its ``B x W`` nodes stay within
    what the device does in one weight read; past that, a larger tree costs more than its extra
    accepted tokens gain. So the tick's node budget is shared: each request's tree (root
    included) gets its own ``want + 1`` nodes as long as they fit its share, ``step_nodes //
    batch`` rounded down to a power of two (the target's width buckets 1, 4, 8, 16, 32, 64, so a
    capped tree is never padded). Below ``min_nodes`` draft nodes per request the tick does not
    draft (0).

    Returns:
        draft nodes per request (tree budget, root excluded), or 0: no drafting this tick.
    """
    share = step_nodes // max(1, batch)
    if share < 1:
        return 0
    nodes = min(want + 1, 1 << (share.bit_length() - 1))
    return nodes - 1 if nodes - 1 >= min_nodes else 0


def target_status(code: grpc.StatusCode, reason: str) -> tuple[grpc.StatusCode, str]:
    """The status and reason a request ends with when a call to the target failed with ``code``
    and ``reason``: a deadline or cancellation (the target did not answer) is UNAVAILABLE, and
    UNAVAILABLE without a reason of the target's own is ``TARGET_UNAVAILABLE``; anything else
    passes on as the target gave it (its reason may be ``""``: an older target)."""
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return grpc.StatusCode.UNAVAILABLE, Reason.TARGET_UNAVAILABLE.value
    if code == grpc.StatusCode.UNAVAILABLE and not reason:
        return code, Reason.TARGET_UNAVAILABLE.value
    return code, str(reason)


class Scheduler:
    """Runs every request of the orchestrator in ticks of one Propose and one Verify.

    Args:
        target: the target peer (its Info gives ``max_context``, tree width/depth caps).
        draft: the draft peer (may have no address).
        max_sessions: most requests holding a target session at once.
        max_queue: most requests waiting for a session; beyond it :meth:`submit` rejects.
        step_nodes: verify nodes per tick shared by the batch (:func:`adaptive_budget`); 0:
            :meth:`OrchestratorConfig.auto_step_nodes` of the target's device.
        step_timeout: seconds a Verify exchange may take before the target is treated as failed
            (and the most any Propose may take).
        history_bytes: most bytes of feature rows kept per request for a drafter session that has
            not had them yet (ticks without a Propose for it); past it the session is re-created
            later from rows the target recomputes.
        draft_deadline_factor, draft_deadline_min_ms, draft_deadline_ms, draft_deadline_row_us: the
            Propose deadline (:class:`orchestrator.peers.DraftDeadline`; module docstring):
            measured round trips (0: no deadline but ``step_timeout``), least and most
            milliseconds, microseconds per feature row of a new or re-created drafter session;
            ``draft_deadline_ms`` and ``draft_deadline_row_us`` 0 are decided by the drafter's
            device (:meth:`OrchestratorConfig.draft_deadline_for`) when it is reached.
        draft_policy: ``always`` (a tick drafts whenever the drafter is up) or ``measured`` (when
            that is faster at its batch size, as measured: :class:`orchestrator.policy.DraftPolicy`;
            experimental, docs/ARCHITECTURE.md "When to draft").
        stream_interval_ms: most milliseconds a request's tokens are held before they go to its
            handler (:meth:`_flush_events`), so the tokens of the ticks within it are streamed as
            one message; a request's first tokens and its end are never held. 0: every tick's.
        stream_hold_max_ms, stream_host_share: the adaptive hold (:meth:`_adapt_hold`): with
            several requests in a tick, their tokens are held (as with ``stream_interval_ms``)
            long enough that streaming takes at most ``stream_host_share`` of one core (its
            messages' measured cost), at most ``stream_hold_max_ms``; either 0: never.
        feature_ring: ask the target to put the committed rows in its feature ring while the
            drafter is reached over the same-host hop (docs/ARCHITECTURE.md, "The feature ring"):
            a Propose then names them (slot and count) instead of carrying them. Off after the
            drafter refuses an item as ``RING_UNAVAILABLE``.
    """

    def __init__(self, target: TargetPeer, draft: DraftPeer, *, max_sessions: int,
                 max_queue: int = OrchestratorConfig.max_queue, step_nodes: int = OrchestratorConfig.step_nodes,
                 step_timeout: float = OrchestratorConfig.step_timeout,
                 history_bytes: int = int(OrchestratorConfig.draft_history_mib * (1 << 20)),
                 draft_deadline_factor: float = OrchestratorConfig.draft_deadline_factor,
                 draft_deadline_min_ms: float = OrchestratorConfig.draft_deadline_min_ms,
                 draft_deadline_ms: float = OrchestratorConfig.draft_deadline_ms,
                 draft_deadline_row_us: float = OrchestratorConfig.draft_deadline_row_us,
                 draft_policy: str = OrchestratorConfig.draft_policy,
                 stream_interval_ms: float = OrchestratorConfig.stream_interval_ms,
                 stream_hold_max_ms: float = OrchestratorConfig.stream_hold_max_ms,
                 stream_host_share: float = OrchestratorConfig.stream_host_share,
                 feature_ring: bool = OrchestratorConfig.feature_ring):
        self.target = target
        self.draft = draft
        self.info = target.info()
        self.max_sessions = max(1, int(max_sessions))
        self.max_queue = max(0, int(max_queue))
        self.step_nodes = max(1, int(step_nodes or OrchestratorConfig.auto_step_nodes(self.info.device)))
        self.step_timeout = step_timeout
        self.history_bytes = history_bytes
        #: feature ring: asked for (config), refused by the drafter (it cannot read it: stop
        #: asking), the target's descriptor (its latest reply's) and rows per slot
        self.feature_ring = bool(feature_ring)
        self.ring_refused = False
        self._ring: common_pb2.FeatureRing | None = None
        self._ring_slot_rows = 0
        self.ring_rows_sent = 0     # rows Proposes named in the ring (SchedulerStatus.ring_rows)
        self.stream_interval = max(0.0, float(stream_interval_ms)) / 1e3
        self.hold_max = max(0.0, float(stream_hold_max_ms)) / 1e3
        self.stream_share = max(0.0, float(stream_host_share))
        self.hold = 0.0             # seconds a request's tokens are held now (_adapt_hold)
        self.message_s = 0.0        # measured CPU seconds of one Generate message (note_message)
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._queue: collections.deque[Request] = collections.deque()
        self._prefilling: list[tuple[Request, grpc.Future]] = []
        # recomputes of lost drafter sessions' rows: (request, prefill future, scratch session id, rows)
        self._refeaturing: list[tuple[Request, grpc.Future, str, int]] = []
        self._refeature_wanted = False   # some request's drafter session is lost (_lose_rows)
        self._scratch = 0                # scratch target sessions started (their ids: _start_refeatures)
        self.refeatures = 0              # drafter sessions whose rows the target recomputed
        self._stop_features: list[str] = []   # requests made plain outside a tick: the next Verify stops their rows
        self._active: list[Request] = []
        self._admitting = 0   # requests taken off the queue whose prefill is not in _prefilling yet
        # (request, event) emitted and not yet handed to its handler (_emit, _end, _flush_events)
        self._pending: collections.deque[tuple[Request, Tokens | Failure]] = collections.deque()
        # with stream_interval: events held until their request's flush_at, and the earliest of those
        self._held_events: dict[Request, list[Tokens | Failure]] = {}
        self._next_due = float("inf")
        self._slot_wait_until = 0.0
        self._releasing = {"target": 0, "draft": 0}  # sessions whose Release is unanswered: slots not free yet
        self._verify: StreamCall | None = None
        self._propose: StreamCall | None = None
        self._deadline_ask = (draft_deadline_ms, draft_deadline_row_us)  # 0: by the drafter's device
        self._deadline_device: str | None = None  # the device they were decided for
        max_ms, row_us = OrchestratorConfig.draft_deadline_for("", draft_deadline_ms, draft_deadline_row_us)
        self.deadline = DraftDeadline(draft_deadline_factor, draft_deadline_min_ms / 1e3, max_ms / 1e3, row_us / 1e6,
                                      cap_s=step_timeout)
        # drafter session ids that may still be held (their Propose was lost, or their Release
        # failed): released when the drafter answers again; they count as held slots till then
        self._draft_stale: collections.deque[str] = collections.deque(maxlen=STALE_IDS)
        self._stale_retry_at = 0.0
        self.deadline_misses = 0
        self._drafter_slots_noted = 0   # the drafter's session count last warned about (fewer than ours)
        self._stop = threading.Event()
        self._draining = False   # drain(): admit nothing new
        self.ticks = 0
        self.batched_items = 0
        self.fallbacks = 0
        self.budget_now = 0
        self.drafting = False
        self._trees = TreeChecker()   # the drafted trees' shapes seen, checked once each
        #: when to draft (orchestrator.policy): measured per batch bucket, or None: whenever a drafter is up
        self.policy: DraftPolicy | None = DraftPolicy() if draft_policy == "measured" else None
        self.demoted = 0   # requests that started drafting and decode plainly for the rest of their lives (_demote)
        #: requests that asked for speculation and start plainly for life: no tree fits their share
        #: of ``step_nodes`` at the batch they join (:meth:`_fits_a_draft`; the ``always`` policy), or
        #: the measured policy expects plain ticks faster there (``DraftPolicy.admit``)
        self.admitted_plain = 0
        #: drafter sessions given up, to be re-created from rows the target recomputes (:meth:`_give_up_rows`)
        self.given_up = 0
        #: Propose items not sent because every drafter slot was held (the request decoded plainly that tick)
        self.no_drafter_slot = 0
        #: seconds of the loop iterations that ticked (wall, this thread's CPU) and of their
        #: exchanges (:meth:`_exchange`): SchedulerStatus.tick_seconds ...
        self.tick_s = self.tick_cpu_s = self.exchange_s = self.exchange_cpu_s = 0.0
        #: seconds the ticks' items waited in the target's / the drafter's queues (replies' queue_s)
        self.verify_queue_s = self.propose_queue_s = 0.0
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ handler side
    def submit(self, req: Request) -> None:
        """Queue ``req``; its handler then reads ``req.events``.

        Raises:
            Rejected: RESOURCE_EXHAUSTED / ``QUEUE_FULL`` when ``max_queue`` requests already
                wait, or UNAVAILABLE / ``SHUTTING_DOWN`` when the scheduler is draining or stopped.
        """
        req.speculative = req.speculative and self.draft.address is not None  # no drafter configured: plain
        with self._lock:
            if self._stop.is_set() or self._draining:
                raise Rejected(grpc.StatusCode.UNAVAILABLE, "orchestrator is shutting down", Reason.SHUTTING_DOWN)
            held = self._held()
            if len(self._queue) >= self.max_queue and any(r.closed for r in self._queue):
                # requests cancelled while queued hold no session: they never count against the queue
                self._queue = collections.deque(r for r in self._queue if not r.closed)
            if len(self._queue) >= self.max_queue and (held >= self.max_sessions or self._queue):
                metrics.observe_admission("rejected")
                raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server busy: {held} sessions decoding and {len(self._queue)} requests waiting "
                               f"(--max-sessions {self.max_sessions}, --max-queue {self.max_queue})",
                               Reason.QUEUE_FULL)
            self._queue.append(req)
            metrics.observe_admission("queued" if held >= self.max_sessions else "admitted")
            metrics.set_queue_depth(len(self._queue))
        self._wake.set()

    def close(self, req: Request, why: Failure | None = None) -> None:
        """The handler is done with ``req`` (finished, cancelled or past its deadline): its
        sessions are released on the next tick. ``why`` is sent to the handler (to wake it)."""
        if req.closed:
            return
        req.closed = True
        if why is not None:
            self._end(req, why)
        self._wake.set()

    @property
    def admitting(self) -> bool:
        """Whether :meth:`submit` takes new requests (False once draining or stopped)."""
        return not (self._stop.is_set() or self._draining)

    def _held(self) -> int:
        """Requests holding (or opening) a target session; one being admitted counts (it left the
        queue under the lock, its prefill is sent outside it), so :meth:`drain` never sees it in
        neither place."""
        return len(self._active) + len(self._prefilling) + self._admitting + len(self._refeaturing)

    def status(self) -> generation_pb2.SchedulerStatus:
        """What the scheduler is doing now (``ServiceInfo.scheduler``)."""
        with self._lock:
            queued, held = len(self._queue), self._held()
        return generation_pb2.SchedulerStatus(
            active_sessions=held, queued_requests=queued, max_sessions=self.max_sessions, max_queue=self.max_queue,
            ticks=self.ticks, mean_batch=self.batched_items / self.ticks if self.ticks else 0.0,
            tree_budget_now=self.budget_now, drafting=self.drafting, draft_fallbacks=self.fallbacks,
            ring_rows=self.ring_rows_sent, refeatures=self.refeatures, drafter_sessions_given_up=self.given_up,
            admitted_plain=self.admitted_plain, demoted=self.demoted, no_drafter_slot=self.no_drafter_slot,
            draft_deadline_misses=self.deadline_misses, tick_seconds=self.tick_s, tick_cpu_seconds=self.tick_cpu_s,
            exchange_seconds=self.exchange_s, exchange_cpu_seconds=self.exchange_cpu_s,
            verify_queue_seconds=self.verify_queue_s, propose_queue_seconds=self.propose_queue_s)

    def drain(self, timeout: float, release_timeout: float = 5.0) -> bool:
        """Graceful shutdown (``--shutdown-timeout``): admit nothing new (:meth:`submit` raises
        UNAVAILABLE / ``SHUTTING_DOWN``), let running and queued requests go on until none is left
        or ``timeout`` seconds passed, then :meth:`stop` (what is left ends UNAVAILABLE /
        ``SHUTTING_DOWN``; every session is released, waiting for the Release calls at most
        ``release_timeout`` seconds). Returns True when every request had finished by itself."""
        with self._lock:
            self._draining = True
            left = len(self._queue) + self._held()
        log.info("draining", extra={"requests": left, "timeout_s": timeout})
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._lock:
                busy = len(self._queue) + self._held()
            if not busy or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        self.stop(release_timeout=release_timeout)
        return not busy

    def stop(self, timeout: float = 5.0, release_timeout: float = 5.0) -> None:
        """End every request (UNAVAILABLE / ``SHUTTING_DOWN``), release their sessions on the
        target and the drafter and stop the thread. Returns once the Release calls were answered
        (at most ``timeout`` seconds for the thread, then ``release_timeout`` for the releases)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        deadline = time.monotonic() + max(0.0, release_timeout)
        # the thread's last act released its requests' sessions asynchronously: wait for the answers
        while (self._releasing["target"] or self._releasing["draft"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        # sessions it could not release: prefills answered after it stopped, or a thread stuck in a tick
        on_target = {r.session_id for r in self._active if r.on_target}
        on_drafter = {r.session_id for r in self._active if r.on_drafter}
        opening = [(req.session_id, fut) for req, fut in self._prefilling]
        opening += [(sid, fut) for _, fut, sid, _ in self._refeaturing]   # scratch sessions of recomputes
        for sid, fut in opening:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic() - 1.0))   # keep 1 s for the Releases
                on_target.add(sid)
            except (grpc.FutureTimeoutError, concurrent.futures.TimeoutError):
                fut.cancel()         # (over the hop: its connection closed, the target's call ends)
                on_target.add(sid)   # still running: release it on the target anyway
            except Exception:  # noqa: BLE001 - refused or cancelled: nothing opened
                pass
        self._prefilling, self._refeaturing = [], []
        released = {"target": 0, "draft": 0}
        for peer, who, ids in (("target", self.target, on_target), ("draft", self.draft, on_drafter)):
            stub = getattr(who, "stub", None) if ids else None
            left = max(1.0, deadline - time.monotonic())
            if stub is None:
                continue
            try:
                released[peer] = stub.Release(common_pb2.ReleaseRequest(session_ids=sorted(ids)), timeout=left).released
            except Exception as e:  # noqa: BLE001 - an RPC error, or a channel already closed
                code = e.code().name if isinstance(e, grpc.RpcError) else type(e).__name__
                log.warning("release at shutdown failed", extra={"peer": peer, "code": code, "sessions": len(ids)})
        if on_target or on_drafter:
            log.info("released the sessions left at shutdown",
                     extra={"target": len(on_target), "draft": len(on_drafter), "released": released})

    # ------------------------------------------------------------------ scheduler thread
    def _end(self, req: Request, event, hand_over: bool = True) -> None:
        """``event`` is ``req``'s last: queued behind the tokens emitted before it, and handed
        over now with them (``hand_over``), or by the next :meth:`_flush_events` (a request's
        final tokens, from :meth:`_emit`). Later ends of the same request are dropped."""
        if not req.ended:
            req.ended = True
            if self.policy is not None:
                self.policy.forget(req.session_id)
            self._pending.append((req, event))
            if hand_over:
                self._flush_events()

    def _flush_events(self, force: bool = False) -> None:
        """Hand the tokens emitted so far to their handlers (:meth:`_emit` defers them to here).

        Called once the next exchange's request is on its way (its ``on_sent``), so the handler
        threads these wake (detokenising, streaming to the client) run while this thread waits
        for the reply instead of taking the GIL when the reply arrives; also before anything
        else reaches a handler (:meth:`_end`) and before the loop idles (``force``).

        With ``stream_interval`` (or the adaptive :attr:`hold`, the longer), a request's events
        wait here until its ``flush_at`` (the interval after its last hand-over; its first event
        is due at once, and so is everything once it has ended), then all go together: its
        handler sends them as one message (``force``: every event now)."""
        pending = self._pending
        interval = max(self.stream_interval, self.hold)
        if not interval and not self._held_events:
            while pending:
                try:
                    req, event = pending.popleft()
                except IndexError:
                    return
                req.events.put(event)
            return
        if not pending and not self._held_events:
            return
        with self._flush_lock:   # (a handler's close may flush too: a request's events stay in order)
            now = time.monotonic()
            held, handed = self._held_events, []
            scan = force or self._next_due <= now
            while pending:
                req, event = pending.popleft()
                waiting = held.get(req)
                if waiting is not None:
                    waiting.append(event)
                    scan = scan or req.ended
                elif force or req.ended or req.flush_at <= now:
                    req.events.put(event)
                    handed.append(req)
                else:
                    held[req] = [event]
                    self._next_due = min(self._next_due, req.flush_at)
            if held and scan:
                self._next_due = float("inf")
                for req in list(held):
                    if force or req.ended or req.flush_at <= now:
                        for event in held.pop(req):
                            req.events.put(event)
                        handed.append(req)
                    else:
                        self._next_due = min(self._next_due, req.flush_at)
            until = now + interval
            for req in handed:
                req.flush_at = until

    def _run(self) -> None:
        wall, cpu = time.perf_counter, time.thread_time
        while not self._stop.is_set():
            try:
                w0, c0 = wall(), cpu()
                self._drop_closed()
                if self._refeaturing:
                    self._collect_refeatures()
                if self._refeature_wanted:
                    self._start_refeatures()
                self._admit()
                self._collect_prefills()
                batch = [r for r in self._active if not r.closed]
                if not batch:
                    self._flush_events(force=True)
                    metrics.flush()   # the last ticks' notes, before idling (metrics: FLUSH_INTERVAL_S)
                    self._wake.wait(0.05 if self._prefilling or self._queue else 1.0)
                    self._wake.clear()
                    continue
                try:
                    self._tick(batch)
                finally:   # (a tick that raised too: its exchanges are counted, so is it)
                    self.tick_s += wall() - w0
                    self.tick_cpu_s += cpu() - c0
            except Exception as e:  # noqa: BLE001 - a bug here must not hang every client
                log.exception("scheduler tick failed")
                for r in self._active:
                    self._end(r, Failure(grpc.StatusCode.INTERNAL, f"orchestrator error: {type(e).__name__}: {e}", Reason.INTERNAL))
                    r.closed = True
        # shutting down
        self._flush_events(force=True)
        with self._lock:
            waiting = list(self._queue) + [r for r, _ in self._prefilling] + self._active
            self._queue.clear()
        for r in waiting:
            self._end(r, Failure(grpc.StatusCode.UNAVAILABLE, "orchestrator is shutting down", Reason.SHUTTING_DOWN))
            r.closed = True
        self._drop_closed()
        for call in (self._verify, self._propose):
            if call is not None:
                call.close()

    def _drop_closed(self) -> None:
        """Forget closed requests; release their sessions on both services (one call each)."""
        with self._lock:
            gone = [r for r in self._queue if r.closed]
            if gone:
                self._queue = collections.deque(r for r in self._queue if not r.closed)
                metrics.set_queue_depth(len(self._queue))
        gone += [r for r in self._active if r.closed]
        if not gone:
            return
        self._active = [r for r in self._active if not r.closed]
        if self.policy is not None:   # (a request closed without an end event, e.g. its coroutine cancelled)
            for r in gone:
                self.policy.forget(r.session_id)
        self._release([r for r in gone if r.on_target], [r for r in gone if r.on_drafter])
        for r in gone:
            r.on_target = r.on_drafter = False
        self._slot_wait_until = 0.0  # a slot may be free now
        metrics.set_active_sessions(self._held())

    def _release(self, on_target: list[Request], on_drafter: list[Request]) -> None:
        """Release sessions on the target and the drafter (one asynchronous call each). Until a
        call is answered its sessions count as held (``_releasing``), so admission never sends a
        prefill or a Propose past a service's slots while the release is in flight. Drafter ids
        whose release fails are kept to be released again when the drafter answers."""
        self._release_ids("target", [r.session_id for r in on_target])
        self._release_ids("draft", [r.draft_id for r in on_drafter])

    def _release_ids(self, peer: str, ids: list[str]) -> None:
        stub, timeout = (self.target.stub, 5.0) if peer == "target" else (self.draft.stub, 2.0)
        if not ids or stub is None:
            return
        n = len(ids)
        with self._lock:
            self._releasing[peer] += n

        def freed(f, peer=peer, n=n):
            with self._lock:
                self._releasing[peer] -= n
                if peer == "draft" and f.exception() is not None and f.exception().code() in _TRANSIENT:
                    self._draft_stale.extend(ids)  # maybe still held: again when the drafter answers
            if f.exception() is not None:
                log.warning("release failed", extra={"peer": peer, "code": str(f.exception().code())})
            self._wake.set()

        stub.Release.future(common_pb2.ReleaseRequest(session_ids=ids), timeout=timeout).add_done_callback(freed)

    def _release_stale(self) -> None:
        """Release the drafter ids that may still be held (the drafter answers again), at most
        once a second."""
        now = time.monotonic()
        if not self._draft_stale or now < self._stale_retry_at:
            return
        self._stale_retry_at = now + 1.0
        with self._lock:
            ids = list(self._draft_stale)
            self._draft_stale.clear()
        self._release_ids("draft", ids)

    def _new_draft_session(self, r: Request, drop: bool = False) -> None:
        """``r``'s drafter session is lost or in an unknown state: its old id is to be released
        (later, :meth:`_release_stale`) and it is re-created under a new id (:meth:`_lose_rows`)."""
        with self._lock:
            self._draft_stale.append(r.draft_id)
        r.draft_gen += 1
        r.on_drafter = False
        self._lose_rows(r, drop)

    def _lose_rows(self, r: Request, drop: bool = False) -> None:
        """``r``'s drafter session is gone (or never to be used again as it is): the next Propose
        that carries ``r`` creates a new one from rows ``[0, L)``. Rows kept from ``rows_from > 0``
        cannot do that alone, so they are dropped and ``r`` keeps none until the target has
        recomputed the rows of its committed tokens (:meth:`_start_refeatures`); rows kept from 0
        (a prompt's, not yet sent) still can, unless ``drop``. The orchestrator keeps no history
        of sent rows (docs/ARCHITECTURE.md, "Drafter faults")."""
        r.draft_synced = False
        if drop or r.rows_from or not r.keeping or r.ring_rows:
            r.history.clear()
            r.history_bytes = r.loose = r.ring_rows = 0
            r.rows_from = r.length
            if r.keeping and r.speculative:
                self._refeature_wanted = True
            r.keeping = False

    def _start_refeatures(self) -> None:
        """Ask the target to recompute the feature rows of lost drafter sessions: for each
        drafting request that keeps no rows (:meth:`_lose_rows`), a prefill of its committed
        tokens ``seq[:L]`` into a scratch target session (``session_id#fN``, released when it
        answers) returns rows ``[0, L)``; the rows its ticks commit meanwhile are kept from ``L``
        on (:meth:`_collect_refeatures` joins them). At most :data:`REFEATURES_AT_ONCE` at a time,
        each holding a target slot while it runs (before admission takes the free ones; one at a
        time while requests are queued), and only while ticks draft (the drafter usable, the batch
        small enough to draft, the policy drafting): otherwise nothing is kept or recomputed."""
        self._refeature_wanted = False
        layers = None
        now = time.monotonic()
        # while requests wait for a session, one recompute at a time goes ahead of them
        most = 1 if self._queue else REFEATURES_AT_ONCE
        for r in self._active:
            if r.keeping or r.closed or not r.speculative:
                continue
            if not self.drafting or r.refeat_after > now or len(self._refeaturing) >= most:
                self._refeature_wanted = True   # (later: a tick that drafts, its backoff, a free place)
                continue
            if layers is None:
                layers = self.draft.layers() if self._drafter() is not None else None
                if not layers:
                    self._refeature_wanted = True
                    return
            with self._lock:
                if self._held() + self._releasing["target"] >= self.max_sessions:
                    self._refeature_wanted = True
                    return
            self._scratch += 1
            sid = f"{r.session_id}#f{self._scratch}"
            item = target_pb2.PrefillItem(session_id=sid, prompt_tokens=r.seq[:r.length],
                                          sampling=common_pb2.SamplingParams(), feature_layer_ids=layers)
            fut = self._prefill_future(target_pb2.PrefillRequest(items=[item]), self.step_timeout + r.length / 50)
            fut.add_done_callback(lambda _f: self._wake.set())
            r.keeping, r.rows_from = True, r.length    # the rows committed from now on are kept
            self._refeaturing.append((r, fut, sid, r.length))

    def _collect_refeatures(self) -> None:
        """Join the rows the target recomputed (:meth:`_start_refeatures`) before the rows kept
        since: the request's next Propose creates its drafter session from rows ``[0, L)``. A
        refused or failed recompute leaves the request decoding plainly meanwhile; a request that
        ended meanwhile is forgotten. Every scratch session is released. A recompute refused for
        want of a slot is tried again a quarter of a second later; one that failed as the target
        may when busy or restarting (:data:`_RETRIED`) after 1, 2, 4 ... s, :data:`REFEATURE_TRIES`
        times at most; any other failure (a context the target will not prefill, a malformed reply)
        leaves the request plain to its end, like a demoted one (the next Verify's
        ``stop_features`` names it)."""
        still, done = [], []
        for entry in self._refeaturing:
            (still if not entry[1].done() else done).append(entry)
        if not done:
            return
        self._refeaturing = still
        self._release_ids("target", [sid for _, _, sid, _ in done])
        now = time.monotonic()
        for r, fut, sid, rows in done:
            if r.closed or not r.speculative or not r.keeping or r.rows_from != rows:
                continue   # ended, demoted, or lost again meanwhile (a newer recompute or none)
            try:
                res = fut.result().results[0]
                got = Rows.of_tensor(res.features)
                if got is None or got.rows != rows:
                    raise ValueError(f"{got.rows if got is not None else 0} feature rows for {rows} tokens")
            except (grpc.RpcError, ValueError, IndexError) as e:
                code = e.code() if isinstance(e, grpc.RpcError) else None
                reason = target_status(code, reason_of(e))[1] if code is not None else ""
                self._lose_rows(r)
                r.refeat_tries += 1
                if reason == Reason.NO_FREE_SLOT:   # slots held by another client: again soon
                    r.refeat_after = now + 0.25
                    self._refeature_wanted = True
                elif code in _RETRIED and r.refeat_tries < REFEATURE_TRIES:   # (a target busy or restarting)
                    r.refeat_after = now + min(30.0, 2.0 ** (r.refeat_tries - 1))
                    self._refeature_wanted = True
                else:   # a context the target refuses, a malformed reply, tries spent: plain to its end
                    log.warning("the target did not recompute a lost drafter session's rows; it decodes plainly "
                                "to its end", extra={"session": r.session_id, "code": code.name if code else "",
                                                      "reason": reason, "error": str(e)[:200], "tries": r.refeat_tries})
                    self._plain_for_life(r)   # (as a demoted request: the target stops its feature rows)
                    self._stop_features.append(r.session_id)
                continue
            r.history.insert(0, got)
            r.history_bytes += len(got.data)
            r.loose += 1
            r.rows_from = 0
            self.refeatures += 1

    def _admit(self) -> None:
        """Start prefills for queued requests while sessions are free (oldest first)."""
        if time.monotonic() < self._slot_wait_until:
            return
        while True:
            with self._lock:
                if not self._queue or self._held() + self._releasing["target"] >= self.max_sessions:
                    return
                req = self._queue.popleft()
                self._admitting += 1
                waiting = len(self._queue)
                metrics.set_queue_depth(waiting)
            try:
                layers = []
                # the batch it joins: the requests decoding, starting, and those queued behind it,
                # which join the same ticks (a burst of N requests is a batch of N from the first),
                # at most the sessions that decode at once
                joining = min(self.max_sessions, len(self._active) + len(self._prefilling) + waiting + 1)
                if req.speculative and self.policy is None and not self._fits_a_draft(req, joining):
                    req.speculative = False   # no tree fits its share of a tick's nodes: plain for life
                    self.admitted_plain += 1
                    if self.admitted_plain == 1:
                        log.info("requests start plainly: no tree of theirs fits their share of the verify nodes "
                                 "per tick (--step-nodes) at the batch they join",
                                 extra={"step_nodes": self.step_nodes, "active": len(self._active), "queued": waiting})
                if req.speculative and self.policy is not None:
                    # plain for life where plain ticks are expected faster at the batch it joins
                    # (policy.admit)
                    probe = self.policy.expected(joining) == PLAIN
                    if self.policy.admit(joining) == PLAIN:
                        req.speculative = False
                        self.admitted_plain += 1
                    else:
                        req.probe = probe   # drafting kept measured at that size: never demoted
                if req.speculative:
                    layers = self.draft.layers()
                    if layers is None:  # the drafter was never reachable: no features (the target taps
                        layers, req.speculative = [], False   # a session's layers from its prefill), no drafting
                item = target_pb2.PrefillItem(session_id=req.session_id, prompt_tokens=req.prompt, sampling=req.sampling,
                                              feature_layer_ids=layers)
                prefill = target_pb2.PrefillRequest(items=[item], feature_ring=bool(layers) and self._ring_wanted())
                # over the target's same-host hop where it has one (its prompt's rows then reach the
                # feature ring: TargetPeer.prefill_future), else gRPC
                fut = self._prefill_future(prefill, self.step_timeout + len(req.prompt) / 50)
                fut.add_done_callback(lambda _f: self._wake.set())
                self._prefilling.append((req, fut))
            finally:
                with self._lock:
                    self._admitting -= 1
            metrics.set_active_sessions(self._held())

    def _fits_a_draft(self, req: Request, batch: int) -> bool:
        """Whether ``req`` would draft at all in a tick of ``batch`` requests: its tree (or chain)
        gets at least one node from the tick's share of :attr:`step_nodes`
        (:func:`adaptive_budget`, as :meth:`_tick` gates a tick's drafting, two draft nodes a
        request, and :meth:`_propose_trees` sizes each tree: two draft nodes for a tree, one for
        a chain). Where it would not, a request that may draft still costs every
        tick what drafting keeps (the target's feature rows, the orchestrator's bookkeeping, a
        drafter session) for no tree: on an H200 at the sweep's largest level, where no tree fit
        the CUDA default ``step_nodes``, speculation made 0.91x our plain decoding
        (``benchmarks/gpu/concurrency/run28-sweep``). So
        :meth:`_admit` starts it plainly for its life (docs/ARCHITECTURE.md, "When to draft"), a
        rule of the tick's node budget, not a measured threshold; ``batch`` counts the requests
        decoding, starting and queued behind it, which join the same ticks."""
        if adaptive_budget(batch, self.step_nodes, want=1 << 30) <= 0:
            return False   # (no tick of that batch drafts at all: _tick's gate)
        t = req.tree
        if t.budget:
            return adaptive_budget(batch, self.step_nodes, want=t.budget, min_nodes=2) > 0
        return adaptive_budget(batch, self.step_nodes, want=t.max_depth or 10**9, min_nodes=1) > 0

    def _prefill_future(self, request: target_pb2.PrefillRequest, timeout: float):
        """The target's Prefill of ``request``, answered later (``done``, ``result``,
        ``add_done_callback``): :meth:`orchestrator.peers.TargetPeer.prefill_future` (the same-host
        hop where the target has one), or the peer's ``stub.Prefill.future`` (an in-process target,
        a test's)."""
        call = getattr(self.target, "prefill_future", None)
        if call is not None:
            return call(request, timeout)
        return self.target.stub.Prefill.future(request, timeout=timeout)

    def _collect_prefills(self) -> None:
        still = []
        requeue = []
        for req, fut in self._prefilling:
            if not fut.done():
                still.append((req, fut))
                continue
            try:
                reply = fut.result()
                res = reply.results[0]
            except grpc.RpcError as e:
                code, reason = target_status(e.code(), reason_of(e))
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and reason == Reason.NO_FREE_SLOT and not req.closed:
                    requeue.append(req)  # the target's slots are held by another client: wait
                    continue
                self._end(req, Failure(code, f"target service: {e.details() or ''}", reason))
                req.closed = True
                continue
            req.on_target = True
            if req.closed:
                self._release([req], [])
                req.on_target = False
                continue
            req.root, req.length = res.first_token, res.committed_length
            req.t_first = time.monotonic()
            if req.speculative:
                req.seq = req.prompt + [req.root]
                if res.ring_rows:   # (the prompt's rows in the feature ring)
                    self._note_ring(reply)
                    self._keep(req, RingRows(res.ring_slot, res.ring_rows))
                else:
                    self._keep(req, res.features)
            self._active.append(req)
            self._emit(req, [req.root])
        self._prefilling = still
        if requeue:
            with self._lock:
                self._queue.extendleft(reversed(requeue))
                metrics.set_queue_depth(len(self._queue))
            self._slot_wait_until = time.monotonic() + 0.25
        metrics.set_active_sessions(self._held())

    def _keep(self, req: Request, features: Rows | common_pb2.Tensor | None) -> None:
        """Append the rows of ``features`` (just committed: :class:`~dflash_grpc.columns.Rows`, or
        a wire tensor) to the rows ``req``'s drafter session does not have yet, which its next
        Propose sends (and then drops: the orchestrator keeps no history of sent rows). A request
        whose drafter session is lost keeps none (:meth:`_lose_rows`). Rows that are a view of the
        reply that carried them (which holds every item's rows) stay so for up to
        :data:`KEEP_VIEWS` ticks, then are copied out, several ticks' at once (:meth:`_compact`),
        so a reply's buffer is not held for long by a request that has not drafted for a while.
        Past ``history_bytes`` of rows piled up over ticks without a Propose for the request, its
        drafter session is given up and re-created later from rows the target recomputes (its
        first entry, a prompt's rows or recomputed ones, is always kept whatever its size)."""
        if not req.keeping:
            req.rows_from = req.length
            return
        if type(features) is RingRows:
            self._keep_ring(req, features)
            return
        if req.ring_rows and features is not None:   # rows as bytes after rows in the ring (the ring was
            self._give_up_rows(req)                 # turned off): one Propose cannot carry that order
            return
        if type(features) is not Rows:
            if features is None:
                return
            features = Rows.of_tensor(features) if not isinstance(features, Rows) else features
            if features is None:
                return
        if not features[2]:   # (Rows.rows: no rows)
            return
        history = req.history
        history.append(features)
        data = features[3]
        req.history_bytes += len(data)
        if req.loose == len(history) - 1 and type(data) is bytes:
            req.loose += 1
        elif len(history) - req.loose > KEEP_VIEWS:
            self._compact(req)
        if len(history) > 1 and req.history_bytes > self.history_bytes:
            # rows piled up over ticks without a Propose for it (its first entry, a prompt's or
            # the recomputed rows, is always kept): given up; the target recomputes them later
            self._give_up_rows(req)

    def _give_up_rows(self, req: Request) -> None:
        """``req``'s drafter session is given up: re-created later from rows the target
        recomputes (:meth:`_lose_rows`)."""
        self.given_up += 1
        if req.on_drafter:
            self._new_draft_session(req, drop=True)
        else:
            self._lose_rows(req, drop=True)

    def _keep_ring(self, req: Request, ring: RingRows) -> None:
        """Count ``ring``'s rows (just committed, in the feature ring) among those ``req``'s
        drafter session does not have yet, after its ``history``. A session whose unread rows no
        longer fit a ring slot, or whose rows moved slot (a target restart: its sessions are gone
        anyway), is given up as :meth:`_keep` gives up one past ``history_bytes``; before a Verify
        could write over unread rows, :meth:`_ring_guard` gives it up."""
        if not self._ring_slot_rows:   # (rows in a ring no reply described: never asked again)
            self.ring_refused = True
            self._give_up_rows(req)
            return
        if req.ring_rows and ring.slot != req.ring_slot:
            self._give_up_rows(req)
            return
        req.ring_slot = ring.slot
        req.ring_rows += ring.rows
        if req.ring_rows > self._ring_slot_rows:
            self._give_up_rows(req)

    def _ring_wanted(self) -> bool:
        """Whether this tick's Verify (or an admission's Prefill) asks for the feature ring: on,
        not refused by the drafter, and the drafter reached over the same-host hop."""
        return self.feature_ring and not self.ring_refused and type(self._propose) is LocalHopCall

    def _note_ring(self, reply) -> None:
        """Keep the feature ring a Verify or Prefill reply describes (``reply.ring``)."""
        if reply.HasField("ring"):
            desc = reply.ring
            if self._ring is None or desc.id != self._ring.id:
                self._ring, self._ring_slot_rows = desc, desc.slot_rows

    def _ring_guard(self, batch: list[Request], nodes_of: list[int]) -> None:
        """Before a Verify: a request whose unread ring rows and the rows this tick's tree may
        commit (its draft nodes, ``nodes_of``, and the root) would pass a ring slot is given up
        now, before the target writes over the oldest of them (a request that drafted this tick
        has none unread: its Propose read them)."""
        limit = self._ring_slot_rows
        for r, nodes in zip(batch, nodes_of):
            if r.ring_rows and r.ring_rows + nodes + 1 > limit:
                self._give_up_rows(r)

    def _ask_ring(self, request: target_pb2.VerifyRequest, batch: list[Request], nodes_of: list[int]) -> None:
        """Make ``request`` (the Verify of ``batch``, trees of ``nodes_of`` draft nodes) ask for the
        feature ring, after :meth:`_ring_guard`. A request whose drafter session lacks rows [0,
        rows_from) (lost, its rows recomputed or to be) is named in ``ring_off``: its rows wait as
        bytes meanwhile, since a recompute may take more ticks than a ring slot holds unread rows
        (docs/ARCHITECTURE.md, "The feature ring")."""
        if self._ring_slot_rows:
            self._ring_guard(batch, nodes_of)
        request.feature_ring = True
        off = [r.session_id for r in batch if r.rows_from and not r.draft_synced and r.speculative]
        if off:
            request.ring_off.extend(off)

    @staticmethod
    def _compact(req: Request) -> None:
        """Copy the rows that may be views of a reply (``history[loose:]``) into bytes of their
        own, joined into one entry."""
        history, loose = req.history, req.loose
        history[loose:] = _owned(history[loose:])
        req.loose = len(history)

    @staticmethod
    def _sent(req: Request) -> None:
        """``req``'s drafter session now holds rows ``[0, L)``."""
        req.draft_synced = True
        req.history.clear()
        req.history_bytes = req.loose = req.ring_rows = 0
        req.rows_from = req.length

    def _emit(self, req: Request, tokens: list[int], finish: str | None = None, now: float | None = None) -> None:
        """Send ``tokens`` to the handler, cut at EOS and ``max_tokens`` (which end the request);
        ``now``: ``time.monotonic()`` of the tick (None: read here)."""
        eos = req.eos
        if eos and not eos.isdisjoint(tokens):
            for i, tok in enumerate(tokens):
                if tok in eos:
                    tokens, finish = tokens[:i], FINISH_EOS
                    break
        room = req.max_tokens - req.emitted
        if len(tokens) >= room:
            tokens = tokens[:room]
            finish = finish or FINISH_LENGTH
        req.emitted += len(tokens)
        req.stats.decode_time_s = (time.monotonic() if now is None else now) - req.t_first
        if finish is not None:
            self._end(req, Tokens(tokens, finish), hand_over=False)
            req.closed = True
        elif tokens:
            self._pending.append((req, Tokens(tokens)))   # handed over by _flush_events

    def hop_spin(self, batch: int) -> float:
        """Seconds the same-host hop polls for an exchange's reply before blocking, for a tick of
        ``batch`` requests: :data:`dflash_grpc.localhop.SPIN_S` (on for a CUDA target) while the tick
        has at most :data:`SPIN_BATCH` requests, else 0. At one or two streams the exchange is the
        step's critical path and nothing else in this process wants the CPU; with more, the
        handler threads streaming tokens do, and a polling thread takes the GIL from them between
        its polls (a waiting thread gets it back only at the switch interval)."""
        return localhop.SPIN_S if batch <= SPIN_BATCH else 0.0

    def _drafter(self) -> draft_pb2.DrafterInfo | None:
        """The drafter's Info when it is usable for this target now, else None."""
        info = self.draft.state()
        return info if info is not None and drafter_mismatch(info, self.info) is None else None

    def _tick(self, batch: list[Request]) -> None:
        t0 = time.perf_counter()
        budget = adaptive_budget(len(batch), self.step_nodes, want=1 << 30)  # the cap; each tree: _propose_trees
        self.budget_now = budget
        drafter = self._drafter() if budget > 0 else None
        mode = None   # the policy's choice, when it had one to make (some request may draft)
        stop_features: list[str] = []
        if drafter is not None and self.policy is not None and any(r.speculative for r in batch):
            may_draft = [r.session_id for r in batch if r.speculative]
            mode = self.policy.choose(len(batch), may_draft)
            if mode == PLAIN:
                drafter = None
                if self.policy.demote(len(batch), may_draft):
                    stop_features = self._demote(batch)
        self.drafting = drafter is not None
        trees: dict[int, tuple[list[int], list[int], int]] | CheckedTrees = {}   # batch index -> tokens, parents, depth
        draft_s, unmeasured = 0.0, False
        columnar = len(batch) >= COLUMNS_FROM and COLUMNAR in self.info.features
        if drafter is not None:
            trees, draft_s, unmeasured = self._propose_trees(batch, drafter, columnar)
        t1 = time.perf_counter()
        sids = [r.session_id for r in batch]
        if isinstance(trees, CheckedTrees):   # every item's tree, as the drafter packed them
            request = verify_request(True, sids, (), (), (), trees.columns)
            nodes_of, depth_of = [n - 1 for n in trees.sizes], trees.depths
        else:
            sizes, tokens, parents = [], [], []
            nodes_of, depth_of = [0] * len(batch), [0] * len(batch)
            for i, r in enumerate(batch):
                drafted = trees.get(i)
                if drafted is None:
                    sizes.append(1)
                    tokens.append(r.root)
                    parents.append(-1)
                else:
                    sizes.append(len(drafted[0]))
                    tokens += drafted[0]
                    parents += drafted[1]
                    nodes_of[i], depth_of[i] = len(drafted[0]) - 1, drafted[2]
            request = verify_request(columnar, sids, sizes, tokens, parents)
        ring = self._ring_wanted()
        if ring:
            self._ask_ring(request, batch, nodes_of)
        if self._stop_features:
            stop_features = stop_features + self._stop_features
            self._stop_features = []
        if stop_features:
            request.stop_features.extend(stop_features)
        try:
            if self._verify is None:
                self._verify = self.target.verify_stream(None)
            self._verify.spin_s = self.hop_spin(len(batch))
            reply = self._exchange(self._verify, request, self.step_timeout)
            try:
                refused, accepted, bonus, lengths, feats = verify_columns(reply, len(batch))
            except ColumnsError as e:   # as a reply that does not decode: the stream is over (_verify_failed)
                raise StreamError(grpc.StatusCode.INTERNAL, f"the reply's columns do not fit together: {e}") from None
        except grpc.RpcError as e:
            self._verify_failed(batch, e)
            return
        verify_s = time.perf_counter() - t1
        if ring:
            self._note_ring(reply)
        if self._verify.broken:  # its deadline passed just after the reply came: the reply stands
            self._verify.close()
            self._verify = None
        compute_s, device_s = reply.compute_s, reply.device_s
        self.verify_queue_s += reply.queue_s
        steps = []   # (draft nodes, depth, accepted) of each verified item: the metrics, once per tick
        emitted = 0
        now = time.monotonic()
        keep, emit, hand, add_step = self._keep, self._emit, self._pending.append, steps.append
        # drafted items are noted only on a tick the policy measures (not one carrying a resync's
        # rows: those trees are as good, but the tick's seconds are not comparable)
        note = self.policy.note if mode == DRAFT and trees and not unmeasured else None
        for i, (r, tokens, root, length, features, nodes, depth) in enumerate(
                zip(batch, accepted, bonus, lengths, feats, nodes_of, depth_of)):
            stats = r.stats
            stats.verify_time_s += verify_s
            stats.verify_compute_s += compute_s
            stats.verify_device_s += device_s
            if refused and i in refused:
                status = refused[i]
                self._verify_item_failed(r, status_code(status.code), status.message, status.reason)
                continue
            k = len(tokens)
            stats.record_step(depth, nodes, k)
            add_step((nodes, depth, k))
            emitted += k + 1
            if nodes and note is not None:   # a drafted item: its tokens, for the policy's estimate of this text
                note(r.session_id, k + 1)
            r.root, r.length = root, length
            tokens.append(root)
            if r.speculative:
                keep(r, features)
                r.seq += tokens
            eos = r.eos
            if k + 1 < r.max_tokens - r.emitted and (not eos or eos.isdisjoint(tokens)):
                r.emitted += k + 1   # (_emit's common case: no EOS, not the last tokens)
                stats.decode_time_s = now - r.t_first
                hand((r, Tokens(tokens)))
            else:
                emit(r, tokens, now=now)
        if steps:
            metrics.observe_verify_batch(steps)
        self.ticks += 1
        self.batched_items += len(batch)
        tick_s = time.perf_counter() - t0
        # not measured: a drafting tick that drafted nothing, or one that carried a re-created
        # drafter session's rows (a drafter restart's cost, not drafting's) or, beyond the
        # step's own rows, more than ``block`` rows per item (new prompts while the batch is small: the
        # level's first ticks would judge the bucket). Fewer such rows are measured: only a
        # drafting request sends them, and under steady arrivals at many streams most drafting
        # ticks carry some (benchmarks/gpu/concurrency/run17-demote)
        if stop_features:
            pass   # (a tick that demoted: its Verify also changed the target's sessions; not a plain tick's cost)
        elif mode is not None and (mode == PLAIN or (trees and not unmeasured)):
            drafted = len(batch) if isinstance(trees, CheckedTrees) else len(trees)
            self.policy.observe(len(batch), mode, emitted, tick_s, drafted if mode == DRAFT else None)
        elif self.policy is not None and not any(r.speculative for r in batch):
            self.policy.observe(len(batch), BARE, emitted, tick_s)   # what a request started plainly pays
        metrics.observe_tick(len(batch), draft_s, verify_s, tick_s - draft_s - verify_s)
        self._adapt_hold(len(batch), tick_s)

    def _exchange(self, call: StreamCall, request, timeout: float | None):
        """``call.exchange(request, timeout)``, handing the tokens emitted so far to their streams
        once the request is sent (:meth:`_flush_events`), with its wall and CPU seconds on this
        thread counted (``exchange_s``, ``exchange_cpu_s``) less the hand-over's, which is the
        orchestrator's own work done while it waits: its own part of a tick is the loop's
        seconds less these."""
        wall, cpu = time.perf_counter, time.thread_time
        handed = [0.0, 0.0]

        def sent() -> None:
            w, c = wall(), cpu()
            try:
                self._flush_events()
            finally:
                handed[0] += wall() - w
                handed[1] += cpu() - c

        w0, c0 = wall(), cpu()
        try:
            return call.exchange(request, timeout, sent)
        finally:
            self.exchange_s += wall() - w0 - handed[0]
            self.exchange_cpu_s += cpu() - c0 - handed[1]

    def _demote(self, batch: list[Request]) -> list[str]:
        """The requests of ``batch`` that may draft, probes aside, decode plainly for the rest of
        their lives (:meth:`DraftPolicy.demote`): their kept feature rows are dropped, their drafter
        sessions released, and their session ids returned for the tick's Verify to carry as
        ``stop_features`` (the target then sends them no more feature rows). They then cost what a
        request started plainly costs; a tick of only such requests is bare (docs/ARCHITECTURE.md,
        "When to draft")."""
        gone = [r for r in batch if r.speculative and not r.probe]
        if not gone:
            return []
        on_drafter = [r for r in gone if r.on_drafter]
        self._release([], on_drafter)
        for r in gone:
            r.on_drafter = False
            self._plain_for_life(r)
        self.demoted += len(gone)
        log.info("draft policy: requests that started drafting decode plainly from now on",
                 extra={"requests": len(gone), "batch": len(batch), "demoted_total": self.demoted})
        return [r.session_id for r in gone]

    def _plain_for_life(self, r: Request) -> None:
        """``r`` decodes plainly to its end: no kept rows, no recompute, no drafter session
        (released by the caller), no measured tokens in the policy. The caller names it in a
        Verify's ``stop_features`` so the target sends no more rows for it."""
        r.speculative = False
        self._lose_rows(r, drop=True)   # (not speculative: no recompute is wanted)
        r.seq = []
        if self.policy is not None:
            self.policy.forget(r.session_id)

    def note_message(self, cpu_s: float) -> None:
        """A handler sent one Generate message, which took its thread ``cpu_s`` seconds of CPU
        (``time.thread_time``: detokenising, the message, grpc's send): :attr:`message_s`, a
        moving average, is the measured cost of a message (:meth:`_adapt_hold`). Any thread."""
        self.message_s += (cpu_s - self.message_s) * 0.05

    def _adapt_hold(self, batch: int, tick_s: float) -> None:
        """Coalesce streaming when it would cost the host more than ``stream_host_share`` of a
        core (docs/ARCHITECTURE.md, "Serving many sessions"). Each Generate message costs the
        orchestrator 100-200 us of host time on the CPU box (a handler thread's wake, the
        message, grpc's send and its completion: tools/host_per_item.py), and the handler
        threads share the GIL with the ticks. A request's tokens are therefore held (as with
        ``stream_interval_ms``) for :attr:`hold` = ``batch x message_s / stream_host_share``
        seconds at most ``stream_hold_max_ms``: the messages of a tick's requests then take at
        most that share of the host's time, wherever ticks come faster than that; ticks slower
        than the hold (the device's, or a few streams') stream every tick as before, as does a
        tick of one request (its per-tick latency is kept)."""
        hold = 0.0
        if batch >= 2 and self.hold_max and self.stream_share:
            hold = min(self.hold_max, batch * self.message_s / self.stream_share)
            if hold < tick_s / 2:   # shorter than a tick: nothing would wait
                hold = 0.0
        self.hold = hold

    def _propose_trees(self, batch: list[Request], drafter: draft_pb2.DrafterInfo, columnar: bool = False
                       ) -> tuple[dict[int, tuple[list[int], list[int], int]] | CheckedTrees, float, bool]:
        """One Propose for every request that drafts this tick: their trimmed trees by batch
        index, with their depths (:func:`fit_tree`), the exchange's seconds, and whether the policy
        is not to measure the tick (:meth:`_tick`): it carried the rows of a drafter session
        being re-created (a drafter restart's, a refused item's), or more feature rows beyond a
        step's worth than ``block`` per item (new sessions' prompts, a request catching up after
        plain ticks or a tick without a drafter slot). When every request
        drafts, ``columnar`` (the Verify goes as columns) and the reply's trees are all fit to
        verify as they came (:class:`~orchestrator.messages.TreeChecker`, checked at once), the
        trees are those columns (:class:`~orchestrator.messages.CheckedTrees`), not read per item."""
        block = drafter.model.block_size or 1
        width_cap = self.info.max_tree_width or 1
        depth_cap = self.info.max_tree_depth or 10**9
        self._release_stale()
        if drafter.model.device != self._deadline_device:
            self._deadline_device = drafter.model.device
            max_ms, row_us = OrchestratorConfig.draft_deadline_for(self._deadline_device, *self._deadline_ask)
            self.deadline.max_s, self.deadline.row_s = max_ms / 1e3, row_us / 1e6
        # the drafter's slots: sessions it holds for us, those being released, then new ones
        slots = drafter.model.max_sessions
        if slots and slots < self.max_sessions and slots != self._drafter_slots_noted:
            self._drafter_slots_noted = slots
            log.warning("the drafter holds fewer sessions than the orchestrator runs: requests beyond its slots decode "
                        "plainly (give the draft service the target's --max-sessions)",
                        extra={"drafter_sessions": slots, "max_sessions": self.max_sessions})
        with self._lock:
            room = ((slots or 10**9) - sum(r.on_drafter for r in self._active)
                    - self._releasing["draft"] - len(self._draft_stale))
        items = ProposeItems()
        who: list[tuple[int, int]] = []   # (batch index, max_depth) of each item
        extra_rows = 0  # feature rows beyond a step's worth (new or re-created sessions)
        resync_rows = 0  # those of re-created sessions being re-created now (a drafter restart, a refused item)
        extra_bytes = 0  # their bytes (RESYNC_BYTES)
        held_rows = 0   # rows the drafter holds for the asked sessions (a miss recomputes them all)
        max_context, n, step_nodes = self.info.max_context, len(batch), self.step_nodes
        shares: dict[tuple[int, int], int] = {}   # adaptive_budget of this tick, by (want, min_nodes)
        tree_nodes: dict[int, int] = {}   # (the same, for a tree of each budget: read per item)
        depth_cap = min(block - 1, depth_cap)
        for i, r in enumerate(batch):
            if not r.speculative or not r.keeping or (r.rows_from and not r.draft_synced):
                continue  # not drafting, or its lost drafter session's rows are not recomputed yet
            asked = r.tree_params
            if asked is None:   # (the message's fields, read once per request)
                t = r.tree
                asked = r.tree_params = (t.budget, t.top_k, t.max_depth or 10**9)
            budget, top_k, asked_depth = asked
            max_depth = depth_cap if depth_cap < asked_depth else asked_depth
            length = r.length
            if length + max_depth >= max_context or r.emitted + max_depth >= r.max_tokens:   # (near its end)
                max_depth = min(max_depth, max_context - length - 1, r.max_tokens - r.emitted - 1)
            # a tree's node budget, or a chain's length, within this request's share of the tick
            if max_depth <= 0:
                continue
            if budget:
                nodes = tree_nodes.get(budget)
                if nodes is None:
                    nodes = tree_nodes[budget] = adaptive_budget(n, step_nodes, want=budget, min_nodes=2)
            else:
                key = (max_depth, 1)
                nodes = shares.get(key)
                if nodes is None:
                    nodes = shares[key] = adaptive_budget(n, step_nodes, want=max_depth, min_nodes=1)
            if not nodes:
                continue
            if not r.on_drafter:
                if room <= 0:
                    self.no_drafter_slot += 1
                    continue  # no drafter slot free: this request decodes plainly this tick
                room -= 1
            else:
                held_rows += r.rows_from   # (the rows it was last sent up to)
            # the rows it lacks: [rows_from, L), from 0 for a new or re-created session (history
            # entries are never empty: _keep; one entry, the common case, is sent as is)
            history = r.history
            features = (history[0] if len(history) == 1 else join_rows(history)) if history else None
            rows = (features.rows if features is not None else 0) + r.ring_rows
            if rows > block:
                if features is not None:
                    nbytes = memoryview(features.data).nbytes
                    if extra_bytes and extra_bytes + nbytes > RESYNC_BYTES:
                        room += not r.on_drafter
                        continue  # this Propose carries enough such rows: this request drafts at a later tick
                    extra_bytes += nbytes
                extra_rows += rows - block
                if r.draft_gen and not r.draft_synced:
                    resync_rows += rows - block
            if not budget:
                max_depth = nodes   # a chain of that length
            ring = None
            if r.ring_rows:
                ring = RingRows(r.ring_slot, r.ring_rows)
                self.ring_rows_sent += r.ring_rows
            items.add(r.draft_id, r.root, length, nodes if budget else 0, top_k, max_depth, features, ring)
            who.append((i, max_depth))
        unmeasured = bool(resync_rows) or extra_rows > block * len(who)
        if not who:
            return {}, 0.0, unmeasured
        as_columns = len(who) >= COLUMNS_FROM and COLUMNAR in drafter.model.features
        timeout = self.deadline.timeout(len(who), extra_rows, held_rows)
        if timeout is not None:
            metrics.set_draft_deadline(timeout)
        t0 = time.perf_counter()
        try:
            if self._propose is None:
                self._propose = self.draft.propose_stream(None)
            # the feature ring's descriptor only over the same-host hop (items naming ring rows
            # over gRPC are then written without them: the drafter refuses them, LENGTH_MISMATCH)
            items.ring = self._ring if type(self._propose) is LocalHopCall else None
            # as wire bytes where the stream sends a message's bytes itself (not grpc's own stub)
            request = items.request(as_columns, as_columns and isinstance(self._propose, (LocalHopCall, DirectStreamCall)))
            t0 = time.perf_counter()
            self._propose.spin_s = self.hop_spin(len(batch))
            reply = self._exchange(self._propose, request, timeout)
            checked = None
            if columnar and len(who) == len(batch) and reply.HasField("trees") and not reply.refused:
                checked = self._trees.check(reply.trees, [r.root for r in batch], [d for _, d in who], width_cap)
            try:
                results = propose_results(reply, len(who)) if checked is None else None
            except ColumnsError as e:   # as a reply that does not decode: the stream is over
                raise StreamError(grpc.StatusCode.INTERNAL, f"the reply's columns do not fit together: {e}") from None
        except grpc.RpcError as e:
            self._draft_failed([batch[i] for i, _ in who], e)
            return {}, time.perf_counter() - t0, unmeasured
        draft_s = time.perf_counter() - t0
        if self._propose.broken:  # its deadline passed just after the reply came: the reply stands
            self._propose.close()
            self._propose = None
        self.draft.mark_ok()
        if not extra_rows:
            self.deadline.observe(draft_s, len(who))
        compute_s, device_s = reply.compute_s, reply.device_s
        self.propose_queue_s += reply.queue_s
        if checked is not None:
            sent = self._sent
            for r in batch:
                r.on_drafter = True
                sent(r)
                stats = r.stats
                stats.draft_time_s += draft_s
                stats.draft_compute_s += compute_s
                stats.draft_device_s += device_s
            return checked, draft_s, unmeasured
        trees = {}
        for (i, max_depth), res in zip(who, results):
            r = batch[i]
            r.on_drafter = True
            r.stats.draft_time_s += draft_s
            r.stats.draft_compute_s += compute_s
            r.stats.draft_device_s += device_s
            status = res.status
            if status is not None:
                if status.reason == Reason.RING_UNAVAILABLE and not self.ring_refused:
                    self.ring_refused = True   # (its rows come as bytes from the next Verify on)
                    log.warning("the drafter cannot read the target's feature ring: feature rows go through this "
                                "orchestrator", extra={"error": status.message[:200]})
                log.warning("drafter refused an item; this step goes on without a tree",
                            extra={"session": r.session_id, "code": status_code(status.code).name,
                                   "reason": status.reason, "error": status.message[:200]})
                self._release([], [r])  # re-created later under a new id (_lose_rows)
                r.draft_gen += 1
                r.on_drafter = False
                self._lose_rows(r)
                r.stats.draft_fallbacks += 1
                self.fallbacks += 1
                metrics.observe_fallback("draft_item_error")
                continue
            self._sent(r)
            try:
                tokens, parents, depth = fit_tree(res.tokens, res.parents, max_depth, width_cap)
            except TreeError as e:
                log.warning("drafter sent a malformed tree; this step goes on without a tree",
                            extra={"session": r.session_id, "error": str(e)[:200]})
                continue
            if tokens and tokens[0] == r.root:
                trees[i] = (tokens, parents, depth)
        return trees, draft_s, unmeasured

    def _draft_failed(self, asked: list[Request], e: grpc.RpcError) -> None:
        """The Propose call failed or missed its deadline: every request goes on root-only this
        tick; those that asked for a tree count a fallback; the drafter's circuit opens (no
        Propose until it answers a probe); the stream is dropped (a late reply must never pass for
        a later tick's); every drafter session that may exist is re-created later
        from rows the target recomputes, under a new id, the old ids released when the drafter
        answers again."""
        code = e.code()
        if isinstance(e, ExchangeTimeout):
            why, reason = f"Propose missed its {e.timeout * 1e3:.0f} ms deadline", "draft_deadline"
            self.deadline_misses += 1
            metrics.observe_deadline_miss()
        else:
            why, reason = f"Propose failed: {code.name}", "draft_unavailable"
        log.warning("draft service failed; decoding goes on without it until it answers a probe",
                    extra={"code": code.name, "why": why, "error": str(e.details())[:200]})
        if self._propose is not None:
            self._propose.close()
            self._propose = None
        self.draft.mark_failed(why)
        asked_ids = {id(r) for r in asked}
        for r in asked:
            r.stats.draft_fallbacks += 1
        for r in self._active:
            if r.on_drafter or id(r) in asked_ids:
                self._new_draft_session(r)
            r.on_drafter = False   # (others keep their rows: a new session's, or a recompute's in flight)
        self.fallbacks += 1
        metrics.observe_fallback(reason)

    def _verify_failed(self, batch: list[Request], e: grpc.RpcError) -> None:
        code, reason = target_status(e.code(), reason_of(e))
        if e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            msg = f"target service did not answer within {self.step_timeout:.0f} s"
        else:
            msg = f"target service: {e.details()}"
        log.warning("verify failed", extra={"code": code.name, "reason": reason, "error": msg[:200], "batch": len(batch)})
        if self._verify is not None:
            self._verify.close()
            self._verify = None
        for r in batch:
            self._end(r, Failure(code, msg, reason))
            r.closed = True
            if code == grpc.StatusCode.UNAVAILABLE:
                r.on_target = False  # the target is gone: nothing to release there

    def _verify_item_failed(self, r: Request, code: grpc.StatusCode, message: str, reason: str) -> None:
        """The target refused ``r``'s item: context full (reason ``CONTEXT_FULL``) finishes it
        with finish reason CONTEXT; a lost session (NOT_FOUND) ends it UNAVAILABLE /
        ``TARGET_UNAVAILABLE``; anything else ends it with the target's status and reason."""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and reason == Reason.CONTEXT_FULL:
            self._emit(r, [], FINISH_CONTEXT)
            return
        if code == grpc.StatusCode.NOT_FOUND:
            code, reason, message = (grpc.StatusCode.UNAVAILABLE, Reason.TARGET_UNAVAILABLE,
                                     f"the target lost this session (restarted?): {message}")
            r.on_target = False
        self._end(r, Failure(code, f"target: {message}", reason))
        r.closed = True
