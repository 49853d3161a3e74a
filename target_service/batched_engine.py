"""The GPU engine: sessions in a state pool, batched fixed-shape verify steps replayed as CUDA
graphs, chunked prefill (docs/ARCHITECTURE.md, "The GPU path").

:class:`BatchedEngine` has the API of the reference :class:`target_service.engine.TargetEngine`
(``prefill``, ``verify``, ``verify_batch``, ``start_prefill`` / ``run_prefill``, ``release``)
and gives the same tokens (tests/test_batched_engine.py holds them equal). It runs anywhere:

* on CUDA, verify steps are padded to a (batch bucket, width bucket) and each bucket's step is a
  CUDA graph captured once (:meth:`BatchedEngine.capture`, or on first use), replayed every step
  with one host-to-device copy of the packed inputs and one device-to-host copy of the results:
  one host synchronisation per step;
* on the CPU (or with ``cuda_graphs=False``), the same step code runs eagerly, with exact shapes
  on the CPU (padding only costs there).

Every item of a batch is validated on the host before the step; a refused item gets its own
error and the step runs as if it were absent.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
from typing import Sequence

import numpy as np
import torch

from kernels.attention import default_splits, split_buckets, splits_for
from kernels.linear import batch_invariant
from target_service.config import TargetConfig
from target_service.engine import PrefillJob, PrefillOutcome, Sampling, VerifyOutcome, check_prompt
from runtime.feature_ring import FeatureRing, slot_rows_for
from runtime.errors import EngineError, InvalidArgument, Reason, ResourceExhausted, SessionNotFound
from runtime.graphs import GraphSet, StepGraph, batch_buckets_for, bucket_for, capped_buckets, slots_for_budget
from target_service.models.layers import rope_table
from runtime.pool import PoolShape, StatePool
from target_service.pooled import StepLayout, StepTensors, prefill_step, run_step
from runtime.tree import TreeError, analyze_tree

log = logging.getLogger(__name__)

#: rows per slot a feature ring has at least beyond the widest tree's (below, none: a client
#: would give up its drafter sessions' rows after a few ticks without a Propose)
RING_LEAST_ROWS = 16

#: most tree shapes (parent lists) whose analysis :meth:`BatchedEngine._analyze` keeps at a time
TREE_SHAPES = 4096

#: Default width buckets (docs/ARCHITECTURE.md, "The GPU path"): a step of B trees of at most W nodes runs in
#: the smallest (batch, width) bucket that holds it (:class:`TargetConfig` holds the numbers); the default
#: batch buckets follow the session slots (:func:`runtime.config.batch_buckets_for`).
WIDTH_BUCKETS = TargetConfig.width_buckets


@dataclasses.dataclass
class PoolSession:
    """Host-side state of one session: its slot, committed length, root and sampling settings."""

    session_id: str
    slot: int
    sampling: Sampling
    feature_layers: list[int]
    length: int = 0
    root: int = -1
    ready: bool = False
    #: its verified rows go to the feature ring (:meth:`BatchedEngine.ring_features`) when its
    #: feature layers are the ring's
    ring: bool = False

    @property
    def inv_temperature(self) -> float:
        """float32(1 / T) as a float (0 = greedy): what the device sampler multiplies by."""
        t = self.sampling.temperature
        return float(np.float32(1.0) / np.float32(t)) if t > 0 else 0.0

    @property
    def seed_bits(self) -> int:
        """The seed's 64 bits as a signed int64 value."""
        s = self.sampling.seed & ((1 << 64) - 1)
        return s - (1 << 64) if s >= 1 << 63 else s

    @functools.cached_property
    def sampling_row(self) -> tuple[int, int, float, float]:
        """``(seeds, top_k, inv_temperature, top_p)`` as a step's row fields hold them (top_p 0
        when greedy), made once: a session's sampling is set when it opens and never changes (a
        caller that replaced :attr:`sampling` would have to drop this cached value), and the
        float32 division and the seed's bits cost the host about 1.3 us a step per item
        (``benchmarks/cpu-host-per-item/run28-tree-shapes``)."""
        sp = self.sampling
        return self.seed_bits, sp.top_k, self.inv_temperature, sp.top_p if sp.temperature > 0 else 0.0


def prefill_sizes(prefill_chunk: int, padded: bool) -> tuple[int, ...]:
    """The prefill chunk sizes captured as graphs (``BatchedEngine.prefill_buckets``), ascending:
    the powers of two up to ``prefill_chunk`` where a prompt's last chunk runs padded to the next
    one (``padded``); otherwise also every size up to 32 and every multiple of 32 up to
    ``prefill_chunk``, so that chunks of exactly these sizes, largest first, cut any remainder
    under ``prefill_chunk`` in at most two (a multiple of 32, then the rest)."""
    chunk = max(1, int(prefill_chunk))
    sizes = {1 << i for i in range(chunk.bit_length())}
    if not padded:
        sizes |= set(range(1, min(32, chunk) + 1)) | set(range(32, chunk + 1, 32))
    return tuple(sorted(sizes))


def _out_bytes(engine: "BatchedEngine", batch: int, width: int) -> int:
    """Bytes of a ``(batch, width)`` step's results (:class:`_Runner`'s output buffer): the int64
    path, accepted counts and bonus tokens, then the tapped features in the model dtype."""
    item = torch.empty(0, dtype=engine.dtype).element_size()
    return (batch * width + 2 * batch) * 8 + batch * width * engine.feature_width * item


