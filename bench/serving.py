"""``dflash-grpc bench``: acceptance length (tau) and speed of chain vs tree drafting.

Starts the three services on loopback (as ``demo`` does), runs every prompt with every drafting
configuration at temperature 0, and reports per configuration: tau (tokens per target forward),
draft tokens per forward, acceptance rate per depth, tokens/s, and whether every completion
equals target-only decoding (configuration ``ar``, which is always run first). Writes a text table
and, with ``--json``, the raw numbers.

Configurations: ``ar`` (no drafter), ``chain`` (greedy chain of block_size - 1), and
``tree:BUDGET:TOPK`` (DDTree with at most BUDGET nodes, TOPK candidates per depth).

``--concurrency 1,4,16`` adds a load sweep (:func:`run_concurrency`): for each level N, N client
streams (threads, one channel each) generate at once, autoregressive and speculative (the server's
default tree); reported per level: aggregate tokens/s (all streams' generated tokens / the level's
wall time) and each stream's tokens/s. ``--png PATH`` draws acceptance by draft position and
aggregate tokens/s against concurrency (:func:`write_png`; needs matplotlib).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any, Callable, Sequence

from client import AcceptanceStats, Client, DFlashError, GenerateRequest


@dataclasses.dataclass
class BenchConfig:
    """One drafting configuration of the benchmark."""

    name: str
    speculative: bool
    tree_budget: int | None = None
    top_k: int | None = None

    @classmethod
    def parse(cls, text: str) -> "BenchConfig":
        """``ar`` | ``chain`` | ``tree:BUDGET:TOPK`` (raises ``ValueError`` otherwise)."""
        if text == "ar":
            return cls("ar", False)
        if text == "chain":
            return cls("chain", True, 0, 1)
        parts = text.split(":")
        if len(parts) == 3 and parts[0] == "tree":
            return cls(text, True, int(parts[1]), int(parts[2]))
        raise ValueError(f"bad configuration {text!r}: use ar, chain or tree:BUDGET:TOPK")

    def kwargs(self) -> dict[str, Any]:
        """The configuration's generation options (fields of :class:`client.GenerateRequest`)."""
        if not self.speculative:
            return {"speculative": False}
        return {"speculative": True, "tree_budget": self.tree_budget, "top_k_draft": self.top_k}


def _merge(stats: list[AcceptanceStats]) -> dict[str, Any]:
    hist: list[int] = []
    acc: list[int] = []
    drafted: list[int] = []
    tot = {"generated_tokens": 0, "target_forwards": 0, "draft_tokens": 0, "accepted_tokens": 0, "decode_time_s": 0.0, "drafts": 0,
           "draft_time_s": 0.0, "verify_time_s": 0.0, "draft_compute_s": 0.0, "verify_compute_s": 0.0,
           "draft_device_s": 0.0, "verify_device_s": 0.0}
    for s in stats:
        for key in tot:
            tot[key] += getattr(s, key)
        for dst, src in ((hist, s.acceptance_length_histogram), (acc, s.accepted_per_position), (drafted, s.drafted_per_position)):
            dst.extend([0] * (len(src) - len(dst)))
            for i, v in enumerate(src):
                dst[i] += v
    forwards = sum(hist)
    per_step = 1000.0 / forwards if forwards else 0.0
    return {
        **tot,
        # milliseconds per target forward (= per speculative step): the services' compute, the
        # rest of the Propose / Verify round trips (gRPC, serialisation, queueing) and the
        # orchestrator's own time between them
        "step_ms": {
            "total": tot["decode_time_s"] * per_step,
            "draft_compute": tot["draft_compute_s"] * per_step,
            "verify_compute": tot["verify_compute_s"] * per_step,
            # the device part of each (the services' CUDA events; 0 off CUDA)
            "draft_device": tot["draft_device_s"] * per_step,
            "verify_device": tot["verify_device_s"] * per_step,
            "grpc_and_queue": (tot["draft_time_s"] - tot["draft_compute_s"] + tot["verify_time_s"] - tot["verify_compute_s"]) * per_step,
            "orchestrator": (tot["decode_time_s"] - tot["draft_time_s"] - tot["verify_time_s"]) * per_step,
        },
        "tau": sum(t * c for t, c in enumerate(hist)) / forwards if forwards else 0.0,
        "tokens_per_second": tot["generated_tokens"] / tot["decode_time_s"] if tot["decode_time_s"] else 0.0,
        "draft_tokens_per_forward": tot["draft_tokens"] / forwards if forwards else 0.0,
        "acceptance_per_depth": [a / d if d else 0.0 for a, d in zip(acc, drafted)],
        "acceptance_length_histogram": hist,
    }


