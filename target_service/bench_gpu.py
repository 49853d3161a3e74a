"""GPU benchmark of the target engine, with same-run baselines (``tools/gpu_run.sh bench`` runs it).

    python -m target_service.bench_gpu engine --model M.gguf --name NAME --out NAME.json [--hf]
    python -m target_service.bench_gpu report --dir DIR --out DIR/RESULTS.md
    python -m target_service.bench_gpu env --out DIR/env.json

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
* commit latency of a 16-node verify (eager, CUDA events around the commit alone);
* with ``--hf``: transformers ``generate`` of 128 tokens from the same GGUF (bf16, greedy).

``report`` merges every ``*.json`` of a directory (engine results, ``llamacpp.jsonl`` from
llama-bench, ``e2e.json`` from ``dflash-grpc bench``) into RESULTS.md with the ratios the issue's
goals are stated in.
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

        def run(r):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            (r.graph.replay() if r.graph is not None else r.body())
            e.record()
            e.synchronize()
            timer.times.append(s.elapsed_time(e))

        self._cls, self._orig, self._run = runner_cls, orig, run

    def __enter__(self):
        self._cls.run = self._run
        return self

    def __exit__(self, *exc):
        self._cls.run = self._orig


def _weights(model) -> list[torch.Tensor]:
    """The model's weight tensors, each once (a tied LM head is the embedding)."""
    seen, out = set(), []
    for t in [model.embed, model.lm_head, model.norm] + [x for lw in model.layers for x in lw.values()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def bench_engine(path: str, name: str, reps: int = 5, hf: bool = False, max_context: int = 2048,
                 batch_buckets=(1, 4, 16), width_buckets=(1, 4, 8, 16, 32, 64), log=print) -> dict:
    """Everything ``engine`` measures for one GGUF (module docstring); returns a JSON-able dict."""
    from target_service.batched_engine import BatchedEngine
    from target_service.engine import Sampling
    from target_service.gguf_loader import open_gguf
    from target_service.models import load_model

    dev = torch.device("cuda")
    out: dict = {"name": name, "path": os.path.basename(path), "file_bytes": os.path.getsize(path)}
    bw = copy_bandwidth(dev)
    out["copy_bandwidth_GBps"] = bw / 1e9
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    g = open_gguf(path)
    model = load_model(g, device=dev, dtype=torch.bfloat16, progress=True)
    out["arch"] = g.architecture
    out["load_s"] = time.perf_counter() - t0
    weights = torch.cuda.memory_allocated() - base
    wbytes = sum(t.numel() * t.element_size() for t in _weights(model))
    out["weight_bytes"] = wbytes
    out["params"] = sum(t.numel() for t in _weights(model))
    out["floor_tok_s"] = bw / wbytes
    log(f"[{name}] loaded {out['params'] / 1e9:.3f}B params, {wbytes / 2**30:.2f} GiB bf16 in {out['load_s']:.1f} s; "
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

    # time to first token (prefill of 512 + the first token), cold then warm; prefill throughput
    before_prefill = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ttft = []
    for i in range(reps + 1):
        p = rand(512)
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.prefill(f"p{i}", p, s, taps)
        torch.cuda.synchronize()
        ttft.append(time.perf_counter() - t)
        engine.release([f"p{i}"])
    out["ttft_cold_s"] = ttft[0]
    out["ttft_warm_s"] = _stats(ttft[1:])
    out["prefill512_tok_s"] = _stats([512 / x for x in ttft[1:]])
    prefill_scratch = torch.cuda.max_memory_allocated() - before_prefill
    if engine.prefill_buckets:
        # the eager prefill path (fla-core's chunked GDN kernel when installed) for comparison
        buckets, engine.prefill_buckets, eager = engine.prefill_buckets, (), []
        try:
            for i in range(reps + 1):
                p = rand(512)
                torch.cuda.synchronize()
                t = time.perf_counter()
                engine.prefill(f"pe{i}", p, s, taps)
                torch.cuda.synchronize()
                eager.append(512 / (time.perf_counter() - t))
                engine.release([f"pe{i}"])
            out["prefill512_eager_tok_s"] = _stats(eager[1:])
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
        out["commit_ms"] = commit_timing(engine)
        log(f"[{name}] commit of a 16-node verify: {out['commit_ms']['median']:.3f} ms (eager)")
    except Exception as e:  # noqa: BLE001 - report and go on
        out["commit_ms"] = {"error": repr(e)}
    for key, kw in PROFILES.items():
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
def commit_timing(engine, width: int = 16, reps: int = 20) -> dict:
    """Milliseconds of the commit of a ``width``-node chain whose whole path is accepted, run
    eagerly on the spare slot (CUDA events around the commit only)."""
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
    _, _, backend = forward(engine.model, engine.pool, st, engine.rope, engine.taps, commit_chain=False)
    path = torch.arange(width, device=engine.device)[None]
    n_acc = torch.full((1,), width, device=engine.device)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        backend.commit(path, n_acc)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return _stats(times[2:])


_FAMILIES = (("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "cublas", "splitk", "_skinny")),
             ("gdn conv (ours)", ("_conv_kernel",)),
             ("attention (ours)", ("_pool_attention", "_combine")), ("gated delta (ours)", ("_tree_kernel", "_commit_kernel")),
             ("norms (ours)", ("_rms_kernel",)), ("rope+kv (ours)", ("_rope_store",)), ("swiglu (ours)", ("_silu_mul",)),
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
    from torch.profiler import ProfilerActivity, profile

    from target_service.tree import analyze_tree

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
    r.body()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r.body()
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


# ------------------------------------------------------------------------------------- report
def _load_dir(d: str) -> tuple[dict, dict, dict | None, dict]:
    engines, llama, e2e, env = {}, {}, None, {}
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
        elif f == "llamacpp.jsonl":
            for line in open(p):
                line = line.strip()
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                key = os.path.basename(r.get("model_filename", ""))
                test = "pp512" if r.get("n_prompt") else "tg128"
                llama.setdefault(key, {})[test] = {"avg_ts": r["avg_ts"], "stddev_ts": r.get("stddev_ts")}
    return engines, llama, e2e, env


def report(d: str, out_path: str, command: str = "") -> str:
    """RESULTS.md text from a results directory (module docstring)."""
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
          "| model | " + " | ".join(f"B={b} device / wall" for b in (1, 4, 16)) + " | B=16 / B=1 (device) | commit of 16 nodes (eager) |",
          "|---|---|---|---|---|---|"]
    for name, r in engines.items():
        vb = {int(k): v for k, v in r["verify_batch"].items()}
        cells = [f"{vb[b]['device_ms']['median']:.3f} / {vb[b]['wall_ms']['median']:.3f}" if b in vb else "-" for b in (1, 4, 16)]
        ratio = vb[16]["device_ms"]["median"] / vb[1]["device_ms"]["median"] if 16 in vb and 1 in vb else 0
        cm = r.get("commit_ms", {})
        L.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x | {cm.get('median', float('nan')):.3f} |")
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
    text = "\n".join(L) + "\n"
    with open(out_path, "w") as f:
        f.write(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m target_service.bench_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine", help="benchmark one GGUF")
    e.add_argument("--model", required=True)
    e.add_argument("--name", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--hf", action="store_true", help="also time transformers on the same file")
    e.add_argument("--reps", type=int, default=5)
    e.add_argument("--max-context", type=int, default=2048)
    r = sub.add_parser("report", help="write RESULTS.md from a results directory")
    r.add_argument("--dir", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--command", default="")
    r = sub.add_parser("env", help="write env.json (device and versions)")
    r.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "engine":
        try:
            res = bench_engine(args.model, args.name, reps=args.reps, hf=args.hf, max_context=args.max_context,
                               log=lambda m: print(m, flush=True))
        except Exception:
            traceback.print_exc()
            return 1
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    elif args.cmd == "report":
        print(report(args.dir, args.out, args.command))
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
