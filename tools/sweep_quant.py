"""Micro-benchmark of the quantized Triton kernels (``kernels/quant/triton.py``) on a GPU: times
candidate launch configs of the skinny path at decode shapes and of the tiled path at a prefill
shape, beside baselines, and prints what a config table would hold (issue 19; nothing is changed
in the code: paste the winners into ``config_for`` / ``tiled_config_for`` by hand).

Usage (on the GPU machine, from the repository root; ``tools/gpu_quant.sh`` runs it with SWEEP=1)::

    python tools/sweep_quant.py --out sweep-quant.json                 # defaults below, ~3-5 min
    python tools/sweep_quant.py --types Q4_K --skinny-only --budget-s 120
    python tools/sweep_quant.py --smollm --out sweep-smollm.json       # SmolLM2-135M's shapes, ~2-4 min
    python tools/sweep_quant.py --dry-run                              # the candidates, no GPU
    python tools/sweep_quant.py --smoke                                # CPU self-test (interpreter)
    python tools/sweep_quant.py --smollm --smoke                       # the same with unroll / split-K candidates

What it measures (bfloat16 activations, the engine's dtype):

* **skinny** (decode, verify), ``--types`` (default Q4_K, Q8_0, Q6_K: a Q4_K_M file's types and
  Q8_0) x ``--shapes`` (default the 9B's: ``N x K`` = 4096 x 4096, 12288 x 4096 (per half of
  ``gate_up``), 4096 x 12288 (``down``), 8192 x 4096) x ``M`` in ``--rows`` (default 1, 16):
  every ``Config(BLOCK_N, num_warps, num_stages)`` of ``BLOCK_N`` {16, 32, 64, 128} x warps {2, 4,
  8} x stages {1, 2, 3} that leaves at least half a program per SM (``BLOCK_N`` 16 always), plus
  the current default; for the legacy types also the largest ``unroll`` (blocks of ``K`` per loop
  iteration) that fits.
* **--smollm**: SmolLM2-135M-Instruct Q4_1's decode shapes instead (skinny only, ``M`` 1 and 16):
  Q4_1 ``qkv`` 960 x 576, ``o`` 576 x 576, ``gate_up`` 3072 x 576, ``down`` 576 x 1536 and the Q8_0
  tied LM head 49152 x 576; candidates ``BLOCK_N`` {16, 32, 64} x warps {2, 4} x stages {1, 2} x
  every ``split_k`` (programs over ``K``; only where ``N / BLOCK_N`` is under one program per SM)
  and ``unroll`` in {1, 2, 3, 4, 6, 8} that divide ``K``'s blocks (``BLOCK_N * 32 * unroll`` <=
  8192). At these sizes a call is latency-bound
  (``kernels/quant/triton.py``, "Small shapes"), so each graph holds as many calls as weight
  copies (2x L2), every call reading a cold copy, as in a step over the whole model.
  Per candidate: microseconds per call and GB/s of the weight's bytes (what a decode step reads).
  Baselines: the bf16 skinny kernel of ``kernels/linear`` on a bf16 weight of the same shape (the
  ``--weights bf16`` path) and a device-to-device copy of the quantized bytes (``copy GB/s``: read
  bytes per second, the bandwidth yardstick).
* **tiled** (prefill), the same types x ``--prefill-shapes`` (default 4096 x 4096, 12288 x 4096)
  at ``M`` = ``--prefill-rows`` (512): ``TiledConfig`` of ``BLOCK_M`` {64, 128} x ``BLOCK_N`` {64,
  128} x warps {4, 8} x stages {2, 3} (dequantize-then-dot, split), the factored arithmetic
  (``dequant=False``) on 128 x 128 tiles, the default, and ``split=False`` on the default (what
  bfloat16 without the second dot would gain, at ~1.6e-3 relative error). TFLOP/s
  (``2 M N K``). Baselines: cuBLAS on a bf16 weight, and ``reference.linear_dequantized`` (the weight
  dequantized per call, then cuBLAS: the path the tiled kernel replaced).

Method (as ``tools/sweep_linear.py``): every candidate kernel is first compiled into Triton's
on-disk cache on ``--jobs`` processes (``JITFunction.warmup``; compiling is single-threaded, ~1-3 s
a kernel, ~150 kernels for the defaults); then each timed unit is a CUDA graph of ``C``
back-to-back calls cycling through ``R`` copies of the weight spanning twice the L2 cache, so each
call reads its weight from HBM as in a real step; median over ``--reps`` replays of ``elapsed /
C``. All skinny timings come before the tiled ones; ``--budget-s`` stops timing new candidates
when spent (those left are listed). Each best config is checked against ``reference.linear``
(relative error, float32 output).

Output: per (type, shape, M) the candidates by time with the default marked, a summary of the best
per type against the default and the baselines, and ``--out`` JSON (every timing).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

SKINNY_BN = (16, 32, 64, 128)
SKINNY_WARPS = (2, 4, 8)
SKINNY_STAGES = (1, 2, 3)
TILED_BM = (64, 128)
TILED_BN = (64, 128)
TILED_WARPS = (4, 8)
TILED_STAGES = (2, 3)
#: byte offsets of each type's float16 fields in a block (d, m, dmin): set to finite values
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
SMS_H100 = 132
L2_BYTES = 50 * 2**20
#: split_k and unroll values tried (those dividing the weight's blocks of K)
SPLITS = (1, 2, 3, 4, 6, 8)
UNROLLS = (1, 2, 3, 4, 6, 8)
#: SmolLM2-135M-Instruct Q4_1's skinny cases (type, N, K): qkv, o, gate_up, down; the Q8_0 tied LM head
SMOLLM_CASES = [("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)]


def parse_shapes(s: str) -> list[tuple[int, int]]:
    """``"4096x4096,12288x4096"`` -> ``[(4096, 4096), (12288, 4096)]`` (``N x K``)."""
    out = []
    for part in s.split(","):
        n, k = part.lower().split("x")
        out.append((int(n), int(k)))
    return out


def random_weight(name: str, n: int, k: int, device, seed: int = 0):
    """A :class:`kernels.quant.QuantizedWeight` of random blocks whose float16 fields are finite
    (``N(0, 0.02)``), made on ``device``."""
    from kernels.quant import QuantizedWeight, block_geometry

    qk, bs = block_geometry(name)
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // qk, bs), generator=g, device=device, dtype=torch.uint8)
    for off in F16_FIELDS[name]:
        f = (torch.randn(n, k // qk, generator=g, device=device) * 0.02).half()
        raw[:, :, off:off + 2] = f.view(torch.uint8).reshape(n, k // qk, 2)
    return QuantizedWeight(raw.reshape(n, -1).contiguous(), name, (n, k))


def engine_weight(name: str, n: int, k: int, device, seed: int = 0):
    """:func:`random_weight` in the block stride the loader gives the type
    (``kernels.quant.weight.stride_for``: Q6_K padded unless ``DFLASH_QUANT_Q6K_STRIDE=210``), so
    that timings are of the layout the engine runs."""
    from kernels.quant.weight import stride_for

    return random_weight(name, n, k, device, seed=seed).with_stride(stride_for(name))


def probe_launches(n: int, k: int, block_ns, warps, targets) -> dict:
    """``{"bn{BLOCK_N}-w{warps}-s{split}": (BLOCK_N, warps, split)}``: a probe kernel's launch grid
    over a k-quant weight ``[N, K]`` (``tools/quant_gemv_probe.py``, ``tools/quant_sb_probe.py``):
    each ``BLOCK_N`` and warp count, with ``K`` split (powers of two, 256-element super-blocks) until
    the launch has at least each of ``targets`` programs."""
    out = {}
    for bn in block_ns:
        for w in warps:
            for target in targets:
                split = 1
                while (n // bn) * split < target and k % (256 * split * 2) == 0:
                    split *= 2
                out[f"bn{bn}-w{w}-s{split}"] = (bn, w, split)
    return out


def probe_args(doc: str):
    """The command line of a kernel probe (``tools/quant_gemv_probe.py``, ``tools/quant_sb_probe.py``):
    ``--out FILE.json`` and ``--smoke`` (a CPU check under the Triton interpreter)."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU check of the kernel against the reference (interpreter)")
    return p.parse_args()


