"""The draft service's engines: the per-session reference (:class:`ReferenceDrafterEngine`) and the
GPU engine (:class:`BatchedDrafter`), with one interface, ``propose_batch(items)`` / ``release(ids)``,
run by a :class:`runtime.step_loop.StepLoop` (``batch_method="propose_batch"``).

Neither imports grpc: a refused item is an :class:`runtime.errors.EngineError` (or the
exception that broke its step) in its place of the result list, and the servicer
(:mod:`draft_service.servicer`) maps it to a gRPC status (``runtime.status.item_status``).

Rules every item goes through, in this order, before anything is computed (both engines; an item
that fails leaves its session exactly as it was, a new session is not created, and no other item
of the batch is affected):

* ``INVALID_ARGUMENT``: empty session id; features not ``[rows, N*H]`` floating point; non-finite
  features; root token outside the vocabulary; tree params negative or over the service's bounds
  (``budget > MAX_TREE_BUDGET``, ``top_k > vocab_size``, ``max_depth > block_size - 1``);
* ``RESOURCE_EXHAUSTED``: the session is new and every session slot is taken;
* ``FAILED_PRECONDITION``: ``committed_length`` differs from rows held + rows sent;
* ``RESOURCE_EXHAUSTED``: the session would exceed ``max_context`` rows.

Items of one batch are served in order: a session may appear several times (each item sees the
rows its earlier items appended).

**The batched engine** (docs/ARCHITECTURE.md, "The GPU path"; the draft-side counterpart of
:class:`target_service.batched_engine.BatchedEngine`):

* a context pool allocated once (:class:`runtime.pool.StatePool`): K and V
  ``[num_layers, slots + 1, rows, Hkv, D]`` in the model dtype, ``rows = max_context +
  max(block_size, append_rows)``; slot ``slots`` is the spare that padded batch rows use, so a
  padded row never touches a live session; a slot is zeroed when a session takes it; addresses
  never move;
* one step for a batch of sessions (:func:`draft_step`): append each session's new context rows
  (``fc`` + ``hidden_norm`` + each layer's k/v, ``k_norm``, RoPE at their absolute positions,
  written into the pool through index tensors), then the block ``[root, MASK x (B-1)]`` at
  positions ``L..L+B-1`` through every layer (the block's K/V written at the scratch rows
  ``[L, L+B)`` of the slot; attention by ``kernels.attention.pool_attention`` with every block
  row seeing all context rows and all block rows, or in a sliding layer those within its window,
  ``window`` = the layer's ``sliding_window``: pool row = position), ``output_norm``, the target LM head on rows
  ``1..B-1``, log-softmax and the top-``K`` per depth (``K = max_top_k``);
* the trees built on the device inside the step (``device_trees``, the default with the fused
  step): one launch of :func:`kernels.ddtree.step_output` runs the best-first search of
  :func:`draft_service.tree.build_tree` for every row (its budget, top_k and depth read from the
  step's int64 input buffer) and writes each row's tree (tokens, parents, node count) and its
  top-K table into one packed int32 row; one device-to-host copy of those rows per step, and an
  item's tree on the host is two slices of its row (an item asking a DDTree of more than
  ``tree_nodes`` nodes has its tree built on the host from the table instead). Without
  ``device_trees`` the step copies the ``[batch, B-1, K]`` log-prob + token table back and each
  item's tree is built on the host (:func:`draft_service.tree.build_tree` on the table: the same
  tree as from the logits), which is also the oracle;
* on CUDA fixed shapes: batches padded to a batch bucket (by default the powers of two below the
  session slots, then the slot count: 1, 2, 4, ... 64 for 64 slots), ``append_rows`` (``A``,
  default the block size: a verify commits at most ``B`` rows) feature rows per session and step;
  rows beyond ``A`` (the first call carries the whole prompt, or after a fallback) are appended
  eagerly before the step, all of its items' rows together in chunks (:meth:`BatchedDrafter._append_eager`). Per-step values (slots, held rows, row counts, roots) are
  read from one pinned int64 buffer and the features from one pinned ``[batch, A, N*H]`` buffer
  (model dtype), both copied to the device once; each bucket's step is one CUDA graph captured at
  start (:meth:`BatchedDrafter.capture`), replayed every step; one host synchronisation per step.
  ``cuda_graphs=False`` runs the same code eagerly;
* on the CPU the same step runs eagerly with exact shapes (no batch padding).

The math is the drafter's own (:class:`draft_service.drafter.DFlashDrafter`: ``context_rows``,
``_context_kv``, ``run_blocks`` / ``_layer``); only the attention backend differs (pooled).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import NamedTuple, Sequence

import numpy as np
import torch

from draft_service.config import DraftConfig
from draft_service.drafter import DFlashDrafter, DrafterContext
from draft_service.fused_step import FusedDrafter
from draft_service.tree import TopK, build_tree
from kernels import attention as attn_ops
from kernels import ring as ring_kernels
from kernels.attention import default_splits, split_buckets, splits_for
from kernels.ddtree import PackedLayout, step_output
from kernels.linear import batch_invariant
from kernels.topk.reference import topk_log_softmax as topk_reference
from runtime.errors import EngineError, FailedPrecondition, InvalidArgument, Reason, ResourceExhausted
from runtime.feature_ring import item_offsets
from runtime.graphs import GraphSet, StepGraph, batch_buckets_for, bucket_for, capped_buckets, slots_for_budget
from runtime.pool import PoolShape, StatePool

log = logging.getLogger(__name__)

#: Default number of candidates per depth in the step's top-K table (requests asking more are cut to it).
DEFAULT_MAX_TOP_K = DraftConfig.max_top_k

#: Most non-root nodes a Propose item's tree ``budget`` may ask (larger: INVALID_ARGUMENT). The
#: target verifies at most 64 nodes a tree (``TargetConfig.max_tree_width``, the attention
#: kernel's 64-bit masks), so 1024 leaves room for any target while bounding the best-first
#: search of :func:`draft_service.tree.build_tree` (one heap pop per node, about a millisecond
#: at this size) that runs on the step loop's thread, for such an item, and delays every other
#: stream.
MAX_TREE_BUDGET = 1024

#: Default most non-root nodes of a tree the batched engine builds on the device
#: (``BatchedDrafter(tree_nodes=)``): 63, with the root the 64 nodes a target verifies at most.
#: A DDTree item asking more is built on the host.
DEFAULT_TREE_NODES = 63

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# ----------------------------------------------------------------------------------- items
class DraftItem(NamedTuple):
    """One proposal request for one session.

    Attributes:
        session_id: non-empty id; a session is created on its first successful item.
        features: ``[rows, N*H]`` (any float dtype, CPU) target features of the rows committed
            since the session's last item, in order; ``None`` = 0 rows.
        root_token: the last emitted token, at position ``committed_length``.
        committed_length: ``L``; must equal rows held + ``rows``.
        budget, top_k, max_depth: tree params (``dflash_grpc.v1.TreeParams``): DDTree with
            ``top_k`` candidates per depth and at most ``budget`` non-root nodes when both are
            > 1, else the greedy chain (cut to ``budget`` nodes when ``budget > 0``); depth
            ``max_depth`` (0 = ``block_size - 1``). Bounds (:func:`check_item`): ``0 <= budget
            <= MAX_TREE_BUDGET``, ``0 <= top_k <= vocab_size``, ``0 <= max_depth <= block_size - 1``.
        finite: ``features`` are known to hold only finite values (the sender checked a step's
            rows as one tensor: ``draft_service.servicer.propose_columns``), so :func:`check_item`
            need not look at them again; False: it does.
        ring: more rows after ``features``, in a target's feature ring
            (:mod:`runtime.feature_ring`): ``(ring, slot, rows)``, the ``rows`` positions before
            ``committed_length`` of ``slot``; ``ring`` None when the ring could not be mapped (the
            item is refused, ``RING_UNAVAILABLE``). None: no ring rows. Rows a target wrote, so
            not checked for finite values.
    """

    session_id: str
    features: torch.Tensor | None
    root_token: int
    committed_length: int
    budget: int = 0
    top_k: int = 0
    max_depth: int = 0
    finite: bool = False
    ring: tuple | None = None


def ring_rows(item: DraftItem) -> int:
    """Rows of ``item`` in a feature ring (0: none)."""
    return item.ring[2] if item.ring is not None else 0


def item_features(item: DraftItem, features: torch.Tensor) -> torch.Tensor:
    """Every row of ``item``: ``features`` (its rows sent as bytes, from :func:`check_item`) then
    its ring rows gathered (on the ring's device; ``features`` moved there when it has rows)."""
    if item.ring is None:
        return features
    ring, slot, n = item.ring
    rows = ring.gather(ring.rows_of([slot], [int(item.committed_length)], [n]))
    if not features.shape[0]:
        return rows
    return torch.cat([features.to(device=rows.device, dtype=rows.dtype), rows])


@dataclasses.dataclass
class ProposeOutcome:
    """The proposal for one item: ``tokens`` / ``parents`` (node 0 = root, ``parents[0] = -1``),
    the session's rows held after it (``committed_length``), and, from the batched engine, the
    item's rows of the step's top-K table (``table``, ``[depth, K]``)."""

    tokens: list[int]
    parents: list[int]
    committed_length: int
    table: TopK | None = None


#: float dtype -> (integer dtype of the same width, its exponent bits as a numpy scalar of that
#: width): a value is NaN or infinite exactly when all of its exponent bits are set (IEEE 754 and
#: bfloat16).
_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, np.int16(0x7F80)),
    torch.float16: (torch.int16, np.int16(0x7C00)),
    torch.float32: (torch.int32, np.int32(0x7F800000)),
    torch.float64: (torch.int64, np.int64(0x7FF0000000000000)),
}


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a float tensor is finite. On the CPU it tests the exponent bits
    with numpy (about 5x faster than ``torch.isfinite`` on a ``[4, 2880]`` bf16 tensor), the mask a
    cached scalar and the test the array's own ``any`` (``np.any``'s dispatch cost ~4 us a call
    on the 2-core VM: 27 -> ~12 us on a ``[4, 2880]`` bf16 tensor)."""
    spec = _EXPONENT_BITS.get(t.dtype)
    if spec is None or t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    bits = t.contiguous().view(spec[0]).numpy()
    mask = spec[1]
    return not bool(((bits & mask) == mask).any())


_NO_ROWS: dict[int, torch.Tensor] = {}


def _no_rows(width: int) -> torch.Tensor:
    """An empty float32 ``[0, width]`` tensor, made once per width (an item without rows sent:
    one ``torch.empty`` per item was about 2 us of the drafter's host time each, 0.13 ms a tick at
    64 streams; it holds nothing, so sharing it is safe)."""
    t = _NO_ROWS.get(width)
    if t is None:
        t = _NO_ROWS[width] = torch.empty(0, width)
    return t


def check_item(item: DraftItem, config) -> tuple[torch.Tensor, int]:
    """The session-independent checks of an item (module docstring, ``INVALID_ARGUMENT``).

    Returns:
        ``(features [rows, N*H], depth)``: ``features`` as sent (an empty float32 tensor for
        ``None``) and the tree depth (``max_depth``, or ``block_size - 1`` when 0).

    Raises:
        InvalidArgument: see the module docstring.
    """
    width = config.feature_size
    if not item.session_id:
        raise InvalidArgument("empty session_id")
    f = item.features
    if f is None:
        f = _no_rows(width)
    if not isinstance(f, torch.Tensor) or f.dim() != 2 or f.shape[1] != width:
        shape = list(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
        raise InvalidArgument(f"features must be [rows, {width}] (N={config.num_target_layers} x hidden "
                              f"{config.hidden_size}), got {shape}", reason=Reason.INVALID_FEATURES)
    if not f.is_floating_point():
        raise InvalidArgument(f"features must be floating point, got {f.dtype}", reason=Reason.INVALID_FEATURES)
    if f.numel() and not item.finite and not all_finite(f):
        raise InvalidArgument("features hold NaN or infinite values", reason=Reason.INVALID_FEATURES)
    root = int(item.root_token)
    if not 0 <= root < config.vocab_size:
        raise InvalidArgument(f"root token {root} outside the vocabulary [0, {config.vocab_size})", reason=Reason.INVALID_TOKEN)
    if item.budget < 0 or item.top_k < 0 or item.max_depth < 0:
        raise InvalidArgument(f"negative tree params (budget={item.budget}, top_k={item.top_k}, max_depth={item.max_depth})")
    full = config.block_size - 1
    if item.budget > MAX_TREE_BUDGET:
        raise InvalidArgument(f"tree budget {item.budget} is over the service's bound of {MAX_TREE_BUDGET} nodes")
    if item.top_k > config.vocab_size:
        raise InvalidArgument(f"tree top_k {item.top_k} is over the vocabulary size {config.vocab_size}")
    if item.max_depth > full:
        raise InvalidArgument(f"tree max_depth {item.max_depth} is over the drafter's block size - 1 = {full}")
    if item.ring is not None:
        ring, slot, n = item.ring
        if ring is None or ring.closed:   # (closed: unmapped while the item waited, DraftServiceServicer.feature_ring)
            raise FailedPrecondition("the item's rows are in a feature ring this drafter cannot read; send them as bytes",
                                     reason=Reason.RING_UNAVAILABLE)
        if ring.width != width:
            raise InvalidArgument(f"the feature ring's rows are {ring.width} wide, not {width}", reason=Reason.INVALID_FEATURES)
        if not 0 <= slot < ring.slots or not 0 < n <= ring.slot_rows or n > item.committed_length:
            raise InvalidArgument(f"ring rows outside the ring (slot {slot}, {n} rows before position "
                                  f"{item.committed_length}; {ring.slots} slots of {ring.slot_rows} rows)",
                                  reason=Reason.INVALID_FEATURES)
    return f, (full if item.max_depth == 0 else int(item.max_depth))


def _check_session(sid: str, exists: bool, held: int, rows: int, committed: int, free: int, max_sessions: int,
                   max_context: int) -> None:
    """The session checks (module docstring), given the session's state."""
    if not exists and free <= 0:
        raise ResourceExhausted(f"all {max_sessions} session slots are in use", reason=Reason.NO_FREE_SLOT)
    if committed != held + rows:
        raise FailedPrecondition(f"committed_length {committed} != rows held ({held}) + rows sent ({rows})", reason=Reason.LENGTH_MISMATCH)
    if max_context and held + rows > max_context:
        raise ResourceExhausted(f"context full: {held + rows} rows > max_context {max_context}", reason=Reason.CONTEXT_FULL)


