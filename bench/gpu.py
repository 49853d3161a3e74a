"""GPU benchmark of the target engine, with same-run baselines (``tools/gpu_run.sh bench`` runs it).

    python -m bench.gpu engine --model M.gguf --name NAME --out NAME.json [--hf]
    python -m bench.gpu report --dir DIR --out DIR/RESULTS.md [--acceptance A.json]
    python -m bench.gpu env --out DIR/env.json
    python -m bench.gpu drafter --model M.gguf --name NAME --out NAME.drafter.json [--drafter D.gguf]
    python -m bench.gpu tree-vs-chain --engine NAME.json --acceptance A.json [--draft-ms 1.2]

``engine`` measures, on one CUDA device, in this order (each a median over repeats, with the
spread):

* copy bandwidth (a device-to-device copy of 2 GiB, bytes read + written per second) and the
  memory floor of decoding, ``weight bytes / bandwidth``;
* the engine's start: load, pool, graph capture (count and seconds), memory split into weights,
  state pool, graph pools + static step buffers, and prefill scratch (allocator peaks);
* time to first token of a 512-token prompt, cold (the first request after start) and warm;
  prefill-512 throughput;
* autoregressive decode: 128 tokens after an 8-token prompt through ``verify`` with root-only trees
  (tokens/s, host overhead included), and the device time of one replayed step (CUDA events);
* verify latency per width bucket (a chain and a DDTree-shaped tree of ``W`` nodes, batch 1) and
  per batch bucket (1, 4, 16 sessions of 16-node trees): wall time of ``verify_batch`` and device
  time of the replay;
* commit latency of a 16-node verify (CUDA events around the commit alone: eager, ``commit_ms``, and
  replayed as a CUDA graph as it runs inside the served step, ``commit_graph_ms``);
* the drafter's propose time at batch 1 (:func:`drafter_timing`, key ``draft_propose``; off with
  ``--no-drafter``): the shipped drafter of the target when there is one, else a random-weight
  drafter of the shipped drafter's shape built for this target (its cost, not its acceptance),
  through :class:`draft_service.batched.BatchedDrafter` (CUDA graphs) for the chain and the
  16/17/32/33-node trees: wall time of ``propose_batch`` (step, host sync, tree building) and
  the device time of the replayed step (CUDA events);
* with ``--hf``: transformers ``generate`` of 128 tokens from the same GGUF (bf16, greedy).

``drafter`` runs only the drafter measurement, into ``NAME.drafter.json`` (``{"drafter_of":
NAME, "draft_propose": ...}``), which ``report`` merges into the engine result of ``NAME``.

``report`` merges every ``*.json`` of a directory (engine results, ``llamacpp.jsonl`` from
llama-bench, ``e2e.json`` from ``dflash-grpc bench``) into RESULTS.md with the ratios the issue's
goals are stated in, and with ``--acceptance`` (default ``benchmarks/tree_vs_chain/acceptance.json``
when it exists; from ``tools/acceptance.py``) the section "Tree vs chain": per model,
``tok/s = tau / (draft ms + verify ms)`` for autoregressive, chain and trees
(:func:`tree_vs_chain`). ``tree-vs-chain`` prints that table for one engine result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

N_AR = 128


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written
    (median of ``reps`` copies after a warm-up, CUDA events)."""
    a = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def _tree_shape(w: int) -> list[int]:
    """Parents of a DDTree-like tree of ``w`` nodes: a main chain of about half the nodes, the
    rest siblings hanging at shallow depths (as the top-K builder grows them)."""
    chain = max(1, (w + 1) // 2)
    parents = [-1] + list(range(chain - 1))
    d = 0
    while len(parents) < w:
        parents.append(d % chain)
        d += 1
    return parents[:w]


class _Timer:
    """Device time of the engine's replayed steps: CUDA events around each ``_Runner.run``."""

    def __init__(self, engine):
        from target_service import batched_engine

        self.times: list[float] = []
        runner_cls = batched_engine._Runner
        orig = runner_cls.run
        timer = self

        def run(self, tail=None, head=None):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            if head is not None:       # (runtime.graphs.StepGraph.run's head: queued before the step)
                head()
            (self.graph.replay() if self.graph is not None else self.body())
            if tail is not None:       # (runtime.graphs.StepGraph.run's tail: queued before the one wait)
                tail()
            e.record()
            e.synchronize()
            timer.times.append(s.elapsed_time(e))

        self._cls, self._orig, self._run = runner_cls, orig, run

    def __enter__(self):
        self._cls.run = self._run
        return self

    def __exit__(self, *exc):
        self._cls.run = self._orig


def _weights(model) -> list:
    """The model's weights, each once (a tied LM head is the embedding): float tensors,
    ``kernels.quant.QuantizedWeight`` / ``PackedWeight`` (``--weights quantized``)."""
    from target_service.models.weights import model_weights

    return model_weights(model)


def _numel(w) -> int:
    """Elements (parameters) of a weight of any form (a quantized one by its logical shape)."""
    return w.numel() if isinstance(w, torch.Tensor) else int(w.shape[0]) * int(w.shape[1])


def bench_engine(path: str, name: str, reps: int = 5, hf: bool = False, max_context: int = 2048,
                 batch_buckets=(1, 4, 16), width_buckets=(1, 4, 8, 16, 32, 64), log=print,
                 drafter: bool = True, drafter_path: str | None = None, weights: str = "auto",
                 quick: bool = False) -> dict:
    """Everything ``engine`` measures for one GGUF (module docstring); returns a JSON-able dict.
    ``weights``: the target's ``--weights`` (``auto`` = bf16 for now, ``bf16``, ``quantized``: GGUF
    blocks on the GPU). ``quick``: only what the quantized table needs (decode, prefill-512,
    verify of 1 and 16 rows, memory): width buckets 1 and 16, batch bucket 1, no eager-prefill
    comparison, commit timing, kernel profile or drafter. The result also holds the file's
    ``tensor_bytes`` and ``file_type`` (:func:`bench.quant_report.file_summary`)."""
    if quick:
        batch_buckets, width_buckets, drafter = (1,), (1, 16), False
    from target_service.batched_engine import BatchedEngine
    from target_service.engine import Sampling
    from runtime.gguf_loader import open_gguf
    from target_service.models import load_model

    dev = torch.device("cuda")
    out: dict = {"name": name, "path": os.path.basename(path), "file_bytes": os.path.getsize(path)}
    bw = copy_bandwidth(dev)
    out["copy_bandwidth_GBps"] = bw / 1e9
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    g = open_gguf(path)
    model = load_model(g, device=dev, dtype=torch.bfloat16, progress=True, weights=weights)
    out["weights"] = weights
    out["arch"] = g.architecture
    from bench.quant_report import file_summary

    out.update(file_summary(g))
    out["load_s"] = time.perf_counter() - t0
    weights = torch.cuda.memory_allocated() - base
    from target_service.models.weights import weight_bytes

    wbytes = weight_bytes(model)
    out["weight_bytes"] = wbytes
    out["params"] = sum(_numel(t) for t in _weights(model))
    out["floor_tok_s"] = bw / wbytes
    log(f"[{name}] loaded {out['params'] / 1e9:.3f}B params, {wbytes / 2**30:.2f} GiB ({weights}) in {out['load_s']:.1f} s; "
        f"copy {bw / 1e12:.2f} TB/s -> floor {out['floor_tok_s']:.0f} tok/s")
    taps = [1, max(1, model.cfg.num_layers // 2), model.cfg.num_layers - 3] if g.architecture == "llama" else []
    engine = BatchedEngine(model, max_sessions=16, max_context=max_context, max_tree_width=64, max_tree_depth=63,
                           feature_layers=taps, batch_buckets=batch_buckets, width_buckets=width_buckets, max_step_tokens=1024)
    pool_bytes = engine.pool.nbytes
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    n_buckets = engine.capture(progress=True)
    out["capture_s"] = time.perf_counter() - t0
    out["graph_captures"] = engine.captures
    out["buckets"] = n_buckets
    graph_bytes = torch.cuda.memory_allocated() - before
    log(f"[{name}] {engine.captures} graphs for {n_buckets} buckets in {out['capture_s']:.1f} s")
    s = Sampling.checked(0.0, 0, 0.0, 0)
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def prefill_times(prefix: str) -> list[float]:
        """Seconds per 512-token prefill (+ the first token), cold first, then ``reps`` warm."""
        times = []
        for i in range(reps + 1):
            p = rand(512)
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.prefill(f"{prefix}{i}", p, s, taps)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            engine.release([f"{prefix}{i}"])
        return times

    # time to first token (prefill of 512 + the first token), cold then warm; prefill throughput
    before_prefill = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ttft = prefill_times("p")
    out["ttft_cold_s"] = ttft[0]
    out["ttft_warm_s"] = _stats(ttft[1:])
    out["prefill512_tok_s"] = _stats([512 / x for x in ttft[1:]])
    prefill_scratch = torch.cuda.max_memory_allocated() - before_prefill
    if engine.prefill_buckets and not quick:
        # the eager prefill path (fla-core's chunked GDN kernel when installed) for comparison
        buckets, engine.prefill_buckets = engine.prefill_buckets, ()
        try:
            out["prefill512_eager_tok_s"] = _stats([512 / x for x in prefill_times("pe")[1:]])
            log(f"[{name}] eager prefill {out['prefill512_eager_tok_s']['median']:.0f} tok/s")
        finally:
            engine.prefill_buckets = buckets
    log(f"[{name}] TTFT(512) cold {ttft[0] * 1e3:.1f} ms, warm {out['ttft_warm_s']['median'] * 1e3:.1f} ms, "
        f"prefill {out['prefill512_tok_s']['median']:.0f} tok/s")

    # autoregressive decode
    runs, dev_ms = [], []
    for i in range(reps):
        root = engine.prefill(f"ar{i}", rand(8), s, taps).first_token
        with _Timer(engine) as tm:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(N_AR):
                root = engine.verify(f"ar{i}", [root], [-1]).bonus_token
            dt = time.perf_counter() - t
        engine.release([f"ar{i}"])
        runs.append(N_AR / dt)
        dev_ms.append(statistics.median(tm.times))
    out["ar_tok_s"] = _stats(runs)
    out["ar_step_device_ms"] = _stats(dev_ms)
    out["ar_pct_floor"] = 100 * out["ar_tok_s"]["median"] / out["floor_tok_s"]
    log(f"[{name}] AR {out['ar_tok_s']['median']:.0f} tok/s ({out['ar_pct_floor']:.1f}% of floor), "
        f"device {out['ar_step_device_ms']['median']:.3f} ms/step")

    def verify_timing(batch: int, parents: list[int], steps: int = 30) -> dict:
        sids = [f"v{b}" for b in range(batch)]
        roots = [engine.prefill(sid, rand(64), s, taps).first_token for sid in sids]
        walls = []
        with _Timer(engine) as tm:
            for _ in range(steps):
                items = [(sid, [roots[b]] + rand(len(parents) - 1), parents) for b, sid in enumerate(sids)]
                t = time.perf_counter()
                res = engine.verify_batch(items)
                walls.append((time.perf_counter() - t) * 1e3)
                roots = [r.bonus_token for r in res]
        engine.release(sids)
        return {"wall_ms": _stats(walls[3:]), "device_ms": _stats(tm.times[3:])}

    out["verify_width"] = {}
    for w in width_buckets:
        chain = [-1] + list(range(w - 1))
        entry = {"chain": verify_timing(1, chain)}
        if w >= 4:
            entry["tree"] = verify_timing(1, _tree_shape(w))
        out["verify_width"][w] = entry
        log(f"[{name}] verify W={w}: chain {entry['chain']['device_ms']['median']:.3f} ms device, "
            f"{entry['chain']['wall_ms']['median']:.3f} ms wall" +
            (f"; tree {entry['tree']['device_ms']['median']:.3f} ms device" if "tree" in entry else ""))
    out["verify_batch"] = {}
    for b in batch_buckets:
        out["verify_batch"][b] = verify_timing(b, _tree_shape(16))
        log(f"[{name}] verify B={b} W=16: {out['verify_batch'][b]['device_ms']['median']:.3f} ms device")
    try:
        if quick:
            raise RuntimeError("skipped (quick)")
        out["commit_ms"] = commit_timing(engine)
        out["commit_graph_ms"] = commit_timing(engine, graph=True)
        log(f"[{name}] commit of a 16-node verify: {out['commit_ms']['median']:.3f} ms eager, "
            f"{out['commit_graph_ms']['median']:.3f} ms as a CUDA graph")
    except Exception as e:  # noqa: BLE001 - report and go on
        out.setdefault("commit_ms", {"error": repr(e)})
        out["commit_graph_ms"] = {"error": repr(e)}
    for key, kw in ({} if quick else PROFILES).items():
        try:
            out.setdefault("profile", {})[key] = pr = profile_step(engine, **kw)
            log(f"[{name}] eager {key} step: {pr['kernels']} kernels, {pr['device_us'] / 1e3:.3f} ms device; "
                + ", ".join(f"{k} {v['count']}x {v['us']:.0f}us" for k, v in pr["families"].items()))
        except Exception as e:  # noqa: BLE001
            out.setdefault("profile", {})[key] = {"error": repr(e)}
    out["memory"] = {"weights": weights, "pool": pool_bytes, "graph_pools_and_step_buffers": graph_bytes,
                     "prefill_scratch_peak": prefill_scratch, "peak_allocated": torch.cuda.max_memory_allocated()}
    del engine
    torch.cuda.empty_cache()
    if drafter:
        try:
            out["draft_propose"] = drafter_timing(path, drafter_path, log=lambda m: log(f"[{name}] {m}"))
        except Exception as e:  # noqa: BLE001 - report and go on
            out["draft_propose"] = {"error": repr(e)}
            log(f"[{name}] drafter timing failed: {e!r}")
        torch.cuda.empty_cache()
    if hf:
        try:
            del model
            torch.cuda.empty_cache()
            out["hf"] = hf_decode(path, reps=3)
            log(f"[{name}] transformers {out['hf']['tok_s']['median']:.1f} tok/s")
        except Exception as e:  # noqa: BLE001
            out["hf"] = {"error": repr(e)}
            log(f"[{name}] transformers failed: {e!r}")
    return out


@torch.no_grad()
def chain_forward(engine, width: int):
    """The eager forward of a ``width``-node chain (tokens ``0..width-1``) on ``engine``'s spare
    slot at ``L = 0``, not committed: its :class:`target_service.pooled.PoolBackend`, whose
    ``commit`` the caller runs (:func:`commit_timing`; tests)."""
    import numpy as np

    from target_service.pooled import StepLayout, StepTensors, forward

    lay = StepLayout(1, width)
    buf = np.zeros(lay.size, dtype=np.int64)
    v = lay.host_views(buf)
    v["tokens"][0] = np.arange(width)
    v["parents"][0] = np.arange(-1, width - 1)
    v["depth"][0] = np.arange(width)
    v["ancestors"][0] = [(1 << (i + 1)) - 1 for i in range(width)]
    v["n_nodes"][0], v["slots"][0], v["lengths"][0] = width, engine.pool.spare, 0
    st = StepTensors.from_buffer(lay, torch.from_numpy(buf).to(engine.device), engine.conv_kernel)
    return forward(engine.model, engine.pool, st, engine.rope, engine.taps, commit_chain=False)[2]


def commit_timing(engine, width: int = 16, reps: int = 20, graph: bool = False) -> dict:
    """Milliseconds of the commit of a ``width``-node chain whose whole path is accepted, on the
    spare slot (CUDA events around the commit only): eager, or with ``graph`` the commit alone
    captured as a CUDA graph and replayed (how it runs inside the served step, whose graph holds
    it: ``target_service.pooled.run_step``)."""
    backend = chain_forward(engine, width)
    path = torch.arange(width, device=engine.device)[None]
    n_acc = torch.full((1,), width, device=engine.device)
    commit = lambda: backend.commit(path, n_acc)  # noqa: E731
    run = commit
    if graph:   # warmed up and captured as the engines' steps are (runtime.graphs.StepGraph.capture)
        from runtime.graphs import StepGraph

        class _Commit(StepGraph):
            def body(self) -> None:
                commit()

            def fill_idle(self) -> None:   # the inputs are fixed above
                pass

        step = _Commit(engine.device)
        step.capture(torch.cuda.graph_pool_handle())
        run = step.graph.replay
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return _stats(times[2:])


#: kernel families of the profile, first match wins (the conv and KV commit kernels before the GDN
#: ``_commit_kernel`` whose name they contain)
_FAMILIES = (("quant linear (ours)", ("_qlinear_kernel", "_split_sum_kernel")),
             ("quant integer dots (ours)", ("_dp4a_kernel", "_mma_kernel", "_split_kernel")),
             ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "cublas", "splitk", "_skinny")),
             ("gdn conv (ours)", ("_conv_kernel", "_conv_commit_kernel")), ("kv commit (ours)", ("_kv_commit_kernel",)),
             ("attention (ours)", ("_pool_attention", "_pool_tree_nodes", "_combine")), ("gated delta (ours)", ("_tree_kernel", "_commit_kernel", "_tree_walk_kernel")),
             ("norms (ours)", ("_rms_kernel",)), ("rope+kv (ours)", ("_rope_store",)), ("swiglu (ours)", ("_silu_mul",)),
             ("top-k (ours)", ("_topk_lsm",)),
             ("sampler (ours)", ("sample", "threshold", "philox", "_argmax", "_reduce")),
             ("index/gather/scatter", ("index", "gather", "scatter")), ("copy", ("memcpy", "copy")),
             ("reduce", ("reduce",)), ("elementwise", ("elementwise", "vectorized", "unrolled")))


def _family(name: str) -> str:
    low = name.lower()
    for fam, keys in _FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "other"


#: the steps profiled per model (key -> profile_step arguments): an AR step, a width-16 chain and
#: tree, and a 512-token prefill chunk
PROFILES = {"1": dict(width=1), "16": dict(width=16), "tree16": dict(width=16, parents="tree"), "prefill512": dict(width=512, prefill=True)}


@torch.no_grad()
def profile_step(engine, width: int, parents: list[int] | None = None, prefill: bool = False) -> dict:
    """Kernels of one eager ``(1, width)`` step in the spare slot (a chain, or the tree of
    ``parents``; with ``prefill`` a prefill chunk of ``width`` tokens) under the PyTorch profiler:
    count and device microseconds per kernel family, and the top kernels by time."""
    from runtime.tree import analyze_tree

    if parents == "tree":
        parents = _tree_shape(width)
    if prefill:
        r = engine._prefill_runners.get(width) or engine._prefill_runner(width)
    else:
        r = engine._runners.get((1, width)) or engine._runner(1, width)
    lay = r.layout
    lay.fill_padding(r.host_np, engine.pool.spare)
    v = lay.host_views(r.host_np)
    parents = parents or list(range(-1, width - 1))
    depth, bits = (list(range(width)), [0] * width) if prefill else analyze_tree([0] * width, parents, 1, width)
    v["n_nodes"][0] = width
    v["parents"][0] = parents
    v["depth"][0] = depth
    v["ancestors"][0] = bits
    return profile_kernels(r.body)


@torch.no_grad()
def profile_kernels(fn) -> dict:
    """Kernels of one eager ``fn()`` (after one unprofiled call) under the PyTorch profiler: count
    and device microseconds per kernel family (:data:`_FAMILIES`), and the top kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fams: dict[str, list[float]] = {}
    kernels = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        if not t or evt.key.startswith("ProfilerStep") or "cudaDevice" in evt.key:
            continue
        f = fams.setdefault(_family(evt.key), [0, 0.0])
        f[0] += evt.count
        f[1] += t
        kernels.append((t, evt.count, evt.key[:90]))
    kernels.sort(reverse=True)
    return {"kernels": sum(c for c, _ in fams.values()), "device_us": sum(t for _, t in fams.values()),
            "families": {k: {"count": c, "us": round(t, 1)} for k, (c, t) in sorted(fams.items(), key=lambda kv: -kv[1][1])},
            "top": [{"us": round(t, 1), "count": c, "name": n} for t, c, n in kernels[:12]]}


def hf_decode(path: str, n: int = N_AR, reps: int = 3) -> dict:
    """transformers: load the GGUF (bf16, CUDA) and time greedy ``generate`` of ``n`` tokens."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(os.path.abspath(path))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16).to("cuda").eval()
    load_s = time.perf_counter() - t0
    ids = torch.full((1, 8), 1, dtype=torch.long, device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        runs = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            o = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()
            runs.append((o.shape[1] - ids.shape[1]) / (time.perf_counter() - t))
    del model
    torch.cuda.empty_cache()
    return {"tok_s": _stats(runs), "load_s": load_s}


# ------------------------------------------------------------------------------ tree vs chain
#: the drafting configurations of the tree-vs-chain estimate, named as ``dflash-grpc bench`` and
#: ``tools/acceptance.py`` name them: the chain (block size - 1 draft tokens), and DDTrees of
#: BUDGET draft nodes (BUDGET + 1 with the root) with TOPK candidates per depth
DRAFT_CONFIGS = ("chain", "tree:15:4", "tree:16:4", "tree:31:4", "tree:32:4")


def _draft_params(config: str) -> tuple[int, int]:
    """``(budget, top_k)`` of a configuration name (``chain``: ``(0, 1)``)."""
    if config == "chain":
        return 0, 1
    _, budget, top_k = config.split(":")
    return int(budget), int(top_k)


@torch.no_grad()
def drafter_timing(target_path: str, drafter_path: str | None = None, configs=DRAFT_CONFIGS, steps: int = 40,
                   warmup: int = 5, rows_per_step: int = 4, prompt_rows: int = 64, device: str | None = None,
                   cuda_graphs: bool = True, log=print) -> dict:
    """Propose time of a drafter at batch 1, per drafting configuration, in process.

    The drafter: ``drafter_path``, else the drafter shipped for the target (same fingerprint),
    else a random-weight drafter of the shipped drafter's shape (3 layers, block 16, 5 target
    layers) written for this target in a temporary directory (the cost of a drafter for it; it
    accepts nothing). It runs in :class:`draft_service.batched.BatchedDrafter` (bf16, one batch
    bucket, CUDA graphs on CUDA; float32 and eager on the CPU). Per configuration: one session
    gets ``prompt_rows`` feature rows, then ``steps`` proposals of ``rows_per_step`` new rows each
    (about what a verify commits), the tree as the orchestrator asks for it (depth ``B - 1``).
    Timed after ``warmup`` proposals: ``wall_ms``, ``propose_batch`` from call to return (inputs
    staged, the step, its host sync, the tree built on the host); ``device_ms``, CUDA events
    around the engine's step (replay plus the host sync), CUDA only; ``tree_us``, the host tree
    building alone. On CUDA the step runs twice per configuration: as served (the fused step,
    :mod:`draft_service.fused_step`) into ``configs``, and its plain-PyTorch reference (the step
    as it was before) into ``reference_step``.

    Returns:
        ``{"drafter", "source", "trained", "device", "block_size", "rows_per_step", "configs":
        {name: {"nodes", "wall_ms", "device_ms", "tree_us"}}, "reference_step": {same}, "profile"}``
        (``_stats`` dicts; ``device_ms`` None and ``reference_step`` empty off CUDA; ``profile``, CUDA
        only: :func:`profile_kernels` of one eager fused step, the last configuration's shape).
    """
    import shutil
    import tempfile

    from draft_service import batched as dbatched
    from draft_service import shipped_drafter
    from draft_service.batched import BatchedDrafter, DraftItem
    from draft_service.drafter import DFlashDrafter
    from draft_service.gguf_io import load_drafter
    from draft_service.gguf_io import is_trained
    from runtime.fingerprint import model_fingerprint
    from runtime.gguf_loader import open_gguf

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    g = open_gguf(target_path)
    tmp = None
    source = "given"
    if drafter_path is None:
        drafter_path = shipped_drafter(model_fingerprint(g))
        source = "shipped"
    try:
        if drafter_path is None:
            from draft_service.init_random import write_random_drafter

            tmp = tempfile.mkdtemp(prefix="bench-drafter-")
            drafter_path = os.path.join(tmp, "random-drafter.gguf")
            write_random_drafter(g, drafter_path, layers=3, block_size=16, num_target_layers=5)
            source = "random weights, the shipped drafter's shape (3 layers, block 16, 5 target layers)"
        model = load_drafter(drafter_path, g, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
        trained = bool(is_trained(drafter_path))
        name = os.path.basename(drafter_path)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    c = model.config
    rows_total = prompt_rows + (warmup + steps) * rows_per_step
    times: list[float] = []
    orig = dbatched._Runner.run

    def timed_run(r, *args, **kw):
        if not cuda:
            return orig(r, *args, **kw)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        res = orig(r, *args, **kw)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
        return res

    gen = torch.Generator().manual_seed(0)
    out: dict = {"drafter": name, "source": source, "trained": trained, "device": str(dev), "block_size": c.block_size,
                 "rows_per_step": rows_per_step, "configs": {}, "reference_step": {}}
    dbatched._Runner.run = timed_run
    try:
        # the step as served (fused kernels on CUDA), then its plain-PyTorch reference (the
        # step before issue 18's fusion) on the same drafter
        for key, fused in (("configs", None), ("reference_step", False)):
            if key == "reference_step" and not cuda:
                break
            engine = BatchedDrafter(model, max_sessions=1, max_context=rows_total + c.block_size, cuda_graphs=cuda_graphs,
                                    batch_buckets=(1,), append_rows=max(rows_per_step, c.block_size), fused=fused)
            engine.capture()
            for cfg in configs:
                budget, top_k = _draft_params(cfg)
                sid = f"draft-{cfg}"
                L = 0
                walls, trees, nodes = [], [], 0
                times.clear()
                for i in range(warmup + steps + 1):
                    n = prompt_rows if i == 0 else rows_per_step
                    feats = torch.randn(n, c.feature_size, generator=gen).to(model.dtype)
                    root = int(torch.randint(0, c.vocab_size, (1,), generator=gen))
                    L += n
                    item = DraftItem(sid, feats, root, L, budget=budget, top_k=top_k, max_depth=c.block_size - 1)
                    tree_s = engine.tree_s
                    if cuda:
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    (res,) = engine.propose_batch([item])
                    wall = time.perf_counter() - t0
                    if isinstance(res, BaseException):
                        raise res
                    if i > warmup:  # the first call carries the prompt rows
                        walls.append(wall * 1e3)
                        trees.append((engine.tree_s - tree_s) * 1e6)
                    nodes = len(res.tokens)
                if cuda and key == "configs" and cfg == configs[-1]:
                    # the kernels of one eager step of the runner just used (its inputs as the last
                    # proposal left them): what the drafter's device time is made of
                    out["profile"] = profile_kernels(engine._runner(1, engine.append_rows).body)
                engine.release([sid])
                dev_times = times[-steps:] if cuda else []
                row = {"nodes": nodes, "wall_ms": _stats(walls), "tree_us": _stats(trees),
                       "device_ms": _stats(dev_times) if dev_times else None}
                out[key][cfg] = row
                log(f"drafter {cfg} ({'fused' if key == 'configs' and engine.fused is not None else 'reference'} step): "
                    f"{nodes} nodes, propose {row['wall_ms']['median']:.3f} ms wall"
                    + (f", step {row['device_ms']['median']:.3f} ms device" if dev_times else "")
                    + f", tree {row['tree_us']['median']:.0f} us host")
            del engine
    finally:
        dbatched._Runner.run = orig
    del model
    return out


def _nominal_nodes(config: str, block_size: int) -> int:
    """Nodes of a configuration's full tree, root included (chain: the block size)."""
    budget, _ = _draft_params(config)
    return block_size if config == "chain" else budget + 1


def _median(d, *keys):
    """``d[k0][k1]...["median"]``, or None where a key is missing."""
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d.get("median") if isinstance(d, dict) else (d if isinstance(d, (int, float)) else None)


def tree_vs_chain(engine: dict, acceptance: dict, draft_ms: "dict | float | None" = None, kind: str = "device_ms",
                  prompt_set: str | None = None) -> dict:
    """Estimated decode speed per drafting configuration at batch 1: ``tok/s = tau / (draft_ms +
    verify_ms) * 1000``.

    Args:
        engine: a benchmark result of ``engine`` (:func:`bench_engine`): ``verify_width`` (per
            width ``W``: ``chain`` and ``tree`` timings), ``ar_step_device_ms`` and, when
            measured, ``draft_propose`` (:func:`drafter_timing`).
        acceptance: ``tools/acceptance.py``'s JSON: per configuration ``tau`` and ``max_nodes``
            (nodes of the full tree, root included; else taken from the name).
        draft_ms: drafter milliseconds per step: one number for every configuration, or a dict
            name -> ms; None: ``engine["draft_propose"]["configs"][name]["wall_ms"]``.
        kind: ``device_ms`` (the replayed step, CUDA events) or ``wall_ms`` (``verify_batch``
            with its host work) of the verify.
        prompt_set: take tau of one prompt set (``by_set``, e.g. ``humaneval``) instead of all.

    The verify of ``n`` nodes costs the measured step of the smallest measured width ``W >= n``
    (the engine pads a step to its width bucket: 16 nodes run at ``W = 16``, 17 at ``W = 32``),
    of the chain shape for the chain and the tree shape for trees (the chain's where the tree's
    is missing). Autoregressive decoding: tau 1, no drafter, the AR step (``ar_step_device_ms``;
    for ``wall_ms`` or when it is missing, the chain at ``W = 1``). Missing figures give None in
    the row (``missing`` says which), never an exception.

    Returns:
        ``{"model", "kind", "draft_source", "rows": {name: {"tau", "nodes", "width", "shape",
        "draft_ms", "verify_ms", "step_ms", "tok_s", "vs_ar", "vs_chain", "missing"}}}`` with
        ``ar`` first, then the configurations of ``acceptance`` in order.
    """
    vw = {}
    for w, entry in (engine.get("verify_width") or {}).items():
        try:
            vw[int(w)] = entry or {}
        except (TypeError, ValueError):
            continue
    widths = sorted(vw)
    prop = (engine.get("draft_propose") or {}).get("configs") or {}
    if draft_ms is None:
        source = (f"measured: {engine['draft_propose'].get('drafter', 'drafter')} ({engine['draft_propose'].get('source', '')})"
                  if prop else "none")
    elif isinstance(draft_ms, dict):
        source = "given per configuration"
    else:
        source = f"given: {float(draft_ms):.3f} ms"

    def drafter(name: str):
        if draft_ms is None:
            return _median(prop, name, "wall_ms")
        if isinstance(draft_ms, dict):
            v = draft_ms.get(name)
            return float(v) if v is not None else None
        return float(draft_ms)

    def verify(nodes: int, shape: str):
        width = next((w for w in widths if w >= nodes), None)
        if width is None:
            return None, None, shape
        t = _median(vw[width], shape, kind)
        if t is None and shape != "chain":
            shape = "chain"
            t = _median(vw[width], shape, kind)
        return width, t, shape

    ar_ms = _median(engine, "ar_step_device_ms") if kind == "device_ms" else None
    if ar_ms is None:
        ar_ms = _median(vw.get(1, {}), "chain", kind)
    rows: dict = {}

    def row(tau, nodes, width, shape, d, v):
        missing = [k for k, x in (("tau", tau), ("draft_ms", d), ("verify_ms", v)) if x is None]
        step = d + v if d is not None and v is not None else None
        tok_s = tau / step * 1e3 if tau is not None and step else None
        return {"tau": tau, "nodes": nodes, "width": width, "shape": shape, "draft_ms": d, "verify_ms": v,
                "step_ms": step, "tok_s": tok_s, "vs_ar": None, "vs_chain": None, "missing": missing}

    rows["ar"] = row(1.0, 1, 1, "ar", 0.0, ar_ms)
    block = int(acceptance.get("block_size") or 16)
    for name, c in (acceptance.get("configs") or {}).items():
        if name == "ar" or not isinstance(c, dict):
            continue
        try:
            nodes = int(c.get("max_nodes") or _nominal_nodes(name, block))
        except ValueError:
            continue  # a configuration name this estimate does not know
        width, v, shape = verify(nodes, "chain" if name == "chain" else "tree")
        tau = c.get("tau") if prompt_set is None else ((c.get("by_set") or {}).get(prompt_set) or {}).get("tau")
        rows[name] = row(tau, nodes, width, shape, drafter(name), v)
    ar_tok, chain_tok = rows["ar"]["tok_s"], rows.get("chain", {}).get("tok_s")
    for r in rows.values():
        if r["tok_s"] is not None:
            r["vs_ar"] = r["tok_s"] / ar_tok if ar_tok else None
            r["vs_chain"] = r["tok_s"] / chain_tok if chain_tok else None
    return {"model": engine.get("name", ""), "kind": kind, "draft_source": source, "prompt_set": prompt_set or "all", "rows": rows}


def format_tree_vs_chain(est: dict, markdown: bool = True) -> list[str]:
    """The rows of :func:`tree_vs_chain` as a markdown table (lines)."""
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = ["| config | nodes (width bucket) | tau | draft ms | verify ms | step ms | tok/s | vs AR | vs chain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in est["rows"].items():
        nodes = "1" if name == "ar" else f"{r['nodes']} (W={r['width'] if r['width'] is not None else '?'}, {r['shape']})"
        lines.append(f"| {name} | {nodes} | {f(r['tau'], '.3f')} | {f(r['draft_ms'], '.3f')} | {f(r['verify_ms'], '.3f')} | "
                     f"{f(r['step_ms'], '.3f')} | {f(r['tok_s'], '.0f')} | {f(r['vs_ar'], '.2f')}{'x' if r['vs_ar'] else ''} | "
                     f"{f(r['vs_chain'], '.2f')}{'x' if r['vs_chain'] else ''} |")
    return lines


# ------------------------------------------------------------------------------------- report
def _load_dir(d: str) -> tuple[dict, dict, dict | None, dict]:
    engines, llama, e2e, env = {}, {}, None, {}
    drafters = {}
    for f in sorted(os.listdir(d)):
        p = os.path.join(d, f)
        if f == "e2e.json":
            e2e = json.load(open(p))
        elif f == "env.json":
            env = json.load(open(p))
        elif f.endswith(".json"):
            r = json.load(open(p))
            if "name" in r:
                engines[r["name"]] = r
            elif "drafter_of" in r:   # ``drafter``: merged into the engine result of that name
                drafters[r["drafter_of"]] = r.get("draft_propose")
        elif f == "llamacpp.jsonl":
            for line in open(p):
                line = line.strip()
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                key = os.path.basename(r.get("model_filename", ""))
                test = "pp512" if r.get("n_prompt") else "tg128"
                llama.setdefault(key, {})[test] = {"avg_ts": r["avg_ts"], "stddev_ts": r.get("stddev_ts")}
    for name, dp in drafters.items():
        if name in engines and dp:
            engines[name]["draft_propose"] = dp
    return engines, llama, e2e, env


#: ``tools/acceptance.py``'s committed result (``report``'s default ``--acceptance``)
DEFAULT_ACCEPTANCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "benchmarks", "tree_vs_chain", "acceptance.json")


def _fallback_draft_ms(engines: dict, e2e: dict | None, configs) -> tuple[dict | None, str]:
    """Drafter ms per configuration for an engine result without its own ``draft_propose``: the
    shipped drafter's measured propose time from another result of the run, else the draft
    service's compute per step of ``e2e.json`` (configurations it lacks: the mean of those it
    has; the drafter's step hardly depends on the tree), else None."""
    for r in engines.values():
        dp = r.get("draft_propose") or {}
        if dp.get("configs") and dp.get("source") == "shipped":
            ms = {c: _median(dp["configs"], c, "wall_ms") for c in configs}
            return {c: v for c, v in ms.items() if v is not None}, f"the shipped drafter's propose time, measured with {r['name']}"
    got = {}
    for c, v in ((e2e or {}).get("configs") or {}).items():
        ms = (v.get("step_ms") or {}).get("draft_compute")
        if ms:
            got[c] = ms
    if got:
        mean = sum(got.values()) / len(got)
        return ({c: got.get(c, mean) for c in configs},
                "e2e.json: the draft service's compute per step with the shipped pair (" + ", ".join(sorted(got)) + "; others: their mean)")
    return None, "none"


def _tree_vs_chain_section(engines: dict, e2e: dict | None, acceptance: dict,
                           path: str = "benchmarks/tree_vs_chain/acceptance.json") -> list[str]:
    """The "Tree vs chain" section of RESULTS.md (:func:`tree_vs_chain` per engine result);
    ``path``: the acceptance JSON's name in the text."""
    cfgs = [c for c in acceptance.get("configs", {}) if c != "ar"]
    lossless = "every output equal to target-only greedy decoding" if acceptance.get("all_lossless") else "NOT every output lossless"
    set_text = ", ".join(f"{v} {k}" for k, v in (acceptance.get("prompt_sets") or {}).items())
    L = ["", "## Tree vs chain (estimate: tok/s = tau / (draft ms + verify ms), batch 1)", "",
         f"tau: the shipped SmolLM2 pair, greedy, in process on the CPU (`{acceptance.get('command', 'tools/acceptance.py')}`, "
         f"`{path}`): {acceptance.get('prompts')} prompts ({set_text}), up to "
         f"{acceptance.get('max_tokens')} new tokens each; {lossless}. The Qwen3.5 files are random weights, so their rows "
         "assume a drafter that accepts like the shipped one. Verify: the measured device time of the width bucket the "
         "tree pads to (chain shape for the chain, tree shape for trees; tree:N:K sends N + 1 nodes with the root, so "
         "tree:16:4 runs at W=32). Draft: the drafter's propose time per step (source under each table). No gRPC, "
         "queueing or orchestrator time (the end-to-end section has those).", ""]
    sets = list(acceptance.get("prompt_sets") or {})
    L += ["| config | tau | " + "".join(f"tau {s} | " for s in sets) + "steps | P(accept >= 1) | >= 2 | >= 4 | >= 8 |",
          "|---|---|" + "---|" * len(sets) + "---|---|---|---|---|"]
    for c, a in acceptance.get("configs", {}).items():
        ge = a.get("accept_ge") or []
        at = lambda d: f"{ge[d - 1]:.2f}" if len(ge) >= d else "-"  # noqa: E731
        by = [((a.get("by_set") or {}).get(s) or {}).get("tau") for s in sets]
        L.append(f"| {c} | {a.get('tau', 0):.3f} | " + "".join(f"{t:.3f} | " if t is not None else "- | " for t in by)
                 + f"{a.get('steps', '-')} | {at(1)} | {at(2)} | {at(4)} | {at(8)} |")
    drafts = {}
    for name, r in engines.items():
        draft, source = None, None
        if not (r.get("draft_propose") or {}).get("configs"):
            draft, source = _fallback_draft_ms(engines, e2e, cfgs)
            if draft is None:
                draft, source = 0.0, "no drafter time in this run: verify only (draft 0)"
        drafts[name] = (draft, source)

    def estimate(name: str, prompt_set: str | None) -> dict:
        draft, source = drafts[name]
        est = tree_vs_chain(engines[name], acceptance, draft, prompt_set=prompt_set)
        if source:
            est["draft_source"] = source
        return est

    summary = []
    for prompt_set in [None] + sets:
        summary += ["", f"Prompts: {prompt_set or 'all'}. Cells: estimated tok/s (x autoregressive).", "",
                    "| model | AR tok/s | " + " | ".join(cfgs) + " | best tree / chain |", "|---|---|" + "---|" * (len(cfgs) + 1)]
        for name in engines:
            rows = estimate(name, prompt_set)["rows"]
            chain = rows.get("chain", {}).get("tok_s")
            trees = [v["tok_s"] for k, v in rows.items() if k.startswith("tree") and v["tok_s"]]
            best = f"{max(trees) / chain:.2f}x" if trees and chain else "-"
            cells = [f"{rows[c]['tok_s']:.0f} ({rows[c]['vs_ar']:.2f}x)" if c in rows and rows[c]["tok_s"] and rows[c]["vs_ar"] else "-"
                     for c in cfgs]
            ar = rows["ar"]["tok_s"]
            summary.append(f"| {name} | {f'{ar:.0f}' if ar else '-'} | " + " | ".join(cells) + f" | {best} |")
    per_model = []
    for name in engines:
        est = estimate(name, None)
        per_model += ["", f"### {name} (all prompts)", "", f"Draft time: {est['draft_source']}.", ""] + format_tree_vs_chain(est)
    return L + summary + per_model


def report(d: str, out_path: str, command: str = "", acceptance: str | None = DEFAULT_ACCEPTANCE) -> str:
    """RESULTS.md text from a results directory (module docstring); ``acceptance``: the JSON of
    ``tools/acceptance.py`` for the "Tree vs chain" section (skipped when None or absent)."""
    engines, llama, e2e, env = _load_dir(d)
    L = ["# GPU benchmark", ""]
    if command:
        L += ["Command:", "", "```", command, "```", ""]
    if env:
        L += [f"Device: {env.get('device')}; {env.get('versions')}", ""]
    L += ["Our engine: `target_service.batched_engine.BatchedEngine`, bf16 weights, CUDA graphs; llama.cpp: "
          "`llama-bench -ngl 99 -fa 1 -p 512 -n 128 -r 3` on the same GGUF, built in the same call; "
          "floor: weight bytes (bf16, as loaded) / copy bandwidth measured in the same process. "
          "Medians with [min, max] over repeats.", ""]
    L += ["## Decode and prefill", "",
          "| model | params | floor tok/s | AR tok/s [min,max] | % floor | AR step device ms | llama.cpp tg128 | AR / llama.cpp | HF tok/s | AR / HF | prefill-512 tok/s | llama.cpp pp512 | TTFT-512 cold / warm ms | graphs (capture s) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in engines.items():
        lc = llama.get(r["path"], {})
        tg = lc.get("tg128", {}).get("avg_ts")
        pp = lc.get("pp512", {}).get("avg_ts")
        hf = r.get("hf", {}).get("tok_s", {}).get("median") if isinstance(r.get("hf"), dict) else None
        ar = r["ar_tok_s"]
        L.append(
            f"| {name} | {r['params'] / 1e9:.3f}B | {r['floor_tok_s']:.0f} | {ar['median']:.0f} [{ar['min']:.0f}, {ar['max']:.0f}] | "
            f"{r['ar_pct_floor']:.1f}% | {r['ar_step_device_ms']['median']:.3f} | {tg:.0f} | {ar['median'] / tg:.2f}x | "
            if tg else
            f"| {name} | {r['params'] / 1e9:.3f}B | {r['floor_tok_s']:.0f} | {ar['median']:.0f} [{ar['min']:.0f}, {ar['max']:.0f}] | "
            f"{r['ar_pct_floor']:.1f}% | {r['ar_step_device_ms']['median']:.3f} | - | - | "
        )
        L[-1] += (f"{hf:.1f} | {ar['median'] / hf:.1f}x | " if hf else "- | - | ")
        L[-1] += (f"{r['prefill512_tok_s']['median']:.0f} | {pp:.0f} | " if pp else f"{r['prefill512_tok_s']['median']:.0f} | - | ")
        L[-1] += f"{r['ttft_cold_s'] * 1e3:.0f} / {r['ttft_warm_s']['median'] * 1e3:.1f} | {r['graph_captures']} ({r['capture_s']:.1f}) |"
    L += ["", "## Verify latency (ms, batch 1; device = replayed graph, wall = `verify_batch` incl. host work)", ""]
    widths = sorted({int(w) for r in engines.values() for w in r["verify_width"]})
    L += ["| model | shape | " + " | ".join(f"W={w}" for w in widths) + " | W=16 / W=1 |", "|---|---|" + "---|" * (len(widths) + 1)]
    for name, r in engines.items():
        vw = {int(k): v for k, v in r["verify_width"].items()}
        for shape in ("chain", "tree"):
            for kind in ("device_ms", "wall_ms"):
                cells = [f"{vw[w][shape][kind]['median']:.3f}" if shape in vw.get(w, {}) else "-" for w in widths]
                ratio = vw[16][shape][kind]["median"] / vw[1]["chain"][kind]["median"] if shape in vw.get(16, {}) else 0
                L.append(f"| {name} | {shape} {kind[:-3]} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    L += ["", "## Verify latency per batch bucket (16-node trees; ms)", "",
          "| model | " + " | ".join(f"B={b} device / wall" for b in (1, 4, 16)) + " | B=16 / B=1 (device) | commit of 16 nodes: eager / graph |",
          "|---|---|---|---|---|---|"]
    for name, r in engines.items():
        vb = {int(k): v for k, v in r["verify_batch"].items()}
        cells = [f"{vb[b]['device_ms']['median']:.3f} / {vb[b]['wall_ms']['median']:.3f}" if b in vb else "-" for b in (1, 4, 16)]
        ratio = vb[16]["device_ms"]["median"] / vb[1]["device_ms"]["median"] if 16 in vb and 1 in vb else 0
        cm, cg = r.get("commit_ms", {}), r.get("commit_graph_ms", {})
        L.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x | {cm.get('median', float('nan')):.3f} / "
                 f"{cg.get('median', float('nan')):.3f} |")
    L += ["", "## Kernel profile of one eager step (PyTorch profiler; kernels, device microseconds per family)", "",
          "| model | width | kernels | device us | by family (count x, us) |", "|---|---|---|---|---|"]
    for name, r in engines.items():
        order = list(PROFILES)
        for w, pr in sorted(r.get("profile", {}).items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
            if "families" not in pr:
                continue
            fams = ", ".join(f"{k} {v['count']}x {v['us']:.0f}" for k, v in pr["families"].items())
            L.append(f"| {name} | {w} | {pr['kernels']} | {pr['device_us']:.0f} | {fams} |")
    L += ["", "## Memory (GiB)", "", "| model | weights | state pool | graph pools + step buffers | prefill scratch peak | peak allocated |",
          "|---|---|---|---|---|---|"]
    for name, r in engines.items():
        m = r["memory"]
        L.append(f"| {name} | {m['weights'] / 2**30:.2f} | {m['pool'] / 2**30:.2f} | {m['graph_pools_and_step_buffers'] / 2**30:.2f} | "
                 f"{m['prefill_scratch_peak'] / 2**30:.2f} | {m['peak_allocated'] / 2**30:.2f} |")
    if e2e:
        L += ["", "## End to end: three services on the GPU, shipped SmolLM2 pair, one stream", "",
              f"{e2e['prompts']} HumanEval prompts, {e2e['max_tokens']} tokens each, temperature 0.", "",
              "| config | tau | tok/s | lossless | ms/step total | draft | verify | gRPC + queue | orchestrator |", "|---|---|---|---|---|---|---|---|---|"]
        for cname, c in e2e["configs"].items():
            sm = c.get("step_ms", {})
            L.append(f"| {cname} | {c['tau']:.2f} | {c['tokens_per_second']:.1f} | {'yes' if c['lossless'] else 'NO'} | "
                     f"{sm.get('total', 0):.3f} | {sm.get('draft_compute', 0):.3f} | {sm.get('verify_compute', 0):.3f} | "
                     f"{sm.get('grpc_and_queue', 0):.3f} | {sm.get('orchestrator', 0):.3f} |")
    if acceptance and os.path.exists(acceptance) and engines:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        shown = os.path.relpath(os.path.abspath(acceptance), root)
        L += _tree_vs_chain_section(engines, e2e, json.load(open(acceptance)), shown if not shown.startswith("..") else acceptance)
    text = "\n".join(L) + "\n"
    with open(out_path, "w") as f:
        f.write(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine", help="benchmark one GGUF")
    e.add_argument("--model", required=True)
    e.add_argument("--name", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--hf", action="store_true", help="also time transformers on the same file")
    e.add_argument("--reps", type=int, default=5)
    e.add_argument("--weights", choices=["auto", "bf16", "quantized"], default="auto",
                   help="the target's weights: GGUF blocks (quantized) or dequantized to bf16 (bf16; auto = bf16 for now)")
    e.add_argument("--quick", action="store_true",
                   help="only decode, prefill-512, verify of 1 and 16 rows and memory (tools/gpu_quant.sh)")
    e.add_argument("--max-context", type=int, default=2048)
    e.add_argument("--no-drafter", dest="drafter", action="store_false", help="skip the drafter's propose timing")
    e.add_argument("--drafter", dest="drafter_path", default=None,
                   help="drafter GGUF to time (default: the shipped one of the target, else a random one of its shape)")
    dr = sub.add_parser("drafter", help="time only the drafter's proposals (NAME.drafter.json, merged by report)")
    dr.add_argument("--model", required=True, help="target GGUF")
    dr.add_argument("--name", required=True, help="the engine result's name this timing belongs to")
    dr.add_argument("--out", required=True)
    dr.add_argument("--drafter", dest="drafter_path", default=None)
    r = sub.add_parser("report", help="write RESULTS.md from a results directory")
    r.add_argument("--dir", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--command", default="")
    r.add_argument("--acceptance", default=DEFAULT_ACCEPTANCE, help="tools/acceptance.py's JSON for 'Tree vs chain' (default %(default)s)")
    t = sub.add_parser("tree-vs-chain", help="print the tree-vs-chain estimate of one engine result")
    t.add_argument("--engine", required=True, help="an engine result JSON")
    t.add_argument("--acceptance", default=DEFAULT_ACCEPTANCE)
    t.add_argument("--draft-ms", type=float, default=None, help="drafter ms per step (default: the result's draft_propose)")
    t.add_argument("--kind", choices=["device_ms", "wall_ms"], default="device_ms", help="verify time: device or wall")
    t.add_argument("--set", dest="prompt_set", default=None, help="tau of one prompt set of the acceptance JSON (e.g. humaneval)")
    r = sub.add_parser("env", help="write env.json (device and versions)")
    r.add_argument("--out", required=True)
    args = p.parse_args(argv)
    def measure_to_json(measure) -> int:
        """Run ``measure()`` and write its dict to ``--out``; print the traceback and return 1 if it raises."""
        try:
            res = measure()
        except Exception:
            traceback.print_exc()
            return 1
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return 0

    if args.cmd == "engine":
        return measure_to_json(lambda: bench_engine(args.model, args.name, reps=args.reps, hf=args.hf, max_context=args.max_context,
                                                    log=lambda m: print(m, flush=True), drafter=args.drafter,
                                                    drafter_path=args.drafter_path, weights=args.weights,
                                                    quick=args.quick))
    elif args.cmd == "drafter":
        return measure_to_json(lambda: {"drafter_of": args.name, "draft_propose": drafter_timing(
            args.model, args.drafter_path, log=lambda m: print(f"[{args.name}] {m}", flush=True))})
    elif args.cmd == "report":
        print(report(args.dir, args.out, args.command, args.acceptance))
    elif args.cmd == "tree-vs-chain":
        est = tree_vs_chain(json.load(open(args.engine)), json.load(open(args.acceptance)), args.draft_ms, args.kind, args.prompt_set)
        print(f"{est['model']}: prompts {est['prompt_set']}, verify {est['kind']}, draft time: {est['draft_source']}")
        print("\n".join(format_tree_vs_chain(est)))
    else:
        import grpc
        import triton

        env = {"device": torch.cuda.get_device_name(0), "python": platform.python_version(),
               "versions": f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}, grpcio {grpc.__version__}"}
        with open(args.out, "w") as f:
            json.dump(env, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