def copy_us(ws: list, timer: "Timer", calls: int) -> float:
    """Microseconds to copy one of the weights ``ws`` (cycling through them, as the kernels read
    them): the bandwidth floor of a call."""
    src = [w.data for w in ws]
    dst = torch.empty_like(src[0])
    return timer(lambda i: dst.copy_(src[i % len(src)]), calls)


def time_launches(timer: "Timer", calls: int, launches: dict, run, what: str = "") -> dict:
    """``{label: microseconds}`` of ``run(i, *launch)`` for each ``label -> launch`` of ``launches``;
    a launch the compiler refuses is printed (``# what label: error``) and left out."""
    got = {}
    for label, launch in launches.items():
        try:
            got[label] = timer(lambda i: run(i, *launch), calls)
        except Exception as e:  # noqa: BLE001 - a config the compiler refuses: noted
            print(f"# {what} {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    return got


def probe_smoke(probe, x: torch.Tensor, launches, tol: float) -> None:
    """A kernel probe's CPU self-test (``--smoke``, under the Triton interpreter): ``probe(x, w,
    BLOCK_N, warps, split_k, float32)`` on a random ``[40, 512]`` Q4_K weight against
    ``kernels.quant.reference.linear`` for each ``(BLOCK_N, warps, split_k)`` of ``launches``,
    relative error below ``tol`` (AssertionError otherwise)."""
    from kernels.quant import reference as R

    os.environ.setdefault("TRITON_INTERPRET", "1")
    w = random_weight("Q4_K", 40, 512, torch.device("cpu"))
    for bn, nw, split in launches:
        err = rel(probe(x, w, bn, nw, split, torch.float32), R.linear(x.float(), w, torch.float32))
        print(f"smoke bn{bn} split{split}: rel err {err:.1e}")
        assert err < tol, err


def write_rows(path: str | None, rows) -> None:
    """``rows`` as indented JSON into ``path`` (a tool's ``--out``; None: nothing)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def cold_weights(name: str, n: int, k: int, device) -> tuple:
    """``(w0, copies, calls)`` for timing one ``[n, k]`` ``name`` weight from HBM: ``w0`` (seed 0),
    enough seeded copies to span twice the L2 cache (at least 2) for a graph of calls to cycle
    through, and the calls per graph (at least 20, at least one per copy). Each in the block stride
    the loader gives the type (``kernels.quant.weight.stride_for``: Q6_K padded unless
    ``DFLASH_QUANT_Q6K_STRIDE=210``)."""
    w0 = engine_weight(name, n, k, device)
    copies = [engine_weight(name, n, k, device, seed=i) for i in range(max(2, -(-2 * L2_BYTES // w0.nbytes)))]
    return w0, copies, max(20, len(copies))


def skinny_candidates(n: int, sms: int, k: int | None = None, qtype: str = "Q4_K", small: bool = False) -> list:
    """Skinny configs for an ``[N, K]`` weight of ``qtype`` (module docstring): ``BLOCK_N`` x warps x
    stages leaving >= ``sms / 2`` programs at ``M = 1`` (``BLOCK_N`` 16 always), times ``unroll``
    for the legacy types (1 and the largest that fits; ``small``: every one) and, ``small`` only,
    ``split_k`` where ``N / BLOCK_N`` < ``sms``, both dividing ``K``'s blocks (``small`` has a
    smaller ``BLOCK_N`` x warps x stages grid). ``k`` None: ``unroll`` and ``split_k`` 1 only.
    :func:`sweep` adds the default."""
    from kernels.quant.triton import MAX_UNROLLED, Config
    from kernels.quant.weight import block_geometry

    qk = block_geometry(qtype)[0]
    nb = k // qk if k else 1
    bns, warps, stages = ((16, 32, 64), (2, 4), (1, 2)) if small else (SKINNY_BN, SKINNY_WARPS, SKINNY_STAGES)
    out = []
    for bn in bns:
        progs = -(-n // bn)
        for sk in (s for s in SPLITS if nb % s == 0 and (s == 1 or (small and progs < sms))):
            if not (bn == 16 and sk == 1) and progs * sk < sms // 2:
                continue
            fit = [u for u in UNROLLS if (nb // sk) % u == 0 and bn * 32 * u <= 2 * MAX_UNROLLED] if qk == 32 else [1]
            unrolls = fit if small else sorted({1, max(fit)})
            out += [Config(bn, w, st, u, sk) for u in unrolls for w in warps for st in stages]
    return out


def tiled_candidates(smoke: bool = False) -> list:
    """Tiled configs (the grid of the module docstring; ``smoke``: two small ones)."""
    from kernels.quant.triton import TiledConfig

    if smoke:
        return [TiledConfig(64, 32, 4, 2), TiledConfig(64, 32, 4, 2, dequant=False)]
    return [TiledConfig(bm, bn, w, s) for bm in TILED_BM for bn in TILED_BN for w in TILED_WARPS
            for s in TILED_STAGES] + [TiledConfig(128, 128, 8, s, dequant=False) for s in TILED_STAGES]


def _warm_worker(items: list[tuple]) -> int:
    """Compile kernels into Triton's on-disk cache (a process of the pool); returns how many failed."""
    from kernels import pdl
    from kernels.quant import triton as T
    from kernels.quant.weight import block_geometry, stride_for

    failed = 0
    for kind, name, n, k, cfg in items:
        qk, bs = block_geometry(name)
        try:
            if kind == "skinny":
                bn, w, s, unroll, split_k = cfg
                const = T.kernel_constants(name, torch.bfloat16, T.BLOCK_M, bn, False, False, unroll, split_k,
                                           stride=stride_for(name))
            else:
                bm, bn, w, s, dq, split = cfg
                const = T.kernel_constants(name, torch.bfloat16, bm, bn, dq, True if split is None else split,
                                           stride=stride_for(name))
            T._qlinear_kernel.warmup(torch.bfloat16, torch.uint8, torch.bfloat16, 1, n, k, k, k // qk * bs, n,
                                     **const, num_warps=w, num_stages=s, grid=(1,), **pdl.options(torch.device("cuda")))
        except Exception:  # noqa: BLE001 - the timed run reports it
            failed += 1
    return failed


