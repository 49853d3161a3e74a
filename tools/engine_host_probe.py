"""Host time per item of the two engines' batch calls under load, in one process (issues 23 and 18).

    python tools/engine_host_probe.py [--sessions 8,64] [--turnover 0,37] [--ticks 120]
                                      [--prompt 130] [--out DIR] [--top 25]

Under load the services' own figures put most of a speculative tick outside the device: at 64
streams the draft service's Propose step took 3.3 ms of which 1.2 on the device, the target's
Verify 3.3-3.6 of which 2.4 (``benchmarks/gpu/concurrency/run26-ring-in-step/final``, ``tick_ms``).
This runs the same engine calls with no gRPC, hop, orchestrator or second process, so whatever
host time is left here is the engines' own:

* the target (:class:`target_service.batched_engine.BatchedEngine`, CUDA graphs, the feature ring
  made at capture as the launcher starts it) and the drafter
  (:class:`draft_service.batched.BatchedDrafter`, graphs, reading the target's ring in process);
* ``N`` sessions in lockstep: one ``propose_batch`` of every session's item (its new rows in the
  ring, as the services send them), then one ``verify_batch`` of every tree (15 draft nodes, top-k
  4: the default tree);
* ``--turnover R``: each session ends after ``R`` ticks (staggered) and a new one takes its place:
  the target prefills its ``--prompt``-token prompt (timed as ``prefill``) and the drafter's first
  item carries the prompt's rows (more than a step holds: the eager append). ``R`` = 0: none. At
  128 tokens and the shipped pair's tau of 3.5, a request lives about 37 ticks.

Models: a llama of SmolLM2-135M's shapes (vocabulary 626, random weights) and a random drafter of
the shipped shape (3 layers, block 16, 5 target layers): it accepts almost nothing, so each tick
commits one row per session; the trees are full-size, so the per-item work is the services'.

Per tick, milliseconds, median [min, max] over the ticks after ``--warm`` of warm-up: ``wall`` of
the call, ``device`` (:func:`runtime.device_time.device_seconds`: CUDA events around the replayed
steps) and ``host / item`` = (wall - device) / sessions in microseconds. Eager work (the drafter's
appends of prompt rows) counts as host here, as it does in the services' ``compute_s - device_s``.
Then one more pass of each configuration under ``cProfile`` (per engine), its top 30
functions by own time and by cumulative time in ``DIR/profile-N-R.txt``: profiled times are inflated, compare them only
with each other. Writes ``DIR/engine-host.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path[:0] = [".", "proto"]

TREE, TOPK = 15, 4


def _paths(tmp: str) -> tuple[str, str]:
    """The SmolLM2-shaped llama and the random drafter of ``tools/gpu_contention.py`` (the same
    files), written into ``tmp``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_contention", os.path.join(os.path.dirname(__file__), "gpu_contention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._paths(tmp)


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


