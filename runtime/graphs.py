"""Fixed-shape steps: buckets, the memory budget, and step runners replayed as CUDA graphs.

docs/ARCHITECTURE.md, "The GPU path". Both batched engines (the target's
:class:`target_service.batched_engine.BatchedEngine` and the drafter's
:class:`draft_service.batched.BatchedDrafter`) stand on this scaffold, shaped like nano-vllm's
model runner (bucket + static buffers + replay):

* a step of ``n`` rows is padded to the smallest **bucket** that holds it (:func:`bucket_for`),
  the buckets past the first that holds every session are never needed (:func:`capped_buckets`);
* the state pool's size follows a **memory budget** in bytes (:func:`slots_for_budget`), the spare
  slot that padded rows use paid for;
* a :class:`StepGraph` owns one step shape's static buffers (pinned host buffers and their
  device twins, addresses fixed for the graph's life) and runs its step: on CUDA captured once as a
  graph (two warm-up runs on a side stream, then capture into the memory pool shared by all of the
  engine's graphs) and replayed, else eagerly; one host synchronisation per step;
* a :class:`GraphSet` holds an engine's runners, one per shape, built on first use or all at
  start (:meth:`GraphSet.capture`, largest first so the shared graph pool is sized once), counts
  captures, and drops everything when the step body changes (:meth:`GraphSet.reset`).

Each engine keeps what is its own: the buffer layout and the step body (a :class:`StepGraph`
subclass) and which shapes it captures.
"""

from __future__ import annotations

import logging
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import torch

from runtime.device_time import add_device_seconds
from runtime.config import BATCH_BUCKETS, batch_buckets_for  # noqa: F401 (defined torch-free; re-exported)
from runtime.errors import ResourceExhausted