# ----------------------------------------------------------------------------------- reference engine
class ReferenceDrafterEngine:
    """The per-session reference engine: one :class:`DrafterContext` (growing per-session K/V
    buffers) per session, items served one at a time with the drafter's cached path
    (``append_context`` + ``block_logits``) and the tree built from the logits. The CPU default
    and the oracle of :class:`BatchedDrafter`.

    Args:
        drafter: the model (any device / dtype; put in eval mode).
        max_sessions: most concurrent sessions.
        max_context: most context rows per session (0 = unlimited).
    """

    def __init__(self, drafter: DFlashDrafter, max_sessions: int = DraftConfig.max_sessions, max_context: int = 0):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.drafter = drafter.eval()
        self.config = drafter.config
        self.max_sessions = int(max_sessions)
        self.max_context = int(max_context)
        self.sessions: dict[str, DrafterContext] = {}
        #: graphs captured (none: this engine runs eagerly)
        self.captures = 0

    @property
    def free_slots(self) -> int:
        return self.max_sessions - len(self.sessions)

    def session_length(self, session_id: str) -> int | None:
        """Context rows held for a session, or None when it does not exist."""
        ctx = self.sessions.get(session_id)
        return None if ctx is None else ctx.length

    def release(self, session_ids: Sequence[str]) -> int:
        """Drop the sessions' contexts; returns how many existed (unknown ids are ignored)."""
        return sum(self.sessions.pop(sid, None) is not None for sid in session_ids)

    @torch.no_grad()
    def propose_batch(self, items: Sequence[DraftItem]) -> list[ProposeOutcome | BaseException]:
        """One outcome per item, in order; a refused or failed item gets its exception
        (an :class:`EngineError`, out-of-memory, or anything unexpected) in its place."""
        out: list[ProposeOutcome | BaseException] = []
        for item in items:
            try:
                out.append(self._propose(item))
            except Exception as e:  # noqa: BLE001 - EngineError, out of memory, or a bug: this item only
                out.append(e)
        return out

    def _propose(self, item: DraftItem) -> ProposeOutcome:
        features, depth = check_item(item, self.config)
        features = item_features(item, features)
        sid, rows = item.session_id, features.shape[0]
        ctx = self.sessions.get(sid)
        held = 0 if ctx is None else ctx.length
        _check_session(sid, ctx is not None, held, rows, int(item.committed_length), self.free_slots,
                       self.max_sessions, self.max_context)
        new = ctx is None
        if new:
            ctx = self.drafter.new_context()
        try:
            self.drafter.append_context(ctx, features)
            logits = self.drafter.block_logits(ctx, int(item.root_token))
        except BaseException:
            ctx.truncate(held)
            raise
        if new:
            self.sessions[sid] = ctx
        tokens, parents = build_tree(int(item.root_token), logits[:depth], int(item.budget), int(item.top_k))
        return ProposeOutcome(tokens, parents, ctx.length)


