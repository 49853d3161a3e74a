"""When to draft: the scheduler's per-tick choice between a speculative tick (Propose, then a
verify of every request's tree) and a plain one (a root-only verify), decided by measurement
(docs/ARCHITECTURE.md, "When to draft").

Speculation pays when the tokens a tick emits per second of tick are more than a plain tick's.
Both depend on how many requests share the tick: a plain tick of ``B`` requests costs about one
forward whatever ``B`` (up to the device's compute), while a speculative tick adds a Propose whose
cost, and a verify whose width, grow with ``B``, and the host work per item of both grows with it
too (issue 23: from 8 streams up, speculation was slower than plain decoding). So the choice is
made per batch bucket (``B`` rounded up to a power of two) from what the ticks of that bucket
measured: :class:`DraftPolicy` keeps, per bucket and per mode, the moving average of emitted
tokens per second of tick (:meth:`DraftPolicy.observe`), picks the faster mode
(:meth:`DraftPolicy.choose`), and measures each mode again after ``refresh`` ticks of the bucket
without it, so a change (acceptance of the text, load on the drafter) is seen.

A tick's choice keeps the costs a request pays for being able to draft later: the target gathers
its feature rows every tick and the orchestrator keeps them, the drafter holds a session. So a
request is also judged once, when it starts (:meth:`DraftPolicy.admit`): where plain ticks were
measured faster at the batch size it joins (or at the nearest smaller batch measured, when its
own is not yet: :meth:`DraftPolicy.expected`), it is decoded plainly for its whole life (no feature
rows, no drafter session), except one request in ``refresh`` (a probe that keeps drafting measured
at that size).

This module imports nothing of the project and no torch: the orchestrator's unit tests drive it
with synthetic costs.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: Modes of a tick.
DRAFT, PLAIN = "draft", "plain"


def batch_bucket(batch: int) -> int:
    """The power of two at or above ``batch`` (>= 1): ticks of one bucket share their measurements."""
    return 1 << max(0, int(batch) - 1).bit_length()


class DraftPolicy:
    """Per batch bucket, the faster of drafting and plain decoding, measured (module docstring).

    Args:
        alpha: weight of a new tick in the moving average of a mode's tokens per second
            (0 < alpha <= 1).
        refresh: ticks of a bucket after which the mode not chosen is measured again (one tick).
        warmup: ticks of each mode measured in a bucket (interleaved, drafting first) before
            they are compared; the first is not averaged. The scheduler does not report a
            drafting tick that carried a prompt's or a resync's features to the drafter.

    Attributes:
        choices: ticks run per mode (``{"draft": n, "plain": m}``).
    """

    def __init__(self, alpha: float = 0.3, refresh: int = 16, warmup: int = 4):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.refresh = max(2, int(refresh))
        self.warmup = max(1, int(warmup))
        self._rate: dict[tuple[int, str], float] = {}   # (bucket, mode) -> tokens per second (moving average)
        self._count: dict[tuple[int, str], int] = {}    # (bucket, mode) -> ticks measured
        self._since: dict[tuple[int, str], int] = {}    # (bucket, mode) -> ticks of the bucket since it ran
        self._best: dict[int, str] = {}                 # bucket -> the mode last preferred (for the log)
        self._admitted: dict[int, int] = {}             # bucket -> requests started plain there since a probe
        self.choices = {DRAFT: 0, PLAIN: 0}
        self.admissions = {DRAFT: 0, PLAIN: 0}

    def choose(self, batch: int) -> str:
        """The mode of the next tick of ``batch`` requests that may draft: :data:`DRAFT` or
        :data:`PLAIN`. While either mode has fewer than ``warmup`` measurements in the bucket the
        two alternate (drafting first); then a mode not run for ``refresh`` ticks of the bucket is
        run once; otherwise the one with more tokens per second."""
        b = batch_bucket(batch)
        nd, np_ = self._count.get((b, DRAFT), 0), self._count.get((b, PLAIN), 0)
        if nd < self.warmup or np_ < self.warmup:   # both measured, interleaved, drafting first
            return DRAFT if (nd <= np_ and nd < self.warmup) or np_ >= self.warmup else PLAIN
        for mode in (DRAFT, PLAIN):
            if self._since.get((b, mode), 0) >= self.refresh:
                return mode
        best = self.faster(batch)
        if self._best.get(b) != best:
            self._best[b] = best
            log.info("draft policy: %s is faster at this batch size", best,
                     extra={"batch_bucket": b, "draft_tok_s": round(self._rate[(b, DRAFT)]),
                            "plain_tok_s": round(self._rate[(b, PLAIN)])})
        return best

    def faster(self, batch: int) -> str | None:
        """The mode measured faster at ``batch``'s bucket once both have ``warmup`` measurements
        there (ties: :data:`DRAFT`), else None."""
        b = batch_bucket(batch)
        if self._count.get((b, DRAFT), 0) < self.warmup or self._count.get((b, PLAIN), 0) < self.warmup:
            return None
        return DRAFT if self._rate[(b, DRAFT)] >= self._rate[(b, PLAIN)] else PLAIN

    def expected(self, batch: int) -> str | None:
        """The mode expected faster at ``batch``'s bucket: :meth:`faster` where the bucket is
        measured; else :data:`PLAIN` when the nearest smaller measured bucket found plain faster
        (drafting's gain only shrinks as a batch grows: the verify turns compute-bound and the
        host work per tick grows with the requests, module docstring), else None."""
        mode = self.faster(batch)
        if mode is not None:
            return mode
        b = batch_bucket(batch) >> 1
        while b >= 1:
            mode = self.faster(b)
            if mode is not None:
                return PLAIN if mode == PLAIN else None
            b >>= 1
        return None

    def admit(self, batch: int) -> str:
        """Whether a request that may draft, starting with ``batch`` requests decoding (itself
        included), is to be able to draft (:data:`DRAFT`: the target gathers its feature rows, the
        drafter holds a session) or decoded plainly for its whole life (:data:`PLAIN`): plain where
        plain ticks are expected faster at ``batch``'s bucket (:meth:`expected`: measured there,
        or at the nearest smaller measured bucket), except one request in ``refresh`` started
        there, which drafts (without such probes a bucket of plain requests would never measure
        drafting again). Buckets with nothing measured at or below them: :data:`DRAFT`."""
        b = batch_bucket(batch)
        mode = DRAFT
        if self.expected(batch) == PLAIN:
            n = self._admitted.get(b, 0) + 1
            if n >= self.refresh:
                n = 0
            else:
                mode = PLAIN
            self._admitted[b] = n
        self.admissions[mode] += 1
        return mode

    def observe(self, batch: int, mode: str, tokens: int, seconds: float) -> None:
        """A tick of ``batch`` requests ran in ``mode`` and emitted ``tokens`` in ``seconds``
        (the whole tick: Propose, verify and the orchestrator's own work)."""
        if seconds <= 0 or batch <= 0:
            return
        b = batch_bucket(batch)
        key = (b, mode)
        rate = tokens / seconds
        n = self._count.get(key, 0)
        # the first tick is only counted; the next sets the average, later ones move it by alpha
        if n == 1:
            self._rate[key] = rate
        elif n > 1:
            self._rate[key] += self.alpha * (rate - self._rate[key])
        self._count[key] = n + 1
        self.choices[mode] = self.choices.get(mode, 0) + 1
        self._since[key] = 0
        other = (b, PLAIN if mode == DRAFT else DRAFT)
        self._since[other] = self._since.get(other, 0) + 1

    def rates(self) -> dict[int, dict[str, float]]:
        """Tokens per second per bucket and mode, as measured so far (for metrics and tests)."""
        out: dict[int, dict[str, float]] = {}
        for (b, mode), r in self._rate.items():
            out.setdefault(b, {})[mode] = r
        return out


__all__ = ["DRAFT", "PLAIN", "DraftPolicy", "batch_bucket"]