log = logging.getLogger(__name__)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``n``.

    Args:
        n: rows (or nodes) of a step, ``>= 1``.
        buckets: ascending sizes.

    Raises:
        ValueError: ``n`` exceeds the largest bucket (the engines plan steps so that it never does).
    """
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1] if buckets else None}")


def capped_buckets(buckets: Sequence[int], n: int) -> list[int]:
    """The ascending ``buckets`` up to the first that holds ``n`` (all of them when none does):
    with at most ``n`` sessions, a larger batch bucket is never used."""
    buckets = sorted(set(buckets))
    top = next((b for b in buckets if b >= n), buckets[-1])
    return [b for b in buckets if b <= top]


def slots_for_budget(budget: int | None, slot_bytes: int, max_sessions: int, what: str = "session") -> int:
    """Session slots a pool may hold: ``max_sessions``, fewer when ``budget`` bytes do not hold
    them and the spare slot (``budget // slot_bytes - 1``). A cut is logged (a warning naming
    the slots asked and granted, the budget and a slot's bytes), so the real number is never a
    surprise; the engines report it (``max_sessions``, the services' ``Info``).

    Args:
        budget: bytes for the pool, spare slot included; ``None`` = no limit.
        slot_bytes: bytes of one slot (:meth:`runtime.pool.PoolShape.slot_bytes`).
        max_sessions: the most slots wanted.
        what: what a slot holds, for the error message ("session", "drafter session").

    Raises:
        ResourceExhausted: the budget does not hold one slot plus the spare.
    """
    slots = int(max_sessions)
    if budget is not None:
        slots = min(slots, int(budget) // slot_bytes - 1)   # the spare slot is paid for too
        if slots < 1:
            raise ResourceExhausted(f"a memory budget of {budget} bytes holds no {what} slot "
                                    f"({slot_bytes} bytes each, plus one spare)")
        if slots < max_sessions:
            log.warning("the memory budget holds fewer slots than max_sessions asks: the pool holds the granted number",
                        extra={"what": what, "asked": int(max_sessions), "granted": slots, "budget_bytes": int(budget),
                               "slot_bytes": int(slot_bytes)})
    return slots


class StepGraph:
    """One step shape's static buffers and its step, replayed as a CUDA graph or run eagerly.

    A subclass allocates its buffers in ``__init__`` with :meth:`host_buffer` / :meth:`device_twin`
    (their addresses must not change once captured), fills the host inputs before each
    :meth:`run`, and implements :meth:`body` (copy the inputs in, compute, copy the results out:
    device work only, no host reads, no value-dependent shapes) and :meth:`fill_idle` (inputs of a
    harmless step, every row padding in the spare slot: what warm-up and capture run).

    Args:
        device: where the step runs; off CUDA the device buffers are the host buffers.

    Attributes:
        graph: the captured ``torch.cuda.CUDAGraph`` (``None``: :meth:`run` runs :meth:`body`).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self._events: tuple | None = None   # (start, end) CUDA events of run(), made on first use

    # ---------------------------------------------------------------- buffers
    def host_buffer(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor of ``shape`` and ``dtype``, pinned on CUDA (asynchronous copies)."""
        return torch.zeros(*shape, dtype=dtype, pin_memory=self.cuda)

    def device_twin(self, host: torch.Tensor) -> torch.Tensor:
        """A zeroed device tensor shaped as ``host`` on CUDA; ``host`` itself elsewhere."""
        return torch.zeros_like(host, device=self.device) if self.cuda else host

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` without blocking the host, skipped when they are one tensor (a host
        buffer and its :meth:`device_twin` off CUDA)."""
        if dst is not src:
            dst.copy_(src, non_blocking=True)

    # ---------------------------------------------------------------- the step
    def body(self) -> None:
        """The step (subclass): inputs in, compute, results out."""
        raise NotImplementedError

    def fill_idle(self) -> None:
        """Make the host inputs a harmless step, every row padding (subclass)."""
        raise NotImplementedError

    def capture(self, pool_handle) -> None:
        """Warm up (two runs on a side stream: compiles the Triton kernels, pays autotuning) and
        capture :meth:`body` as a CUDA graph into the shared memory pool ``pool_handle``, with
        the inputs of :meth:`fill_idle`. CUDA only."""
        self.fill_idle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool_handle):
            self.body()
        self.graph = g

    def run(self, tail: Callable[[], None] | None = None, head: Callable[[], None] | None = None) -> None:
        """Run the step on the current host inputs (replay the graph, or :meth:`body`); on CUDA
        wait for it: the step's one host synchronisation. The host results are then readable.
        ``tail``: more work queued on the step's stream after it and before that wait (e.g. an
        asynchronous copy of results this step's caller wants and the graph does not copy), so
        the step keeps its one synchronisation; ``head``: work queued before it (inputs the
        graph reads from device buffers). On CUDA its device time (``head`` and ``tail``
        included) is added to :func:`runtime.device_time.device_seconds`."""
        if not self.cuda:
            if head is not None:
                head()
            self.body()
            if tail is not None:
                tail()
            return
        ev = self._events
        if ev is None:
            ev = self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        stream = torch.cuda.current_stream(self.device)
        ev[0].record(stream)
        if head is not None:
            head()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()
        if tail is not None:
            tail()
        ev[1].record(stream)
        stream.synchronize()   # the step's one host sync
        add_device_seconds(ev[0].elapsed_time(ev[1]) * 1e-3)


class GraphSet:
    """An engine's step runners, one per shape key, with one shared CUDA graph memory pool.

    Args:
        build: ``key -> StepGraph``, the runner of a shape (its buffers allocated, not captured).
        cuda_graphs: capture each runner when it is built (CUDA only; else runners run eagerly).

    Attributes:
        captures: graphs captured so far, those dropped by :meth:`reset` included.
    """

    def __init__(self, build: Callable[[Hashable], StepGraph], cuda_graphs: bool):
        self.build = build
        self.cuda_graphs = bool(cuda_graphs)
        self.captures = 0
        self._runners: dict[Hashable, StepGraph] = {}
        self._pool = None

    def __len__(self) -> int:
        return len(self._runners)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._runners

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._runners)

    def items(self):
        """``(key, runner)`` pairs of the runners built so far."""
        return self._runners.items()

    def get(self, key: Hashable) -> StepGraph:
        """The runner of ``key``, built (and with CUDA graphs captured) on first use."""
        r = self._runners.get(key)
        if r is None:
            r = self._runners[key] = self.build(key)
            if self.cuda_graphs:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                r.capture(self._pool)
                self.captures += 1
        return r

    @torch.no_grad()
    def capture(self, keys: Iterable[Hashable], size: Callable[[Hashable], int], progress: bool = False,
                desc: str = "") -> int:
        """Build the runner of every key, largest ``size`` first (ties in the given order), so the
        shared graph pool is sized by the first capture; with CUDA graphs each is captured, else
        each runs once on :meth:`StepGraph.fill_idle` inputs (compiles the kernels now, not at the
        first request).

        Args:
            keys: the shapes to build.
            size: a shape's size (e.g. nodes per step).
            progress: show a tqdm bar (capture also pays Triton JIT compilation).
            desc: the bar's label prefix ("drafter: ").

        Returns:
            The number of shapes.
        """
        keys = sorted(keys, key=lambda k: -size(k))
        it: Iterable[Hashable] = keys
        if progress:
            from tqdm import tqdm

            it = tqdm(keys, desc=desc + ("capturing CUDA graphs" if self.cuda_graphs else "warming up"), unit="graph")
        for k in it:
            r = self.get(k)
            if not self.cuda_graphs:
                r.fill_idle()
                r.run()
        return len(keys)

    def reset(self) -> bool:
        """Drop every runner and the graph pool (the step body changed, e.g. new feature taps);
        later shapes are built and captured anew. Returns whether anything was dropped."""
        had = bool(self._runners)
        self._runners.clear()
        self._pool = None
        return had


__all__ = ["BATCH_BUCKETS", "GraphSet", "StepGraph", "batch_buckets_for", "bucket_for", "capped_buckets",
           "slots_for_budget"]
