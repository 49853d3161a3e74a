"""Where each process's Python time goes, from a py-spy raw profile of a whole bench run.

    py-spy record -f raw --subprocesses [-t] -o prof.txt -- python -m client.cli bench ...
    python tools/pyspy_report.py prof.txt [--top 25] [--under FUNC] [--out report.txt]

py-spy's raw format (the input of flamegraph.pl) is one line per distinct stack: frames from the
root, ``;``-separated, then the sample count. With ``--subprocesses`` the first frames name the
processes (``process PID:"command line"``), so the services of one ``dflash-grpc bench`` run come
apart by their command line (``-m orchestrator``, ``-m target_service``, ``-m draft_service``).

For each process the report prints its samples, then the functions with the most samples
inclusive (the function or anything it called) and exclusive (the function itself), both as a
share of the process's busy samples: stacks whose innermost frame is a wait (a condition, a
lock, a socket poll, a queue get, a sleep) are counted apart as idle. ``--under FUNC`` keeps only
the stacks through a frame containing FUNC (e.g. ``propose_batch`` or ``_tick``), so one code path
can be split into its parts. py-spy samples wall-clock stacks of every thread; a thread blocked in
C (a CUDA synchronisation, a gRPC send) is shown in its Python frame, which is what we want: the
host side of a step includes its waits on the device.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

#: innermost frames that mean "this thread waits for something else" (not host work): the frame's
#: function (its last dotted part, e.g. ``_PollLikeSelector.select`` -> ``select``), or its module
IDLE = re.compile(r"(^|\.)(wait|_wait_once|_wait_for_tstate_lock|select|poll|_poll|recv_bytes|_recv|sleep|accept|"
                  r"_run_channel_spin_thread|channel_spin) \(|^(get|Queue\.get) \(.*queue\.py|"
                  r"^_worker \(concurrent|^_serve \(grpc")


def _service(cmd: str) -> str:
    """A short name for a process's command line."""
    for name in ("orchestrator", "target_service", "draft_service"):
        if f"-m {name}" in cmd:
            return name
    if "client.cli" in cmd or "dflash-grpc" in cmd:
        return "bench (client)"
    return cmd[:60] or "(root)"


def parse(path: str) -> dict[str, list[tuple[list[str], int]]]:
    """``{process name: [(frames, samples), ...]}`` of a raw py-spy file (process frames removed)."""
    out: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = stack.split(";")
            procs = [fr for fr in frames if fr.startswith("process ")]
            rest = [fr for fr in frames if not fr.startswith("process ") and not fr.startswith("thread ")]
            cmd = procs[-1].split(":", 1)[1].strip('"') if procs else ""
            out[_service(cmd)].append((rest, int(n)))
    return out


def _name(frame: str) -> str:
    """``func (file:line)`` -> ``func (file)`` (lines of one function merged)."""
    return re.sub(r":\d+\)$", ")", frame)


def report(stacks: list[tuple[list[str], int]], top: int, under: str | None) -> list[str]:
    """The lines of one process's section."""
    if under:
        stacks = [(fr[next(i for i, x in enumerate(fr) if under in x):], n) for fr, n in stacks
                  if any(under in x for x in fr)]
    total = sum(n for _, n in stacks)
    idle = sum(n for fr, n in stacks if not fr or IDLE.search(fr[-1]))
    busy = [(fr, n) for fr, n in stacks if fr and not IDLE.search(fr[-1])]
    nb = sum(n for _, n in busy) or 1
    incl: collections.Counter[str] = collections.Counter()
    excl: collections.Counter[str] = collections.Counter()
    for fr, n in busy:
        names = [_name(x) for x in fr]
        for x in set(names):
            incl[x] += n
        excl[names[-1]] += n
    lines = [f"  samples {total}, waiting {idle}, busy {nb}" + (f" (stacks through '{under}')" if under else "")]
    lines.append("  inclusive (share of busy samples):")
    lines += [f"    {n / nb:6.1%}  {x}" for x, n in incl.most_common(top)]
    lines.append("  exclusive:")
    lines += [f"    {n / nb:6.1%}  {x}" for x, n in excl.most_common(top)]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--under", default=None, help="only stacks through a frame containing this text")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lines = []
    for proc, stacks in sorted(parse(a.profile).items(), key=lambda kv: -sum(n for _, n in kv[1])):
        lines.append(f"## {proc}")
        lines += report(stacks, a.top, a.under)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