def precompile(items: list[tuple], jobs: int) -> None:
    """Fill Triton's cache in parallel (module docstring). Failures are left to the timed run."""
    if jobs <= 1 or not items:
        return
    import concurrent.futures
    import multiprocessing

    t0 = time.time()
    chunks = [items[i::jobs * 2] for i in range(jobs * 2)]
    try:
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            failed = sum(ex.map(_warm_worker, [c for c in chunks if c]))
        print(f"[sweep-quant] precompiled {len(items)} kernels on {jobs} processes in {time.time() - t0:.1f} s "
              f"({failed} failed)", flush=True)
    except Exception as exc:  # noqa: BLE001 - compile lazily instead
        print(f"[sweep-quant] parallel precompile failed ({exc!r}); compiling lazily", file=sys.stderr)


class Timer:
    """Microseconds per call of ``fn(i)`` (``i`` picks the weight copy): a CUDA graph of ``calls``
    back-to-back calls, median over ``reps`` replays; on the CPU a plain loop (``--smoke``)."""

    def __init__(self, device, calls: int, reps: int, warmup: int = 3):
        self.device, self.calls, self.reps, self.warmup = device, calls, reps, warmup

    def __call__(self, fn, calls: int | None = None) -> float:
        """``calls`` (default the timer's): calls per graph (``i`` = 0 .. calls - 1)."""
        calls = calls or self.calls
        fn(0)                                   # compile, allocate
        if self.device.type != "cuda":
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            return (time.perf_counter() - t) / calls * 1e6
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(2):
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        for _ in range(self.warmup):
            graph.replay()
        times = []
        for _ in range(self.reps):
            torch.cuda._sleep(200_000)          # keep launch latency out of the events
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / calls)
        del graph
        return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@dataclasses.dataclass