# ----------------------------------------------------------------------------------- the pooled step
class _PoolAttend:
    """The attention backend of :meth:`DFlashDrafter._layer` over one layer of the context pool:
    writes the block's K/V at rows ``[L, L + B)`` of each row's slot and runs
    ``kernels.attention.pool_attention`` (all context rows and all block rows visible; for a
    sliding layer, ``window`` > 0, only those within its window: pool row = position)."""

    def __init__(self, k_pool, v_pool, slots, lengths, block_rows, ancestors, scale: float, splits: int,
                 window: int = 0, max_splits: int | None = None):
        self.k_pool, self.v_pool, self.slots, self.lengths = k_pool, v_pool, slots, lengths
        self.block_rows, self.ancestors, self.scale, self.splits = block_rows, ancestors, scale, splits
        self.window = int(window)
        self.max_splits = max_splits

    def __call__(self, q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor) -> torch.Tensor:
        nb, nh, B, D = q.shape
        where = (self.slots[:, None], self.block_rows)
        self.k_pool[where] = k_blk.transpose(1, 2).to(self.k_pool.dtype)
        self.v_pool[where] = v_blk.transpose(1, 2).to(self.v_pool.dtype)
        o = attn_ops.pool_attention(q.transpose(1, 2), self.k_pool, self.v_pool, self.slots, self.lengths,
                                    self.ancestors, self.scale, splits=self.splits, window=self.window,
                                    max_splits=self.max_splits)
        return o.reshape(nb, B, nh * D)


def write_context(drafter: DFlashDrafter, pool: StatePool, slots: torch.Tensor, starts: torch.Tensor,
                  features: torch.Tensor) -> None:
    """Append context rows into the pool: row ``j`` of batch row ``b`` (``features[b, j]``) goes
    to row ``starts[b] + j`` of slot ``slots[b]`` (its position) in every layer. Graph-safe.

    Args:
        slots, starts: ``[b]`` int64 (device).
        features: ``[b, a, N*H]`` (device, any float dtype).
    """
    b, a = features.shape[:2]
    rows = starts[:, None] + torch.arange(a, device=features.device)        # [b, a] = positions
    ctx = drafter.context_rows(features)                                     # [b, a, H]
    where = (slots[:, None], rows)
    for i, layer in enumerate(drafter.layers):
        k, v = drafter._context_kv(layer, ctx, rows)                          # [b, nkv, a, D]
        pool.k[i][where] = k.transpose(1, 2).to(pool.k.dtype)
        pool.v[i][where] = v.transpose(1, 2).to(pool.v.dtype)


