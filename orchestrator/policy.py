"""When to draft: the scheduler's per-tick choice between a speculative tick (Propose, then a
verify of every request's tree) and a plain one (a root-only verify), decided by measurement
(docs/ARCHITECTURE.md, "When to draft").

Speculation pays when the tokens a tick emits per second of tick are more than a plain tick's.
That splits into two measured parts that vary for different reasons:

* **what a tick costs**, by mode and batch bucket (``B`` rounded up to a power of two): a plain
  tick of ``B`` requests costs about one forward whatever ``B`` (up to the device's compute),
  while a speculative tick adds a Propose whose cost, and a verify whose width, grow with ``B``,
  and the host work per item of both grows with it too (issue 23: from 8 streams up, speculation
  was slower than plain decoding). Measured per bucket (:meth:`DraftPolicy.observe`): a decayed
  mean of the tick's seconds. It depends on the machine and the load, not on the text.
* **what a drafting tick emits** per request: one plus the tokens its tree got accepted, which
  depends on the text and the drafter. Measured per request (:meth:`DraftPolicy.note`, each
  drafted item's tokens) and over all requests (the prior of a request not yet measured, and
  the weight it is pulled towards while its own count is small). A plain tick emits one per
  request.

A tick drafts when the expected tokens of its requests over the drafting tick's cost (scaled to the
number of its requests that would draft: :meth:`DraftPolicy.draft_seconds`) beat its requests over
the plain tick's cost (:meth:`DraftPolicy.choose`). Deciding from one request's
first few drafting ticks, as per-bucket token rates did, judged by the start of one text, and the
tokens of one text's drafting ticks vary from 1 to 6 tick to tick (one stream on an H200:
``benchmarks/gpu/policy/session13``), and applied that verdict to every later request. The cost of the mode not chosen is
measured again now and then, less often while it keeps confirming the choice.

A tick's choice keeps the costs a request pays for being able to draft later: the target gathers
its feature rows every tick and the orchestrator keeps them, the drafter holds a session. So a
request is also judged once, when it starts (:meth:`DraftPolicy.admit`): where plain ticks are
expected faster at the batch size it joins with the prior tokens per drafting item (or at the
nearest smaller batch measured, when its own is not yet: :meth:`DraftPolicy.expected`), it is
decoded plainly for its whole life (no feature rows, no drafter session), except a probe request
now and then, which keeps drafting measured at that size.

A plain tick of requests that may draft still pays those costs, so it is dearer than a plain tick
of requests that may not (:data:`BARE`: requests admitted plainly, or that asked for no
speculation). On an H200 with the shipped SmolLM2 pair at 16 streams a drafting tick cost 4.1x a
tick of plain decoding for 3.3x its tokens, yet beat the dearer plain ticks, so the policy drafted
at every level (``benchmarks/gpu/concurrency/run12-long``). Where bare ticks are measured at a
batch size, admission compares drafting with them (:meth:`DraftPolicy.expected`); where not, with
the plain ticks of drafting requests, as before.

This module imports nothing of the project and no torch: the orchestrator's unit tests drive it
with synthetic costs.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: Modes of a tick.
DRAFT, PLAIN = "draft", "plain"
#: A tick none of whose requests carries what drafting costs every tick (feature rows gathered and
#: kept, a drafter session): every request in it started plainly (:meth:`DraftPolicy.admit`) or asked
#: for no speculation. Not a choice of :meth:`DraftPolicy.choose`, only a cost measured
#: (:meth:`DraftPolicy.observe`): what a request admitted plainly is charged.
BARE = "bare"


def batch_bucket(batch: int) -> int:
    """The power of two at or above ``batch`` (>= 1): ticks of one bucket share their measurements."""
    return 1 << max(0, int(batch) - 1).bit_length()


def _decayed(sums: list[float] | None, value: float, items: float, alpha: float) -> list[float]:
    """``sums`` = ``[decayed sum, decayed count]`` (None: empty) after ``value`` over ``items`` more
    items: the older ones weigh ``(1 - alpha) ** items`` of what they did (updated in place)."""
    if sums is None:
        return [float(value), float(items)]
    keep = (1.0 - alpha) ** items
    sums[0] = keep * sums[0] + value
    sums[1] = keep * sums[1] + items
    return sums


class DraftPolicy:
    """Per batch bucket, the faster of drafting and plain decoding, measured (module docstring).

    Costs: per (bucket, mode) a decayed mean of tick seconds (each new tick weighs ``alpha``; a
    mode's first tick in a bucket is not counted: it carries one-time work). Tokens: the decayed
    mean of tokens per drafting item over all requests (``alpha_tokens`` per item) is the prior;
    a request's own estimate is its drafted items' decayed mean pulled towards the prior as if the
    prior were ``prior_weight`` items more (a request measured on two ticks is not trusted as one
    measured on twenty). Until a bucket has ``warmup`` counted ticks of each mode the modes
    alternate, drafting first. Re-measuring the mode not chosen costs a tick run the slower way
    (and, for drafting in a batch of mostly plain requests, a verify as wide as the trees for
    every request), so its interval backs off: each re-measurement that leaves the choice as it
    was doubles the bucket's interval (from ``refresh`` up to ``max_refresh`` ticks), one that
    changes it sets it back to ``refresh``; the probes of :meth:`admit` follow the same interval.

    Args:
        alpha: weight of a new tick in a mode's decayed mean of seconds (0 < alpha <= 1).
        refresh: ticks of a bucket after which the mode not chosen is run again (one tick), at
            first; doubled per confirming re-measurement up to ``max_refresh``.
        warmup: counted ticks of each mode in a bucket before the modes are compared.
        alpha_tokens: weight of a new drafted item in the prior's decayed mean (0 < a <= 1).
        alpha_request: weight of a request's new drafted item in its own decayed mean.
        prior_weight: items' worth of the prior in a request's estimate.
        max_refresh: the longest interval between re-measurements (ticks of a bucket).

    Attributes:
        choices: ticks run per mode (``{"draft": n, "plain": m}``).
        admissions: requests started per mode (:meth:`admit`).

    Raises:
        ValueError: an ``alpha`` outside (0, 1].
    """

    def __init__(self, alpha: float = 0.3, refresh: int = 16, warmup: int = 3, alpha_tokens: float = 0.02,
                 alpha_request: float = 0.2, prior_weight: float = 4.0, max_refresh: int = 1024):
        for name, a in (("alpha", alpha), ("alpha_tokens", alpha_tokens), ("alpha_request", alpha_request)):
            if not 0 < a <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {a}")
        self.alpha, self.alpha_tokens, self.alpha_request = float(alpha), float(alpha_tokens), float(alpha_request)
        self.prior_weight = max(0.0, float(prior_weight))
        self.refresh = max(2, int(refresh))
        self.max_refresh = max(self.refresh, int(max_refresh))
        self.warmup = max(1, int(warmup))
        self._secs: dict[tuple[int, str], float] = {}   # (bucket, mode) -> decayed mean seconds per tick
        self._drafted: dict[int, float] = {}            # bucket -> decayed mean drafting items per drafting tick
        self._count: dict[tuple[int, str], int] = {}    # (bucket, mode) -> ticks observed
        self._since: dict[tuple[int, str], int] = {}    # (bucket, mode) -> ticks of the bucket since it ran
        self._best: dict[int, str] = {}                 # bucket -> the mode last preferred (for the log)
        self._interval: dict[int, int] = {}             # bucket -> ticks between re-measurements (backed off)
        self._admitted: dict[int, int] = {}             # bucket -> requests started plain there since a probe
        self._prior: list[float] | None = None          # [decayed tokens, decayed items] of drafted items
        self._req: dict[str, list[float]] = {}          # request -> [decayed tokens, decayed items]
        self._noted = 0                                 # drafted items noted since the last observe
        self.choices = {DRAFT: 0, PLAIN: 0}
        self.admissions = {DRAFT: 0, PLAIN: 0}

    # ------------------------------------------------------------------ tokens
    def prior(self) -> float | None:
        """Tokens a drafted item emits (one plus its accepted tokens), over all requests; None
        before any was measured."""
        p = self._prior
        return p[0] / p[1] if p and p[1] > 0 else None

    def _add_prior(self, tokens: float, items: float) -> None:
        if items > 0:
            self._prior = _decayed(self._prior, tokens, items, self.alpha_tokens)

    def note(self, request: str, tokens: int) -> None:
        """A drafted item of ``request`` emitted ``tokens`` (one plus its accepted tokens)."""
        self._req[request] = _decayed(self._req.get(request), tokens, 1, self.alpha_request)
        self._add_prior(tokens, 1)
        self._noted += 1

    def forget(self, request: str) -> None:
        """``request`` ended: drop its estimate."""
        self._req.pop(request, None)

    def tokens(self, request: str | None) -> float | None:
        """Tokens a drafting tick is expected to emit for ``request``: its own decayed mean pulled
        towards :meth:`prior` by ``prior_weight`` items (the prior alone for a request not
        measured, or ``None``)."""
        prior = self.prior()
        r = self._req.get(request) if request is not None else None
        if r is None:
            return prior
        if prior is None:
            return r[0] / r[1]
        return (r[0] + self.prior_weight * prior) / (r[1] + self.prior_weight)

    # ------------------------------------------------------------------ costs
    def _warm(self, b: int) -> bool:
        return (self._count.get((b, DRAFT), 0) > self.warmup and self._count.get((b, PLAIN), 0) > self.warmup
                and self.prior() is not None)

    def interval(self, batch: int) -> int:
        """Ticks of ``batch``'s bucket between re-measurements of the mode not chosen (and requests
        per admission probe): ``refresh``, doubled per re-measurement that confirmed the choice."""
        return self._interval.get(batch_bucket(batch), self.refresh)

    def _pick(self, b: int, batch: int, requests, plain: str = PLAIN) -> str:
        """The faster mode of a warm bucket for ``batch`` requests, ``requests`` the ids of those
        that may draft (None: all of them, at the prior); ``plain``: the plain ticks to compare
        with (:data:`PLAIN`, or :data:`BARE` for admission)."""
        if requests is None:
            d, drafted = batch, batch * self.prior()
        else:
            d = len(requests)
            drafted = sum(self.tokens(r) for r in requests) + (batch - d)
        draft = drafted / self.draft_seconds(b, d)
        rate = batch / self._secs[(b, plain)]
        return DRAFT if draft >= rate else PLAIN

    def draft_seconds(self, bucket: int, drafting: int) -> float:
        """Expected seconds of a drafting tick of ``bucket`` in which ``drafting`` requests draft:
        the measured drafting ticks' mean, scaled where they carried another number of drafting
        requests, linearly from the plain tick's cost (no request drafting) through the measured
        point (their mean drafting requests). A bucket where plain was found faster drafts only
        with its probes, so its drafting ticks are cheap; judging a request that starts there (and
        every one after it would draft too) by those ticks' cost admitted requests to draft that
        later ticks demoted (126 demotions in one H200 sweep at 32-64 streams,
        ``benchmarks/gpu/concurrency/run25-prefill-hop/c``). The fixed part of a drafting tick (the
        verify as wide as the trees) makes the true cost grow more slowly than this line past the
        measured point, so the estimate errs towards plain there, never towards drafting."""
        secs = self._secs[(bucket, DRAFT)]
        mean = self._drafted.get(bucket)
        plain = self._secs.get((bucket, PLAIN))
        if mean is None or plain is None or mean <= 0 or drafting == mean:
            return secs
        return plain + max(0.0, secs - plain) * drafting / mean

    def _admit_faster(self, batch: int, requests=None) -> str | None:
        """:meth:`faster` for admission: against bare ticks where the bucket has them measured
        (and drafting), else against the plain ticks of drafting requests; ``requests``: the ids
        of the requests that may draft (None: all ``batch`` of them, at the prior)."""
        b = batch_bucket(batch)
        if (self.prior() is not None and self._count.get((b, DRAFT), 0) > self.warmup
                and self._count.get((b, BARE), 0) > self.warmup):
            return self._pick(b, batch, requests, BARE)
        return self.faster(batch, requests)

    def choose(self, batch: int, requests=None) -> str:
        """The mode of the next tick of ``batch`` requests, ``requests`` the ids of those that may
        draft (None: all of them, each at the prior): :data:`DRAFT` or :data:`PLAIN`. Until the
        bucket is warm the modes alternate, drafting first; then the mode not chosen runs once
        when :meth:`interval` ticks of the bucket passed without it; otherwise the mode whose
        expected tokens per second are more (module docstring)."""
        b = batch_bucket(batch)
        if not self._warm(b):
            nd, np_ = self._count.get((b, DRAFT), 0), self._count.get((b, PLAIN), 0)
            return DRAFT if nd <= np_ or self.prior() is None else PLAIN
        best = self._pick(b, batch, requests)
        other = PLAIN if best == DRAFT else DRAFT
        if self._since.get((b, other), 0) >= self.interval(batch):
            return other
        if self._best.get(b) != best:
            self._best[b] = best
            log.info("draft policy: %s is faster at this batch size", best,
                     extra={"batch_bucket": b, "draft_tick_ms": round(self._secs[(b, DRAFT)] * 1e3, 3),
                            "plain_tick_ms": round(self._secs[(b, PLAIN)] * 1e3, 3),
                            "tokens_per_drafted_item": round(self.prior(), 2)})
        return best

    def faster(self, batch: int, requests=None) -> str | None:
        """The mode expected faster at ``batch``'s bucket for ``batch`` requests, once the bucket is
        warm (ties: :data:`DRAFT`), else None; ``requests``: the ids of those that may draft, each
        at its own estimate (None: all of them, at the prior tokens per drafted item)."""
        b = batch_bucket(batch)
        if not self._warm(b):
            return None
        return self._pick(b, batch, requests)

    def expected(self, batch: int) -> str | None:
        """The mode expected faster at ``batch``'s bucket for a request starting there: drafting
        against bare ticks where both are measured, else :meth:`faster`; where the bucket is not
        measured, :data:`PLAIN` when the nearest smaller measured bucket found plain faster
        (drafting's gain only shrinks as a batch grows: the verify turns compute-bound and the
        host work per tick grows with the requests, module docstring), else None."""
        mode = self._admit_faster(batch)
        if mode is not None:
            return mode
        b = batch_bucket(batch) >> 1
        while b >= 1:
            mode = self._admit_faster(b)
            if mode is not None:
                return PLAIN if mode == PLAIN else None
            b >>= 1
        return None

    def demote(self, batch: int, requests=None) -> bool:
        """Whether the requests of a tick of ``batch`` that may draft (probes aside; ``requests``
        their ids, each judged at its own estimate as :meth:`choose` judges them; None: all
        ``batch`` at the prior) are to decode plainly for the rest of their lives: where
        ``batch``'s own bucket is measured and plain ticks are expected faster there (bare ones
        where measured, as :meth:`expected` judges a request starting there; never inferred from
        a smaller bucket). A request starts drafting where nothing was measured yet (or where the
        load was lighter) and would otherwise keep the costs of drafting (its feature rows, a
        drafter session, a verify as wide as the trees whenever a probe drafts) for its whole
        life after its batch turned out to decode faster plainly."""
        return self._admit_faster(batch, requests) == PLAIN

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

    def observe(self, batch: int, mode: str, tokens: int, seconds: float, drafted: int | None = None) -> None:
        """A tick of ``batch`` requests ran in ``mode`` (:data:`DRAFT`, :data:`PLAIN`, or
        :data:`BARE` for a tick of requests that may not draft) and emitted ``tokens`` in
        ``seconds`` (the whole tick: Propose, verify and the orchestrator's own work); ``drafted``:
        how many of a drafting tick's requests drafted (None: all, :meth:`draft_seconds`). A
        drafting tick whose items were not :meth:`note`-d adds its tokens per request to the prior."""
        if seconds <= 0 or batch <= 0:
            return
        b = batch_bucket(batch)
        key = (b, mode)
        if mode == BARE:   # a cost only: no choice was made, nothing to re-measure
            self._add_cost(key, seconds)
            return
        before = self.faster(batch)
        if mode == DRAFT and not self._noted:
            self._add_prior(tokens, batch)
        self._noted = 0
        if mode == DRAFT and self._count.get(key, 0) >= 1:   # (as _add_cost: a mode's first tick not counted)
            d = float(batch if drafted is None else max(1, min(int(drafted), batch)))
            old = self._drafted.get(b)
            self._drafted[b] = d if old is None else old + self.alpha * (d - old)
        self._add_cost(key, seconds)
        self.choices[mode] = self.choices.get(mode, 0) + 1
        self._since[key] = 0
        other = (b, PLAIN if mode == DRAFT else DRAFT)
        self._since[other] = self._since.get(other, 0) + 1
        if before is not None and mode != before:   # a re-measurement of the mode not chosen
            after = self.faster(batch)
            self._interval[b] = (min(self.max_refresh, 2 * self.interval(batch)) if after == before
                                 else self.refresh)

    def _add_cost(self, key: tuple[int, str], seconds: float) -> None:
        """A tick of ``key`` = ``(bucket, mode)`` took ``seconds``: counted, and, from the second
        on (the first carries one-time work), folded into the decayed mean with weight ``alpha``."""
        n = self._count.get(key, 0)
        if n >= 1:
            old = self._secs.get(key)
            self._secs[key] = seconds if old is None else old + self.alpha * (seconds - old)
        self._count[key] = n + 1

    def rates(self) -> dict[int, dict[str, float]]:
        """Expected tokens per second per request, per warm-enough bucket and mode: the prior
        tokens per drafted item over a drafting tick's seconds, one over a plain tick's (for
        metrics and tests)."""
        out: dict[int, dict[str, float]] = {}
        prior = self.prior()
        for (b, mode), sec in self._secs.items():
            if sec > 0 and (mode == PLAIN or prior is not None):
                out.setdefault(b, {})[mode] = (prior if mode == DRAFT else 1.0) / sec
        return out


__all__ = ["BARE", "DRAFT", "PLAIN", "DraftPolicy", "batch_bucket"]
