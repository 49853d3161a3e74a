"""Where a speculative step's host time goes inside the two services (GPU; issue 18's "host" parts).

    python tools/host_profile.py --model TARGET.gguf [--drafter DRAFTER.gguf] [--steps 200]
                                 [--budget 15] [--top-k 4] [--sessions 1] [--out DIR] [--top 30]

Both services' plain-Python APIs run in this process, on CUDA, exactly as their gRPC handlers
call them, with the messages the orchestrator sends (no gRPC, no second process): the target's
:class:`target_service.servicer.TargetServicer` (``_verify``: item decoding, the step loop's inline
batch, the batched engine and its CUDA graphs, the reply) and the draft service's
:class:`draft_service.servicer.DraftServiceServicer` (``propose``). ``--sessions`` sessions (1 by
default) each decode a random 64-token prompt speculatively, in lockstep: one Propose of every
session's item -> one Verify of every session's tree -> ..., the drafter's trees of ``--budget``
nodes, features passed along as the orchestrator passes them (as messages, not the columns the
orchestrator sends from 8 items up: the servicers' parsing differs, the engines' work does not).
With many sessions the per-item host cost under load shows (``host / item``).

Per call (milliseconds, median [min, max] over ``--steps`` calls after 10 of warm-up):
``wall`` (the call, from request to reply message), ``compute`` (the reply's ``compute_s``: the
step loop's batch), ``device`` (CUDA events around each replayed graph of the call) and
``host = wall - device``. Then the same loop under ``cProfile`` (one profiler per service, enabled
only around its calls), the top ``--top`` functions by own time of each written to
``DIR/host-profile.txt`` (and printed). Profiled times are inflated; compare them only with each
other.

Without ``--drafter``: the drafter shipped for the target, else a random drafter of the shipped
drafter's shape written for it (it accepts little: the trees are still full-size).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path[:0] = [".", "proto"]

import torch  # noqa: E402


def _stats(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


class _DeviceTimer:
    """CUDA events around every ``run`` of the given runner classes (target and drafter graphs)."""

    def __init__(self, *classes):
        self.times: list[float] = []
        self._saved = [(c, c.run) for c in classes]

    def __enter__(self):
        timer = self
        for cls, orig in self._saved:
            def run(r, *args, _orig=orig, **kwargs):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = _orig(r, *args, **kwargs)
                e.record()
                e.synchronize()
                timer.times.append(s.elapsed_time(e))
                return out
            cls.run = run
        return self

    def __exit__(self, *exc):
        for cls, orig in self._saved:
            cls.run = orig

    def take(self) -> float:
        t, self.times = sum(self.times), []
        return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target GGUF")
    ap.add_argument("--drafter", default=None, help="drafter GGUF (default: shipped for the target, else random)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--budget", type=int, default=15, help="draft nodes per tree (0: the chain)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=1, help="sessions decoding in lockstep, one batch per call")
    ap.add_argument("--top", type=int, default=30, help="functions listed per profile")
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda", help="cuda (the point), or cpu for a smoke run (no device times)")
    args = ap.parse_args(argv)

    from client.launcher import drafter_feature_layers
    from dflash_grpc.v1 import draft_pb2, target_pb2
    from draft_service import batched as dbatched
    from draft_service import shipped_drafter
    from draft_service.servicer import DraftServiceServicer
    from dflash_grpc.localhop import LocalContext as _Context
    from runtime.fingerprint import model_fingerprint
    from runtime.gguf_loader import open_gguf
    from target_service import batched_engine
    from target_service.__main__ import build_servicer, stop_servicer
    from target_service.config import TargetConfig

    g = open_gguf(args.model)
    drafter = args.drafter or shipped_drafter(model_fingerprint(g))
    if drafter is None:
        from draft_service.init_random import write_random_drafter

        drafter = os.path.join(tempfile.mkdtemp(prefix="host-profile-"), "random-drafter.gguf")
        write_random_drafter(g, drafter, layers=3, block_size=16, num_target_layers=5)
    layers = drafter_feature_layers(drafter) or []
    target = build_servicer(TargetConfig(model=args.model, device=args.device, feature_layers=tuple(layers),
                                         max_sessions=max(4, args.sessions + 1)))
    draft = DraftServiceServicer.from_paths(drafter, args.model, device=args.device, max_sessions=max(4, args.sessions + 1))
    ctx = _Context(())
    vocab = draft.info().model.vocab_size
    gen = torch.Generator().manual_seed(0)
    n_s = max(1, args.sessions)
    sids = [f"profile-{i}" for i in range(n_s)]
    prompts = {sid: torch.randint(0, min(vocab, 1000), (64,), generator=gen).tolist() for sid in sids}
    block = draft.info().model.block_size

    def prefill(sid):
        preq = target_pb2.PrefillRequest()
        item = preq.items.add(session_id=sid, feature_layer_ids=layers)
        item.prompt_tokens.extend(prompts[sid])
        pres = target._prefill(preq, ctx, None).results[0]
        return [pres.first_token, pres.committed_length, pres.features]

    state = {sid: prefill(sid) for sid in sids}   # sid -> [root, length, features]

    def verify_call(trees):
        req = target_pb2.VerifyRequest()
        for sid, (tokens, parents) in zip(sids, trees):
            tree = req.items.add(session_id=sid).tree
            tree.tokens.extend(tokens)
            tree.parents.extend(parents)
        return next(target._verify(iter([req]), None))

    def propose_call():
        req = draft_pb2.ProposeRequest()
        for sid in sids:
            root, length, features = state[sid]
            it = req.items.add(session_id=sid, root_token=root, committed_length=length)
            it.features.CopyFrom(features)
            t = it.tree
            t.top_k = args.top_k
            if args.budget:
                t.max_depth, t.budget = block - 1, args.budget
            else:
                t.max_depth = block - 1
            t.SetInParent()
        return draft.propose(req, None)

    def new_rows() -> dict:
        return {key: {"wall": [], "compute": [], "device": []} for key in ("propose", "verify")}

    rows, plain = new_rows(), new_rows()   # with CUDA events around each step; without (host timing alone)
    profs = {"propose": cProfile.Profile(), "verify": cProfile.Profile()}
    accepted = []

    def loop(n: int, into: dict | None = None, timer: _DeviceTimer | None = None, profile: bool = False):
        """``n`` speculative steps of every session; each call's times into ``into`` (None: not kept)."""
        for _ in range(n):
            if timer:
                timer.take()
            t0 = time.perf_counter()
            if profile:
                profs["propose"].enable()
            pr = propose_call()
            if profile:
                profs["propose"].disable()
            t1 = time.perf_counter()
            dp = timer.take() if timer else 0.0
            trees = []
            for sid, r in zip(sids, pr.results):
                tokens, parents = list(r.tree.tokens), list(r.tree.parents)
                trees.append((tokens, parents) if tokens else ([state[sid][0]], [-1]))
            t2 = time.perf_counter()
            if profile:
                profs["verify"].enable()
            vr = verify_call(trees)
            if profile:
                profs["verify"].disable()
            t3 = time.perf_counter()
            dv = timer.take() if timer else 0.0
            if into is not None:
                for key, wall, comp, dev in (("propose", t1 - t0, pr.compute_s, dp), ("verify", t3 - t2, vr.compute_s, dv)):
                    into[key]["wall"].append(wall * 1e3)
                    into[key]["compute"].append(comp * 1e3)
                    into[key]["device"].append(dev)
            for sid, res in zip(sids, vr.results):
                if res.status.code:
                    raise RuntimeError(f"verify refused: {res.status.message}")
                if into is not None:
                    accepted.append(len(res.accepted_tokens))
                state[sid] = [res.bonus_token, res.committed_length, res.features]
                if res.committed_length > 1500:   # start over before the context fills
                    target.loop.release([sid])
                    draft.release([sid])
                    state[sid] = prefill(sid)

    loop(10)
    cuda = args.device.startswith("cuda")
    with _DeviceTimer(*((batched_engine._Runner, dbatched._Runner) if cuda else ())) as timer:
        loop(args.steps, rows, timer if cuda else None)
    loop(args.steps, plain)   # host timing without the events' syncs inside the call
    loop(args.steps, profile=True)

    lines = [f"# host_profile: {os.path.basename(args.model)}, drafter {os.path.basename(drafter)}, "
             f"budget {args.budget} top-k {args.top_k}, {n_s} session(s), {args.steps} steps, "
             f"{torch.cuda.get_device_name() if cuda else 'cpu'}",
             f"# accepted per step: mean {statistics.mean(accepted):.2f}",
             "call     | wall ms (events on)       | wall ms (no events)       | compute ms                | device ms                 | host = wall - device      | host / item us"]
    for key in ("propose", "verify"):
        r = rows[key]
        host = [w - d for w, d in zip(r["wall"], r["device"])]
        lines.append(f"{key:8} | {_stats(r['wall']):25} | {_stats(plain[key]['wall']):25} | {_stats(r['compute']):25} | "
                     f"{_stats(r['device']):25} | {_stats(host):25} | {statistics.median(host) / n_s * 1e3:.1f}")
    for key, prof in profs.items():
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(args.top)
        st.sort_stats("cumulative").print_stats(args.top)
        lines.append(f"\n## cProfile, {key} calls ({args.steps})\n" + s.getvalue())
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host-profile.txt"), "w") as f:
        f.write(text + "\n")
    draft.close()
    stop_servicer(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