def run_bench(address: str, prompts: Sequence[str], configs: Sequence[BenchConfig], max_tokens: int,
              timeout: float | None = None, progress=None, warmup: int = 1) -> dict[str, Any]:
    """Run every prompt under every configuration against a running orchestrator.

    ``warmup``: requests of the first prompt run under each configuration before its timed ones,
    their results dropped. A configuration's first requests pay one-time work that steady decoding
    does not (kernels compiled on first use, memory the services' allocators grow into), which
    would otherwise land on whichever configuration runs first: without it, the speculative
    configuration run second was 8-119% faster than the one run first in four runs of four,
    whichever tree each was; with it the two were within 3% (``benchmarks/gpu/step/run26-order``).

    Returns:
        ``{"configs": {name: merged stats + "lossless": bool}, "prompts": n, "max_tokens": m,
        "reference_tokens": [the ar run's token ids per prompt]}``; ``lossless`` compares each
        completion's token ids with the ``ar`` run of the same prompt.
    """
    if not configs or configs[0].name != "ar":
        configs = [BenchConfig.parse("ar"), *[c for c in configs if c.name != "ar"]]
    out: dict[str, Any] = {"prompts": len(prompts), "max_tokens": max_tokens, "configs": {}}
    reference: list[list[int]] = []
    with Client(address, timeout=timeout) as c:
        for cfg in configs:
            request = GenerateRequest(max_tokens=max_tokens, **cfg.kwargs())
            for _ in range(max(0, warmup) if prompts else 0):
                c.generate(prompts[0], request=request)
            stats, same = [], True
            t0 = time.monotonic()
            for i, prompt in enumerate(prompts):
                res = c.generate(prompt, request=request)
                stats.append(res.stats)
                if cfg.name == "ar":
                    reference.append(res.token_ids)
                else:
                    same = same and res.token_ids == reference[i]
                if progress:
                    progress(cfg.name, i + 1, len(prompts))
            out["configs"][cfg.name] = {**_merge(stats), "lossless": same, "wall_s": time.monotonic() - t0}
    out["reference_tokens"] = reference
    return out


def format_table(result: dict[str, Any]) -> str:
    """The benchmark as a fixed-width text table."""
    lines = [
        f"{result['prompts']} prompts, up to {result['max_tokens']} new tokens each, temperature 0",
        f"{'config':<14} {'tau':>6} {'draft/fwd':>9} {'tok/s':>8} {'tokens':>7} {'forwards':>8} {'lossless':>8} "
        f"{'ms/step: draft':>14} {'verify':>6} {'rpc':>5} {'orch':>5}  acceptance by depth",
    ]
    for name, r in result["configs"].items():
        depth = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"][:8])
        lines.append(
            f"{name:<14} {r['tau']:>6.3f} {r['draft_tokens_per_forward']:>9.1f} {r['tokens_per_second']:>8.2f} "
            f"{r['generated_tokens']:>7} {r['target_forwards']:>8} {'yes' if r['lossless'] else 'NO':>8} "
            f"{r['step_ms']['draft_compute']:>14.2f} {r['step_ms']['verify_compute']:>6.2f} {r['step_ms']['grpc_and_queue']:>5.2f} "
            f"{r['step_ms']['orchestrator']:>5.2f}  {depth}"
        )
    return "\n".join(lines)


def dump_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


# --------------------------------------------------------------------------------------------
# Concurrency sweep

#: the sweep's two modes: plain autoregressive, and speculative with the server's default tree
CONCURRENCY_MODES: dict[str, dict[str, Any]] = {"ar": {"speculative": False}, "spec": {"speculative": True}}


