"""Issue 23's concurrency table and figure: our load sweep (``dflash-grpc bench --concurrency``
JSON) beside ``llama-batched-bench``'s aggregate decode on the same file (its markdown table, S_TG).

    python -m bench.concurrency_report CONCURRENCY.json [--llama LLAMA_BATCHED.txt] [--png OUT.png] [--out OUT.md]
                                       [--project-tau REFERENCE.json]

Per level: llama.cpp's S_TG (tokens/s of the decode phase, all sequences), our AR and speculative
aggregate tokens/s (every stream's generated tokens / the level's wall time), each against
llama.cpp and spec / AR, per-stream tokens/s, p50 / p99 inter-token latency and whether every
request's tokens equal its single-stream AR reference (``mismatches``). Then, where the sweep
recorded them, time to first token (p50 / p99, :func:`ttft_table`) and where a tick went
(:func:`tick_table`). The PNG: aggregate tokens/s against streams, both systems (needs matplotlib).

``--project-tau``: another sweep's JSON (the shipped SmolLM2 pair's, whose drafter is trained)
whose speculative ``tau`` per level projects this sweep's speculative throughput (a target with a
random drafter of the shipped drafter's shape, issue 23's 9B row): ``spec tok/s x tau_reference /
tau_measured`` per level, on the assumption that a tick's time does not depend on how much of
its trees is accepted (the trees' sizes, not their acceptance, set the verify's width).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any


def parse_llama_batched(text: str) -> dict[int, float]:
    """``{B: S_TG}`` from ``llama-batched-bench``'s markdown table (columns ``PP | TG | B | N_KV |
    T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...``). Rows that do not parse are skipped."""
    out: dict[int, float] = {}
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells and "B" in cells:
            header = cells
            continue
        if header is None or re.fullmatch(r"-+", cells[0] or "-"):
            continue
        try:
            row = dict(zip(header, cells))
            out[int(row["B"])] = float(row["S_TG t/s"])
        except (KeyError, ValueError):
            continue
    return out


def rows(sweep: dict[str, Any], llama: dict[int, float]) -> list[dict[str, Any]]:
    """One dict per level of the sweep (``sweep``: the ``concurrency`` part of the bench JSON)."""
    modes = sweep["modes"]
    by = {name: {r["concurrency"]: r for r in rs} for name, rs in modes.items()}
    out = []
    for n in sweep["levels"]:
        ar, sp = by.get("ar", {}).get(n), by.get("spec", {}).get(n)
        out.append({"streams": n, "llama": llama.get(n), "ar": ar, "spec": sp})
    return out


def spec_tau(sweep: dict[str, Any]) -> dict[int, float | None]:
    """``{streams: tau}`` of a sweep's speculative levels (None where it recorded none)."""
    return {r["concurrency"]: r.get("tau") for r in sweep.get("modes", {}).get("spec", [])}


def projected(sweep: dict[str, Any], reference: dict[str, Any]) -> dict[int, float]:
    """``{streams: projected speculative tokens/s}`` (module docstring): for each level both sweeps
    ran with a speculative ``tau`` (``--project-tau``)."""
    ref = spec_tau(reference)
    out = {}
    for r in sweep.get("modes", {}).get("spec", []):
        t, t_ref = r.get("tau"), ref.get(r["concurrency"])
        if t and t_ref:
            out[r["concurrency"]] = r["aggregate_tokens_per_second"] * t_ref / t
    return out


def _f(v, fmt="{:,.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _x(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def markdown(sweep: dict[str, Any], llama: dict[int, float], reference: dict[str, Any] | None = None) -> str:
    """The table (markdown); with ``reference`` (``--project-tau``) the speculative tau and the
    projected speculative throughput (:func:`projected`) too."""
    proj = projected(sweep, reference) if reference is not None else None
    extra_head = " spec tau | reference tau | spec projected | projected / llama.cpp | projected / AR |" if proj is not None else ""
    lines = ["| streams | llama.cpp batched (S_TG) | ours AR | AR / llama.cpp | ours spec | spec / llama.cpp | spec / AR "
             "| per stream AR / spec | ITL p50 ms AR / spec | ITL p99 ms AR / spec | lossless AR / spec |" + extra_head,
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 5 if proj is not None else "")]
    ref_tau = spec_tau(reference or {})

    def agg(r):
        return None if r is None else r["aggregate_tokens_per_second"]

    def ok(r):
        if r is None or r.get("mismatches") is None:
            return "-"
        return "yes" if r["mismatches"] == 0 and not r.get("errors") else f"NO ({r['mismatches']}, {r.get('errors', 0)} err)"

    for row in rows(sweep, llama):
        a, s, ll = row["ar"], row["spec"], row["llama"]
        lines.append(
            f"| {row['streams']} | {_f(ll)} | {_f(agg(a))} | {_x(agg(a), ll)} | {_f(agg(s))} | {_x(agg(s), ll)} | "
            f"{_x(agg(s), agg(a))} | {_f(a and a['mean_stream_tokens_per_second'])} / "
            f"{_f(s and s['mean_stream_tokens_per_second'])} | {_f(a and a.get('itl_p50_ms'), '{:.2f}')} / "
            f"{_f(s and s.get('itl_p50_ms'), '{:.2f}')} | {_f(a and a.get('itl_p99_ms'), '{:.2f}')} / "
            f"{_f(s and s.get('itl_p99_ms'), '{:.2f}')} | {ok(a)} / {ok(s)} |"
            + ("" if proj is None else
               f" {_f(s and s.get('tau'), '{:.2f}')} | {_f(ref_tau.get(row['streams']), '{:.2f}')} | "
               f"{_f(proj.get(row['streams']))} | {_x(proj.get(row['streams']), ll)} | {_x(proj.get(row['streams']), agg(a))} |"))
    ticks, ttft, counted = tick_table(sweep), ttft_table(sweep), counters_table(sweep)
    return "\n".join(lines) + "".join("\n\n" + t for t in (ttft, ticks, counted) if t)


