"""What :meth:`runtime.graphs.StepGraph.run` costs the host around a replayed graph, on a GPU
(issue 18: a one-stream speculative step of the shipped pair spends 0.28 ms of drafter host time
and 0.38 ms of target host time beyond their device time, ``benchmarks/gpu/step/run26-ring-in-step``,
while their Python before and after the step is a few tens of microseconds).

    python tools/stepgraph_overhead.py [--nodes 1,64,256] [--iters 500] [--out FILE]

A :class:`~runtime.graphs.StepGraph` whose body is ``--nodes`` tiny dependent kernels (an in-place
add on a 256-element tensor each, about the node count of a SmolLM2 verify step at 256) and one
host-to-device and one device-to-host copy of a pinned buffer, as the engines' steps have. Per node
count, medians over ``--iters`` after 50 of warm-up, microseconds:

* ``run``: the wall time of ``StepGraph.run()`` (events, replay, synchronisation, device seconds);
* ``device``: what its CUDA events measured (what the services report as device time);
* ``run - device``: the host's share the services report as host time;
* the pieces alone: ``current_stream``, an ``Event.record``, ``graph.replay()`` (launch only),
  ``synchronize`` on a stream already idle, ``elapsed_time`` of two completed events;
* ``replay+sync``: a replay and a synchronisation, no events.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

sys.path[:0] = [".", "proto"]


def main() -> None:
    import torch

    from runtime.graphs import StepGraph

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1,64,256")
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)

    class Chain(StepGraph):
        def __init__(self, n: int):
            super().__init__(dev)
            self.n = n
            self.host = self.host_buffer(64, dtype=torch.long)
            self.dev = self.device_twin(self.host)
            self.out = self.host_buffer(64, dtype=torch.long)
            self.x = torch.zeros(256, device=dev)

        def body(self) -> None:
            self.copy(self.dev, self.host)
            for _ in range(self.n):
                self.x.add_(1.0)
            self.copy(self.out, self.dev)

        def fill_idle(self) -> None:
            self.host.zero_()

    def med(f, iters=a.iters) -> float:
        for _ in range(50):
            f()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)

    results = {}
    stream = torch.cuda.current_stream(dev)
    for n in [int(x) for x in a.nodes.split(",")]:
        g = Chain(n)
        g.capture(torch.cuda.graph_pool_handle())
        from runtime import device_time
        devs = []

        def run():
            d0 = device_time.device_seconds()
            g.run()
            devs.append((device_time.device_seconds() - d0) * 1e6)

        r = {"run_us": med(run)}
        r["device_us"] = statistics.median(devs[50:])
        r["host_us"] = r["run_us"] - r["device_us"]
        ev = torch.cuda.Event(enable_timing=True)
        r["current_stream_us"] = med(lambda: torch.cuda.current_stream(dev))
        r["event_record_us"] = med(lambda: ev.record(stream))
        torch.cuda.synchronize()

        def replay_only():
            g.graph.replay()
            stream.synchronize()
        r["replay_sync_us"] = med(replay_only)
        launch = []

        def replay_launch():
            t0 = time.perf_counter()
            g.graph.replay()
            launch.append((time.perf_counter() - t0) * 1e6)
            stream.synchronize()
        med(replay_launch)
        r["replay_launch_us"] = statistics.median(launch[50:])
        r["sync_idle_us"] = med(stream.synchronize)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        e1.record(stream)
        stream.synchronize()
        r["elapsed_time_us"] = med(lambda: e0.elapsed_time(e1))
        results[n] = r
        print(f"nodes {n:4}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "iters": a.iters, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
