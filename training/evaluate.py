"""Acceptance length τ of a drafter on HumanEval and held-out ShareGPT prompts, chain and tree.

    python -m training.evaluate --drafter DRAFTER.gguf [--target T.gguf] \\
        [--datasets sharegpt,humaneval] [--modes chain,tree] [--num-prompts 0] \\
        [--method replay|engine|both] [--engine-prompts 16] \\
        [--max-new-tokens 256] [--tree-budget 31 --tree-top-k 4] [--out results.json]

Greedy decoding (temperature 0); τ = tokens emitted per target forward (verify). Two methods:

* ``engine``: the project's :class:`target_service.engine.TargetEngine` and the drafter in
  process, one prompt and one verify at a time (:func:`training.train.measure_tau`). The
  reference; slow (one Python round trip per verify).
* ``replay`` (default): the target's greedy continuations and features from transformers in
  batches, then the speculative steps replayed with the drafter's blocks of many prompts in one
  forward (:func:`training.replay.replay_tau`; the same steps and counts as the engine,
  tested equal on CPU). Minutes instead of hours for all 164 HumanEval problems.
* ``both``: replay on every prompt and the engine on the first ``--engine-prompts`` of each
  dataset; each engine run is paired with the replay over the same prompts (τ of both and the
  number of prompts whose emitted tokens are identical), to show the agreement on real prompts.

Prompts: the target's chat template around each user message; ShareGPT prompts are the held-out
split (:func:`training.data.heldout_prompts`, never trained on), HumanEval
:func:`training.data.humaneval_prompts`; ``--prompts-file`` (from ``python -m
training.data export``) replaces both packages. ``--num-prompts 0`` takes every prompt.
Tree mode uses DDTree (:func:`draft_service.tree.build_tree`). Results go to ``--out`` as JSON
and a table on stdout.
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
    from training import data

    if prompts_file:
        got = data.load_prompts_file(prompts_file)
        return got["heldout"] if dataset == "sharegpt" else got["humaneval"]
    return data.heldout_prompts() if dataset == "sharegpt" else data.humaneval_prompts()


def tree_builder(budget: int, top_k: int):
    """``(root, logits) -> (tokens, parents)`` with DDTree (:func:`draft_service.tree.build_tree`)."""
    from draft_service.tree import build_tree

    return lambda root, logits: build_tree(root, logits, budget, top_k)


def _row(d: str, m: str, method: str, r: dict[str, Any]) -> str:
    return (f"{d:<10} {m:<6} {method:<7} {r['prompts']:>7} {r['tau']:>6.3f} {r['tokens']:>7} {r['steps']:>8} "
            f"{r.get('wall_s', r['seconds']):>7.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--drafter", required=True, help="drafter GGUF")
    ap.add_argument("--target", default=None, help="target GGUF (default: target_service.default_model_path())")
    ap.add_argument("--datasets", default="sharegpt,humaneval")
    ap.add_argument("--modes", default="chain,tree")
    ap.add_argument("--method", choices=["replay", "engine", "both"], default="replay")
    ap.add_argument("--num-prompts", type=int, default=0, help="prompts per dataset (0: all)")
    ap.add_argument("--engine-prompts", type=int, default=16, help="with --method both: prompts per dataset run through the engine too")
    ap.add_argument("--max-prompt-tokens", type=int, default=2048, help="skip longer (chat-templated) prompts")
    ap.add_argument("--prompt-indices", default=None,
                    help="comma-separated indices into each dataset's prompt list: evaluate only these (after --max-prompt-tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tree-budget", type=int, default=31, help="non-root tree nodes (tree mode)")
    ap.add_argument("--tree-top-k", type=int, default=4, help="candidates per depth (tree mode)")
    ap.add_argument("--batch-size", type=int, default=128, help="replay: prompts per transformers batch")
    ap.add_argument("--group", type=int, default=16, help="replay: prompts per drafter forward")
    ap.add_argument("--prompts-file", default=None, help="JSON from `python -m training.data export`")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="target and drafter dtype")
    ap.add_argument("--out", default=None, help="results JSON (default: next to the drafter, <name>.eval.json)")
    args = ap.parse_args(argv)

    from training.data import encode_prompts, load_hf_target
    from draft_service.drafter import DFlashDrafter
    from draft_service.gguf_io import load_drafter
    from training.replay import replay_prompts
    from training.train import build_target_engine, measure_tau, resolve_device
    from runtime.gguf_loader import open_gguf
    from runtime.tokenizer import GGUFTokenizer

    if args.target is None:
        from runtime.defaults import default_model_path

        args.target = default_model_path()
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    target = open_gguf(args.target)
    tok = GGUFTokenizer.from_gguf(target)
    stop = tok.eos_token_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    drafter = load_drafter(args.drafter, target, device=device, dtype=dtype)
    datasets = [d for d in args.datasets.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    trees: dict[str, Any] = {}
    for m in modes:
        if m == "chain":
            trees[m] = None
        elif m == "tree":
            trees[m] = tree_builder(args.tree_budget, args.tree_top_k)
        else:
            raise SystemExit(f"unknown mode {m!r} (chain, tree)")
    n = args.num_prompts or None
    prompts = {d: encode_prompts(tok, load_prompt_texts(d, args.prompts_file), n, args.max_prompt_tokens)[0] for d in datasets}
    if args.prompt_indices:
        pick = [int(i) for i in args.prompt_indices.split(",") if i.strip()]
        prompts = {d: [ps[i] for i in pick if 0 <= i < len(ps)] for d, ps in prompts.items()}
    results: dict[str, Any] = {
        "drafter": os.path.abspath(args.drafter),
        "target": os.path.abspath(args.target),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "dtype": args.dtype,
        "method": args.method,
        "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "block_size": drafter.config.block_size,
        "tree_budget": args.tree_budget,
        "tree_top_k": args.tree_top_k,
        "command": "python -m training.evaluate " + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs": [],
    }
    print(f"{'dataset':<10} {'mode':<6} {'method':<7} {'prompts':>7} {'tau':>6} {'tokens':>7} {'verifies':>8} {'wall_s':>7}", flush=True)
    replayed: dict[tuple[str, str], dict[str, Any]] = {}
    if args.method in ("replay", "both"):
        hf = load_hf_target(args.target, device, dtype)
        for d in datasets:
            got = replay_prompts(drafter, hf, prompts[d], args.max_new_tokens, trees, stop_tokens=stop,
                                 pad_token_id=pad, batch_size=args.batch_size, group=args.group)
            for m, r in got.items():
                replayed[(d, m)] = r
                rec = {k: v for k, v in r.items() if k != "outputs"}
                rec.update(dataset=d, mode=m, method="replay", wall_s=r["seconds"] + r["target_s"])
                results["runs"].append(rec)
                print(_row(d, m, "replay", rec), flush=True)
        del hf
    if args.method in ("engine", "both"):
        k = args.engine_prompts if args.method == "both" else None
        longest = max((len(p) for ps in prompts.values() for p in ps[:k]), default=1)
        engine = build_target_engine(args.target, device, dtype,
                                     max_context=longest + args.max_new_tokens + drafter.config.block_size + 8)
        for d in datasets:
            for m, tree in trees.items():
                t = time.monotonic()
                r = measure_tau(engine, drafter, prompts[d][:k], args.max_new_tokens, tree, stop_tokens=stop)
                rec = {key: v for key, v in r.items() if key != "outputs"}
                rec.update(dataset=d, mode=m, method="engine", wall_s=time.monotonic() - t)
                if (d, m) in replayed:  # the replay over the same prompts
                    rp = replayed[(d, m)]
                    cnt = len(r["outputs"])
                    steps = sum(rp["per_prompt_steps"][:cnt])
                    toks = sum(len(o) - 1 for o in rp["outputs"][:cnt])
                    rec["replay_same_prompts"] = {
                        "tau": toks / steps if steps else float("nan"), "steps": steps, "tokens": toks,
                        "identical_outputs": sum(a == b for a, b in zip(r["outputs"], rp["outputs"])),
                    }
                results["runs"].append(rec)
                print(_row(d, m, "engine", rec)
                      + (f"   replay on these prompts: tau {rec['replay_same_prompts']['tau']:.3f}, "
                         f"{rec['replay_same_prompts']['identical_outputs']}/{cnt} identical outputs"
                         if "replay_same_prompts" in rec else ""), flush=True)
    out = args.out or os.path.splitext(args.drafter)[0] + ".eval.json"
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
