"""Why the quantized engine's greedy tokens leave the bf16 engine's, and where its AR step's time
goes (issue 19; the first GPU run, benchmarks/gpu/quant/run1: 393 of 8 x 128 greedy tokens in
matched prefixes, first divergence prompt 0 position 25; AR step 2.91 ms device against 1.01 for
bf16 weights). One GPU; meant to take under 2 minutes on an H100 (Triton compiles included).

Usage (GPU machine, repository root; ``--out`` JSON of everything, a summary on stdout)::

    PYTHONPATH=/tmp/site:$PWD:$PWD/proto python3 tools/quant_diag.py \\
        --model /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT/diag.json
    python3 tools/quant_diag.py --smoke            # CPU: a tiny Q4_1 file, reference kernels, seconds

**The hypothesis.** ``--weights bf16`` dequantizes each weight to float32 and ROUNDS it to
bfloat16 (relative error up to 2^-9 a weight); the quantized kernels multiply the exact float32
dequantized values (the codes exact in bfloat16, the scale applied in float32: see
``kernels/quant/triton.py``). The two engines then see different weights and part at near-ties,
and the quantized one may be the more accurate. What this measures, on the 8 prompts of the test
(``tests/conftest.py`` ``PROMPTS[:8]``, the model's own tokenizer) x ``--tokens`` greedy tokens:

* **engines** (``BatchedEngine``, CUDA graphs, the sizes of ``tests/test_batched_engine_gpu.py``'s
  ``_engines``): ``quantized`` (``--weights quantized``, bfloat16 activations), ``quantized-round``
  (the same with ``kernels.quant.triton.ROUND_WEIGHTS``: each dequantized weight rounded to
  bfloat16 before its product, the values the bf16 path holds), ``bf16`` (``--weights bf16``,
  bfloat16) and the **oracle** ``float32`` (``--weights bf16`` with ``dtype=float32``: the weights
  dequantized to float32 on the GPU, float32 activations).
* **matched**: per pair, the tokens in the matched prefix of each prompt's greedy stream (the
  test's measure, >= 95% asked) and the first divergence ``(prompt, position, a, b)``. If the
  hypothesis holds, ``quantized-round vs bf16`` is high (only float32 summation order differs)
  while ``quantized vs bf16`` is low.
* **teacher-forced logits**: every model fed the oracle's sequence (prompt + the float32 engine's
  greedy tokens) in chunks of at most 64 rows (the skinny kernels, whose rows have the bits of a
  one-row decode), ``LlamaModel.forward``; per predicted position the relative error
  ``|l - l_f32| / |l_f32|`` (L2 over the vocabulary) against the oracle, its median / p90 / max,
  and how often the argmax equals the oracle's. The engine with the smaller error is the more
  accurate one, whatever the greedy streams say.
* **step time** (CUDA only): the device time of each replayed AR step (CUDA events around the graph
  replay, as ``bench.gpu``) per engine, and of the quantized engine at the old config rule (no
  unrolling; its tokens must be bit for bit the default's); **per linear site** (``qkv``, ``o``,
  ``gate_up``, ``down``, ``lm_head``): CUDA events around every linear of an eager AR step whose
  launches are all queued behind a ``torch.cuda._sleep`` (so the windows hold device time, not
  launch latency), per call and per step, for the quantized and bf16 engines; the kernel families
  of one eager step under the PyTorch profiler (``bench.gpu.profile_step``); and per site, the
  quantized linear alone at ``M = 1`` over the model's own 30 layer weights in a CUDA graph at the
  default config, the old rule and a few split-``K`` configs.

**Reading it.** ``teacher_forced``: ``quantized`` below ``bf16`` in ``rel_median`` means the exact
products are closer to float32 than bfloat16 weights are; ``matched``'s ``quantized-round vs
bf16`` at >= 95% means the divergence is the bf16 path's weight rounding, not a kernel error.
``sites``: where the quantized step's extra time goes (``us_per_step``), against bf16.

Findings: none recorded yet (the lead runs it; add them here or in benchmarks/gpu/quant/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "proto")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

#: the engine sizes of tests/test_batched_engine_gpu.py's ``_engines`` (same attention splits and step shapes)
ENGINE_KW = dict(max_sessions=4, max_context=512, max_tree_width=32, max_tree_depth=10, batch_buckets=(1, 2, 4),
                 width_buckets=(1, 4, 8, 16, 32))
#: the linear sites of a llama layer (``LlamaModel.layers`` keys) and the LM head
SITES = ("qkv", "o", "gate_up", "down")
#: GPU cycles slept before an eager step whose linears are timed (~50 ms: every launch queues behind it)
SLEEP_CYCLES = 100_000_000


def log(msg: str) -> None:
    print(f"[quant-diag] {msg}", flush=True)


@contextlib.contextmanager
def round_weights(on: bool):
    """``kernels.quant.triton.ROUND_WEIGHTS`` set to ``on`` inside the block."""
    from kernels.quant import triton as QT

    old, QT.ROUND_WEIGHTS = QT.ROUND_WEIGHTS, on
    try:
        yield
    finally:
        QT.ROUND_WEIGHTS = old


@contextlib.contextmanager
def old_config_rule():
    """``kernels.quant.triton.config_for`` as before the small-shape change (no unrolling, no
    split): ``BLOCK_N`` 16 / 32 / 64, 4 warps, 2 stages."""
    from kernels.quant import triton as QT

    old = QT.config_for

    def rule(n, k, qtype, stride=None):
        return QT.Config(16 if n <= 4096 else (32 if n <= 16384 else 64), 4, 2)

    QT.config_for = rule
    try:
        yield
    finally:
        QT.config_for = old


def load_models(path: str, device: torch.device, dtype: torch.dtype) -> dict:
    """``quantized`` (GGUF blocks, ``dtype`` activations), ``bf16`` (dequantized at load to
    ``dtype``) and ``float32`` (dequantized to float32: the oracle) models of ``path``."""
    from target_service.models import load_model

    return {"quantized": load_model(path, device=device, dtype=dtype, weights="quantized"),
            "bf16": load_model(path, device=device, dtype=dtype, weights="bf16"),
            "float32": load_model(path, device=device, dtype=torch.float32, weights="bf16")}


def greedy_streams(engine, prompts: list[list[int]], n: int, timer=None) -> list[list[int]]:
    """``n`` greedy tokens of each prompt, one session at a time (prefill, then root-only verifies),
    as ``tests.test_batched_engine.ar_stream``; ``timer`` (a ``bench.gpu._Timer``) records the
    device time of every replayed step."""
    from target_service.engine import Sampling

    s = Sampling.checked(0.0, 0, 0.0, 0)
    out = []
    with (timer if timer is not None else contextlib.nullcontext()):
        for i, p in enumerate(prompts):
            sid = f"diag{i}"
            toks = [engine.prefill(sid, p, s, []).first_token]
            for _ in range(n - 1):
                toks.append(engine.verify(sid, [toks[-1]], [-1]).bonus_token)
            engine.release([sid])
            out.append(toks)
    return out


def matched(a: list[list[int]], b: list[list[int]]) -> dict:
    """Tokens in the matched prefixes of stream pairs (the test's measure) and the first divergence
    ``(prompt, position, a's token, b's token)``."""
    per, first = [], None
    for i, (x, y) in enumerate(zip(a, b)):
        k = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        per.append(k)
        if k < min(len(x), len(y)) and first is None:
            first = (i, k, x[k], y[k])
    total = sum(min(len(x), len(y)) for x, y in zip(a, b))
    return {"matched": sum(per), "of": total, "frac": sum(per) / max(total, 1), "per_prompt": per, "first": first}


@torch.no_grad()
def teacher_forced_logits(model, seq: list[int], first: int, chunk: int = 64) -> torch.Tensor:
    """float32 logits (CPU) ``[len(seq) - 1 - first, V]`` of ``model`` at positions ``first ..
    len(seq) - 2`` (each predicting the next token of ``seq``), the sequence fed in chunks of at
    most ``chunk`` rows over a growing cache (the skinny kernels for <= 64 rows)."""
    dev = model.device
    cache = model.new_cache(len(seq) + 1)
    out = []
    toks = seq[:-1]
    pos = 0
    while pos < len(toks):
        part = toks[pos:pos + chunk]
        n = len(part)
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        o = model.forward(torch.tensor(part, device=dev), torch.arange(pos, pos + n, device=dev), mask, cache)
        model.commit(cache, o, torch.arange(n, device=dev))
        out.append(o.logits.float().cpu())
        pos += n
    return torch.cat(out)[first:]


def logit_errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """Per position (rows of each prompt's logits) relative L2 error against ``ref``: median, p90,
    max; argmax agreement with ``ref``; the ``ref`` top-1 minus top-2 margin where they disagree."""
    rels, agree, total, margins = [], 0, 0, []
    for g, r in zip(got, ref):
        g, r = g.double(), r.double()
        rels += ((g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)).tolist()
        ga, ra = g.argmax(-1), r.argmax(-1)
        agree += int((ga == ra).sum())
        total += ga.numel()
        top2 = r.topk(2, dim=-1).values
        margins += (top2[:, 0] - top2[:, 1])[ga != ra].tolist()
    rels.sort()
    q = (lambda f: rels[min(len(rels) - 1, int(f * len(rels)))]) if rels else (lambda f: float("nan"))
    return {"positions": total, "rel_median": q(0.5), "rel_p90": q(0.9), "rel_max": rels[-1] if rels else float("nan"),
            "rel_mean": statistics.fmean(rels) if rels else float("nan"), "argmax_agree": agree / max(total, 1),
            "disagreements": total - agree, "ref_margin_at_disagreements_median": statistics.median(margins) if margins else None}


class SiteTimer:
    """Time of every linear of a model's forward by site (``qkv``, ``o``, ``gate_up``, ``down``,
    ``lm_head``, ``other``): ``target_service.models.llama.linear``,
    ``target_service.models.layers.linear`` and ``.linear_swiglu`` (the gate-up site) wrapped in
    CUDA events (CPU: ``perf_counter``) while the block runs. :meth:`collect` turns the records into times (after a sync)."""

    def __init__(self, model):
        self.label = {}
        for lw in model.layers:
            for key in SITES:
                if key in lw:
                    self.label[id(lw[key])] = key
        self.label[id(model.lm_head)] = "lm_head"
        self.cuda = model.device.type == "cuda"
        self.records: list = []

    def __enter__(self):
        import target_service.models.layers as LY
        import target_service.models.llama as LL

        self._mods = [(m, "linear", m.linear) for m in (LL, LY)] + [(LY, "linear_swiglu", LY.linear_swiglu)]

        def timed(orig):
            def call(x, weight, *args):
                lab = self.label.get(id(weight), "other")
                if self.cuda:
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    y = orig(x, weight, *args)
                    e.record()
                else:
                    s = time.perf_counter()
                    y = orig(x, weight, *args)
                    e = time.perf_counter()
                self.records.append((lab, s, e))
                return y
            return call

        # (llama's and layers' ``linear`` are the same function, kernels.linear.linear)
        wrapped = {"linear": timed(LL.linear), "linear_swiglu": timed(LY.linear_swiglu)}
        for m, name, _ in self._mods:
            setattr(m, name, wrapped[name])
        return self

    def __exit__(self, *exc):
        for m, name, f in self._mods:
            setattr(m, name, f)

    def collect(self) -> tuple[dict[str, list[float]], float]:
        """``({site: [microseconds per call]}, span in microseconds from the first call's start to
        the last's end)``; clears the records."""
        if self.cuda:
            torch.cuda.synchronize()
            us = [(lab, s.elapsed_time(e) * 1e3) for lab, s, e in self.records]
            span = self.records[0][1].elapsed_time(self.records[-1][2]) * 1e3 if self.records else 0.0
        else:
            us = [(lab, (e - s) * 1e6) for lab, s, e in self.records]
            span = (self.records[-1][2] - self.records[0][1]) * 1e6 if self.records else 0.0
        self.records = []
        out: dict[str, list[float]] = {}
        for lab, t in us:
            out.setdefault(lab, []).append(t)
        return out, span


@torch.no_grad()
def site_times(model, prompt: list[int], steps: int) -> dict:
    """Per linear site, the device time of an eager AR step's linears (module docstring): a fresh
    eager engine, ``steps`` root-only verifies each queued behind a GPU sleep; per site the calls
    per step, the median microseconds per call and per step; the span of the step's linears."""
    from target_service.batched_engine import BatchedEngine
    from target_service.engine import Sampling

    eng = BatchedEngine(model, cuda_graphs=False, **ENGINE_KW)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    tok = eng.prefill("site", prompt, s, []).first_token
    tok = eng.verify("site", [tok], [-1]).bonus_token               # compile, warm
    per_step: dict[str, list[tuple[int, float, float]]] = {}
    spans = []
    tm = SiteTimer(model)
    with tm:
        for _ in range(steps):
            if tm.cuda:
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP_CYCLES)
            tok = eng.verify("site", [tok], [-1]).bonus_token
            got, span = tm.collect()
            spans.append(span)
            for lab, ts in got.items():
                per_step.setdefault(lab, []).append((len(ts), statistics.median(ts), sum(ts)))
    eng.release(["site"])
    out = {}
    for lab, rows in per_step.items():
        out[lab] = {"calls_per_step": rows[0][0], "us_per_call": statistics.median(r[1] for r in rows),
                    "us_per_step": statistics.median(r[2] for r in rows)}
    return {"sites": out, "linear_us_per_step": sum(v["us_per_step"] for v in out.values()),
            "span_us": statistics.median(spans) if spans else 0.0}


def graph_us(fn, calls: int, reps: int = 10) -> float:
    """Microseconds per call of ``fn(i)``, ``i`` = 0 .. calls - 1, captured in one CUDA graph and
    replayed (median over ``reps``; the launches queued behind a sleep)."""
    fn(0)
    torch.cuda.synchronize()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn(0)
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(1_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


@torch.no_grad()
def site_configs(model) -> dict:
    """Per site of the quantized model, ``kernels.quant.triton.linear`` alone at ``M = 1`` over
    the model's layer weights (every layer once per graph; the LM head 8 times) at the default
    config, the old rule (no unrolling) and up to two split-``K`` configs that fit (``BLOCK_N``
    16, the largest unroll): microseconds per call (``tools/sweep_quant.py --smollm`` tries many
    more, on random weights)."""
    from kernels.quant import QuantizedWeight
    from kernels.quant import triton as QT

    out = {}
    groups = {key: [lw[key] for lw in model.layers if isinstance(lw.get(key), QuantizedWeight)] for key in SITES}
    if isinstance(model.lm_head, QuantizedWeight):
        groups["lm_head"] = [model.lm_head] * 8
    for key, ws in groups.items():
        if not ws:
            continue
        n, k = ws[0].shape
        qt = ws[0].qtype
        x = torch.randn(1, k, device=model.device, dtype=model.dtype)
        default = QT.config_for(n, k, qt, ws[0].block_stride)
        with old_config_rule():
            old = QT.config_for(n, k, qt, ws[0].block_stride)
        cands = {"default": default, "old rule": old}
        nb = k // ws[0].block_elems
        splits = [sk for sk in (2, 3, 4, 6) if nb % sk == 0 and -(-n // 16) * sk <= 4 * 132][:2]
        for sk in splits:                   # each a compile: two per site at most
            u = max(d for d in (1, 2, 3, 4, 6, 8) if (nb // sk) % d == 0)
            cands[f"split_k={sk}"] = QT.Config(16, 4, 2, u, sk)
        row = {"type": qt.name, "n": n, "k": k, "weights": len(ws), "configs": {}}
        for name, cfg in cands.items():
            try:
                row["configs"][name] = {"config": str(cfg), "us": graph_us(lambda i: QT.linear(x, ws[i], config=cfg), len(ws))}
            except Exception as e:  # noqa: BLE001 - reported
                row["configs"][name] = {"config": str(cfg), "error": repr(e)[:200]}
        out[key] = row
    return out


def smoke_model(d: str) -> str:
    """A tiny llama file like SmolLM2 Q4_1 (Q4_1 projections, a Q8_0 tied embedding), in ``d``."""
    from gguf import GGMLQuantizationType as T

    from fixtures.tiny_models import write_tiny_llama

    path = os.path.join(d, "tiny-q4_1.gguf")
    write_tiny_llama(path, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, tied=True, tensor_type=T.Q4_1,
                     tensor_types={"token_embd.weight": T.Q8_0})
    return path


def run(args) -> dict:
    from runtime.tokenizer import GGUFTokenizer
    from target_service.batched_engine import BatchedEngine

    from tests.conftest import PROMPTS

    t_all = time.perf_counter()
    phases: dict[str, float] = {}
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    res: dict = {"model": os.path.basename(args.model), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                 "dtype": args.dtype, "tokens": args.tokens, "phases_s": phases}
    t = time.perf_counter()
    tok = GGUFTokenizer.from_gguf(args.model)
    prompts = [tok.encode(p) for p in PROMPTS[:args.prompts]]
    models = load_models(args.model, dev, dtype)
    phases["load"] = time.perf_counter() - t
    log(f"{res['device']}: models loaded in {phases['load']:.1f} s; {len(prompts)} prompts x {args.tokens} tokens")

    # ---------------------------------------------------------------- greedy streams per engine
    timer_cls = None
    if cuda:
        from bench.gpu import _Timer as timer_cls
    streams, step_ms, engines = {}, {}, {}
    runs = [("quantized", "quantized", False), ("quantized-round", "quantized", True), ("bf16", "bf16", False),
            ("float32", "float32", False)]
    for name, key, rw in runs:
        t = time.perf_counter()
        with round_weights(rw):
            eng = BatchedEngine(models[key], cuda_graphs=cuda, **ENGINE_KW)
            tm = timer_cls(eng) if timer_cls else None
            streams[name] = greedy_streams(eng, prompts, args.tokens, tm)
        engines[name] = eng
        if tm is not None and tm.times:
            step_ms[name] = statistics.median(tm.times)
        phases[f"streams {name}"] = time.perf_counter() - t
        log(f"{name}: {len(prompts)} streams in {phases[f'streams {name}']:.1f} s"
            + (f", AR step {step_ms[name]:.3f} ms device" if name in step_ms else ""))
    if cuda:
        t = time.perf_counter()
        with old_config_rule():
            eng = BatchedEngine(models["quantized"], cuda_graphs=True, **ENGINE_KW)
            tm = timer_cls(eng)
            n_old = min(args.tokens, 64)
            old = greedy_streams(eng, prompts[:2], n_old, tm)
        step_ms["quantized (old rule)"] = statistics.median(tm.times)
        res["old_rule_tokens_equal"] = old == [s[:n_old] for s in streams["quantized"][:2]]
        phases["streams old rule"] = time.perf_counter() - t
    res["ar_step_device_ms"] = step_ms
    pairs = [("quantized", "bf16"), ("quantized-round", "bf16"), ("quantized", "float32"), ("bf16", "float32"),
             ("quantized-round", "float32"), ("quantized", "quantized-round")]
    res["matched"] = {f"{a} vs {b}": matched(streams[a], streams[b]) for a, b in pairs}
    res["streams"] = streams

    # ---------------------------------------------------------------- teacher-forced logits
    t = time.perf_counter()
    seqs = [p + s for p, s in zip(prompts, streams["float32"])]
    logits = {}
    for name, key, rw in runs:
        with round_weights(rw):
            logits[name] = [teacher_forced_logits(models[key], q, len(p) - 1) for p, q in zip(prompts, seqs)]
    ref = logits["float32"]
    res["teacher_forced"] = {f"{name} vs float32": logit_errors(logits[name], ref) for name in ("quantized", "quantized-round", "bf16")}
    res["teacher_forced"]["quantized vs bf16"] = logit_errors(logits["quantized"], logits["bf16"])
    # sanity: the oracle's forward picks the float32 engine's own tokens (other attention kernels)
    hits = sum(int((r.argmax(-1) == torch.tensor(s)).sum()) for r, s in zip(ref, streams["float32"]))
    res["oracle_forward_agrees_with_its_engine"] = hits / max(1, sum(len(s) for s in streams["float32"]))
    phases["teacher forcing"] = time.perf_counter() - t

    # ---------------------------------------------------------------- where the step's time goes
    if not args.no_profile:
        t = time.perf_counter()
        res["sites"] = {name: site_times(models[name], prompts[0], args.profile_steps) for name in ("quantized", "bf16")}
        if cuda:
            from bench.gpu import profile_step

            res["families"] = {name: profile_step(engines[name], 1) for name in ("quantized", "bf16")}
            if not args.no_configs:
                res["site_configs"] = site_configs(models["quantized"])
        phases["profile"] = time.perf_counter() - t
    phases["total"] = time.perf_counter() - t_all
    return res


def summary(res: dict) -> list[str]:
    """The result as text lines."""
    L = [f"quant-diag {res['model']} on {res['device']} ({res['dtype']} activations), {res['tokens']} greedy tokens a prompt"]
    L.append("greedy streams, tokens in matched prefixes (the test asks >= 95% for quantized vs bf16):")
    for k, m in res["matched"].items():
        L.append(f"  {k:32s} {m['matched']:5d}/{m['of']:<5d} ({100 * m['frac']:5.1f}%)  first divergence "
                 f"(prompt, position, a, b): {m['first']}")
    L.append("teacher-forced logits (the float32 engine's sequences), relative L2 error per position "
             f"(the float32 forward picks its engine's tokens at {100 * res['oracle_forward_agrees_with_its_engine']:.1f}% "
             "of them):")
    for k, e in res["teacher_forced"].items():
        mg = e["ref_margin_at_disagreements_median"]
        L.append(f"  {k:32s} median {e['rel_median']:.2e}  p90 {e['rel_p90']:.2e}  max {e['rel_max']:.2e}  "
                 f"argmax agrees {100 * e['argmax_agree']:5.1f}% ({e['disagreements']} differ"
                 + (f", ref margin there {mg:.3f})" if mg is not None else ")"))
    if res.get("ar_step_device_ms"):
        L.append("AR step, device ms (graph replay): " + ", ".join(f"{k} {v:.3f}" for k, v in res["ar_step_device_ms"].items()))
    if "old_rule_tokens_equal" in res:
        L.append(f"old config rule (no unrolling) gives the same tokens: {res['old_rule_tokens_equal']}")
    for name, st in res.get("sites", {}).items():
        L.append(f"linears of one eager AR step, {name}: {st['linear_us_per_step']:.0f} us of a {st['span_us']:.0f} us span")
        for lab, v in sorted(st["sites"].items(), key=lambda kv: -kv[1]["us_per_step"]):
            L.append(f"  {lab:8s} {v['calls_per_step']:3d} calls x {v['us_per_call']:7.1f} us = {v['us_per_step']:8.1f} us")
    for name, f in res.get("families", {}).items():
        L.append(f"kernel families of one eager AR step (profiler), {name}: {f['device_us']:.0f} us in {f['kernels']} kernels")
        for fam, v in list(f["families"].items())[:8]:
            L.append(f"  {fam:24s} {v['count']:4d} x = {v['us']:8.1f} us")
    for key, row in res.get("site_configs", {}).items():
        cfgs = "; ".join(f"{n} {c['us']:.1f} us" if "us" in c else f"{n} failed" for n, c in row["configs"].items())
        L.append(f"  {key:8s} {row['type']} {row['n']}x{row['k']} at M=1 (graph over {row['weights']} weights): {cfgs}")
    L.append("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in res["phases_s"].items()))
    return L


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the SmolLM2 Q4_1 GGUF (default: runtime.defaults.default_model_path())")
    p.add_argument("--out", default=None, help="JSON of everything")
    p.add_argument("--prompts", type=int, default=8, help="prompts of tests/conftest.py PROMPTS")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens a prompt")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="activations of quantized and bf16")
    p.add_argument("--profile-steps", type=int, default=8, help="eager AR steps timed per linear site")
    p.add_argument("--no-profile", action="store_true", help="skip the step-time part")
    p.add_argument("--no-configs", action="store_true", help="skip the per-site config timings (their compiles)")
    p.add_argument("--smoke", action="store_true", help="CPU self-test: a tiny Q4_1 file, 2 prompts x 6 tokens")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        if args.smoke:
            args.model = smoke_model(d)
            args.prompts, args.tokens, args.profile_steps = min(args.prompts, 2), min(args.tokens, 6), 2
        elif args.model is None:
            from runtime.defaults import default_model_path

            args.model = default_model_path()
        res = run(args)
    print("\n".join(summary(res)), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