def draft_step(drafter: DFlashDrafter, pool: StatePool, slots: torch.Tensor, held: torch.Tensor,
               n_rows: torch.Tensor, roots: torch.Tensor, features: torch.Tensor, k: int,
               splits: int = 1, max_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batched drafter step over the pool (module docstring); graph-safe (no host reads, no
    value-dependent shapes).

    Args:
        slots: ``[b]`` int64 pool slot of each row (padded rows: the spare slot).
        held: ``[b]`` int64 context rows held before this step.
        n_rows: ``[b]`` int64 new context rows in ``features`` (``<= a``; the rest is padding,
            written at scratch rows the block then overwrites).
        roots: ``[b]`` int64 root tokens.
        features: ``[b, a, N*H]`` new context rows (model dtype).
        k: candidates per depth.
        splits: key-range splits of the Triton attention kernel.
        max_splits: the engine's largest split count (sizes the kernel's combine:
            ``kernels.attention.splits_for``; default ``splits``).

    Returns:
        ``(logprobs [b, B-1, k] float32, tokens [b, B-1, k] int64)``: the top-``k`` of the
        log-softmax of each depth's logits, sorted descending (row ``d`` = depth ``d + 1``).
    """
    c = drafter.config
    B = c.block_size
    dev = features.device
    b = features.shape[0]
    write_context(drafter, pool, slots, held, features)
    lengths = held + n_rows                                                  # L
    block_rows = lengths[:, None] + torch.arange(B, device=dev)              # positions L..L+B-1
    ancestors = torch.full((b, B), (1 << B) - 1 if B < 64 else -1, dtype=torch.long, device=dev)
    tokens = torch.cat([roots[:, None], torch.full((b, B - 1), c.mask_token_id, dtype=torch.long, device=dev)], dim=1)
    scale = 1.0 / math.sqrt(c.head_dim)
    attends = [_PoolAttend(pool.k[i], pool.v[i], slots, lengths, block_rows, ancestors, scale, splits,
                           c.layer_window(i), max_splits) for i in range(c.num_layers)]
    hidden = drafter.run_blocks(tokens, block_rows, attends)                 # [b, B, H]
    logits = drafter.logits(hidden[:, 1:])                                   # [b, B-1, V] float32
    return topk_reference(logits, k)


# ----------------------------------------------------------------------------------- the engine
@dataclasses.dataclass
class DraftSession:
    """Host-side state of one session of :class:`BatchedDrafter`: its slot and rows held."""

    session_id: str
    slot: int
    length: int = 0


#: The rows of the step's pinned int64 input buffer: pool slot, rows held, new rows, root token,
#: and the tree params of the device trees (budget, top_k, depth = the item's candidate depths).
_FIELDS = ("slots", "held", "n_rows", "roots", "budget", "top_k", "depth")


class StepResult(NamedTuple):
    """A step's host results (views of the runner's output buffer: read them before its next step).

    Attributes:
        logprobs: ``[batch, B-1, K]`` float32, the top-K log-probs per depth (descending).
        tokens: ``[batch, B-1, K]`` int32, their token ids.
        trees: with device trees, ``(tokens [batch, W] int32, parents [batch, W] int32, count
            [batch] int32)`` (:func:`kernels.ddtree.build_trees_batched`: row ``r``'s tree is the
            first ``count[r]`` entries); else None.
    """

    logprobs: np.ndarray
    tokens: np.ndarray
    trees: tuple[np.ndarray, np.ndarray, np.ndarray] | None


class _Runner(StepGraph):
    """The drafter's step (a :class:`runtime.graphs.StepGraph`) of one ``(batch, rows)`` shape:
    a pinned int64 buffer ``[7, batch]`` (:data:`_FIELDS`), a pinned features buffer ``[batch,
    rows, N*H]`` in the model dtype, and a pinned int32 output: with device trees the packed rows
    ``[batch, layout.size]`` (:class:`kernels.ddtree.PackedLayout`: table, tree tokens, parents,
    node count), else ``[batch, B-1, K, 2]`` (log-prob bits, token). Where the ring's gather
    runs in Triton (CUDA) and ``DFLASH_RING_IN_STEP`` is not ``0``
    (:func:`kernels.ring.gathers_in_step`) also a pinned int64 ring meta buffer ``[3 + 2 * batch
    * rows]`` (:func:`kernels.ring.gather_meta`): the feature ring rows the step reads, gathered
    inside the step (:meth:`body`) from the ring whose address it holds (a count of 0 on every
    step without them). ``splits``: the attention kernel's key-range splits of this step
    (``kernels.attention.splits_for``); ``share``: the runner of the same shape whose buffers a
    fewer-split variant uses."""

    def __init__(self, engine: "BatchedDrafter", batch: int, rows: int, splits: int = 1,
                 share: "_Runner | None" = None):
        super().__init__(engine.device)
        self.engine, self.batch, self.rows, self.splits = engine, batch, rows, splits
        c = engine.config
        self.layout = engine.tree_layout
        if share is not None:
            self.host, self.host_np, self.dev = share.host, share.host_np, share.dev
            self.feats_host, self.feats_dev, self.out = share.feats_host, share.feats_dev, share.out
            self.out_dev = share.out_dev
            self.ring_meta, self.ring_meta_np = share.ring_meta, share.ring_meta_np
            self.ring_meta_dev = share.ring_meta_dev
            return
        self.host = self.host_buffer(len(_FIELDS), batch, dtype=torch.long)
        self.host_np = self.host.numpy()
        self.dev = self.device_twin(self.host)
        self.feats_host = self.host_buffer(batch, rows, c.feature_size, dtype=engine.dtype)
        self.feats_dev = self.device_twin(self.feats_host)
        if self.layout is not None:
            self.out = self.host_buffer(batch, self.layout.size, dtype=torch.int32)
            self.out_dev = self.device_twin(self.out)
        else:
            self.out = self.host_buffer(batch, c.block_size - 1, engine.k, 2, dtype=torch.int32)
            self.out_dev = None
        self.ring_meta = self.ring_meta_np = self.ring_meta_dev = None
        if ring_kernels.gathers_in_step(self.feats_dev):   # (else gathered before the step: _features_in)
            self.ring_meta = self.host_buffer(ring_kernels.META_HEAD + 2 * batch * rows, dtype=torch.long)
            self.ring_meta_np = self.ring_meta.numpy()
            self.ring_meta_dev = self.device_twin(self.ring_meta)

    def view(self, name: str) -> np.ndarray:
        return self.host_np[_FIELDS.index(name)]

    def fill_padding(self, first_row: int) -> None:
        """Rows ``first_row..``: no new rows, root 0, in the spare slot."""
        self.host_np[:, first_row:] = 0
        self.view("slots")[first_row:] = self.engine.pool.spare

    def fill_idle(self) -> None:
        """Every row padding (:meth:`fill_padding` from row 0), no ring rows."""
        self.fill_padding(0)
        if self.ring_meta_np is not None:
            self.ring_meta_np[1] = 0

    def body(self) -> None:
        e = self.engine
        self.copy(self.dev, self.host)   # (rows from the host or the device are in feats_dev already: run's head)
        if self.ring_meta_dev is not None:   # the ring's rows, from the ring the meta names (none: count 0)
            self.copy(self.ring_meta_dev, self.ring_meta)
            ring_kernels.gather_rows(self.feats_dev.view(-1, self.feats_dev.shape[-1]), self.ring_meta_dev)
        slots, held, n_rows, roots, budget, top_k, depth = self.dev.unbind(0)
        if e.fused is not None:
            lp, tok = e.fused.step(e.pool, slots, held, n_rows, roots, self.feats_dev, e.k, self.splits, e.max_splits)
        else:
            lp, tok = draft_step(e.drafter, e.pool, slots, held, n_rows, roots, self.feats_dev, e.k, self.splits,
                                 e.max_splits)
        if self.layout is not None:   # the trees and the table in one launch, then one copy
            step_output(lp, tok, roots, budget, top_k, depth, self.layout, self.out_dev)
            self.copy(self.out, self.out_dev)
            return
        packed = torch.stack([lp.contiguous().view(torch.int32), tok.to(torch.int32)], dim=-1)
        self.out.copy_(packed, non_blocking=True)

    def _ring_rows(self, ring, ring_at: Sequence[tuple[int, int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The ring's rows of ``ring_at`` (``(batch row, slot, rows, committed length)`` each) and
        the rows of ``feats_dev`` (flattened) they go to: int64 ``[m]`` each."""
        at = np.asarray(ring_at, dtype=np.int64)
        n = at[:, 2]
        return ring.rows_of(at[:, 1], at[:, 3], n), np.repeat(at[:, 0] * self.rows, n) + item_offsets(n)

    def _features_in(self, batch: int, host_rows: bool, on_device: Sequence[tuple[int, torch.Tensor]],
                     ring, ring_at: Sequence[tuple[int, int, int, int]]) -> None:
        """Queue the step's new context rows into ``feats_dev`` (before the step; device work
        only): the first ``batch`` rows of the host buffer when some came from the host
        (``host_rows``), the rows already on the device (``on_device``: ``(batch row, [n, N*H])``),
        and the feature ring's rows (``ring_at``: ``(batch row, slot, rows, committed length)``).
        With the ring meta buffer (CUDA) and a ring of the step's dtype on its device, the ring's
        rows are only named in that buffer and the step gathers them (:meth:`body`: no launch
        here, the host's part is computing the indices); else one gather and one scatter here."""
        if host_rows:
            self.copy(self.feats_dev[:batch], self.feats_host[:batch])
        for r, t in on_device:
            self.feats_dev[r, : t.shape[0]].copy_(t, non_blocking=True)
        meta = self.ring_meta_np
        if meta is not None:
            if ring_at and ring.table.dtype == self.feats_dev.dtype and ring.table.device == self.feats_dev.device:
                src, dst = self._ring_rows(ring, ring_at)
                ring_kernels.gather_meta(meta, ring.table, src, dst)
                self.engine.ring_rows_in_step += len(src)
                return
            meta[1] = 0
        if ring_at:
            src, dst = self._ring_rows(ring, ring_at)
            self.engine.ring_rows_before += len(src)
            idx = torch.from_numpy(np.stack([src, dst]))
            if self.cuda:
                idx = idx.pin_memory().to(self.device, non_blocking=True)
            # (two PyTorch ops: on an H200 their launches took less host time than one Triton launch
            # of a row copy, 43 against 95 us: benchmarks/gpu/step/run25-ring-probe)
            flat = self.feats_dev.view(-1, self.feats_dev.shape[-1])
            flat.index_copy_(0, idx[1], ring.gather(idx[0]).to(flat.dtype))

    def run(self, batch: int = 0, host_rows: bool = False, on_device: Sequence[tuple[int, torch.Tensor]] = (),
            ring=None, ring_at: Sequence[tuple[int, int, int, int]] = ()) -> StepResult:
        """Run the step (:meth:`StepGraph.run`: replay or eager, one host sync) after queueing its
        new context rows (:meth:`_features_in`); returns its :class:`StepResult` (views of the
        output buffer: read them before the next step)."""
        super().run(head=lambda: self._features_in(batch, host_rows, on_device, ring, ring_at))
        out = self.out.numpy()
        if self.layout is None:
            return StepResult(out[..., 0].view(np.float32), out[..., 1], None)
        table, tokens, parents, count = self.layout.views(out)
        return StepResult(table[..., 0].view(np.float32), table[..., 1], (tokens, parents, count))


