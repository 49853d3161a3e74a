"""``dflash-grpc bench``: acceptance length (tau) and speed of chain vs tree drafting.

Starts the three services on loopback (as ``demo`` does), runs every prompt with every drafting
configuration at temperature 0, and reports per configuration: tau (tokens per target forward),
draft tokens per forward, acceptance rate per depth, tokens/s, and whether every completion
equals target-only decoding (configuration ``ar``, which is always run first). Writes a text table
and, with ``--json``, the raw numbers.

Configurations: ``ar`` (no drafter), ``chain`` (greedy chain of block_size - 1), and
``tree:BUDGET:TOPK`` (DDTree with at most BUDGET nodes, TOPK candidates per depth).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Sequence

from client import AcceptanceStats, Client


@dataclasses.dataclass
class BenchConfig:
    """One drafting configuration of the benchmark."""

    name: str
    speculative: bool
    tree_budget: int | None = None
    top_k: int | None = None

    @classmethod
    def parse(cls, text: str) -> "BenchConfig":
        """``ar`` | ``chain`` | ``tree:BUDGET:TOPK`` (raises ``ValueError`` otherwise)."""
        if text == "ar":
            return cls("ar", False)
        if text == "chain":
            return cls("chain", True, 0, 1)
        parts = text.split(":")
        if len(parts) == 3 and parts[0] == "tree":
            return cls(text, True, int(parts[1]), int(parts[2]))
        raise ValueError(f"bad configuration {text!r}: use ar, chain or tree:BUDGET:TOPK")

    def kwargs(self) -> dict[str, Any]:
        if not self.speculative:
            return {"speculative": False}
        return {"speculative": True, "tree_budget": self.tree_budget, "top_k_draft": self.top_k}


def _merge(stats: list[AcceptanceStats]) -> dict[str, Any]:
    hist: list[int] = []
    acc: list[int] = []
    drafted: list[int] = []
    tot = {"generated_tokens": 0, "target_forwards": 0, "draft_tokens": 0, "accepted_tokens": 0, "decode_time_s": 0.0, "drafts": 0,
           "draft_time_s": 0.0, "verify_time_s": 0.0, "draft_compute_s": 0.0, "verify_compute_s": 0.0}
    for s in stats:
        for key in tot:
            tot[key] += getattr(s, key)
        for dst, src in ((hist, s.acceptance_length_histogram), (acc, s.accepted_per_position), (drafted, s.drafted_per_position)):
            dst.extend([0] * (len(src) - len(dst)))
            for i, v in enumerate(src):
                dst[i] += v
    forwards = sum(hist)
    per_step = 1000.0 / forwards if forwards else 0.0
    return {
        **tot,
        # milliseconds per target forward (= per speculative step): the services' compute, the
        # rest of the Propose / Verify round trips (gRPC, serialisation, queueing) and the
        # orchestrator's own time between them
        "step_ms": {
            "total": tot["decode_time_s"] * per_step,
            "draft_compute": tot["draft_compute_s"] * per_step,
            "verify_compute": tot["verify_compute_s"] * per_step,
            "grpc_and_queue": (tot["draft_time_s"] - tot["draft_compute_s"] + tot["verify_time_s"] - tot["verify_compute_s"]) * per_step,
            "orchestrator": (tot["decode_time_s"] - tot["draft_time_s"] - tot["verify_time_s"]) * per_step,
        },
        "tau": sum(t * c for t, c in enumerate(hist)) / forwards if forwards else 0.0,
        "tokens_per_second": tot["generated_tokens"] / tot["decode_time_s"] if tot["decode_time_s"] else 0.0,
        "draft_tokens_per_forward": tot["draft_tokens"] / forwards if forwards else 0.0,
        "acceptance_per_depth": [a / d if d else 0.0 for a, d in zip(acc, drafted)],
        "acceptance_length_histogram": hist,
    }


def run_bench(address: str, prompts: Sequence[str], configs: Sequence[BenchConfig], max_tokens: int,
              timeout: float | None = None, progress=None) -> dict[str, Any]:
    """Run every prompt under every configuration against a running orchestrator.

    Returns:
        ``{"configs": {name: merged stats + "lossless": bool}, "prompts": n, "max_tokens": m}``;
        ``lossless`` compares each completion's token ids with the ``ar`` run of the same prompt.
    """
    if not configs or configs[0].name != "ar":
        configs = [BenchConfig.parse("ar"), *[c for c in configs if c.name != "ar"]]
    out: dict[str, Any] = {"prompts": len(prompts), "max_tokens": max_tokens, "configs": {}}
    reference: list[list[int]] = []
    with Client(address, timeout=timeout) as c:
        for cfg in configs:
            stats, same = [], True
            t0 = time.monotonic()
            for i, prompt in enumerate(prompts):
                res = c.generate(prompt=prompt, max_tokens=max_tokens, **cfg.kwargs())
                stats.append(res.stats)
                if cfg.name == "ar":
                    reference.append(res.token_ids)
                else:
                    same = same and res.token_ids == reference[i]
                if progress:
                    progress(cfg.name, i + 1, len(prompts))
            out["configs"][cfg.name] = {**_merge(stats), "lossless": same, "wall_s": time.monotonic() - t0}
    return out


def format_table(result: dict[str, Any]) -> str:
    """The benchmark as a fixed-width text table."""
    lines = [
        f"{result['prompts']} prompts, up to {result['max_tokens']} new tokens each, temperature 0",
        f"{'config':<14} {'tau':>6} {'draft/fwd':>9} {'tok/s':>8} {'tokens':>7} {'forwards':>8} {'lossless':>8} "
        f"{'ms/step: draft':>14} {'verify':>6} {'rpc':>5} {'orch':>5}  acceptance by depth",
    ]
    for name, r in result["configs"].items():
        depth = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"][:8])
        lines.append(
            f"{name:<14} {r['tau']:>6.3f} {r['draft_tokens_per_forward']:>9.1f} {r['tokens_per_second']:>8.2f} "
            f"{r['generated_tokens']:>7} {r['target_forwards']:>8} {'yes' if r['lossless'] else 'NO':>8} "
            f"{r['step_ms']['draft_compute']:>14.2f} {r['step_ms']['verify_compute']:>6.2f} {r['step_ms']['grpc_and_queue']:>5.2f} "
            f"{r['step_ms']['orchestrator']:>5.2f}  {depth}"
        )
    return "\n".join(lines)


def dump_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