class _Runner(StepGraph):
    """The target's step (a :class:`runtime.graphs.StepGraph`) of one ``(B, W)`` shape: the verify
    of ``B`` trees of at most ``W`` nodes, or with ``prefill`` one prefill chunk of at most ``W``
    prompt tokens (``B = 1``; the rows past ``n_nodes`` are padding: ``prefill_step``).

    Buffers: ``host`` / ``dev``, the packed int64 step inputs (:class:`StepLayout`, ``views`` its
    numpy fields); ``out_host`` / ``out_dev``, one byte buffer holding the int64 results
    (``out_ints``: ``[B*W]`` accepted path, ``[B]`` accepted counts, ``[B]`` bonus tokens; for a
    prefill chunk the first int is the token chosen after it) and the tapped features
    (``out_feats``: ``[B, W, len(taps) * H]`` in the model dtype, ``None`` without taps), so the
    step ends with one device-to-host copy of the ints; the features of the first rows follow only
    when the caller asks (:meth:`fetch_features`, queued before the step's one synchronisation: a
    step none of whose sessions wants feature rows copies none, where every row's features of a
    64 x 16 verify are 5.9 MB on SmolLM2 and 42 MB on a 9B shape). ``out``: a ``(host, device)`` pair of byte buffers
    whose first bytes hold ``out_host`` / ``out_dev`` (the prefill runners, which never run at
    once, share the largest one's: ``BatchedEngine._prefill_out``)."""

    def __init__(self, engine: "BatchedEngine", batch: int, width: int, prefill: bool = False, splits: int = 1,
                 share: "_Runner | None" = None, out: "tuple[torch.Tensor, torch.Tensor] | None" = None):
        super().__init__(engine.device)
        self.engine, self.layout, self.prefill = engine, StepLayout(batch, width), prefill
        #: the attention kernel's key-range splits of this step (``kernels.attention.splits_for``)
        self.splits = splits
        if share is not None:   # a fewer-split variant of the same shape: the same buffers
            for name in ("host", "host_np", "views", "dev", "out_host", "out_dev", "out_ints", "out_feats",
                         "out_feats_u8", "_dev_ints", "_dev_feats", "_ints_bytes"):
                setattr(self, name, getattr(share, name))
            return
        self.host = self.host_buffer(self.layout.size, dtype=torch.long)
        self.host_np = self.host.numpy()
        self.views = self.layout.host_views(self.host_np)       # built once: packed every step
        self.dev = self.device_twin(self.host)
        n_ints = batch * width + 2 * batch
        feat = engine.feature_width
        nbytes = _out_bytes(engine, batch, width)
        if out is not None:
            self.out_host, self.out_dev = out[0][:nbytes], out[1][:nbytes]
        else:
            self.out_host = self.host_buffer(nbytes, dtype=torch.uint8)
            self.out_dev = self.device_twin(self.out_host)
        self.out_ints, self.out_feats = self._views(self.out_host, n_ints, batch, width, feat)
        self._dev_ints, self._dev_feats = self._views(self.out_dev, n_ints, batch, width, feat)
        self._ints_bytes = n_ints * 8
        #: ``out_feats``' bytes as a numpy array ``[B, W, F * itemsize]`` (cheap row slices: BatchedEngine._step_features)
        self.out_feats_u8 = self.out_feats.view(torch.uint8).numpy() if self.out_feats is not None else None

    def body(self) -> None:
        e = self.engine
        self.copy(self.dev, self.host)
        st = StepTensors.from_buffer(self.layout, self.dev, e.conv_kernel)
        if self.prefill:
            out = prefill_step(e.model, e.pool, st, e.rope, e.taps)
            self._dev_ints[: out.ints.shape[0]].copy_(out.ints)
            if self._dev_feats is not None:
                self._dev_feats.copy_(out.features)
        else:   # every row's bits independent of the step's rows (kernels.linear.batch_invariant)
            with batch_invariant():   # written into the output buffers (ints: path, counts, bonus): no copies after
                run_step(e.model, e.pool, st, e.rope, e.taps, self.splits, e.max_splits,
                         out_ints=self._dev_ints, out_feats=self._dev_feats)
        if self.cuda:   # (off CUDA the host buffer is its own device twin)
            self.copy(self.out_host[: self._ints_bytes], self.out_dev[: self._ints_bytes])

    def fetch_features(self, rows: int) -> None:
        """Queue the copy of the first ``rows`` batch rows' tapped features to :attr:`out_feats`
        (asynchronous: pass as :meth:`run`'s ``tail``, so the step keeps its one host
        synchronisation); nothing without taps."""
        if self.out_feats is not None and self.cuda:   # (off CUDA the host buffer is its own device twin)
            self.copy(self.out_feats[:rows], self._dev_feats[:rows])

    def fill_idle(self) -> None:
        """Every row padding in the spare slot (root-only greedy trees)."""
        self.layout.fill_padding(self.host_np, self.engine.pool.spare, first_row=0, views=self.views)

    def _views(self, buf: torch.Tensor, n_ints: int, batch: int, width: int, feat: int):
        ints = buf[: n_ints * 8].view(torch.long)
        feats = buf[n_ints * 8 :].view(self.engine.dtype).reshape(batch, width, feat) if feat else None
        return ints, feats


