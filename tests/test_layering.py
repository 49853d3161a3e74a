"""The package layering of docs/ARCHITECTURE.md ("Packages"), read from the source: no arrow runs
up or sideways between the services, no import cycle, and the orchestrator runs without torch."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import import_graph  # noqa: E402


def test_no_arrow_breaks_the_layering():
    assert import_graph.violations(import_graph.graph()) == []


def test_no_import_cycles():
    assert import_graph.cycles(import_graph.graph()) == []


def test_checker_sees_a_violation_and_a_cycle():
    g = {"draft_service.x": {"target_service.y"}, "target_service.y": {"runtime.a"},
         "runtime.a": {"runtime.b"}, "runtime.b": {"runtime.a"}, "orchestrator.z": {"runtime.pool"}}
    assert import_graph.violations(g) == ["draft_service.x -> target_service.y", "orchestrator.z -> runtime.pool (imports torch)"]
    assert import_graph.cycles(g) == [["runtime.a", "runtime.b"]]


def test_orchestrator_imports_no_torch():
    code = ("import sys, orchestrator.__main__, orchestrator.servicer, orchestrator.scheduler; "
            "print('torch' in sys.modules, 'target_service' in sys.modules, 'draft_service' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]
