"""Acceptance statistics: per request and global (tau = k + 1 per verify: docs/ARCHITECTURE.md,
"One speculative step")."""

from __future__ import annotations

import dataclasses
import threading

from dflash_grpc.v1 import generation_pb2


def bump(hist: list[int], index: int, by: int = 1) -> None:
    """``hist[index] += by``, the list grown with zeros first when it is shorter."""
    if len(hist) <= index:
        hist.extend([0] * (index + 1 - len(hist)))
    hist[index] += by


def positions_of_ends(ends: list[int]) -> list[int]:
    """Per-position counts from a histogram of ends: ``ends[n]`` items covered positions
    ``0..n-1`` each (a verify's drafted or accepted positions); returns ``out[d]``, the items that
    covered position ``d``, for ``len(ends) - 1`` positions (the deepest end counted)."""
    out = [0] * max(0, len(ends) - 1)
    total = 0
    for d in range(len(ends) - 1, 0, -1):
        total += ends[d]
        out[d - 1] = total
    return out


@dataclasses.dataclass
class AcceptanceStats:
    """Counters of a request (or, merged, of the whole server). Field meanings: ``AcceptanceStats``
    in ``generation.proto``."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # drafts by their accepted draft tokens and by their tree's depth: ``accepted_per_position`` and
    # ``drafted_per_position`` are read from them (one count per verify, not one per position)
    accepted_ends: list[int] = dataclasses.field(default_factory=list)
    drafted_ends: list[int] = dataclasses.field(default_factory=list)
    acceptance_length_histogram: list[int] = dataclasses.field(default_factory=list)
    target_forwards: int = 0
    wall_time_s: float = 0.0
    decode_time_s: float = 0.0
    draft_fallbacks: int = 0
    autoregressive_steps: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    draft_compute_s: float = 0.0
    verify_compute_s: float = 0.0
    draft_device_s: float = 0.0
    verify_device_s: float = 0.0

    _bump = staticmethod(bump)

    @property
    def accepted_per_position(self) -> list[int]:
        """``[d]``: draft tokens accepted at depth ``d + 1`` (drafts that accepted more than ``d``)."""
        return positions_of_ends(self.accepted_ends)

    @property
    def drafted_per_position(self) -> list[int]:
        """``[d]``: drafts whose tree reached depth ``d + 1``."""
        return positions_of_ends(self.drafted_ends)

    def record_step(self, tree_depth: int, draft_nodes: int, accepted: int) -> None:
        """Count one verify forward: a tree of ``draft_nodes`` non-root nodes, deepest at
        ``tree_depth``, of which a path of ``accepted`` draft tokens was accepted."""
        self.target_forwards += 1
        if draft_nodes == 0:
            self.autoregressive_steps += 1
        else:
            self.drafts += 1
            self.draft_tokens += draft_nodes
            self.accepted_tokens += accepted
            hist = self.drafted_ends
            if len(hist) > tree_depth:
                hist[tree_depth] += 1
            else:
                bump(hist, tree_depth)
            hist = self.accepted_ends
            if len(hist) > accepted:
                hist[accepted] += 1
            else:
                bump(hist, accepted)
        hist = self.acceptance_length_histogram
        if len(hist) > accepted + 1:
            hist[accepted + 1] += 1
        else:
            bump(hist, accepted + 1)

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens emitted per verify forward, ``mean(k + 1)`` (0 before any forward)."""
        n = sum(self.acceptance_length_histogram)
        return sum(t * c for t, c in enumerate(self.acceptance_length_histogram)) / n if n else 0.0

    def merge(self, other: "AcceptanceStats") -> None:
        """Add ``other``'s counters into this one."""
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, list):
                for i, v in enumerate(b):
                    self._bump(a, i, v)
            else:
                setattr(self, f.name, a + b)

    def to_proto(self) -> generation_pb2.AcceptanceStats:
        d = dataclasses.asdict(self)
        del d["accepted_ends"], d["drafted_ends"]
        return generation_pb2.AcceptanceStats(
            **d,
            accepted_per_position=self.accepted_per_position,
            drafted_per_position=self.drafted_per_position,
            mean_acceptance_length=self.mean_acceptance_length,
            tokens_per_second=self.generated_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0,
        )


class GlobalStats:
    """Thread-safe server-wide accumulation of finished requests' statistics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = AcceptanceStats()

    def add(self, s: AcceptanceStats) -> None:
        with self._lock:
            self._stats.merge(s)

    def snapshot(self) -> generation_pb2.AcceptanceStats:
        with self._lock:
            return self._stats.to_proto()