class BatchedEngine:
    """Sessions in a :class:`~runtime.pool.StatePool`, verified in batched steps.

    Args:
        model: a loaded ``LlamaModel`` or ``Qwen35Model`` (any device, any dtype).
        max_sessions: most sessions (the pool may hold fewer when ``memory_budget`` is smaller).
        max_context: tokens per session.
        max_tree_width, max_tree_depth: most nodes / deepest node of a verified tree.
        feature_layers: target layers whose outputs are tapped for the drafter; a session asking
            for others extends the set (and recaptures the graphs, logged).
        memory_budget: bytes for the pool, spare slot included (``None``: whatever
            ``max_sessions`` needs).
        cuda_graphs: capture and replay steps as CUDA graphs (CUDA only).
        batch_buckets, width_buckets: step shapes on CUDA (padded to the smallest that fits);
            ``batch_buckets`` None (or empty): :func:`runtime.config.batch_buckets_for` the slots
            granted (every session the pool holds fits one bucket).
        max_step_tokens: most nodes of one step (``B x W``, buckets); a batch whose bucketed
            shape would exceed it is split into steps, and only shapes within it are built.
        prefill_chunk: most prompt tokens per prefill forward.
        pad_to_buckets: pad steps to the buckets (default: on CUDA only; tests turn it on on the
            CPU to check that padding is inert).

    Raises:
        ResourceExhausted: the budget does not hold one slot.
    """

    def __init__(self, model, max_sessions: int = TargetConfig.MAX_SESSIONS_CPU, max_context: int = TargetConfig.max_context,
                 max_tree_width: int = TargetConfig.max_tree_width, max_tree_depth: int = TargetConfig.max_tree_depth,
                 feature_layers: list[int] | tuple[int, ...] = (), memory_budget: int | None = None,
                 cuda_graphs: bool = TargetConfig.cuda_graphs, batch_buckets: tuple[int, ...] | None = TargetConfig.batch_buckets,
                 width_buckets: tuple[int, ...] = WIDTH_BUCKETS, max_step_tokens: int = TargetConfig.max_step_tokens,
                 prefill_chunk: int = TargetConfig.prefill_chunk, pad_to_buckets: bool | None = None,
                 ring_rows: int = TargetConfig.feature_ring_rows, ring_bytes: int = TargetConfig.feature_ring_bytes):
        self.model, self.cfg = model, model.cfg
        self.device, self.dtype = model.device, model.dtype
        self.max_context = min(max_context, model.cfg.context_length)
        self.max_tree_width = min(max_tree_width, 64)
        self.max_tree_depth = max_tree_depth
        self.max_step_tokens = max(max_step_tokens, self.max_tree_width)
        self.prefill_chunk = prefill_chunk
        self.cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and self.cuda
        self.pad = self.cuda if pad_to_buckets is None else pad_to_buckets
        self.width_buckets = tuple(sorted({w for w in width_buckets if w < self.max_tree_width} | {self.max_tree_width}))
        shape = PoolShape.of(self.cfg, self.max_context, self.max_tree_width)
        #: bytes of one session slot of the pool
        self.slot_bytes = shape.slot_bytes(self.dtype)
        self.max_sessions = slots_for_budget(memory_budget, self.slot_bytes, max_sessions)
        self.batch_buckets = tuple(sorted({int(b) for b in batch_buckets if b >= 1})) if batch_buckets else \
            batch_buckets_for(self.max_sessions)
        self.pool = StatePool(shape, self.max_sessions, self.device, self.dtype)
        self.conv_kernel = shape.conv[0] + 1 if shape.conv else None
        self.rope = rope_table(self.max_context + self.max_tree_width + 1, self.cfg.rope_dim, self.cfg.rope_theta, self.device)
        self.taps = sorted(set(feature_layers))
        self.sessions: dict[str, PoolSession] = {}
        #: the attention kernel's key-range splits (CUDA): the full count, and the split counts a
        #: verify step may run with (a runner per count and shape; :meth:`_step` takes the fewest
        #: that hold the step's keys, with the same bits: ``kernels.attention.splits_for``)
        self.max_splits = default_splits(self.max_context + self.max_tree_width) if self.cuda else 1
        self.split_buckets = split_buckets(self.max_splits) if self.pad else (self.max_splits,)
        #: the step runners, keyed ``(batch, width, prefill, splits)``
        self.graphs = GraphSet(self._build_runner, self.cuda_graphs)
        #: a prompt's last chunk runs padded in the next bucket up (one replay for its remainder)
        #: instead of as chunks of exactly the buckets, largest first (a 150-token prompt: one
        #: replay of 256 instead of four, 128 + 16 + 4 + 2; every replay costs about one decode
        #: step's launches whatever its rows: ``benchmarks/gpu/concurrency/run16-prefill``). Only
        #: without GDN layers: a chain's recurrent and conv state would take in the padding nodes
        #: (their K/V rows lie past the committed length, where nothing reads them). A function of
        #: the model alone, never of the load.
        self.pad_prefill = self.cuda_graphs and not shape.gdn_layers
        #: prefill chunk sizes replayed as graphs (CUDA graphs only), up to ``prefill_chunk``: powers
        #: of two where the last chunk runs padded; with GDN layers, whose chunks are never padded,
        #: also every size up to 32 and every multiple of 32, so a remainder under ``prefill_chunk``
        #: takes at most two replays (150 tokens: 128 + 22, not 128 + 16 + 4 + 2).
        #: :meth:`next_prefill_tokens` cuts a prompt into them.
        self.prefill_buckets = prefill_sizes(min(prefill_chunk, self.max_context), self.pad_prefill) if self.cuda_graphs else ()
        #: the prefill runners' shared output buffers (:meth:`_prefill_out`)
        self._prefill_bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        #: steps run, forwards (graphs captured: :attr:`captures`)
        self.steps = 0
        self.forwards = 0
        self._shapes: dict[tuple, tuple] = {}   # parent list -> (depth, bits, deepest) of a shape that passed (_analyze)
        #: the feature ring (:meth:`feature_ring`), made on first use; ``ring_rows``: rows per
        #: slot it is made with at most (0: no ring), ``ring_bytes`` its most bytes
        self.ring: FeatureRing | None = None
        self.ring_rows = int(ring_rows)
        self.ring_bytes = int(ring_bytes)
        self._ring_failed = False

    # ------------------------------------------------------------------ shapes
    @property
    def feature_width(self) -> int:
        return len(self.taps) * self.cfg.hidden_size

    @property
    def captures(self) -> int:
        """Graphs captured so far (recaptures after a tap change included)."""
        return self.graphs.captures

    @property
    def _runners(self) -> dict[tuple[int, int, int], _Runner]:
        """The verify runners built so far, by ``(batch, width, splits)``."""
        return {(b, w, sp): r for (b, w, prefill, sp), r in self.graphs.items() if not prefill}

    @property
    def _prefill_runners(self) -> dict[int, _Runner]:
        """The prefill-chunk runners built so far, by chunk size."""
        return {w: r for (_, w, prefill, _sp), r in self.graphs.items() if prefill}

    def _build_runner(self, key: tuple[int, int, bool, int]) -> _Runner:
        """The runner of ``(batch, width, prefill, splits)``; a fewer-split verify runner shares
        the buffers of its shape's full-split runner (built first)."""
        b, w, prefill, splits = key
        share = None if prefill or splits == self.max_splits else self.graphs.get((b, w, False, self.max_splits))
        return _Runner(self, b, w, prefill, splits, share, self._prefill_out() if prefill else None)

    def _prefill_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The output byte buffers (host, device) the prefill runners share: sized for the widest
        prefill bucket (one chunk's ints and features), made on first use and again after a tap
        change. One set, not one per chunk size: a GDN model captures 47 sizes at the default
        ``prefill_chunk`` (about 4,800 rows of features in all against 512)."""
        nbytes = _out_bytes(self, 1, max(self.prefill_buckets or (self.prefill_chunk,)))
        if self._prefill_bufs is None or self._prefill_bufs[0].numel() < nbytes:
            host = StepGraph(self.device).host_buffer(nbytes, dtype=torch.uint8)
            self._prefill_bufs = (host, StepGraph(self.device).device_twin(host))
        return self._prefill_bufs

    def _bucket(self, n: int, buckets: tuple[int, ...]) -> int:
        return bucket_for(n, buckets) if self.pad else n

    def buckets(self) -> list[tuple[int, int]]:
        """The (batch, width) step shapes this engine captures: every pair within
        ``max_step_tokens`` nodes (any width at batch 1) and ``max_sessions`` rows (batch buckets
        past the session count are not needed). So the count stays bounded as the batch buckets
        grow: a batch bucket ``B`` adds only the widths ``W <= max_step_tokens / B`` (256 sessions
        and 1024 step tokens: widths 1 and 4 at ``B = 256``, 1, 4 and 8 at ``B = 128``), and
        :meth:`_plan` never runs a step outside these shapes."""
        rows = capped_buckets(self.batch_buckets, self.max_sessions)
        return [(b, w) for b in rows for w in self.width_buckets if b * w <= self.max_step_tokens or b == 1]

    def _runner(self, b: int, w: int, splits: int | None = None) -> _Runner:
        """The verify runner of ``(b, w)`` with ``splits`` attention splits (default: the full
        count), built, and with CUDA graphs captured, on first use."""
        return self.graphs.get((b, w, False, self.max_splits if splits is None else splits))

    def _prefill_runner(self, w: int) -> _Runner:
        """The runner of a prefill chunk of exactly ``w`` tokens."""
        return self.graphs.get((1, w, True, 1))

    def capture(self, progress: bool = False) -> int:
        """Build the runner of every bucket and prefill chunk size (largest first, so the shared
        graph memory pool is sized once) and, with CUDA graphs, capture it; eagerly, run each
        once. Returns the number of runners. ``progress`` shows a tqdm bar (graph capture also
        pays Triton JIT compilation). With taps, also make the feature ring (:meth:`feature_ring`),
        so the first request that uses it does not pay for making it and compiling its store: on
        a fresh H200 the first speculative requests waited behind that in their Prefill
        (``benchmarks/gpu/step/run26-order``)."""
        shapes = [(b, w, False, sp) for b, w in self.buckets() for sp in reversed(self.split_buckets)] + \
            [(1, w, True, 1) for w in self.prefill_buckets]
        n = self.graphs.capture(shapes, size=lambda s: s[0] * s[1], progress=progress)
        self._warm_prefill()
        if self.taps:   # (the launcher starts the target with its drafter's layers: the ring is wanted)
            self.feature_ring()
        return n

    def _warm_prefill(self) -> None:
        """Compile the prefill path's kernels now (a long and a short chunk in a scratch session),
        so the first request's time to first token does not pay Triton / fla JIT."""
        if not self.cuda or self.cuda_graphs or self.pool.free == 0:
            return
        s = Sampling.checked(0.0, 0, 0.0, 0)
        for n in (min(self.prefill_chunk, self.max_context - 1), 3):
            self.prefill("__warmup__", [i % self.cfg.vocab_size for i in range(n)], s, list(self.taps))
            self.release(["__warmup__"])

    def feature_ring(self) -> FeatureRing | None:
        """The feature ring (:mod:`runtime.feature_ring`): one slot per session slot of
        ``ring_rows`` rows (fewer where ``ring_bytes`` holds fewer; none below
        a tree's rows and :data:`RING_LEAST_ROWS` more) of the tapped features, made on the first
        call (by :meth:`capture` where the taps are known then, else on the step loop's thread).
        None: no taps, no ring configured, or no memory for it (then never again)."""
        if self.ring is not None or self._ring_failed or not self.taps:
            return self.ring
        item = torch.empty(0, dtype=self.dtype).element_size()
        least = self.max_tree_width + 1 + RING_LEAST_ROWS   # (a verify's rows and some unread ones)
        rows = slot_rows_for(self.pool.slots, self.feature_width, item, self.ring_rows, self.ring_bytes, least)
        if not rows:
            self._ring_failed = True
            return None
        try:
            self.ring = FeatureRing.create(self.pool.slots, rows, self.feature_width, self.dtype, self.device)
        except (torch.OutOfMemoryError, RuntimeError, OSError) as e:
            log.warning("no feature ring: feature rows go in the replies", extra={"error": str(e)[:200]})
            self._ring_failed = True
            return None
        try:   # (its store's kernel compiled now, not in the first step that stores rows)
            self.ring.warm()
        except Exception as e:  # noqa: BLE001 - the ring works without it; the compile comes later
            log.warning("feature ring: warming its store failed", extra={"error": str(e)[:200]})
        log.info("feature ring made", extra={"slots": self.pool.slots, "slot_rows": rows,
                                             "kind": self.ring.descriptor.kind})
        return self.ring

    def ring_features(self, session_ids: list[str], on: bool = True) -> int:
        """From the next step on, write these sessions' verified rows into the feature ring
        instead of the outcomes (those whose feature layers are the ring's; unknown ids are
        skipped), or with ``on`` False into the outcomes again. Returns how many sessions
        changed (0: no ring)."""
        if (self.feature_ring() if on else self.ring) is None:
            return 0
        n = 0
        for sid in session_ids:
            s = self.sessions.get(sid)
            if s is not None and (s.feature_layers == self.taps if on else s.ring):
                s.ring = on
                n += 1
        return n

    def _ensure_taps(self, layers: list[int]) -> None:
        missing = set(layers) - set(self.taps)
        if not missing:
            return
        self.taps = sorted(set(self.taps) | missing)
        if self.ring is not None:   # its rows are the old taps' width: a new ring on first use
            self.ring.close()
            self.ring = None
            for s in self.sessions.values():
                s.ring = False
        if self.graphs:
            log.warning("new feature layers requested: recapturing the step graphs", extra={"taps": self.taps})
            self.graphs.reset()

    # ------------------------------------------------------------------ sessions
    def session(self, session_id: str) -> PoolSession:
        """The live session ``session_id`` (raises :class:`SessionNotFound`)."""
        s = self.sessions.get(session_id)
        if s is None or not s.ready:
            raise SessionNotFound(f"unknown session {session_id!r}")
        return s

    def release(self, session_ids: list[str]) -> int:
        """Drop sessions and free their slots; unknown ids are ignored. Returns how many were live."""
        return self.pool.release_sessions(self.sessions, session_ids)

    # ------------------------------------------------------------------ prefill
    def start_prefill(self, session_id: str, prompt: list[int], sampling: Sampling, feature_layers: list[int],
                      ring: bool = False) -> PrefillJob:
        """Validate a prompt and take a zeroed slot for it; :meth:`run_prefill` then commits it
        chunk by chunk. ``ring``: the prompt's rows go to the feature ring (and the session's
        verified rows after them: :meth:`ring_features`) when its feature layers are the ring's and
        the prompt fits a ring slot; else in the outcome.

        Raises:
            InvalidArgument: empty id or prompt, token outside the vocabulary, bad feature layer,
                session id already live.
            ResourceExhausted: no free slot, or prompt longer than ``max_context - 1``.
        """
        check_prompt(session_id, prompt, feature_layers, self.cfg, self.max_context)
        if session_id in self.sessions:
            raise InvalidArgument(f"session {session_id!r} already exists", reason=Reason.SESSION_EXISTS)
        slot = self.pool.acquire()
        if slot is None:
            raise ResourceExhausted(f"all {self.max_sessions} session slots are in use", reason=Reason.NO_FREE_SLOT)
        self._ensure_taps(feature_layers)
        s = self.sessions[session_id] = PoolSession(session_id, slot, sampling, list(feature_layers))
        if ring and feature_layers and s.feature_layers == self.taps:
            r = self.feature_ring()
            s.ring = r is not None and len(prompt) <= r.slot_rows
        return PrefillJob(session_id, list(prompt), sampling, list(feature_layers), state=[])

    def next_prefill_tokens(self, job: PrefillJob) -> int:
        """The prompt tokens :meth:`run_prefill` commits next for ``job`` (:meth:`_next_chunk`)."""
        return self._next_chunk(job)[0]

    def _next_chunk(self, job: PrefillJob) -> tuple[int, int]:
        """``(tokens, width)`` of ``job``'s next chunk: ``min(prefill_chunk, tokens left)`` tokens;
        when chunks replay as graphs, rounded down to the largest of :attr:`prefill_buckets` unless
        the chunk may run padded in a wider graph (:meth:`_prefill_width`). A function of the
        prompt alone, never of the load: a prompt is cut into the same chunks (the same GEMM
        shapes, so the same bits) whether it is prefilled alone or beside others, which keeps a
        request's tokens equal to its single-stream run (issue 23)."""
        n = max(1, min(self.prefill_chunk, len(job.prompt) - job.done))
        if not self.prefill_buckets:
            return n, n
        w = self._prefill_width(job.done, n)
        if w > n:
            return n, w
        n = self.prefill_buckets[bisect.bisect_right(self.prefill_buckets, n) - 1]   # the largest bucket <= n
        return n, n

    def _prefill_width(self, start: int, n: int) -> int:
        """The width of the graph that runs ``n`` prompt tokens from row ``start``: with
        :attr:`pad_prefill`, the power of two at or above ``n`` when it is a captured bucket (a
        ``prefill_chunk`` that is not a power of two never pads past itself) and the padded chunk's
        scratch rows fit the slot (``start + width <= max_context + max_tree_width``: the pool's
        rows and the rotary table's); else ``n`` (a chunk of exactly a bucket, or eager)."""
        if not self.pad_prefill:
            return n
        w = 1 << (n - 1).bit_length()
        fits = w in self.prefill_buckets and start + w <= self.max_context + self.max_tree_width
        return w if fits else n

    @torch.no_grad()
    def run_prefill(self, job: PrefillJob, budget: int) -> int:
        """Commit the next chunk of ``job``'s prompt (:meth:`next_prefill_tokens` tokens; the
        caller's ``budget`` decides whether it runs this tick, never its size); after the last
        chunk ``job.outcome`` holds the first token and the prompt's features. Returns the tokens
        processed (0 if the session was released meanwhile)."""
        s = self.sessions.get(job.session_id)
        if s is None:
            return 0
        start = job.done
        n, w = self._next_chunk(job)
        if self.prefill_buckets:                     # graphs: a captured chunk of a bucket's size (padded: w > n)
            runner = self._prefill_runner(w)
            v = runner.views
        else:                                        # eager: a chunk of any size
            layout = StepLayout(1, n)
            buf = np.zeros(layout.size, dtype=np.int64)
            v = layout.host_views(buf)
        v["tokens"][0, :n] = job.prompt[start : start + n]
        v["tokens"][0, n:] = 0                       # padding: a causal chunk's valid rows never read it
        v["parents"][0] = np.arange(-1, w - 1)
        v["depth"][0] = np.arange(w)
        v["ancestors"][0] = 0                        # causal chunks read no ancestor masks
        v["n_nodes"][0], v["slots"][0], v["lengths"][0] = n, s.slot, start
        self._fill_sampling(v, 0, s)
        ring = self.ring if s.ring else None   # (the prompt fits a ring slot: positions [0, len) are rows in order)
        if ring is not None:   # the chunk's rows into the slot's rows [start, start + n), on the device
            base = s.slot * ring.slot_rows + start
            to_ring = ring.table[base : base + n]
        if self.prefill_buckets:
            if ring is not None:
                runner.run(lambda: to_ring.copy_(runner._dev_feats[0, :n], non_blocking=True))
            else:
                runner.run((lambda: runner.fetch_features(1)) if s.feature_layers else None)
            first, feats = runner.out_ints[0], runner.out_feats
        else:
            st = StepTensors.from_buffer(layout, torch.from_numpy(buf).to(self.device), self.conv_kernel)
            out = prefill_step(self.model, self.pool, st, self.rope, self.taps, fla=True)
            first, feats = out.ints[0], out.features
            if ring is not None:
                to_ring.copy_(feats[0, :n])
        self.forwards += 1
        if self.taps and ring is None:
            job.state.append(self._session_features(feats[0, :n], s).cpu().clone())
        job.done = start + n
        job.chunks.append(n)
        s.length = job.done
        if job.done == len(job.prompt):
            s.root, s.ready = int(first), True
            job.outcome = PrefillOutcome(s.root, s.length, torch.cat(job.state) if job.state else None, tuple(job.chunks),
                                         s.slot if ring is not None else -1)
        return n

    def prefill(self, session_id: str, prompt: list[int], sampling: Sampling, feature_layers: list[int]) -> PrefillOutcome:
        """Open ``session_id`` and commit its whole prompt (raises as :meth:`start_prefill`)."""
        job = self.start_prefill(session_id, prompt, sampling, feature_layers)
        try:
            while job.outcome is None:
                self.run_prefill(job, self.prefill_chunk)
        except BaseException:
            self.release([session_id])
            raise
        return job.outcome

    # ------------------------------------------------------------------ verify
    def verify(self, session_id: str, tokens: list[int], parents: list[int]) -> VerifyOutcome:
        """Verify one tree (raises the item's error)."""
        out = self.verify_batch([(session_id, tokens, parents)])[0]
        if isinstance(out, EngineError):
            raise out
        return out

    def _analyze(self, tokens: list[int], parents: list[int]) -> tuple[Sequence[int], Sequence[int], int]:
        """``(depth, bits, deepest)`` of a tree (:func:`runtime.tree.analyze_tree`, which is the
        reference and raises its :class:`TreeError`). The rules of a tree's shape (its structure,
        width and depth) are a function of ``parents`` alone, and the drafter's trees come in few
        shapes (as the orchestrator's ``TreeChecker`` finds), so a shape that passed keeps its
        depths and ancestor bits (tuples, shared by the trees of that shape) and a later tree of it
        checks only its tokens (the vocabulary, width and depth bounds are the engine's, fixed
        when it is made); at most :data:`TREE_SHAPES` shapes are kept, then the memory starts
        again. On the CPU box analyze_tree took 2.5 us an 8-node tree (a 64-stream tick's) and
        4.1 a 16-node one, a kept shape 0.9 and 1.25 (``benchmarks/cpu-host-per-item/run28-tree-shapes``)."""
        key = parents if type(parents) is tuple else tuple(parents)
        hit = self._shapes.get(key)
        if hit is not None and len(tokens) == len(key) and min(tokens) >= 0 and max(tokens) < self.cfg.vocab_size:
            return hit
        depth, bits = analyze_tree(tokens, parents, self.cfg.vocab_size, self.max_tree_width, self.max_tree_depth)
        shapes = self._shapes
        if len(shapes) >= TREE_SHAPES:
            shapes.clear()
        hit = shapes[key] = (tuple(depth), tuple(bits), max(depth))
        return hit

    def _check(self, sid: str, tokens: list[int], parents: list[int], seen: set[str]):
        s = self.session(sid)
        if sid in seen:
            raise InvalidArgument(f"session {sid!r} appears twice in one verify")
        try:
            depth, bits, deepest = self._analyze(tokens, parents)
        except TreeError as e:
            raise InvalidArgument(f"invalid tree: {e}", reason=Reason.INVALID_TREE) from None
        if tokens[0] != s.root:
            raise InvalidArgument(f"tree root {tokens[0]} is not the session's last token {s.root}", reason=Reason.INVALID_TREE)
        if s.length + deepest + 1 > self.max_context:
            raise ResourceExhausted(f"context full: {s.length} committed + depth {deepest + 1} exceeds {self.max_context}", reason=Reason.CONTEXT_FULL)
        return s, depth, bits

    @torch.no_grad()
    def verify_batch(self, items: list[tuple[str, list[int], list[int]]]) -> list[VerifyOutcome | EngineError]:
        """Verify several sessions' trees (``(session_id, tokens, parents)`` each) in as few
        batched steps as the buckets allow. A refused item (unknown session, malformed tree, root
        not the session's, context full, a session twice) gets its error in its place; the others
        run as if it were absent."""
        results: list[VerifyOutcome | EngineError | None] = [None] * len(items)
        ready, seen = [], set()
        for idx, (sid, tokens, parents) in enumerate(items):
            try:
                s, depth, bits = self._check(sid, tokens, parents, seen)
            except EngineError as e:
                results[idx] = e
                continue
            seen.add(sid)
            ready.append((idx, s, tokens, parents, depth, bits))
        for group in self._plan(ready):
            for (idx, *_), out in zip(group, self._step(group)):
                results[idx] = out
        return results

    def _plan(self, ready: list) -> list[list]:
        """Split the ready items (in order) into steps whose bucketed shape ``(batch bucket,
        width bucket)`` holds at most ``max_step_tokens`` nodes (one of :meth:`buckets`; any width
        alone) and whose rows fit the largest batch bucket."""
        groups, cur, width = [], [], 0
        max_rows = self.batch_buckets[-1] if self.pad else len(ready) or 1
        for item in ready:
            w = max(width, len(item[2]))
            rows = len(cur) + 1
            fits = rows <= max_rows and (self._bucket(rows, self.batch_buckets) * self._bucket(w, self.width_buckets) <= self.max_step_tokens or rows == 1)
            if cur and not fits:
                groups.append(cur)
                cur, w = [], len(item[2])
            cur.append(item)
            width = w
        if cur:
            groups.append(cur)
        return groups

    @staticmethod
    def _fill_rows(v: dict[str, np.ndarray], group: list) -> None:
        """Write a step's trees (``group``: ``(idx, session, tokens, parents, depth, bits)`` per
        batch row) into a runner's host views ``v`` (:meth:`StepLayout.host_views`): each row's
        nodes, node count, slot, committed length and sampling fields
        (:attr:`PoolSession.sampling_row`); rows past ``len(group)`` and nodes past a row's count
        are :meth:`StepLayout.fill_padding`'s."""
        for r, (_, s, tokens, parents, depth, bits) in enumerate(group):
            n = len(tokens)
            v["tokens"][r, :n] = tokens
            v["parents"][r, :n] = parents
            v["depth"][r, :n] = depth
            v["ancestors"][r, :n] = bits
            v["n_nodes"][r], v["slots"][r], v["lengths"][r] = n, s.slot, s.length
            BatchedEngine._fill_sampling(v, r, s)

    @staticmethod
    def _fill_sampling(v: dict[str, np.ndarray], r: int, s: PoolSession) -> None:
        """Row ``r``'s sampling fields of a step's host views ``v``: ``s``'s
        :attr:`PoolSession.sampling_row`."""
        v["seeds"][r], v["top_k"][r], v["inv_temperature"][r], v["top_p"][r] = s.sampling_row

    def _session_features(self, f: torch.Tensor, s: PoolSession) -> torch.Tensor:
        """The columns of the session's feature layers, in its order, from tapped features
        ``[..., len(taps) * H]``."""
        if s.feature_layers == self.taps:
            return f
        h = self.cfg.hidden_size
        return torch.cat([f[..., self.taps.index(i) * h : (self.taps.index(i) + 1) * h] for i in s.feature_layers], dim=-1) \
            if s.feature_layers else f[..., :0]

    def _step(self, group: list) -> list[VerifyOutcome]:
        b = len(group)
        w = max(len(item[2]) for item in group)
        wb = self._bucket(w, self.width_buckets)
        # the fewest attention splits whose chunks hold every row's keys (context + its nodes)
        splits = splits_for(max(item[1].length for item in group) + wb, self.split_buckets)
        runner = self._runner(self._bucket(b, self.batch_buckets), wb, splits)
        lay = runner.layout
        v = runner.views
        wants_features = False   # some session of the step has feature layers (and the engine taps): its live rows' features come back
        ring = self.ring
        ringed: list[int] = []   # batch rows whose rows go to the feature ring
        self._fill_rows(v, group)
        for r, item in enumerate(group):
            s = item[1]
            if s.ring and ring is not None:
                ringed.append(r)
            else:
                wants_features = wants_features or bool(s.feature_layers)
        wants_features = wants_features and runner.out_feats is not None
        lay.fill_padding(runner.host_np, self.pool.spare, first_row=b, views=v)
        if ringed and runner.out_feats is not None:
            def tail():
                sessions = [group[r][1] for r in ringed]
                ring.store(runner._dev_feats, ringed, [x.slot for x in sessions], [x.length for x in sessions],
                           runner._dev_ints[lay.batch * lay.width : lay.batch * lay.width + lay.batch])
                if wants_features:
                    runner.fetch_features(b)
            runner.run(tail)
        else:
            ringed = []
            runner.run((lambda: runner.fetch_features(b)) if wants_features else None)
        self.steps += 1
        self.forwards += 1
        ints = runner.out_ints.numpy()
        bw = lay.batch * lay.width
        path = ints[:bw].reshape(lay.batch, lay.width)
        n_acc = ints[bw : bw + lay.batch]
        bonus = ints[bw + lay.batch :]
        outs = []
        counts = n_acc[:b].tolist()
        feats_of = self._step_features(runner, group, counts, ringed) if wants_features else None
        for r, (_, s, tokens, *_rest) in enumerate(group):
            n = counts[r]
            nodes = path[r, :n].tolist()
            s.length += n
            s.root = int(bonus[r])
            outs.append(VerifyOutcome(nodes, [tokens[j] for j in nodes[1:]], s.root, s.length,
                                      feats_of[r] if feats_of is not None else None))
        for r in ringed:
            outs[r].ring_slot = group[r][1].slot
        return outs

    def _step_features(self, runner: _Runner, group: list, counts: list[int], ringed: Sequence[int] = ()
                       ) -> list[torch.Tensor | None]:
        """Each item's accepted rows' features after a step (``[n, len(feature_layers) * H]`` in
        the model dtype, owned: the runner's buffer is the next step's; None for a session without
        feature layers). The sessions that tap exactly the engine's layers (the common case) take
        one copy for the whole step: numpy slices of the output's bytes, one concatenation, one
        split into per-item views of it; the others a copy each (:meth:`_session_features`). A
        ``torch`` slice and ``clone`` per item cost the host about 12 us an item (0.8 ms a step at
        64 sessions on an H200: ``benchmarks/gpu/step/run17-featcopy``)."""
        u8, taps = runner.out_feats_u8, self.taps
        out: list[torch.Tensor | None] = [None] * len(group)
        parts, sizes, where = [], [], []
        skip = set(ringed)
        for r, item in enumerate(group):
            layers = item[1].feature_layers
            if not layers or r in skip:   # (no layers, or its rows went to the feature ring)
                continue
            n = counts[r]
            if layers == taps:
                parts.append(u8[r, :n])
                sizes.append(n)
                where.append(r)
            else:
                out[r] = self._session_features(runner.out_feats[r, :n], item[1]).clone()
        if parts:
            packed = torch.from_numpy(np.concatenate(parts)).view(self.dtype)
            for r, t in zip(where, packed.split(sizes)):
                out[r] = t
        return out