def ttft_table(sweep: dict[str, Any]) -> str:
    """Time to first token per level (markdown; ``bench.serving``'s ``ttft_p50_ms`` /
    ``ttft_p99_ms``: a request's call to its first chunk of tokens, its prompt's prefill and the
    queue before it included), AR / spec. Empty when the sweep recorded none (older JSON)."""
    modes = sweep.get("modes", {})
    by_level: dict[int, dict[str, dict]] = {}
    for mode, levels in modes.items():
        for r in levels:
            if r.get("ttft_p50_ms") is not None:
                by_level.setdefault(r["concurrency"], {})[mode] = r
    if not by_level:
        return ""
    lines = ["Time to first token, ms (a request's call to its first tokens: its prefill and the queue before it):", "",
             "| streams | TTFT p50 AR / spec | TTFT p99 AR / spec |", "|---|---|---|"]
    for n in sorted(by_level):
        a, s = by_level[n].get("ar"), by_level[n].get("spec")
        lines.append(f"| {n} | {_f(a and a.get('ttft_p50_ms'), '{:.2f}')} / {_f(s and s.get('ttft_p50_ms'), '{:.2f}')} | "
                     f"{_f(a and a.get('ttft_p99_ms'), '{:.2f}')} / {_f(s and s.get('ttft_p99_ms'), '{:.2f}')} |")
    return "\n".join(lines)


def tick_table(sweep: dict[str, Any]) -> str:
    """Where a request's tick went at each level (markdown; ``bench.serving``'s ``tick_ms``:
    milliseconds per verify forward, means over the level's requests): the tick, the Propose
    exchange as the orchestrator saw it (the draft service's step time / its device time), the
    Verify exchange likewise, and the orchestrator's part (the tick less both exchanges); then
    each service's host time on the tick's path per item (issue 23's "host time per item per
    tick", microseconds): a service's step less its device time, and the orchestrator's part,
    divided by the level's streams (a full tick's items: the level's tails, with fewer, make this
    a lower bound). Empty when the sweep recorded none (older JSON)."""
    lines = []
    for mode, levels in sweep.get("modes", {}).items():
        for r in levels:
            t = r.get("tick_ms")
            if not t:
                continue
            n = max(1, int(r["concurrency"]))
            draft = f"{(t['draft_compute'] - t['draft_device']) * 1e3 / n:.1f}" if t["draft_exchange"] else "-"
            lines.append(f"| {mode} | {r['concurrency']} | {_f(r.get('tau'), '{:.2f}')} | {t['tick']:.2f} | "
                         f"{t['draft_exchange']:.2f} ({t['draft_compute']:.2f} / {t['draft_device']:.2f}) | "
                         f"{t['verify_exchange']:.2f} ({t['verify_compute']:.2f} / {t['verify_device']:.2f}) | "
                         f"{t['orchestrator']:.2f} | {draft} / "
                         f"{(t['verify_compute'] - t['verify_device']) * 1e3 / n:.1f} / {t['orchestrator'] * 1e3 / n:.1f} |")
    if not lines:
        return ""
    return "\n".join(["Where a tick went, ms per verify forward of a request (means over the level's requests; "
                      "exchange (service step / device)); host us per item = a service's step less its device "
                      "time, or the orchestrator's part, / streams:", "",
                      "| mode | streams | tau | tick | Propose (draft step / device) | Verify (target step / device) | "
                      "orchestrator | host us per item: draft / target / orchestrator |",
                      "|---|---|---|---|---|---|---|---|"] + lines)