class Probe:
    """Both engines in this process and ``n`` sessions decoding in lockstep (module docstring)."""

    def __init__(self, target_path: str, drafter_path: str, n: int, prompt: int, seed: int = 0, device: str = "cuda"):
        import torch

        from draft_service.batched import BatchedDrafter
        from draft_service.gguf_io import load_drafter, read_drafter_config
        from target_service.__main__ import build_engine
        from target_service.config import TargetConfig

        self.torch = torch
        taps = list(read_drafter_config(drafter_path).target_layer_ids)
        self.taps = taps
        self.target, _ = build_engine(target_path, TargetConfig(device=device, engine="batched", max_sessions=n + 1, max_context=2048,
                                                                 feature_layers=tuple(taps), gpu_memory_fraction=0.3))
        self.ring = self.target.feature_ring()
        if self.ring is None:
            raise RuntimeError("the target made no feature ring")
        d = load_drafter(drafter_path, target_path, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        self.drafter = BatchedDrafter(d, max_sessions=n + 1, max_context=2048)
        self.drafter.capture()
        self.n, self.prompt_len = n, prompt
        self.gen = torch.Generator().manual_seed(seed)
        self.serial = 0
        self.live: dict[str, dict] = {}   # sid -> {root, length (target), held (drafter), age, life}

    def set_appends(self, variant: str) -> None:
        """``graphs``: the drafter's captured appends; ``eager``: its uncaptured reference path
        (the appends' kernels compiled first, as :meth:`BatchedDrafter.capture` does without
        graphs)."""
        if variant not in ("graphs", "eager"):
            raise ValueError(f"unknown appends variant {variant!r}")
        if not hasattr(self, "_appends"):
            self._appends = self.drafter.appends
        if variant == "eager" and self.drafter.appends is not None:
            self.drafter.appends = None
            self.drafter._warm_appends()
        elif variant == "graphs":
            self.drafter.appends = self._appends

    # ---------------------------------------------------------------- sessions
    def open(self, life: int) -> float:
        """A new session: the target prefills its prompt; returns the prefill's wall ms."""
        from runtime.sampling import Sampling

        sid = f"s{self.serial}"
        self.serial += 1
        prompt = self.torch.randint(1, 600, (self.prompt_len,), generator=self.gen).tolist()
        t0 = time.perf_counter()
        job = self.target.start_prefill(sid, prompt, Sampling(), self.taps, ring=True)
        while job.outcome is None:
            self.target.run_prefill(job, self.target.prefill_chunk)
        ms = (time.perf_counter() - t0) * 1e3
        s = self.target.sessions[sid]
        if not s.ring:
            raise RuntimeError("the prompt's rows did not go to the ring (prompt longer than a ring slot?)")
        self.live[sid] = {"root": job.outcome.first_token, "length": len(prompt), "held": 0, "age": 0,
                          "life": life, "slot": s.slot}
        return ms

    def close(self, sid: str) -> None:
        self.target.release([sid])
        self.drafter.release([sid])
        del self.live[sid]

    # ---------------------------------------------------------------- one tick
    def propose(self):
        from draft_service.batched import DraftItem

        items = []
        for sid, st in self.live.items():
            n = st["length"] - st["held"]
            items.append(DraftItem(sid, None, st["root"], st["length"], TREE, TOPK, 15,
                                   ring=(self.ring, st["slot"], n)))
        outs = self.drafter.propose_batch(items)
        trees = []
        for (sid, st), out in zip(self.live.items(), outs):
            if isinstance(out, BaseException):
                raise out
            st["held"] = st["length"]
            trees.append((sid, list(out.tokens), list(out.parents)))
        return trees

    def verify(self, trees) -> None:
        outs = self.target.verify_batch(trees)
        for (sid, _, _), out in zip(trees, outs):
            if isinstance(out, BaseException):
                raise out
            st = self.live[sid]
            st["root"], st["length"] = out.bonus_token, out.committed_length
            st["age"] += 1


def run_config(p: Probe, turnover: int, ticks: int, warm: int, profile: bool) -> dict:
    """``ticks`` lockstep ticks of ``p``'s sessions with ``turnover`` (0: none); per-tick times."""
    from runtime.device_time import device_seconds

    for sid in list(p.live):
        p.close(sid)
    prefill_ms = [p.open(((i * turnover) // p.n) + 1 if turnover else 0) for i in range(p.n)]
    rec = {k: [] for k in ("propose_wall", "propose_device", "verify_wall", "verify_device", "prefill_wall",
                           "new_sessions", "eager_rows")}
    profs = {"propose": cProfile.Profile(), "verify": cProfile.Profile()} if profile else None
    sync = p.torch.cuda.synchronize if p.torch.cuda.is_available() else (lambda: None)
    for t in range(warm + ticks):
        pre, new = 0.0, 0
        # a session's turn is over, or its context nearly full: a new one takes its place
        for sid in [s for s, st in p.live.items() if (turnover and st["age"] >= st["life"]) or st["length"] > 1800]:
            p.close(sid)
            pre += p.open(turnover)
            new += 1
        rows0 = p.drafter.eager_rows
        sync()
        d0, t0 = device_seconds(), time.perf_counter()
        if profs:
            profs["propose"].enable()
        trees = p.propose()
        if profs:
            profs["propose"].disable()
        t1, d1 = time.perf_counter(), device_seconds()
        if profs:
            profs["verify"].enable()
        p.verify(trees)
        if profs:
            profs["verify"].disable()
        t2, d2 = time.perf_counter(), device_seconds()
        if t >= warm:
            rec["propose_wall"].append((t1 - t0) * 1e3)
            rec["propose_device"].append((d1 - d0) * 1e3)
            rec["verify_wall"].append((t2 - t1) * 1e3)
            rec["verify_device"].append((d2 - d1) * 1e3)
            rec["prefill_wall"].append(pre)
            rec["new_sessions"].append(new)
            rec["eager_rows"].append(p.drafter.eager_rows - rows0)
    out = {"sessions": p.n, "turnover": turnover, "ticks": ticks, "first_prefill_ms": _stats(prefill_ms)}
    for k in ("propose", "verify"):
        w, d = rec[f"{k}_wall"], rec[f"{k}_device"]
        out[k] = {"wall_ms": _stats(w), "device_ms": _stats(d),
                  "host_us_per_item": _stats([(a - b) * 1e3 / p.n for a, b in zip(w, d)])}
    out["prefill_ms_per_tick"] = sum(rec["prefill_wall"]) / ticks
    out["new_sessions_per_tick"] = sum(rec["new_sessions"]) / ticks
    out["eager_rows_per_tick"] = sum(rec["eager_rows"]) / ticks
    if profs:
        out["profiles"] = {}
        for k, pr in profs.items():
            s = io.StringIO()
            for order in ("tottime", "cumulative"):
                pstats.Stats(pr, stream=s).sort_stats(order).print_stats(30)
            out["profiles"][k] = s.getvalue()
    return out


def _fmt(s: dict) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"


def _row(n: int, r: int, res: dict) -> None:
    pr, vr = res["propose"], res["verify"]
    print(f"{n:8d} {r:8d} {res['appends']:>7s} | {pr['wall_ms']['median']:.3f} / {pr['device_ms']['median']:.3f}, "
          f"{_fmt(pr['host_us_per_item'])} | {vr['wall_ms']['median']:.3f} / {vr['device_ms']['median']:.3f}, "
          f"{_fmt(vr['host_us_per_item'])} | {res['prefill_ms_per_tick']:.3f}, "
          f"{res['new_sessions_per_tick']:.2f}, {res['eager_rows_per_tick']:.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="8,64", help="comma-separated session counts")
    ap.add_argument("--turnover", default="0,37", help="comma-separated ticks a session lives (0: forever)")
    ap.add_argument("--ticks", type=int, default=120)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=130, help="prompt tokens of each session")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile passes")
    ap.add_argument("--appends", default="graphs",
                    help="comma-separated variants of the drafter's eager appends, alternated --reps times in "
                         "one process: graphs (the captured appends, the default) and/or eager (the "
                         "uncaptured reference path: BatchedDrafter.appends set to None)")
    ap.add_argument("--reps", type=int, default=1, help="rounds of the --appends variants")
    ap.add_argument("--profile-only", action="store_true", help="only the cProfile passes (no timed table)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda", help="cuda (the point), or cpu for a smoke run (no device times)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    target_path, drafter_path = _paths(tempfile.mkdtemp(prefix="engine-host-"))
    results = []
    print("sessions turnover appends | propose wall / device ms, host us/item | verify wall / device ms, host us/item "
          "| prefill ms/tick, new/tick, eager rows/tick", flush=True)
    for n in [int(x) for x in a.sessions.split(",")]:
        p = Probe(target_path, drafter_path, n, a.prompt, device=a.device)
        for r in [int(x) for x in a.turnover.split(",")]:
            for rep in range(0 if a.profile_only else a.reps):
                for variant in a.appends.split(","):
                    p.set_appends(variant)
                    res = run_config(p, r, a.ticks, a.warm, profile=False)
                    res.update(appends=variant, rep=rep + 1)
                    results.append(res)
                    _row(n, r, res)
            p.set_appends("graphs")
            if a.profile_only or not a.no_profile:
                prof = run_config(p, r, max(20, a.ticks // 3), 5, profile=True)
                with open(os.path.join(a.out, f"profile-{n}-{r}.txt"), "w") as f:
                    for k, text in prof["profiles"].items():
                        f.write(f"## {k}_batch, {n} sessions, turnover {r} (cProfile)\n\n{text}\n")
        for sid in list(p.live):
            p.close(sid)
        del p
    with open(os.path.join(a.out, "engine-host.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
