"""Acceptance length τ of a drafter on HumanEval and held-out ShareGPT prompts, chain and tree.

    python -m draft_service.evaluate --drafter DRAFTER.gguf [--target T.gguf] \\
        [--datasets sharegpt,humaneval] [--modes chain,tree] [--num-prompts 20] \\
        [--max-new-tokens 256] [--tree-budget 31 --tree-top-k 4] [--out results.json]

Greedy decoding (temperature 0) with the project's :class:`target_service.engine.TargetEngine`
and the drafter in process (:func:`draft_service.train.measure_tau`): τ = tokens emitted per
target forward. Prompts: the target's chat template around each user message; ShareGPT prompts
are the held-out split (:func:`draft_service.data.heldout_prompts`, never trained on), HumanEval
:func:`draft_service.data.humaneval_prompts`; ``--prompts-file`` (from ``python -m
draft_service.data export``) replaces both packages. Tree mode needs
``draft_service.tree.build_tree`` (DDTree). Results go to ``--out`` as JSON and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch


def load_prompt_texts(dataset: str, prompts_file: str | None) -> list[str]:
    from draft_service import data

    if prompts_file:
        got = data.load_prompts_file(prompts_file)
        return got["heldout"] if dataset == "sharegpt" else got["humaneval"]
    return data.heldout_prompts() if dataset == "sharegpt" else data.humaneval_prompts()


def tree_builder(budget: int, top_k: int):
    """``(root, logits) -> (tokens, parents)`` with DDTree, or None when not available."""
    try:
        from draft_service.tree import build_tree
    except ImportError:
        return None
    return lambda root, logits: build_tree(root, logits, budget, top_k)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draft_service.evaluate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--drafter", required=True, help="drafter GGUF")
    ap.add_argument("--target", default=None, help="target GGUF (default: target_service.default_model_path())")
    ap.add_argument("--datasets", default="sharegpt,humaneval")
    ap.add_argument("--modes", default="chain,tree")
    ap.add_argument("--num-prompts", type=int, default=20, help="prompts per dataset")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tree-budget", type=int, default=31, help="non-root tree nodes (tree mode)")
    ap.add_argument("--tree-top-k", type=int, default=4, help="candidates per depth (tree mode)")
    ap.add_argument("--prompts-file", default=None, help="JSON from `python -m draft_service.data export`")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="target and drafter dtype")
    ap.add_argument("--out", default=None, help="results JSON (default: next to the drafter, <name>.eval.json)")
    args = ap.parse_args(argv)

    from draft_service.data import encode_prompts
    from draft_service.drafter import DFlashDrafter
    from draft_service.train import build_target_engine, measure_tau, resolve_device
    from target_service.gguf_loader import open_gguf
    from target_service.tokenizer import GGUFTokenizer

    if args.target is None:
        from target_service import default_model_path

        args.target = default_model_path()
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    target = open_gguf(args.target)
    tok = GGUFTokenizer.from_gguf(target)
    drafter = DFlashDrafter.from_gguf(args.drafter, target, device=device, dtype=dtype)
    datasets = [d for d in args.datasets.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    prompts = {}
    for d in datasets:
        ids, _ = encode_prompts(tok, load_prompt_texts(d, args.prompts_file), args.num_prompts, args.max_prompt_tokens)
        prompts[d] = ids
    longest = max((len(p) for ps in prompts.values() for p in ps), default=1)
    engine = build_target_engine(args.target, device, dtype,
                                 max_context=longest + args.max_new_tokens + drafter.config.block_size + 8)
    results: dict[str, Any] = {
        "drafter": os.path.abspath(args.drafter),
        "target": os.path.abspath(args.target),
        "device": str(device),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "block_size": drafter.config.block_size,
        "runs": [],
    }
    print(f"{'dataset':<10} {'mode':<6} {'prompts':>7} {'tau':>6} {'tokens':>7} {'verifies':>8} {'tok/s':>7}")
    for d in datasets:
        for m in modes:
            tree = None
            if m == "tree":
                tree = tree_builder(args.tree_budget, args.tree_top_k)
                if tree is None:
                    print(f"{d:<10} {m:<6} skipped: draft_service.tree.build_tree is not available")
                    continue
            elif m != "chain":
                raise SystemExit(f"unknown mode {m!r} (chain, tree)")
            t = time.monotonic()
            r = measure_tau(engine, drafter, prompts[d], args.max_new_tokens, tree, stop_tokens=tok.eos_token_ids)
            r.pop("outputs")
            r.update(dataset=d, mode=m, wall_s=time.monotonic() - t)
            if m == "tree":
                r.update(tree_budget=args.tree_budget, tree_top_k=args.tree_top_k)
            results["runs"].append(r)
            print(f"{d:<10} {m:<6} {r['prompts']:>7} {r['tau']:>6.3f} {r['tokens']:>7} {r['steps']:>8} {r['tokens_per_s']:>7.1f}", flush=True)
    out = args.out or os.path.splitext(args.drafter)[0] + ".eval.json"
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
