"""tools/pyspy_report.py on a small raw py-spy profile: processes told apart by command line,
waits counted apart from busy samples, inclusive / exclusive shares, ``--under``."""

from __future__ import annotations

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("pyspy_report", os.path.join(os.path.dirname(__file__), "..", "tools", "pyspy_report.py"))
pr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pr)

RAW = """\
process 1:"python -m client.cli bench";process 2:"python3 -m draft_service --port 1";main (a.py:1);propose_batch (b.py:5);_step (b.py:9);run (g.py:3) 6
process 1:"python -m client.cli bench";process 2:"python3 -m draft_service --port 1";main (a.py:1);propose_batch (b.py:5);build_tree (t.py:7) 2
process 1:"python -m client.cli bench";process 2:"python3 -m draft_service --port 1";main (a.py:2);Condition.wait (threading.py:327) 10
process 1:"python -m client.cli bench";process 3:"python3 -m orchestrator --x";Scheduler._tick (s.py:1);Scheduler._tick (s.py:2) 4
process 1:"python -m client.cli bench";process 3:"python3 -m orchestrator --x";Scheduler._tick (s.py:1);_PollLikeSelector.select (selectors.py:9) 3
process 1:"python -m client.cli bench";process 3:"python3 -m orchestrator --x";Scheduler._tick (s.py:1);Connection._recv (multiprocessing/connection.py:4) 2
"""


def test_report_splits_processes_waits_and_paths(tmp_path):
    p = tmp_path / "raw.txt"
    p.write_text(RAW)
    procs = pr.parse(str(p))
    assert set(procs) == {"draft_service", "orchestrator"}
    lines = pr.report(procs["draft_service"], top=5, under=None)
    assert lines[0] == "  samples 18, waiting 10, busy 8"
    text = "\n".join(lines)
    assert "100.0%  propose_batch (b.py)" in text and " 75.0%  run (g.py)" in text and " 25.0%  build_tree (t.py)" in text
    under = "\n".join(pr.report(procs["draft_service"], top=5, under="_step"))
    assert "samples 6, waiting 0, busy 6" in under and "build_tree" not in under
    # one function's lines are merged; a recursive frame counts once inclusive
    orch = pr.report(procs["orchestrator"], top=5, under=None)
    assert orch[0] == "  samples 9, waiting 5, busy 4"   # a selector poll and a socket read are waits
    assert "100.0%  Scheduler._tick (s.py)" in "\n".join(orch)
    out = tmp_path / "r.md"
    assert pr.main([str(p), "--out", str(out)]) == 0 and out.read_text().startswith("## draft_service")
