"""What the measured draft policy sees (issue 23 goal 2): the real scheduler with ``--draft-policy
measured`` over real engines (CUDA: the target and the draft service each in a child process, as
``tools/hop_overhead.py --model`` builds them), one stream, HumanEval-style prompts one after
another; prints every tick the policy observed (mode, tokens, ms) and its rates after each request.

    python tools/policy_trace.py --model T.gguf [--drafter D.gguf] [--requests 4] [--tokens 128]

A diagnostic for GPU runs: the sweep's measured-policy rows (``benchmarks/gpu/concurrency``) cannot
show why a mode was chosen.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [".", "proto", "tools"]

PROMPTS = [
    'def has_close_elements(numbers, threshold):\n    """Check if in given list of numbers, are any two numbers closer to each other than\n    given threshold."""\n',
    'def separate_paren_groups(paren_string):\n    """Input to this function is a string containing multiple groups of nested parentheses.\n    Separate those groups into separate strings and return the list of those."""\n',
    'def truncate_number(number):\n    """Given a positive floating point number, return its decimal part."""\n',
    'def below_zero(operations):\n    """You\'re given a list of deposit and withdrawal operations on a bank account that starts with\n    zero balance. Return True if at any point the balance falls below zero."""\n',
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", default=None, help="default: the drafter shipped for the model")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    import time

    import hop_overhead as H

    from dflash_grpc.v1 import common_pb2, draft_pb2
    from draft_service import shipped_drafter
    from orchestrator.peers import DraftPeer, TargetPeer
    from orchestrator.scheduler import Failure, Request, Scheduler
    from runtime.fingerprint import model_fingerprint
    from runtime.gguf_loader import open_gguf
    from runtime.tokenizer import GGUFTokenizer

    drafter = a.drafter or shipped_drafter(model_fingerprint(open_gguf(a.model)))
    settings = {"model": os.path.abspath(a.model), "drafter": os.path.abspath(drafter), "device": "cuda", "hop": "1"}
    tp, taddr = H.spawn("target", settings)
    dp, daddr = H.spawn("draft", settings)
    try:
        target, draft = TargetPeer(taddr), DraftPeer(daddr)
        target.wait_info(300)
        deadline = time.monotonic() + 300
        while draft.state() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        sched = Scheduler(target, draft, max_sessions=8, draft_policy="measured")
        policy = sched.policy
        seen = []
        observe = policy.observe

        def traced(batch, mode, tokens, seconds):
            seen.append((mode[0], tokens, round(seconds * 1e3, 2)))
            return observe(batch, mode, tokens, seconds)

        policy.observe = traced
        tok = GGUFTokenizer.from_gguf(a.model)
        for j in range(a.requests):
            prompt = tok.encode(PROMPTS[j % len(PROMPTS)])
            req = Request(session_id=f"trace-{j}", prompt=prompt, max_tokens=a.tokens, sampling=common_pb2.SamplingParams(),
                          tree=draft_pb2.TreeParams(budget=15, top_k=4), speculative=True)
            t0 = time.perf_counter()
            sched.submit(req)
            n = 0
            while True:
                ev = req.events.get(timeout=120)
                if isinstance(ev, Failure):
                    print("failure", ev)
                    break
                n += len(ev.tokens)
                if ev.finish:
                    break
            dt = time.perf_counter() - t0
            print(f"request {j}: {n} tokens, {n / dt:.0f} tok/s; speculative {req.speculative}; rates "
                  f"{ {b: {m: round(v) for m, v in r.items()} for b, r in policy.rates().items()} }; choices {policy.choices}; "
                  f"admissions {policy.admissions}; interval {policy.interval(1)}", flush=True)
            print("  observed:", " ".join(f"{m}{t}/{s}" for m, t, s in seen), flush=True)
            seen.clear()
        sched.stop()
    finally:
        for p in (tp, dp):
            p.stdin.close()
            p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