class Budget:
    seconds: float
    start: float = dataclasses.field(default_factory=time.perf_counter)
    skipped: list = dataclasses.field(default_factory=list)

    def spent(self) -> bool:
        return time.perf_counter() - self.start > self.seconds


def sweep(args) -> dict:
    """Run the sweep described in the module docstring; returns the JSON-able result."""
    import torch.nn.functional as F

    from kernels.linear import triton as LT
    from kernels.quant import reference as R
    from kernels.quant import triton as T
    from kernels.quant.weight import stride_for

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device.type == "cuda" else 2
    budget = Budget(args.budget_s)
    res: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)",
                 "skinny": [], "tiled": [], "skipped": budget.skipped}
    print(f"[sweep-quant] {res['device']}, {sms} SMs; types {args.types}; budget {args.budget_s:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(1)

    def copies(name, n, k, r):
        return [engine_weight(name, n, k, device, seed=i) for i in range(r)]

    def n_copies(nbytes: int) -> int:
        return 1 if device.type != "cuda" else max(2, math.ceil(2 * L2_BYTES / max(nbytes, 1)))

    timer = Timer(device, args.calls, args.reps)
    cases = [] if args.tiled_only else skinny_cases(args)
    if device.type == "cuda":
        items = []
        for name, n, k in cases:
            items += [("skinny", name, n, k, dataclasses.astuple(c))
                      for c in skinny_candidates(n, sms, k, name, args.smollm) + [T.config_for(n, k, name, stride_for(name))]]
        for name in args.types:
            for n, k in ([] if args.skinny_only else args.prefill_shapes):
                d = T.tiled_config_for(n, k, name)
                items += [("tiled", name, n, k, dataclasses.astuple(c))
                          for c in tiled_candidates() + [d, dataclasses.replace(d, split=False)]]
        precompile(sorted(set(items), key=repr), args.jobs)
    # ---------------------------------------------------------------------- skinny (decode, verify)
    for name, n, k in cases:
        w0 = engine_weight(name, n, k, device)
        ws = copies(name, n, k, n_copies(w0.nbytes))
        wb = [torch.randn(n, k, generator=gen).to(device, torch.bfloat16) for _ in range(n_copies(n * k * 2))]
        src = [w.data for w in ws]
        dst = torch.empty_like(src[0])
        calls = max(args.calls, len(ws)) if args.smollm else args.calls   # every call on a cold copy
        copy_us = timer(lambda i: dst.copy_(src[i % len(src)]), calls)
        default = T.config_for(n, k, name, w0.block_stride)
        if args.smoke:
            cands = [default, T.Config(32, 4, 2)] + [c for c in (T.Config(16, 4, 2, 2, 2),) if c.fits(k, name)]
        else:
            cands = skinny_candidates(n, sms, k, name, args.smollm)
        if default not in cands:
            cands.append(default)
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
            xb = x.to(torch.bfloat16)
            entry = {"type": name, "n": n, "k": k, "m": m, "weight_bytes": w0.nbytes,
                     "copy_us": copy_us, "copy_GBps": w0.nbytes / copy_us / 1e3, "configs": []}
            if device.type == "cuda":
                us = timer(lambda i: LT.linear(xb, wb[i % len(wb)]), calls)
                entry["bf16_skinny_us"] = us
            for cfg in cands:
                if budget.spent():
                    budget.skipped.append(f"skinny {name} {n}x{k} M={m} {cfg}")
                    continue
                try:
                    us = timer(lambda i: T.linear(x, ws[i % len(ws)], config=cfg), calls)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                    entry["configs"].append({"config": dataclasses.asdict(cfg), "error": repr(e)[:200]})
                    continue
                entry["configs"].append({"config": dataclasses.asdict(cfg), "us": us, "GBps": w0.nbytes / us / 1e3,
                                         "default": cfg == default})
            ok = [c for c in entry["configs"] if "us" in c]
            if ok:
                best = min(ok, key=lambda c: c["us"])
                y = T.linear(x, w0, torch.float32, config=T.Config(**best["config"]))
                entry["best_rel_err"] = rel(y, R.linear(x, w0, torch.float32))
                d = next((c for c in ok if c.get("default")), None)
                if d is not None and d["config"] != best["config"] and best["config"]["split_k"] == 1 \
                        and best["config"]["block_n"] == d["config"]["block_n"]:
                    # same BLOCK_N, no split: the same arithmetic, so the same bits as the default
                    entry["best_bits_equal_default"] = bool(torch.equal(y, T.linear(x, w0, torch.float32)))
            res["skinny"].append(entry)
            print_skinny(entry, args.top)
    # ---------------------------------------------------------------------- tiled (prefill)
    for name in args.types:
        for n, k in ([] if args.skinny_only else args.prefill_shapes):
            m = args.prefill_rows
            w0 = random_weight(name, n, k, device)
            ws = copies(name, n, k, n_copies(w0.nbytes))
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
            flop = 2 * m * n * k
            entry = {"type": name, "n": n, "k": k, "m": m, "weight_bytes": w0.nbytes, "configs": []}
            if device.type == "cuda":
                wb = torch.randn(n, k, generator=gen).to(device, torch.bfloat16)
                entry["cublas_bf16_us"] = timer(lambda i: F.linear(x, wb))
                entry["dequant_then_cublas_us"] = timer(lambda i: R.linear_dequantized(x, ws[i % len(ws)]))
            default = T.tiled_config_for(n, k, name)
            cands = tiled_candidates(args.smoke)
            extra = [default, dataclasses.replace(default, split=False)]
            for cfg in cands + [c for c in extra if c not in cands]:
                if budget.spent():
                    budget.skipped.append(f"tiled {name} {n}x{k} M={m} {cfg}")
                    continue
                try:
                    us = timer(lambda i: T.linear_tiled(x, ws[i % len(ws)], config=cfg))
                except Exception as e:  # noqa: BLE001
                    entry["configs"].append({"config": dataclasses.asdict(cfg), "error": repr(e)[:200]})
                    continue
                entry["configs"].append({"config": dataclasses.asdict(cfg), "us": us, "TFLOPs": flop / us / 1e6,
                                         "default": cfg == default})
            ok = [c for c in entry["configs"] if "us" in c and c["config"]["split"] is not False]
            if ok:
                best = min(ok, key=lambda c: c["us"])
                y = T.linear_tiled(x, w0, torch.float32, config=T.TiledConfig(**best["config"]))
                entry["best_rel_err"] = rel(y, R.linear(x, w0, torch.float32))
            res["tiled"].append(entry)
            print_tiled(entry, args.top)
    res["summary"] = summary(res)
    print("\n".join(res["summary"]))
    if budget.skipped:
        print(f"[sweep-quant] budget spent: {len(budget.skipped)} candidates not timed (listed in the JSON)")
    return res


def _cfg(c: dict) -> str:
    d = c["config"]
    if "block_m" in d:
        mode = "dequant" + ("" if d["split"] is None else f" split={d['split']}") if d["dequant"] else "factored"
        return f"BM={d['block_m']} BN={d['block_n']} w={d['num_warps']} s={d['num_stages']} {mode}"
    return (f"BN={d['block_n']} w={d['num_warps']} s={d['num_stages']} unroll={d.get('unroll', 1)} "
            f"split_k={d.get('split_k', 1)}")


def print_skinny(e: dict, top: int) -> None:
    ok = sorted((c for c in e["configs"] if "us" in c), key=lambda c: c["us"])
    base = f"bf16 skinny {e['bf16_skinny_us']:.1f} us; " if "bf16_skinny_us" in e else ""
    print(f"\nskinny {e['type']} N={e['n']} K={e['k']} M={e['m']}: {e['weight_bytes'] / 2**20:.1f} MiB; {base}"
          f"copy {e['copy_us']:.1f} us ({e['copy_GBps']:.0f} GB/s read)", flush=True)
    shown = ok[:top] + [c for c in ok[top:] if c.get("default")]
    for c in shown:
        print(f"  {c['us']:8.1f} us {c['GBps']:7.0f} GB/s  {_cfg(c)}{'  (default)' if c.get('default') else ''}")
    for c in e["configs"]:
        if "error" in c:
            print(f"  failed: {_cfg(c)}: {c['error']}")
    if "best_rel_err" in e:
        print(f"  best config's relative error vs the float32 reference: {e['best_rel_err']:.1e}")


def print_tiled(e: dict, top: int) -> None:
    ok = sorted((c for c in e["configs"] if "us" in c), key=lambda c: c["us"])
    base = (f"cuBLAS bf16 {e['cublas_bf16_us']:.1f} us, dequantize + cuBLAS {e['dequant_then_cublas_us']:.1f} us; "
            if "cublas_bf16_us" in e else "")
    print(f"\ntiled {e['type']} N={e['n']} K={e['k']} M={e['m']}: {base}", flush=True)
    shown = ok[:top] + [c for c in ok[top:] if c.get("default") or c["config"]["split"] is False]
    for c in shown:
        print(f"  {c['us']:8.1f} us {c['TFLOPs']:6.1f} TFLOP/s  {_cfg(c)}{'  (default)' if c.get('default') else ''}")
    for c in e["configs"]:
        if "error" in c:
            print(f"  failed: {_cfg(c)}: {c['error']}")
    if "best_rel_err" in e:
        print(f"  best config's relative error vs the float32 reference: {e['best_rel_err']:.1e}")


def summary(res: dict) -> list[str]:
    """One line per (path, type, shape, M): best vs default time and the best config."""
    L = ["", "summary (best vs default; skinny GB/s of the quantized bytes, tiled TFLOP/s):"]
    for kind in ("skinny", "tiled"):
        for e in res[kind]:
            ok = [c for c in e["configs"] if "us" in c and not (kind == "tiled" and c["config"]["split"] is False)]
            if not ok:
                continue
            best = min(ok, key=lambda c: c["us"])
            d = next((c for c in ok if c.get("default")), None)
            unit = "GBps" if kind == "skinny" else "TFLOPs"
            base = ""
            if kind == "skinny" and "bf16_skinny_us" in e:
                base = f"; bf16 skinny {e['bf16_skinny_us']:.1f} us, copy {e['copy_GBps']:.0f} GB/s"
            elif kind == "tiled" and "cublas_bf16_us" in e:
                base = f"; cuBLAS bf16 {e['cublas_bf16_us']:.1f} us, dequantize+cuBLAS {e['dequant_then_cublas_us']:.1f} us"
            L.append(f"  {kind:6s} {e['type']:5s} {e['n']:6d}x{e['k']:<6d} M={e['m']:<4d} best {best['us']:8.1f} us "
                     f"({best[unit]:.1f} {unit}) {_cfg(best)}; default "
                     + (f"{d['us']:.1f} us ({d['us'] / best['us']:.2f}x)" if d else "-") + base)
    return L


def skinny_cases(args) -> list[tuple[str, int, int]]:
    """The skinny ``(type, N, K)`` cases: ``--smollm``'s list, else ``--types`` x ``--shapes``."""
    if args.smollm:
        return list(SMOLLM_CASES)
    return [(name, n, k) for name in args.types for n, k in args.shapes]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="Q4_K,Q8_0,Q6_K", help="GGUF types, comma-separated")
    p.add_argument("--shapes", default="4096x4096,12288x4096,4096x12288,8192x4096", help="skinny N x K list")
    p.add_argument("--rows", default="1,16", help="skinny M list")
    p.add_argument("--prefill-shapes", default="4096x4096,12288x4096", help="tiled N x K list")
    p.add_argument("--prefill-rows", type=int, default=512)
    p.add_argument("--skinny-only", action="store_true")
    p.add_argument("--tiled-only", action="store_true")
    p.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    p.add_argument("--reps", type=int, default=10, help="graph replays timed")
    p.add_argument("--top", type=int, default=6, help="candidates printed per shape")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop timing new candidates after this")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="processes compiling kernels up front")
    p.add_argument("--out", default=None, help="JSON of every timing")
    p.add_argument("--dry-run", action="store_true", help="print the candidates and exit")
    p.add_argument("--smoke", action="store_true", help="CPU self-test under the Triton interpreter (tiny shapes)")
    p.add_argument("--smollm", action="store_true",
                   help="SmolLM2-135M Q4_1's decode shapes (Q4_1 qkv, o, gate_up, down; Q8_0 LM head), skinny only, "
                        "with unroll and split-K candidates")
    args = p.parse_args(argv)
    args.types = [t.strip() for t in args.types.split(",") if t.strip()]
    args.rows = [int(v) for v in args.rows.split(",")]
    args.shapes = parse_shapes(args.shapes)
    args.prefill_shapes = parse_shapes(args.prefill_shapes)
    if args.smollm:
        args.skinny_only = True
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.types = ["Q4_1"] if args.smollm else args.types[:1]
        args.smollm = False
        args.shapes, args.rows, args.prefill_shapes, args.prefill_rows = [(64, 256)], [1], [(64, 256)], 72
        args.calls, args.reps = 1, 1
    if args.dry_run:
        for name, n, k in ([] if args.tiled_only else skinny_cases(args)):
            print(f"skinny {name} {n}x{k}: {len(skinny_candidates(n, SMS_H100, k, name, args.smollm))} candidates per M")
        if not args.skinny_only:
            print(f"tiled: {len(tiled_candidates()) + 2} candidates per type and shape")
        return 0
    res = sweep(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