class _AppendRunner(StepGraph):
    """The captured form of :meth:`BatchedDrafter._append_rows` for up to ``rows`` context rows
    (a CUDA graph per size of :attr:`BatchedDrafter.append_buckets`): a pinned int64 buffer ``[2,
    rows]`` (each row's pool slot and position) and a device features buffer ``[rows, N*H]`` in
    the model dtype; the step is :meth:`FusedDrafter._context` over all ``rows`` inside
    :func:`kernels.linear.batch_invariant`, so a row's K/V have the bits the eager append gives it
    at any chunk size; rows past the append's are padding in the spare slot. Why: eagerly each
    chunk cost about 0.8 ms of host time (some 25 PyTorch and Triton launches and two blocking
    copies of its slots and positions) and at 64 streams that was 1.45 of the drafter's 3.0 ms a
    tick (``benchmarks/gpu/step/run27-engine-host``); replayed it is one launch and the copies."""

    def __init__(self, engine: "BatchedDrafter", rows: int):
        super().__init__(engine.device)
        self.engine, self.rows = engine, int(rows)
        self.host = self.host_buffer(2, self.rows, dtype=torch.long)
        self.host_np = self.host.numpy()
        self.dev = self.device_twin(self.host)
        self.feats = torch.zeros(self.rows, engine.config.feature_size, dtype=engine.dtype, device=engine.device)

    def fill_padding(self, first_row: int) -> None:
        """Rows ``first_row..``: the spare slot, at distinct positions inside the pool's rows."""
        pad = self.rows - first_row
        self.host_np[0, first_row:] = self.engine.pool.spare
        self.host_np[1, first_row:] = np.arange(pad) % self.engine.pool.shape.rows

    def fill_idle(self) -> None:
        self.fill_padding(0)

    def body(self) -> None:
        e = self.engine
        self.copy(self.dev, self.host)
        slots, positions = self.dev.unbind(0)
        with batch_invariant():
            e.fused._context(e.pool, slots, positions, self.feats[:, None])

    def append(self, pieces: Sequence[tuple[int, int, torch.Tensor]]) -> int:
        """Write the rows of ``pieces`` (``(slot, start, features [m, N*H])`` each, at most
        :attr:`rows` in all) as :meth:`BatchedDrafter._append_rows` does, in one replay; returns
        the rows written."""
        h, at = self.host_np, 0
        for slot, start, f in pieces:
            m = f.shape[0]
            h[0, at : at + m] = slot
            h[1, at : at + m] = np.arange(start, start + m)
            at += m
        self.fill_padding(at)

        def head() -> None:
            i = 0
            for _, _, f in pieces:
                self.feats[i : i + f.shape[0]].copy_(f, non_blocking=True)
                i += f.shape[0]

        self.run(head=head)
        return at