def parse_levels(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (raises ``ValueError`` on a level < 1 or a non-number)."""
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or any(n < 1 for n in levels):
        raise ValueError(f"bad concurrency levels {text!r}: use positive integers, e.g. 1,4,16")
    return levels


#: streams a client process of the load sweep runs (threads, one channel each): at many streams the
#: client's own Python (one message per stream per tick) would otherwise be what limits the level
STREAMS_PER_PROCESS = 16


def _percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100 * len(v) + 0.5)) - 1))]


def _streams(address: str, jobs: list[tuple[int, list[str]]], request: GenerateRequest, timeout: float | None,
             barrier) -> list[dict[str, Any]]:
    """Run one client stream per ``(stream index, prompts)`` job, each on its own thread and channel,
    its prompts in turn, all starting at ``barrier``. Per stream: ``tokens`` (generated), ``seconds``
    (wall, first request's start to last one's end), ``itl`` (seconds per token between consecutive
    chunks of a request: a chunk of ``k`` tokens ``g`` seconds after the previous adds ``k`` samples
    ``g / k``; a request's first chunk is its time to first token, not counted), ``ttft`` (seconds
    from each request's call to its first chunk of tokens: its prefill, queueing and first token),
    ``outputs`` (each request's token ids, in order), ``errors``, and from each request's final statistics
    ``emitted`` (tokens) and ``forwards`` (target verify forwards) summed, ``tau``'s parts."""
    out = [{"stream": j, "tokens": 0, "seconds": 0.0, "itl": [], "ttft": [], "outputs": [], "errors": [], "emitted": 0.0,
            "forwards": 0,
            "parts": dict.fromkeys(TICK_PARTS, 0.0)}
           for j, _ in jobs]
    clients = [Client(address, timeout=timeout) for _ in jobs]

    def stream(slot: int) -> None:
        rec, prompts = out[slot], jobs[slot][1]
        barrier.wait()
        t0 = time.monotonic()
        for prompt in prompts:
            ids: list[int] = []
            last = None
            start = time.monotonic()
            try:
                for chunk in clients[slot].stream(prompt, request=request):
                    now = time.monotonic()
                    st = chunk.stats
                    if st is not None and st.target_forwards:   # the request's final statistics
                        rec["emitted"] += st.mean_acceptance_length * st.target_forwards
                        rec["forwards"] += st.target_forwards
                        for name, field in TICK_PARTS.items():
                            rec["parts"][name] += getattr(st, field)
                    if chunk.token_ids:
                        if last is not None:
                            rec["itl"].extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
                        else:
                            rec["ttft"].append(now - start)
                        last = now
                        ids.extend(chunk.token_ids)
            except DFlashError as e:
                rec["errors"].append(str(e))
                ids = None
            rec["outputs"].append(ids)
            rec["tokens"] += len(ids or [])
        rec["seconds"] = time.monotonic() - t0

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(jobs))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in clients:
            c.close()
    return out


#: A request's final statistics (``AcceptanceStats`` fields, seconds) summed per level into
#: ``tick_ms``: each part's milliseconds per target verify forward (one tick of the request), by name
TICK_PARTS = {"tick": "decode_time_s", "draft_exchange": "draft_time_s", "draft_compute": "draft_compute_s",
              "draft_device": "draft_device_s", "verify_exchange": "verify_time_s", "verify_compute": "verify_compute_s",
              "verify_device": "verify_device_s"}


def _streams_process(args) -> list[dict[str, Any]]:
    """:func:`_streams` in a client process of the sweep (``multiprocessing`` target)."""
    address, jobs, request, timeout, barrier = args
    return _streams(address, jobs, request, timeout, barrier)


def _run_level(address: str, prompts: Sequence[str], n: int, requests_per_stream: int, request: GenerateRequest,
               timeout: float | None, reference: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """N streams at once, each ``requests_per_stream`` requests in turn; stream j's r-th request
    is ``request`` with prompt ``(j * requests_per_stream + r) % len(prompts)``. Up to
    :data:`STREAMS_PER_PROCESS` streams run in this process; more are spread over client
    processes of that many streams each (``spawn``), so the client's own host work does not
    limit the level. ``reference``: prompt -> the token ids the request must give (the
    single-stream AR run, temperature 0): ``mismatches`` counts the requests that differ."""
    jobs = [(j, [prompts[(j * requests_per_stream + r) % len(prompts)] for r in range(requests_per_stream)])
            for j in range(n)]
    if n <= STREAMS_PER_PROCESS:
        barrier = threading.Barrier(n + 1)
        done: list[list[dict[str, Any]]] = []
        runner = threading.Thread(target=lambda: done.append(_streams(address, jobs, request, timeout, barrier)), daemon=True)
        runner.start()
        barrier.wait()
        t0 = time.monotonic()
        runner.join()
        wall = time.monotonic() - t0
        recs = done[0] if done else []
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        groups = [jobs[i:i + STREAMS_PER_PROCESS] for i in range(0, n, STREAMS_PER_PROCESS)]
        with ctx.Manager() as manager:
            barrier = manager.Barrier(n + 1)
            with ctx.Pool(len(groups)) as pool:
                pending = pool.map_async(_streams_process, [(address, g, request, timeout, barrier) for g in groups])
                barrier.wait()
                t0 = time.monotonic()
                parts = pending.get()
                wall = time.monotonic() - t0
        recs = [r for part in parts for r in part]
    recs.sort(key=lambda r: r["stream"])
    tokens = [r["tokens"] for r in recs]
    per_stream = [r["tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0 for r in recs]
    errors = [e for r in recs for e in r["errors"]]
    itl = [x for r in recs for x in r["itl"]]
    ttft = [x for r in recs for x in r["ttft"]]
    forwards = sum(r["forwards"] for r in recs)
    tick_ms = None
    if forwards:
        tick_ms = {name: sum(r["parts"][name] for r in recs) / forwards * 1e3 for name in TICK_PARTS}
        tick_ms["orchestrator"] = tick_ms["tick"] - tick_ms["draft_exchange"] - tick_ms["verify_exchange"]
    mismatches = None
    if reference is not None:
        mismatches = sum(1 for (_, ps), r in zip(jobs, recs) for p, ids in zip(ps, r["outputs"])
                         if ids is not None and p in reference and ids != reference[p])
    return {
        "concurrency": n,
        "requests": n * requests_per_stream,
        "generated_tokens": sum(tokens),
        "wall_s": wall,
        "aggregate_tokens_per_second": sum(tokens) / wall if wall > 0 else 0.0,
        "per_stream_tokens_per_second": per_stream,
        "mean_stream_tokens_per_second": sum(per_stream) / n,
        "min_stream_tokens_per_second": min(per_stream),
        "itl_p50_ms": None if not itl else _percentile(itl, 50) * 1e3,
        "itl_p99_ms": None if not itl else _percentile(itl, 99) * 1e3,
        "ttft_p50_ms": None if not ttft else _percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": None if not ttft else _percentile(ttft, 99) * 1e3,
        "mismatches": mismatches,
        "tau": sum(r["emitted"] for r in recs) / forwards if forwards else None,
        "tick_ms": tick_ms,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def run_concurrency(address: str, prompts: Sequence[str], levels: Sequence[int], max_tokens: int,
                    timeout: float | None = None, requests_per_stream: int = 1,
                    modes: dict[str, dict[str, Any]] | None = None,
                    progress: Callable[[str, int], None] | None = None,
                    reference: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The load sweep against a running orchestrator: every level of every mode (temperature 0).

    Args:
        reference: prompt -> its single-stream AR token ids (:func:`run_bench`'s
            ``reference_tokens``); each level then counts the requests whose tokens differ
            (``mismatches``: lossless under load when 0). None: not checked.

    Returns:
        ``{"levels": [...], "max_tokens": m, "requests_per_stream": r, "modes": {mode: [per level:
        concurrency, requests, generated_tokens, wall_s, aggregate_tokens_per_second,
        per_stream_tokens_per_second, mean/min_stream_tokens_per_second, itl_p50_ms, itl_p99_ms
        (inter-token latency over every streamed token but a request's first), ttft_p50_ms,
        ttft_p99_ms (time to first token: a request's call to its first chunk), mismatches, tau
        (tokens per target verify forward over the level's requests, from their final statistics;
        None when none reported any), tick_ms (where a tick of a request went, milliseconds per
        verify forward, from the requests' final statistics: ``tick`` (decode time), the Propose and
        Verify exchanges as the orchestrator saw them, the services' step time and device time for
        them, and ``orchestrator`` = tick less both exchanges; None when no forward was reported),
        errors, first_error, scheduler (the change of the orchestrator's scheduler counters over the
        level, ``SchedulerStatus.COUNTERS``: ticks, fallbacks, recomputed and given-up drafter
        sessions, requests started plainly, ...; None where its Info failed, the server does not
        report them, or it restarted during the level)]}}``. A failed request counts as an error of its level (e.g.
        RESOURCE_EXHAUSTED past the server's session slots) and adds no tokens.
    """
    if not prompts:
        raise ValueError("no prompts")
    modes = CONCURRENCY_MODES if modes is None else modes
    out: dict[str, Any] = {"levels": list(levels), "max_tokens": max_tokens, "requests_per_stream": requests_per_stream, "modes": {}}
    for name, options in modes.items():
        request = GenerateRequest(max_tokens=max_tokens, **options)  # a bad option fails here, before any stream
        rows = out["modes"][name] = []
        for n in levels:
            if progress:
                progress(name, n)
            before = _scheduler_counters(address, timeout)
            row = _run_level(address, prompts, n, requests_per_stream, request, timeout, reference)
            row["scheduler"] = _counted(before, _scheduler_counters(address, timeout))
            rows.append(row)
    return out


def _scheduler_counters(address: str, timeout: float | None) -> dict[str, float] | None:
    """The orchestrator's scheduler counters now (``SchedulerStatus.COUNTERS`` from its Info), or
    None where Info fails."""
    try:
        with Client(address, timeout=timeout) as c:
            s = c.info().scheduler
    except DFlashError:
        return None
    return {k: getattr(s, k) for k in type(s).COUNTERS}


def _counted(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What the scheduler counted between two :func:`_scheduler_counters` readings, or None where
    they say nothing: a reading failed, the server does not report the counters (it ticked but
    counts no tick seconds: an older orchestrator, or none with a scheduler), or it restarted
    in between (a counter went down)."""
    if before is None or after is None or (after["ticks"] and not after["tick_seconds"]):
        return None
    if any(after[k] < before[k] for k in after):
        return None
    return {k: after[k] - before[k] for k in after}


def format_concurrency(result: dict[str, Any]) -> str:
    """The load sweep as a fixed-width text table (one row per mode and level)."""
    lines = [f"concurrency sweep: up to {result['max_tokens']} new tokens, {result['requests_per_stream']} request(s) per stream",
             f"{'mode':<6} {'streams':>7} {'tok/s':>9} {'per stream':>10} {'min':>7} {'ITL p50':>8} {'ITL p99':>8} "
             f"{'TTFT p50':>8} {'TTFT p99':>8} {'tokens':>7} {'wall s':>7} {'errors':>6} {'lossless':>8}"]

    def ms(v):
        return "-" if v is None else f"{v:.2f}"

    for name, rows in result["modes"].items():
        for r in rows:
            mism = r.get("mismatches")
            lossless = "-" if mism is None else ("yes" if mism == 0 else f"NO ({mism})")
            lines.append(f"{name:<6} {r['concurrency']:>7} {r['aggregate_tokens_per_second']:>9.1f} "
                         f"{r['mean_stream_tokens_per_second']:>10.1f} {r['min_stream_tokens_per_second']:>7.1f} "
                         f"{ms(r.get('itl_p50_ms')):>8} {ms(r.get('itl_p99_ms')):>8} "
                         f"{ms(r.get('ttft_p50_ms')):>8} {ms(r.get('ttft_p99_ms')):>8} "
                         f"{r['generated_tokens']:>7} {r['wall_s']:>7.2f} {r['errors']:>6} {lossless:>8}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# PNG report

PNG_HINT = "--png needs matplotlib: pip install matplotlib (or pip install -e '.[test]')"


def require_matplotlib() -> None:
    """Raise ``ImportError`` with :data:`PNG_HINT` when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(PNG_HINT) from e


def write_png(result: dict[str, Any], path: str, concurrency: dict[str, Any] | None = None) -> None:
    """Two panels into ``path`` (PNG): acceptance rate by draft position of every speculative
    configuration of ``result`` (:func:`run_bench`), and aggregate tokens/s against concurrency per
    mode of ``concurrency`` (:func:`run_concurrency`; the panel says so when there is none).

    Raises:
        ImportError: matplotlib is not installed (message: :data:`PNG_HINT`).
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    plotted = False
    for name, r in result.get("configs", {}).items():
        acc = r.get("acceptance_per_depth") or []
        if name == "ar" or not acc:
            continue
        left.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} (tau {r.get('tau', 0.0):.2f})")
        plotted = True
    left.set(title="acceptance rate by draft position", xlabel="draft position (depth)", ylabel="accepted / drafted", ylim=(0, 1.02))
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.grid(alpha=0.3)
    if plotted:
        left.legend(fontsize=8)
    else:
        left.text(0.5, 0.5, "no speculative configuration", ha="center", va="center", transform=left.transAxes)
    if concurrency and concurrency.get("modes"):
        for name, rows in concurrency["modes"].items():
            xs = [r["concurrency"] for r in rows]
            right.plot(xs, [r["aggregate_tokens_per_second"] for r in rows], marker="o", label=name)
        levels = sorted({r["concurrency"] for rows in concurrency["modes"].values() for r in rows})
        if len(levels) > 1 and levels[-1] / levels[0] >= 4:
            right.set_xscale("log", base=2)
        right.set_xticks(levels, [str(n) for n in levels])
        right.legend(fontsize=8)
    else:
        right.text(0.5, 0.5, "no --concurrency sweep", ha="center", va="center", transform=right.transAxes)
    right.set(title="aggregate throughput", xlabel="concurrent streams", ylabel="tokens/s")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
