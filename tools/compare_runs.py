"""Before / after tables of two GPU benchmark runs (the ``*.json`` of
``python -m bench.gpu engine``): decode, verify cost relative to an AR step,
prefill, and the kernel profile of each profiled step by family.

    python tools/compare_runs.py --before benchmarks/gpu/issue9 --after benchmarks/gpu \\
        --out benchmarks/gpu/PROFILE.md

Only figures present in both runs are compared; the device of each run is printed from its
``env.json``.
"""

from __future__ import annotations

import argparse
import json
import os


def _engines(d: str) -> dict[str, dict]:
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".json") and f not in ("e2e.json", "env.json"):
            r = json.load(open(os.path.join(d, f)))
            if "name" in r:
                out[r["name"]] = r
    return out


def _env(d: str) -> str:
    p = os.path.join(d, "env.json")
    return json.load(open(p)).get("device", "?") if os.path.exists(p) else "?"


def _med(r: dict, *keys, field: str = "median") -> float | None:
    for k in keys:
        if not isinstance(r, dict):
            return None
        r = r.get(k, r.get(str(k)) if not isinstance(k, str) else None)
        if r is None:
            return None
    return r.get(field) if isinstance(r, dict) else r


def _fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _vw(r: dict, w: int, shape: str) -> float | None:
    return _med(r, "verify_width", str(w), shape, "device_ms")


def compare(before: str, after: str) -> str:
    """Markdown of the before/after tables (see the module docstring)."""
    b_runs, a_runs = _engines(before), _engines(after)
    names = [n for n in a_runs if n in b_runs]
    L = [f"Before: `{before}` ({_env(before)}); after: `{after}` ({_env(after)}).", ""]
    L += ["## Decode, verify and prefill", "",
          "| model | run | AR tok/s | AR step ms | chain W16 / AR | tree W16 / AR | tree W64 / AR | prefill-512 tok/s |",
          "|---|---|---|---|---|---|---|---|"]
    for n in names:
        for tag, r in (("before", b_runs[n]), ("after", a_runs[n])):
            ar = _med(r, "ar_step_device_ms")
            cells = []
            for w, shape in ((16, "chain"), (16, "tree"), (64, "tree")):
                v = _vw(r, w, shape)
                cells.append(f"{v / ar:.2f}x ({v:.3f} ms)" if v and ar else "-")
            L.append(f"| {n} | {tag} | {_fmt(_med(r, 'ar_tok_s'), 0)} | {_fmt(ar)} | " + " | ".join(cells)
                     + f" | {_fmt(_med(r, 'prefill512_tok_s'), 0)} |")
    L += ["", "## Kernel profile (one eager step under the PyTorch profiler)", "",
          "| model | step | kernels before -> after | device us before -> after | largest families after (count x, us) | changed families (us before -> after) |",
          "|---|---|---|---|---|---|"]
    for n in names:
        pa, pb = a_runs[n].get("profile", {}), b_runs[n].get("profile", {})
        for step, fa in pa.items():
            if "families" not in fa:
                continue
            fb = pb.get(step, {})
            famb = fb.get("families", {})
            top = ", ".join(f"{k} {v['count']}x {v['us']:.0f}" for k, v in list(fa["families"].items())[:5])
            keys = set(famb) | set(fa["families"])
            deltas = sorted(keys, key=lambda k: -abs(fa["families"].get(k, {}).get("us", 0) - famb.get(k, {}).get("us", 0)))
            changed = ", ".join(f"{k} {famb.get(k, {}).get('us', 0):.0f} -> {fa['families'].get(k, {}).get('us', 0):.0f}"
                                for k in deltas[:4]) if famb else "-"
            kb = fb.get("kernels")
            ub = fb.get("device_us")
            L.append(f"| {n} | {step} | {kb if kb is not None else '-'} -> {fa['kernels']} | "
                     f"{_fmt(ub, 0)} -> {fa['device_us']:.0f} | {top} | {changed} |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--out")
    args = p.parse_args(argv)
    text = compare(args.before, args.after)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