class BatchedDrafter:
    """The GPU drafter engine (module docstring): sessions in a context pool, proposals of a batch
    of sessions in one fixed-shape step (a CUDA graph per batch bucket on CUDA).

    Args:
        drafter: the model (on its device, any float dtype; block size at most 64).
        max_sessions: most sessions (fewer when ``memory_budget`` holds fewer slots).
        max_context: most context rows per session (the pool's size; > 0).
        memory_budget: bytes for the context pool, the spare slot included (``None``: whatever
            ``max_sessions`` slots need).
        cuda_graphs: capture and replay each bucket's step as a CUDA graph (CUDA only).
        batch_buckets: step batch sizes on CUDA (a batch is padded to the smallest that holds it;
            larger batches are split into steps); None (or empty): :func:`runtime.config.batch_buckets_for`
            the slots granted (every session the pool holds fits one step).
        append_rows: ``A``, new context rows per session carried by the step (default: the block
            size); a session sending more has the excess appended eagerly first.
        max_top_k: ``K``, candidates per depth in the step's table; tree requests with a larger
            ``top_k`` are served with ``K``.
        prefill_chunk: most rows per eager append (the excess rows).
        pad_batches: pad batches to the buckets and carry ``A`` rows per session also when not on
            CUDA (default: only on CUDA; used by tests to run the padded shapes on the CPU).
        fused: run the step on the fused kernels (:class:`draft_service.fused_step.FusedDrafter`)
            instead of its plain-PyTorch reference :func:`draft_step` (default: on CUDA).
        device_trees: build the trees inside the step (:func:`kernels.ddtree.step_output`: the
            Triton kernel on CUDA, its PyTorch reference elsewhere) instead of on the host
            (default: when ``fused``); the same trees either way.
        tree_nodes: ``N``, the most non-root nodes of a tree built on the device (at least ``B -
            1`` is used: room for any chain); a DDTree item with a larger budget is built on the
            host from the table. Sizes the kernel's frontier (``N + 1`` rounded up to a power of
            two), so keep it near what targets verify.

    Raises:
        ResourceExhausted: ``memory_budget`` holds no session slot.
        ValueError: bad sizes (``max_context < 1``, block size > 64, ...).
    """

    def __init__(self, drafter: DFlashDrafter, max_sessions: int = DraftConfig.max_sessions,
                 max_context: int = DraftConfig.BATCHED_CONTEXT_CAP, memory_budget: int | None = None,
                 cuda_graphs: bool = DraftConfig.cuda_graphs, batch_buckets: Sequence[int] | None = DraftConfig.batch_buckets,
                 append_rows: int | None = None, max_top_k: int = DEFAULT_MAX_TOP_K,
                 prefill_chunk: int = DraftConfig.prefill_chunk, pad_batches: bool | None = None,
                 fused: bool | None = None, device_trees: bool | None = None,
                 tree_nodes: int = DEFAULT_TREE_NODES):
        c = drafter.config
        if max_sessions < 1 or max_context < 1:
            raise ValueError(f"max_sessions ({max_sessions}) and max_context ({max_context}) must be >= 1")
        if c.block_size > 64:
            raise ValueError(f"block size {c.block_size} > 64 (the attention kernel's bit masks hold 64 rows)")
        if not 1 <= tree_nodes <= MAX_TREE_BUDGET:
            raise ValueError(f"tree_nodes {tree_nodes} outside [1, {MAX_TREE_BUDGET}]")
        self.drafter = drafter.eval()
        self.config = c
        self.device, self.dtype = drafter.device, drafter.dtype
        self.cuda = self.device.type == "cuda"
        self.cuda_graphs = bool(cuda_graphs) and self.cuda
        self.fixed = self.cuda if pad_batches is None else bool(pad_batches)
        self.max_context = int(max_context)
        self.append_rows = int(append_rows or c.block_size)
        self.k = int(max(1, min(max_top_k, c.vocab_size)))
        self.prefill_chunk = max(1, int(prefill_chunk))
        shape = PoolShape(tuple(range(c.num_layers)), (), c.num_kv_heads, c.head_dim,
                          self.max_context + max(c.block_size, self.append_rows))
        self.max_sessions = slots_for_budget(memory_budget, shape.slot_bytes(self.dtype), max_sessions,
                                             what="drafter session")
        self.batch_buckets = tuple(sorted({int(b) for b in batch_buckets or () if b >= 1})) or \
            batch_buckets_for(self.max_sessions)
        self.pool = StatePool(shape, self.max_sessions, self.device, self.dtype)
        #: the fused step's packed weights and rotary table, or None (the reference step)
        self.fused = FusedDrafter(drafter, shape.rows) if (self.cuda if fused is None else fused) else None
        #: the packed output row of the device trees (:class:`kernels.ddtree.PackedLayout`), or None:
        #: trees on the host
        on = self.fused is not None if device_trees is None else bool(device_trees)
        self.tree_layout = PackedLayout(c.block_size - 1, self.k, max(int(tree_nodes), c.block_size - 1)) if on else None
        self.sessions: dict[str, DraftSession] = {}
        #: the attention kernel's key-range splits (CUDA): the full count, and the split counts a
        #: step may run with (``kernels.attention.split_buckets``; the fewest that hold the step's
        #: keys, with the same bits)
        self.max_splits = default_splits(shape.rows) if self.cuda else 1
        self.split_buckets = split_buckets(self.max_splits) if self.fixed else (self.max_splits,)
        #: the step runners of the fixed shapes, keyed ``(batch, rows, splits)``
        self.graphs = GraphSet(self._build_runner, self.cuda_graphs)
        #: row counts of the captured eager appends (:class:`_AppendRunner`; with the fused step,
        #: CUDA graphs and fixed shapes): powers of two from 16 below ``prefill_chunk``, and
        #: ``prefill_chunk`` (a chunk gathers several sessions' rows, so it may hold more rows than
        #: one slot: padding positions wrap inside the spare slot)
        top = self.prefill_chunk
        self.append_buckets = tuple(sorted({1 << k for k in range(4, top.bit_length()) if 1 << k < top} | {top}))
        self.appends = GraphSet(lambda rows: _AppendRunner(self, rows), True) \
            if self.cuda_graphs and self.fixed and self.fused is not None else None
        #: steps run and their seconds (inputs staged, step run, output read back), rows appended
        #: before a step (excess rows: :meth:`_append_eager`, replayed or eager), trees output and their host seconds (built from the table, or
        #: read from the step's rows; graphs captured: :attr:`captures`); feature ring rows gathered
        #: inside the steps (``ring_rows_in_step``) and before them (``ring_rows_before``)
        self.steps = 0
        self.step_s = 0.0
        self.eager_rows = 0
        self.ring_rows_in_step = self.ring_rows_before = 0
        self.trees = 0
        self.tree_s = 0.0

    # ------------------------------------------------------------------ sessions
    @property
    def free_slots(self) -> int:
        return self.pool.free

    def session_length(self, session_id: str) -> int | None:
        """Context rows held for a session, or None when it does not exist."""
        s = self.sessions.get(session_id)
        return None if s is None else s.length

    def release(self, session_ids: Sequence[str]) -> int:
        """Drop sessions and free their slots; unknown ids are ignored. Returns how many were live."""
        return self.pool.release_sessions(self.sessions, session_ids)

    # ------------------------------------------------------------------ shapes
    @property
    def captures(self) -> int:
        """Graphs captured so far."""
        return self.graphs.captures

    def buckets(self) -> list[int]:
        """The batch sizes this engine captures on CUDA: the buckets up to the first that holds
        ``max_sessions``."""
        return capped_buckets(self.batch_buckets, self.max_sessions)

    def _max_step(self) -> int:
        return self.buckets()[-1] if self.fixed else 1 << 30

    def _runner(self, batch: int, rows: int, splits: int | None = None) -> _Runner:
        """The runner of ``(batch, rows)`` with ``splits`` attention splits (default: the full
        count): on fixed shapes built (and with CUDA graphs captured) once; on exact shapes fresh
        (small) buffers every step."""
        splits = self.max_splits if splits is None else splits
        if not self.fixed:
            return _Runner(self, batch, rows, splits)
        return self.graphs.get((batch, rows, splits))

    def _build_runner(self, key: tuple[int, int, int]) -> _Runner:
        """The runner of ``(batch, rows, splits)``; a fewer-split runner shares the buffers of its
        shape's full-split runner (built first)."""
        batch, rows, splits = key
        share = None if splits == self.max_splits else self.graphs.get((batch, rows, self.max_splits))
        return _Runner(self, batch, rows, splits, share)

    @torch.no_grad()
    def capture(self, progress: bool = False) -> int:
        """Build every bucket's runner (largest first, so the shared graph memory pool is sized
        once) and, with CUDA graphs, capture it (after a warm-up that compiles the Triton
        kernels); eagerly, run each once: every batch bucket with each split count of
        :attr:`split_buckets`. No-op on exact shapes. Returns the number of runners. ``progress``
        shows a tqdm bar."""
        if not self.fixed:
            return 0
        shapes = [(b, self.append_rows, sp) for b in self.buckets() for sp in reversed(self.split_buckets)]
        n = self.graphs.capture(shapes, size=lambda s: s[0], progress=progress, desc="drafter: ")
        if self.appends is not None:
            self.appends.capture(self.append_buckets, size=lambda r: r)
        else:
            self._warm_appends()
        return n

    #: row counts of the eager appends run at start (:meth:`_warm_appends`): one of each class
    #: Triton compiles a kernel for (1 row, a multiple of 16, any other; at most 64 rows on the
    #: skinny tiles, more on the wide ones)
    WARM_APPEND_ROWS = (1, 2, 16, 65, 80)

    def _warm_appends(self) -> None:
        """Run :meth:`_append_rows` once per row count of :data:`WARM_APPEND_ROWS` (up to
        ``prefill_chunk``) into the spare slot, which no session reads: the eager appends' kernel
        variants (new sessions' prompt rows) compile now, not inside the first requests (one
        ``rope_store`` variant took a first request ~0.3 s on an H200:
        ``benchmarks/gpu/step/run23-e2e``)."""
        feat = self.config.feature_size
        counts = sorted({min(m, self.prefill_chunk, self.max_context) for m in self.WARM_APPEND_ROWS})
        with torch.no_grad():
            for m in counts:
                f = torch.zeros(m, feat, dtype=self.dtype, device=self.device)
                with batch_invariant():
                    self._append_rows([(self.pool.spare, 0, f)])
        self.eager_rows -= sum(counts)   # (not a session's rows)

    # ------------------------------------------------------------------ proposals
    @torch.no_grad()
    def propose_batch(self, items: Sequence[DraftItem]) -> list[ProposeOutcome | BaseException]:
        """One outcome per item, in order; a refused item gets its :class:`EngineError`, the
        items of a step that failed get its exception (out of memory, ...). Every item is
        validated first (module docstring), in order, as if the items before it had been served;
        then the valid ones run in batched steps (a session's ``k``-th item in the ``k``-th
        round), each tree read from the step's device trees (``device_trees``) or built on the
        host from the step's table."""
        results: list[ProposeOutcome | BaseException | None] = [None] * len(items)
        rounds: list[list[tuple]] = []
        held_after: dict[str, int] = {}          # rows held once the earlier valid items ran
        seen_rounds: dict[str, int] = {}
        free = self.pool.free
        for idx, item in enumerate(items):
            try:
                feats, depth = check_item(item, self.config)
                sid = item.session_id
                s = self.sessions.get(sid)
                exists = s is not None or sid in held_after
                held = held_after.get(sid, s.length if s is not None else 0)
                n = feats.shape[0] + ring_rows(item)
                _check_session(sid, exists, held, n, int(item.committed_length), free,
                               self.max_sessions, self.max_context)
            except Exception as e:  # noqa: BLE001 - EngineError, or a bug: this item only
                results[idx] = e
                continue
            if not exists:
                free -= 1
            held_after[sid] = held + n
            r = seen_rounds.get(sid, 0)
            seen_rounds[sid] = r + 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append((idx, item, feats, depth))
        failed: dict[str, BaseException] = {}
        step = self._max_step()
        for group in rounds:
            live = []
            for entry in group:
                err = failed.get(entry[1].session_id)
                if err is not None:
                    results[entry[0]] = err
                else:
                    live.append(entry)
            for at in range(0, len(live), step):
                part = live[at : at + step]
                try:
                    outs = self._step(part)
                except Exception as e:  # noqa: BLE001 - a failed step fails its items, not the batch
                    if not isinstance(e, (EngineError, _OOM)):
                        log.exception("drafter step failed", extra={"items": len(part)})
                    for idx, item, _, _ in part:
                        results[idx] = e
                        failed[item.session_id] = e
                    continue
                for (idx, *_), out in zip(part, outs):
                    results[idx] = out
        return results  # type: ignore[return-value]

    def _step(self, part: list[tuple]) -> list[ProposeOutcome]:
        """One batched step for ``part`` (at most one item per session). The per-step values go
        into the runner's pinned buffer as one assignment per field, not per item; every item's
        rows beyond what the step carries are appended first, all items' together
        (:meth:`_append_eager`); each tree is two slices of the step's host tree lists."""
        A = self.append_rows
        new: list[DraftSession] = []
        try:
            sessions = []
            for _, item, _, _ in part:
                s = self.sessions.get(item.session_id)
                if s is None:
                    slot = self.pool.acquire()
                    if slot is None:  # cannot happen after validation; kept as a guard
                        raise ResourceExhausted(f"all {self.max_sessions} session slots are in use", reason=Reason.NO_FREE_SLOT)
                    s = DraftSession(item.session_id, slot)
                    new.append(s)
                sessions.append(s)
            b = len(part)
            new_rows = [f.shape[0] + ring_rows(it) for _, it, f, _ in part]
            rows = A if self.fixed else max(1, min(A, max(new_rows)))
            # the fewest attention splits whose chunks hold every row's keys (context + block)
            keys = max(s.length + n for n, s in zip(new_rows, sessions)) + self.config.block_size
            runner = self._runner(self._bucket(b), rows, splits_for(keys, self.split_buckets))
            t0 = time.perf_counter()
            held_l, n_l, excess = [], [], []
            feats_host = runner.feats_host
            host_rows = False                 # some row comes from the host buffer
            on_device: list[tuple[int, torch.Tensor]] = []    # (batch row, its rows on the device)
            ring, ring_at = None, []          # the feature ring and (batch row, slot, rows, end) read from it
            for r, ((_, item, feats, _), s, n) in enumerate(zip(part, sessions, new_rows)):
                start = s.length
                if item.ring is not None and not feats.shape[0] and n <= rows and (ring is None or item.ring[0] is ring):
                    ring = item.ring[0]      # (the common case: every row in the ring, read on the device)
                    ring_at.append((r, item.ring[1], n, int(item.committed_length)))
                    held_l.append(start)
                    n_l.append(n)
                    continue
                if item.ring is not None:    # rows sent and rows in the ring, or more than the step holds
                    feats = item_features(item, feats)
                if n > rows:  # the excess first (_append_eager), the step carries the last rows
                    excess.append((s.slot, start, feats[: n - rows]))
                    start += n - rows
                    feats = feats[n - rows :]
                    n = rows
                held_l.append(start)
                n_l.append(n)
                if n:
                    if feats.device.type == "cpu":
                        feats_host[r, :n].copy_(feats)
                        host_rows = True
                    else:
                        on_device.append((r, feats))
            for name, values in (("slots", [s.slot for s in sessions]), ("held", held_l), ("n_rows", n_l),
                                 ("roots", [int(it.root_token) for _, it, _, _ in part]),
                                 ("budget", [int(it.budget) for _, it, _, _ in part]),
                                 ("top_k", [int(it.top_k) for _, it, _, _ in part]),
                                 ("depth", [d for _, _, _, d in part])):
                runner.view(name)[:b] = values
            if excess:
                self._append_eager(excess)
            runner.fill_padding(b)
            res = runner.run(b, host_rows, on_device, ring, ring_at)
            # the step's table, copied once (the outcomes keep views of it)
            lp, tok = res.logprobs[:b].copy(), res.tokens[:b].copy()
            self.steps += 1
            self.step_s += time.perf_counter() - t0
        except BaseException:
            for s in new:
                self.pool.release(s.slot)
            raise
        outs = []
        limit = self.tree_layout.nodes if self.tree_layout is not None else -1
        t0 = time.perf_counter()
        if res.trees is not None:   # every row's tree as host lists, in three conversions
            tree_tokens, tree_parents, counts = (a[:b].tolist() for a in res.trees)
        for r, ((_, item, feats, depth), s, n) in enumerate(zip(part, sessions, new_rows)):
            s.length += n
            self.sessions[s.session_id] = s
            table = TopK(lp[r, :depth], tok[r, :depth])
            if res.trees is not None and (item.budget <= limit or item.top_k <= 1):
                n = counts[r]
                tokens, parents = tree_tokens[r][:n], tree_parents[r][:n]
            else:   # no device trees, or a DDTree larger than they hold
                tokens, parents = build_tree(int(item.root_token), table, int(item.budget), int(item.top_k))
            outs.append(ProposeOutcome(tokens, parents, s.length, table))
        self.tree_s += time.perf_counter() - t0
        self.trees += len(outs)
        return outs

    def _bucket(self, n: int) -> int:
        return bucket_for(n, self.buckets()) if self.fixed else n

    def _append_eager(self, parts: list[tuple[int, int, torch.Tensor]]) -> None:
        """Append each ``(slot, start, features [m, N*H])`` of ``parts`` (any float dtype, CPU or
        device; converted to the model dtype) at rows ``start..`` of ``slot`` before the step: the
        rows of all parts taken as one sequence, each row with its own slot and position (a batch
        of rows of one row each), ``prefill_chunk`` rows per forward (exact shapes, eager; a chunk
        gathers its rows from the parts it spans, so no copy of every part's rows at once), on the
        fused kernels when the step runs on them, else with ``write_context``. The projections run
        in :func:`kernels.linear.batch_invariant` (the skinny Triton tiles for any number of rows),
        so a row's context does not depend on the rows that share its chunk (the step's own rows,
        over 64 in a batch, go through cuBLAS: their bits may differ from these, which only the
        drafter's proposals see). One forward for several new sessions' prompts where each used to
        take its own, and no cuBLAS call of a new row count each step (at 64 streams a third of the
        drafter's step went to appending prompts one session at a time, mostly cuBLAS:
        ``benchmarks/gpu/step/run14-pyspy``)."""
        chunk = self.prefill_chunk
        with batch_invariant():
            pieces, n = [], 0           # (slot, start, features) of the chunk being gathered, its rows
            for slot, start, f in parts:
                at = 0
                while at < f.shape[0]:
                    take = min(chunk - n, f.shape[0] - at)
                    pieces.append((slot, start + at, f[at : at + take]))
                    n += take
                    at += take
                    if n == chunk:
                        self._append_rows(pieces)
                        pieces, n = [], 0
            if pieces:
                self._append_rows(pieces)

    def _append_rows(self, pieces: list[tuple[int, int, torch.Tensor]]) -> None:
        """One forward of :meth:`_append_eager`: the rows of ``pieces`` (``(slot, start,
        features [m, N*H])`` each) together, row ``i`` of a piece at row ``start + i`` of its slot;
        a replay of the smallest :class:`_AppendRunner` that holds them when the step is fused and
        captured, else eagerly (the code below: the replay's reference, with the same bits)."""
        if self.appends is not None:   # (replayed: :class:`_AppendRunner`; the eager code below is its reference)
            n = sum(f.shape[0] for _, _, f in pieces)
            self.eager_rows += self.appends.get(bucket_for(n, self.append_buckets)).append(pieces)
            return
        dev = self.device
        slots = torch.cat([torch.full((f.shape[0],), slot, dtype=torch.long) for slot, _, f in pieces]).to(dev)
        rows = torch.cat([torch.arange(start, start + f.shape[0], dtype=torch.long) for _, start, f in pieces]).to(dev)
        f = pieces[0][2] if len(pieces) == 1 else torch.cat([p[2].to(device=dev, dtype=self.dtype) for p in pieces])
        f = f.to(device=dev, dtype=self.dtype)   # (pieces sent as bytes are on the CPU, ring rows on the device)
        if self.fused is not None:
            self.fused._context(self.pool, slots, rows, f[:, None])
        else:
            write_context(self.drafter, self.pool, slots, rows, f[:, None])
        self.eager_rows += f.shape[0]


__all__ = ["BatchedDrafter", "DraftItem", "ProposeOutcome", "ReferenceDrafterEngine", "StepResult", "DEFAULT_TREE_NODES",
           "all_finite", "check_item", "draft_step", "write_context", "MAX_TREE_BUDGET"]
