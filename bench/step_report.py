"""The step report of issue 18 (``tools/gpu_run.sh step`` writes its inputs, then runs this):

    python -m bench.step_report --dir DIR --out DIR/STEP.md [--command "..."]

Reads, from one run's directory:

* ``e2e-<label>*.json``: ``dflash-grpc bench`` results (one stream; the label names the layout,
  e.g. ``3proc`` or ``colocated``; ``-1``, ``-2`` suffixes are repeats of the same label);
* ``smollm2-135m-q4_1.json``: the engine benchmark of the same file (``python -m bench.gpu
  engine``): device time of one AR step, of a 16-wide verify, of the drafter's step;
* ``llamacpp.jsonl``: ``llama-bench`` on the same file (its tg128 tok/s);
* ``concurrency-<label>.json``: ``dflash-grpc bench --concurrency`` results.

Writes one markdown page: the end-to-end table (tok/s per configuration and layout, the spread
over repeats, ratios to llama.cpp and to the same layout's AR, tau) with each step's breakdown in
milliseconds (draft device, draft-service host work, verify device, target host work, gRPC and
queue, orchestrator, GPU idle), and the concurrency table (aggregate tok/s, speculative over AR). Device
times come from the engine benchmark (batch 1), host times are the services' step times
(``compute_s``) minus them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def llamacpp_tg(path: str) -> float | None:
    """Mean tg128 tok/s of the first generation row of ``llamacpp.jsonl`` (None: missing)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                row = json.loads(line)
                if row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
                    return float(row["avg_ts"])
    return None


def _device_ms(engine: dict | None, config: str) -> tuple[float | None, float | None]:
    """``(draft device ms, verify device ms)`` of a configuration from the engine benchmark."""
    if not engine:
        return None, None
    if config == "ar":
        return 0.0, engine["ar_step_device_ms"]["median"]
    dp = (engine.get("draft_propose") or {}).get("configs", {}).get(config, {})
    draft = (dp.get("device_ms") or {}).get("median")
    nodes = dp.get("nodes") or 16
    # the width bucket the tree pads to (keys are ints, or strings once through JSON)
    fits = [(int(w), e) for w, e in engine["verify_width"].items() if int(w) >= nodes]
    if not fits:
        return draft, None
    entry = min(fits, key=lambda we: we[0])[1]
    shape = "chain" if config == "chain" else "tree"
    return draft, (entry.get(shape) or entry.get("chain"))["device_ms"]["median"]


def e2e_table(runs: dict[str, list[dict]], engine: dict | None, llama: float | None) -> list[str]:
    """Markdown lines of the end-to-end table (``runs``: label -> repeats of bench results)."""
    L = ["| layout | config | tau | tok/s (median [min, max], n) | / llama.cpp | / own AR | step ms | draft device | "
         "draft host | verify device | verify host | gRPC + queue | orchestrator | GPU idle | lossless |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, reps in runs.items():
        configs = list(reps[0]["configs"])
        ar = statistics.median(r["configs"]["ar"]["tokens_per_second"] for r in reps) if "ar" in configs else None
        for cfg in configs:
            rows = [r["configs"][cfg] for r in reps if cfg in r["configs"]]
            tps = [r["tokens_per_second"] for r in rows]
            med = statistics.median(tps)
            st = {k: statistics.median(r["step_ms"][k] for r in rows) for k in rows[0]["step_ms"]}
            dd, vd = _device_ms(engine, cfg)
            if st.get("verify_device"):   # measured in the services during this very run (CUDA events)
                dd, vd = st["draft_device"], st["verify_device"]
            fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            L.append(
                f"| {label} | {cfg} | {statistics.median(r['tau'] for r in rows):.2f} | "
                f"{med:.0f} [{min(tps):.0f}, {max(tps):.0f}], {len(tps)} | "
                f"{fmt(med / llama if llama else None)}x | {fmt(med / ar if ar else None)}x | {st['total']:.2f} | "
                f"{fmt(dd)} | {fmt(None if dd is None else st['draft_compute'] - dd)} | {fmt(vd)} | "
                f"{fmt(None if vd is None else st['verify_compute'] - vd)} | {st['grpc_and_queue']:.2f} | "
                f"{st['orchestrator']:.2f} | {fmt(None if dd is None or vd is None else st['total'] - dd - vd)} | "
                f"{'yes' if all(r.get('lossless') for r in rows) else 'NO'} |")
    return L


def concurrency_table(runs: dict[str, dict]) -> list[str]:
    """Markdown lines of the concurrency table (``runs``: label -> bench result with ``concurrency``)."""
    L = ["| layout | streams | AR tok/s | speculative tok/s | spec / AR | errors |", "|---|---|---|---|---|---|"]
    for label, res in runs.items():
        c = res["concurrency"]
        modes = c["modes"]
        names = list(modes)
        ar_name = "ar" if "ar" in modes else names[0]
        spec_name = next((n for n in names if n != ar_name), None)
        by = {n: {row["concurrency"]: row for row in modes[n]} for n in names}
        for lvl in c["levels"]:
            a = by[ar_name].get(lvl, {}).get("aggregate_tokens_per_second")
            s = by[spec_name].get(lvl, {}).get("aggregate_tokens_per_second") if spec_name else None
            errs = sum(by[n].get(lvl, {}).get("errors", 0) for n in names)
            L.append(f"| {label} | {lvl} | {a:.0f} | {s:.0f} | {s / a:.2f}x | {errs} |" if a and s else
                     f"| {label} | {lvl} | {a or 0:.0f} | {s or 0:.0f} | - | {errs} |")
    return L


def report(d: str, command: str = "") -> str:
    """The markdown page of directory ``d`` (module docstring)."""
    runs: dict[str, list[dict]] = {}
    for p in sorted(glob.glob(os.path.join(d, "e2e-*.json"))):
        label = re.sub(r"-\d+$", "", os.path.basename(p)[4:-5])
        runs.setdefault(label, []).append(_load(p))
    eng_path = os.path.join(d, "smollm2-135m-q4_1.json")
    engine = _load(eng_path) if os.path.exists(eng_path) else None
    llama = llamacpp_tg(os.path.join(d, "llamacpp.jsonl"))
    conc = {os.path.basename(p)[12:-5]: _load(p) for p in sorted(glob.glob(os.path.join(d, "concurrency-*.json")))}
    L = ["# The speculative step end to end (issue 18)", ""]
    if command:
        L += [f"Command: `{command}`", ""]
    L += [f"llama.cpp on the same file, same run (`llama-bench -fa 1 -n 128`, tg128): "
          f"{'%.0f tok/s' % llama if llama else 'missing'}.", "",
          "Step parts in ms per step: draft / verify device = the services' own CUDA events around their "
          "steps during the run (the replies' `device_s`), or, for a run without them, the engine benchmark "
          "of the same file in the same run (batch 1, CUDA events around the replayed step); host = the "
          "service's step time (its "
          "`compute_s`) minus that; gRPC + queue = the exchange round trips minus the services' step times; "
          "orchestrator = the rest of the tick; GPU idle = the step less its draft and verify device time "
          "(everything the GPU waits on per step).", ""]
    if runs:
        L += e2e_table(runs, engine, llama) + [""]
    if conc:
        L += ["## Concurrency (aggregate tok/s)", ""] + concurrency_table(conc) + [""]
    return "\n".join(L)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--command", default="")
    a = p.parse_args(argv)
    text = report(a.dir, a.command)
    with open(a.out, "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
