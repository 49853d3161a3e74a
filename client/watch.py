"""``dflash-grpc stats --watch``: a live view of a running orchestrator.

Every ``--interval`` seconds it polls ``GetStats`` and ``Info`` and redraws one frame: tokens/s
over the last interval (the change in generated tokens of finished requests), tau, acceptance
rate and acceptance by draft position, the scheduler's active / queued sessions, mean batch and
tree budget, and draft fallbacks. On a terminal the frame is redrawn in place (with ``rich`` when
it is installed, else with ANSI clear-screen); piped, each frame is printed after the previous
one. ``--json`` prints one JSON object per poll instead.

:func:`render_frame` is a pure function of the numbers (tested without a server).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from client import AcceptanceStats, Client, DFlashError, SchedulerStatus

#: draft positions shown in the acceptance table
MAX_POSITIONS = 16
_BAR = 30


def tokens_per_second(stats: AcceptanceStats, prev: AcceptanceStats | None, elapsed_s: float) -> float | None:
    """Generated tokens per second between two snapshots (None without a previous one)."""
    if prev is None or elapsed_s <= 0:
        return None
    return max(0, stats.generated_tokens - prev.generated_tokens) / elapsed_s


def _bar(frac: float, width: int = _BAR) -> str:
    n = round(max(0.0, min(1.0, frac)) * width)
    return "█" * n + "·" * (width - n)


def render_frame(
    stats: AcceptanceStats,
    scheduler: SchedulerStatus | None = None,
    prev: AcceptanceStats | None = None,
    elapsed_s: float = 0.0,
    *,
    address: str = "",
    interval_s: float | None = None,
    clock: str | None = None,
    error: str | None = None,
) -> str:
    """One frame of the live view as plain text.

    Args:
        stats: the server's global statistics now (``GetStats``).
        scheduler: ``Info().scheduler`` now (None or all-zero: no batching scheduler).
        prev: the previous poll's statistics (None on the first frame: no rate yet).
        elapsed_s: seconds between ``prev`` and ``stats``.
        address, interval_s, clock: shown in the title line (``clock``: e.g. ``"12:00:01"``).
        error: the last poll's error, shown under the title (the numbers are the last good ones).
    """
    sched = scheduler or SchedulerStatus()
    title = "dflash-grpc stats" + (f" @ {address}" if address else "")
    if clock:
        title += f"   {clock}"
    if interval_s:
        title += f"   (every {interval_s:g} s; Ctrl-C quits)"
    lines = [title]
    if error:
        lines.append(f"error: {error}")
    lines.append("")
    rate = tokens_per_second(stats, prev, elapsed_s)
    if rate is None:
        lines.append("throughput   -- tok/s (after the next poll)")
    else:
        dreq = stats.requests - prev.requests
        lines.append(f"throughput   {rate:.1f} tok/s   (+{stats.generated_tokens - prev.generated_tokens} tokens, "
                     f"+{dreq} requests in {elapsed_s:.1f} s)")
    lines.append(f"totals       {stats.requests} requests, {stats.generated_tokens} generated, {stats.prompt_tokens} prompt tokens, "
                 f"{stats.tokens_per_second:.1f} tok/s per request decode")
    lines.append(f"tau          {stats.tau:.3f}   acceptance rate {stats.acceptance_rate:.3f}   drafts {stats.drafts}   "
                 f"draft tokens {stats.draft_tokens}   forwards {stats.target_forwards}   AR steps {stats.autoregressive_steps}")
    if sched.max_sessions or sched.ticks or sched.active_sessions or sched.queued_requests:
        lines.append(f"scheduler    active {sched.active_sessions}/{sched.max_sessions}   queued {sched.queued_requests}/{sched.max_queue}   "
                     f"ticks {sched.ticks}   mean batch {sched.mean_batch:.2f}   tree budget {sched.tree_budget_now}   "
                     f"drafting {'yes' if sched.drafting else 'no'}")
    else:
        lines.append("scheduler    (not reported by this server)")
    lines.append(f"fallbacks    {max(stats.draft_fallbacks, sched.draft_fallbacks)}")
    lines.append("")
    drafted = stats.drafted_per_position[:MAX_POSITIONS]
    if any(drafted):
        lines.append("acceptance by draft position")
        for d, (a, n) in enumerate(zip(stats.accepted_per_position + [0] * len(drafted), drafted), start=1):
            frac = a / n if n else 0.0
            lines.append(f"  {d:>3}  {frac:5.3f}  {_bar(frac)}  {a}/{n}")
        if len(stats.drafted_per_position) > MAX_POSITIONS:
            lines.append(f"  ... {len(stats.drafted_per_position) - MAX_POSITIONS} deeper positions not shown")
    else:
        lines.append("acceptance by draft position: nothing drafted yet")
    return "\n".join(lines)


def frame_json(stats: AcceptanceStats, scheduler: SchedulerStatus | None, prev: AcceptanceStats | None,
               elapsed_s: float, error: str | None = None) -> dict[str, Any]:
    """One poll as a JSON-serialisable dict (``--watch --json``)."""
    import dataclasses

    return {
        "time": time.time(),
        "tokens_per_second": tokens_per_second(stats, prev, elapsed_s),
        "tau": stats.tau,
        "acceptance_per_position": stats.per_position_acceptance,
        "stats": stats.to_dict(),
        "scheduler": dataclasses.asdict(scheduler or SchedulerStatus()),
        "error": error,
    }


@contextlib.contextmanager
def _display(out: IO[str]) -> Iterator[Callable[[str], None]]:
    """A function that shows one frame: redrawn in place on a terminal, appended otherwise."""
    if not (hasattr(out, "isatty") and out.isatty()):
        first = [True]

        def append(frame: str) -> None:
            out.write(("" if first[0] else "\n") + frame + "\n")
            out.flush()
            first[0] = False

        yield append
        return
    try:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text
    except ImportError:
        def redraw(frame: str) -> None:
            out.write("\x1b[H\x1b[2J" + frame + "\n")
            out.flush()

        yield redraw
        return
    with Live(Text(""), console=Console(file=out), auto_refresh=False, screen=False) as live:
        yield lambda frame: live.update(Text(frame), refresh=True)


def watch(client: Client, interval: float = 1.0, count: int = 0, *, as_json: bool = False, out: IO[str] | None = None,
          sleep: Callable[[float], None] = time.sleep) -> int:
    """Poll ``client`` every ``interval`` seconds and show a frame each time; stop after ``count``
    frames (0: until Ctrl-C, which returns normally). A failed poll is shown and polling goes on."""
    out = out if out is not None else sys.stdout
    prev: AcceptanceStats | None = None
    stats, sched = AcceptanceStats(), SchedulerStatus()
    t_prev = 0.0
    frames = 0
    try:
        with _display(out) if not as_json else contextlib.nullcontext(None) as show:
            while True:
                t = time.monotonic()
                error = None
                try:
                    stats = client.stats()
                    sched = client.info().scheduler
                except DFlashError as e:
                    error = str(e)
                elapsed = t - t_prev if prev is not None else 0.0
                if as_json:
                    out.write(json.dumps(frame_json(stats, sched, prev, elapsed, error)) + "\n")
                    out.flush()
                else:
                    show(render_frame(stats, sched, prev, elapsed, address=client.address, interval_s=interval,
                                      clock=time.strftime("%H:%M:%S"), error=error))
                if error is None:
                    prev, t_prev = stats, t
                frames += 1
                if count and frames >= count:
                    break
                sleep(max(0.0, interval - (time.monotonic() - t)))
    except KeyboardInterrupt:
        pass
    return 0
