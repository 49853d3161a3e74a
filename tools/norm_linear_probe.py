"""The fused add-norm-projection (``kernels.linear.norm_linear``) on a GPU: rows' bits across the
number of rows, and its time against the two launches it replaces.

    python tools/norm_linear_probe.py [--shapes smollm2|9b|all] [--json FILE]

For each projection shape that follows a norm in a llama layer (qkv, and gate-up with SwiGLU) and
for bfloat16 and float32:

* **bits**: with and without a residual ``delta``, every row of a 1- to 64-row call and of a wide
  (batch-invariant) call of 65-256 rows against the same row's 1-row call (the property a
  speculative verify relies on: ``kernels/linear/triton.py``'s module docstring); prints the rows
  that differ (none expected);
* **time** (bfloat16): the fused launch against ``kernels.norm.add_rms_norm`` then
  ``kernels.linear.linear`` / ``linear_swiglu``, each as a CUDA graph of 30 calls replayed 20
  times after warm-up, CUDA events; microseconds per call, median of 5 replays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))

import torch  # noqa: E402

SHAPES = {
    "smollm2": [("qkv", 960, 576, False), ("gate_up", 3072, 576, True)],
    "9b": [("qkv", 10240, 4096, False), ("gate_up", 24576, 4096, True)],
}


def bits(n: int, k: int, swiglu: bool, dtype: torch.dtype, delta: bool) -> dict:
    """Rows of many-row calls against 1-row calls: the count of rows compared and those differing."""
    from kernels.linear import triton as T

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(dtype)
    x = (torch.randn(256, k, device="cuda", generator=gen) * 3).to(dtype)
    d = (torch.randn(256, k, device="cuda", generator=gen)).to(dtype) if delta else None
    g = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dtype)
    one = [T.norm_linear(x[i:i + 1], None if d is None else d[i:i + 1], g, 1e-5, w, swiglu=swiglu)[1][0]
           for i in range(256)]
    bad, compared = [], 0
    for m in (2, 16, 17, 37, 48, 64, 65, 128, 256):
        s, y = T.norm_linear(x[:m], None if d is None else d[:m], g, 1e-5, w, swiglu=swiglu, wide=m > 64)
        for i in range(m):
            compared += 1
            if not torch.equal(y[i], one[i]):
                bad.append((m, i, float((y[i].float() - one[i].float()).abs().max())))
    return {"compared": compared, "differ": len(bad), "first": bad[:5]}


def timed(fn, reps: int = 5) -> float:
    """Microseconds per call of ``fn`` (30 calls captured in one graph, replayed 20 times)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(30):
            fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        a.record()
        for _ in range(20):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / 600)
    return statistics.median(out)


def times(n: int, k: int, swiglu: bool, m: int) -> dict:
    from kernels.linear import linear, linear_swiglu, norm_linear
    from kernels.norm import add_rms_norm

    dt = torch.bfloat16
    w = (torch.randn(n, k, device="cuda") * 0.05).to(dt)
    x, d = torch.randn(m, k, device="cuda").to(dt), torch.randn(m, k, device="cuda").to(dt)
    g = torch.ones(k, device="cuda", dtype=dt)
    proj = linear_swiglu if swiglu else linear

    def fused():
        norm_linear(x, d, g, 1e-5, w, swiglu=swiglu)

    def pair():
        _, h = add_rms_norm(x, d, g, 1e-5)
        proj(h, w)

    return {"fused_us": round(timed(fused), 2), "pair_us": round(timed(pair), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2", choices=[*SHAPES, "all"])
    ap.add_argument("--json")
    a = ap.parse_args()
    names = list(SHAPES) if a.shapes == "all" else [a.shapes]
    rows = []
    for name in names:
        for proj, n, k, swiglu in SHAPES[name]:
            for dtype in (torch.bfloat16, torch.float32):
                for delta in (False, True):
                    r = {"model": name, "proj": proj, "N": n, "K": k, "dtype": str(dtype).replace("torch.", ""),
                         "delta": delta, **bits(n, k, swiglu, dtype, delta)}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            for m in (1, 16, 64):
                r = {"model": name, "proj": proj, "N": n, "K": k, "rows": m, **times(n, k, swiglu, m)}
                rows.append(r)
                print(json.dumps(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0 if all(r.get("differ", 0) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