#: the scheduler counters :func:`counters_table` shows, by column heading
COUNTER_COLUMNS = (("ticks", "ticks"), ("draft_fallbacks", "fallbacks"), ("refeatures", "recomputed"),
                   ("drafter_sessions_given_up", "given up"), ("admitted_plain", "started plain"),
                   ("demoted", "demoted"), ("no_drafter_slot", "no drafter slot"),
                   ("draft_deadline_misses", "deadline misses"))


def counters_table(sweep: dict[str, Any]) -> str:
    """What the orchestrator's scheduler counted over each level (markdown; ``bench.serving``'s
    ``scheduler``: the change of ``SchedulerStatus``'s counters from the level's start to its end):
    ticks, drafter fallbacks, drafter sessions recomputed and given up, requests started plainly
    for life, demoted, Propose items without a drafter slot, missed Propose deadlines; then the
    orchestrator's own part of a tick, milliseconds per tick: its scheduler thread's loop less the
    exchanges, wall clock and that thread's CPU time (a CPU share well under 1 is waiting: for the
    GIL, for a core). Empty when the sweep recorded none (older JSON, or a server that did not
    report them); then the milliseconds per tick the Verify and Propose items waited in the target's and
    the drafter's queues before their steps (the replies' ``queue_s``)."""
    lines = []
    for mode, levels in sweep.get("modes", {}).items():
        for r in levels:
            c = r.get("scheduler")
            if c:
                ticks = c.get("ticks", 0)
                part = "- | -"
                if ticks and "tick_seconds" in c:
                    wall = (c["tick_seconds"] - c["exchange_seconds"]) / ticks * 1e3
                    cpu = (c["tick_cpu_seconds"] - c["exchange_cpu_seconds"]) / ticks * 1e3
                    part = f"{wall:.2f} | {cpu:.2f}"
                queued = "- | -"
                if ticks and "verify_queue_seconds" in c:
                    queued = (f"{c['verify_queue_seconds'] / ticks * 1e3:.2f} | "
                              f"{c['propose_queue_seconds'] / ticks * 1e3:.2f}")
                lines.append(f"| {mode} | {r['concurrency']} | " + " | ".join(f"{c.get(k, 0):,}" for k, _ in COUNTER_COLUMNS)
                             + f" | {part} | {queued} |")
    if not lines:
        return ""
    return "\n".join(["What the scheduler counted over each level (its Info before and after), its own part of "
                      "a tick in ms (its loop less the exchanges: wall, its thread's CPU), and the ms per tick its "
                      "Verify and Propose items waited in the services' queues:", "",
                      "| mode | streams | " + " | ".join(h for _, h in COUNTER_COLUMNS)
                      + " | own ms / tick | own CPU ms / tick | Verify queue ms / tick | Propose queue ms / tick |",
                      "|---|---|" + "---|" * (len(COUNTER_COLUMNS) + 4)] + lines)


def write_png(sweep: dict[str, Any], llama: dict[int, float], path: str, title: str = "") -> None:
    """Aggregate tokens/s against streams (log2 axis): llama-batched-bench, ours AR, ours spec.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    levels = sweep["levels"]
    if llama:
        xs = [n for n in levels if n in llama]
        ax.plot(xs, [llama[n] for n in xs], marker="s", label="llama-batched-bench (S_TG)")
    for name, label in (("ar", "ours, AR"), ("spec", "ours, speculative (default tree)")):
        rs = sweep["modes"].get(name) or []
        ax.plot([r["concurrency"] for r in rs], [r["aggregate_tokens_per_second"] for r in rs], marker="o", label=label)
    if len(levels) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set(title=title or "aggregate decode throughput", xlabel="concurrent streams", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="dflash-grpc bench --json output with a --concurrency sweep")
    p.add_argument("--llama", help="llama-batched-bench output (its markdown table)")
    p.add_argument("--png", help="write the figure here (needs matplotlib)")
    p.add_argument("--out", help="write the table here (default: stdout)")
    p.add_argument("--title", default="")
    p.add_argument("--project-tau", default=None, metavar="REFERENCE.json",
                   help="a sweep whose speculative tau per level projects this one's (module docstring)")
    a = p.parse_args(argv)
    with open(a.json) as f:
        data = json.load(f)
    sweep = data.get("concurrency", data)
    llama = {}
    if a.llama:
        with open(a.llama) as f:
            llama = parse_llama_batched(f.read())
    reference = None
    if a.project_tau:
        with open(a.project_tau) as f:
            ref = json.load(f)
        reference = ref.get("concurrency", ref)
    table = markdown(sweep, llama, reference)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")
    else:
        print(table)
    if a.png:
        write_png(sweep, llama, a.png, a.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
