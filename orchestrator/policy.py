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

    A mode's speed in a bucket is the ratio of its decayed sums of tokens and seconds (each new
    tick weighs ``alpha``, the older ones ``1 - alpha`` more each tick): a ratio of sums, not an
    average of per-tick rates, so a drafting tick that emitted many tokens weighs as its tokens
    say. Drafting's tokens per tick vary with the text far more than a plain tick's (one per
    request), so drafting gets more warm-up ticks than plain decoding before the two are compared.

    Re-measuring the mode not chosen costs a tick run the slower way (and, for drafting in a batch
    of mostly plain requests, a verify as wide as the trees for every request), so the interval
    backs off: each re-measurement that leaves the choice as it was doubles the bucket's interval
    (from ``refresh`` up to ``max_refresh`` ticks); a re-measurement that changes it sets the
    interval back to ``refresh``. The probes of :meth:`admit` follow the same interval.

    Args:
        alpha: weight of a new tick in a mode's decayed sums (0 < alpha <= 1).
        refresh: ticks of a bucket after which the mode not chosen is measured again (one tick),
            at first; doubled per unchanged re-measurement up to ``max_refresh``.
        warmup: plain ticks measured in a bucket before the modes are compared; the first tick of
            each mode is not counted. The scheduler does not report a drafting tick that carried a
            prompt's or a resync's features to the drafter.
        draft_warmup: drafting ticks measured in a bucket before the modes are compared (default
            ``2 * warmup``); the modes alternate, drafting first, until plain has its ``warmup``,
            then drafting runs until it has its own.
        max_refresh: the longest interval between re-measurements (ticks of a bucket).

    Attributes:
        choices: ticks run per mode (``{"draft": n, "plain": m}``).
        admissions: requests started per mode (:meth:`admit`).
    """

    def __init__(self, alpha: float = 0.3, refresh: int = 16, warmup: int = 4, draft_warmup: int | None = None,
                 max_refresh: int = 1024):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.refresh = max(2, int(refresh))
        self.max_refresh = max(self.refresh, int(max_refresh))
        self.warmup = max(1, int(warmup))
        self.draft_warmup = max(1, int(draft_warmup if draft_warmup is not None else 2 * self.warmup))
        self._sums: dict[tuple[int, str], list[float]] = {}   # (bucket, mode) -> [tokens, seconds], decayed
        self._count: dict[tuple[int, str], int] = {}    # (bucket, mode) -> ticks measured
        self._since: dict[tuple[int, str], int] = {}    # (bucket, mode) -> ticks of the bucket since it ran
        self._best: dict[int, str] = {}                 # bucket -> the mode last preferred
        self._interval: dict[int, int] = {}             # bucket -> ticks between re-measurements (backed off)
        self._admitted: dict[int, int] = {}             # bucket -> requests started plain there since a probe
        self.choices = {DRAFT: 0, PLAIN: 0}
        self.admissions = {DRAFT: 0, PLAIN: 0}

    def _warm(self, b: int) -> bool:
        return (self._count.get((b, DRAFT), 0) >= self.draft_warmup
                and self._count.get((b, PLAIN), 0) >= self.warmup)

    def interval(self, batch: int) -> int:
        """Ticks of ``batch``'s bucket between re-measurements of the mode not chosen (and requests
        per admission probe): ``refresh``, doubled per re-measurement that confirmed the choice."""
        return self._interval.get(batch_bucket(batch), self.refresh)

    def choose(self, batch: int) -> str:
        """The mode of the next tick of ``batch`` requests that may draft: :data:`DRAFT` or
        :data:`PLAIN`. Until the bucket is warm (``warmup`` plain and ``draft_warmup`` drafting
        measurements) the modes alternate, drafting first, then drafting runs alone until it has
        its count; then the mode not chosen runs once when :meth:`interval` ticks of the bucket
        passed without it; otherwise the one with more tokens per second."""
        b = batch_bucket(batch)
        nd, np_ = self._count.get((b, DRAFT), 0), self._count.get((b, PLAIN), 0)
        if np_ < self.warmup:   # interleaved, drafting first
            return DRAFT if nd <= np_ and nd < self.draft_warmup else PLAIN
        if nd < self.draft_warmup:
            return DRAFT
        best = self.faster(batch)
        other = PLAIN if best == DRAFT else DRAFT
        if self._since.get((b, other), 0) >= self.interval(batch):
            return other
        if self._best.get(b) != best:
            self._best[b] = best
            r = self.rates().get(b, {})
            log.info("draft policy: %s is faster at this batch size", best,
                     extra={"batch_bucket": b, "draft_tok_s": round(r.get(DRAFT, 0.0)),
                            "plain_tok_s": round(r.get(PLAIN, 0.0))})
        return best

    def faster(self, batch: int) -> str | None:
        """The mode measured faster at ``batch``'s bucket once it is warm (``warmup`` plain and
        ``draft_warmup`` drafting measurements there; ties: :data:`DRAFT`), else None."""
        b = batch_bucket(batch)
        if not self._warm(b):
            return None
        r = self.rates()[b]
        return DRAFT if r[DRAFT] >= r[PLAIN] else PLAIN

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
        or at the nearest smaller measured bucket), except one request in :meth:`interval` started
        there, which drafts (without such probes a bucket of plain requests would never measure
        drafting again). Buckets with nothing measured at or below them: :data:`DRAFT`."""
        b = batch_bucket(batch)
        mode = DRAFT
        if self.expected(batch) == PLAIN:
            n = self._admitted.get(b, 0) + 1
            if n >= self.interval(batch):
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
        n = self._count.get(key, 0)
        before = self.faster(batch)
        # the first tick is only counted; later ones go into the decayed sums
        if n >= 1:
            sums = self._sums.get(key)
            if sums is None:
                self._sums[key] = [float(tokens), float(seconds)]
            else:
                keep = 1.0 - self.alpha
                sums[0] = keep * sums[0] + tokens
                sums[1] = keep * sums[1] + seconds
        self._count[key] = n + 1
        self.choices[mode] = self.choices.get(mode, 0) + 1
        self._since[key] = 0
        other = (b, PLAIN if mode == DRAFT else DRAFT)
        self._since[other] = self._since.get(other, 0) + 1
        if before is not None and mode != before:   # a re-measurement of the mode not chosen
            after = self.faster(batch)
            self._interval[b] = (min(self.max_refresh, 2 * self.interval(batch)) if after == before
                                 else self.refresh)

    def rates(self) -> dict[int, dict[str, float]]:
        """Tokens per second per bucket and mode (decayed tokens over decayed seconds), as measured
        so far (for metrics and tests)."""
        out: dict[int, dict[str, float]] = {}
        for (b, mode), (tok, sec) in self._sums.items():
            out.setdefault(b, {})[mode] = tok / sec if sec > 0 else 0.0
        return out


__all__ = ["DRAFT", "PLAIN", "DraftPolicy", "batch_bucket"]
