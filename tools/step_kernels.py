"""Every kernel of one eager speculative step, in launch order (GPU; issue 18).

    python tools/step_kernels.py --model TARGET.gguf [--drafter DRAFTER.gguf] [--budget 15]
                                 [--top-k 4] [--graphs] [--out FILE.txt]

The two services' plain-Python APIs in this process, as :mod:`tools.host_profile` builds them,
eager (``cuda_graphs=False`` in both) or with ``--graphs`` replaying their CUDA graphs (the
profiler still sees each kernel, and the gaps are then the device's own): one
Propose of one session (the default tree), one Verify of its tree, and one Verify of a root-only
tree (a plain decoding step). For each call the kernels are listed in the order they started,
with device microseconds and the gap before each (device idle between two kernels of the call,
which a launch that is not a dependent launch leaves open). The summary line per call counts the
kernels that are the project's Triton kernels and the rest (PyTorch's copies, gathers and
elementwise ops, cuBLAS), whose launches break a chain of programmatic dependent launches
(:mod:`kernels.pdl`).

Without ``--drafter``: a random drafter of the shipped shape written for the target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [".", "proto", "tools"]

import torch  # noqa: E402


def _kernels(fn) -> list[tuple[float, float, str]]:
    """``(start us, duration us, name)`` of every device kernel / memcpy / memset of one ``fn()``,
    ordered by start."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start = e.time_range.start
        out.append((float(start), float(e.time_range.end - start), e.name))
    out.sort()
    return out


def _triton(name: str) -> bool:
    return name.startswith("_") or "triton" in name.lower()


def report(label: str, ks: list[tuple[float, float, str]]) -> list[str]:
    """Lines for one call's kernels: a summary, then one line per kernel."""
    if not ks:
        return [f"## {label}: no kernels"]
    first, last = ks[0][0], max(s + d for s, d, _ in ks)
    busy = sum(d for _, d, _ in ks)
    ours = sum(1 for _, _, n in ks if _triton(n))
    lines = [f"## {label}: {len(ks)} kernels ({ours} ours, {len(ks) - ours} others), busy {busy:.1f} us, "
             f"span {last - first:.1f} us", "start_us  dur_us  gap_us  name"]
    end = first
    for s, d, n in ks:
        lines.append(f"{s - first:8.1f} {d:7.1f} {max(0.0, s - end):7.1f}  {'' if _triton(n) else '* '}{n[:110]}")
        end = max(end, s + d)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target GGUF")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--graphs", action="store_true",
                    help="replay the services' CUDA graphs (the profiler sees their kernels with the real gaps)")
    ap.add_argument("--device", default="cuda", help="cuda (the point), or cpu for a smoke run (no kernels)")
    args = ap.parse_args(argv)

    from client.launcher import drafter_feature_layers
    from dflash_grpc.localhop import LocalContext
    from dflash_grpc.v1 import draft_pb2, target_pb2
    from draft_service.servicer import DraftServiceServicer
    from orchestrator.scheduler import join_features
    from runtime.device_time import device_seconds
    from runtime.gguf_loader import open_gguf
    from target_service.__main__ import build_servicer
    from target_service.config import TargetConfig

    g = open_gguf(args.model)
    drafter = args.drafter
    if drafter is None:
        from draft_service.init_random import write_random_drafter

        drafter = os.path.join(tempfile.mkdtemp(prefix="step-kernels-"), "random-drafter.gguf")
        write_random_drafter(g, drafter, layers=3, block_size=16, num_target_layers=5)
    layers = drafter_feature_layers(drafter) or []
    target = build_servicer(TargetConfig(model=args.model, device=args.device, feature_layers=tuple(layers),
                                         max_sessions=4, cuda_graphs=args.graphs))
    draft = DraftServiceServicer.from_paths(drafter, args.model, device=args.device, max_sessions=4,
                                            cuda_graphs=args.graphs)
    ctx = LocalContext(())
    vocab = draft.info().model.vocab_size
    block = draft.info().model.block_size
    prompt = torch.randint(0, min(vocab, 1000), (150,), generator=torch.Generator().manual_seed(0)).tolist()
    preq = target_pb2.PrefillRequest()
    item = preq.items.add(session_id="s", feature_layer_ids=layers)
    item.prompt_tokens.extend(prompt)
    pres = target._prefill(preq, ctx, None).results[0]
    state = {"root": pres.first_token, "length": pres.committed_length, "features": [pres.features], "tree": None}

    def propose():
        req = draft_pb2.ProposeRequest()
        it = req.items.add(session_id="s", root_token=state["root"], committed_length=state["length"])
        feats = join_features(state["features"])
        if feats is not None:
            it.features.CopyFrom(feats)
        it.tree.top_k, it.tree.max_depth, it.tree.budget = args.top_k, block - 1, args.budget
        res = draft.propose(req, None).results[0]
        if res.status.code:
            raise RuntimeError(res.status.message)
        state["tree"] = (list(res.tree.tokens), list(res.tree.parents))
        state["features"] = []   # (every row sent)

    def verify(tokens, parents):
        req = target_pb2.VerifyRequest()
        t = req.items.add(session_id="s").tree
        t.tokens.extend(tokens)
        t.parents.extend(parents)
        res = next(target._verify(iter([req]), None)).results[0]
        if res.status.code:
            raise RuntimeError(res.status.message)
        state["root"], state["length"] = res.bonus_token, res.committed_length
        state["features"].append(res.features)

    lines = [f"# step_kernels: {os.path.basename(args.model)}, drafter {os.path.basename(drafter)}, "
             f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, {'graphs' if args.graphs else 'eager'}; '* ' = not a Triton kernel of ours"]
    for _ in range(3):   # warm-up: every kernel compiled, the session some steps in
        propose()
        verify(*state["tree"])
        verify([state["root"]], [-1])
    # without the profiler: each call's device time from the steps' own CUDA events
    # (runtime.device_time) and its wall time, medians of 30 steps
    timed = {"propose": [], "verify": [], "plain": []}
    for _ in range(30):
        for key, fn in (("propose", propose), ("verify", lambda: verify(*state["tree"])),
                        ("plain", lambda: verify([state["root"]], [-1]))):
            d0, t0 = device_seconds(), time.perf_counter()
            fn()
            timed[key].append(((device_seconds() - d0) * 1e6, (time.perf_counter() - t0) * 1e6))
    for key, xs in timed.items():
        lines.append(f"# {key}: step events {statistics.median(d for d, _ in xs):.1f} us device, "
                     f"{statistics.median(w for _, w in xs):.1f} us wall (medians of {len(xs)})")
    lines += report("propose (default tree)", _kernels(propose))
    lines += report(f"verify ({len(state['tree'][0])}-node tree)", _kernels(lambda: verify(*state["tree"])))
    lines += report("verify (root only: a plain step)", _kernels(lambda: verify([state["root"]], [-1])))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
