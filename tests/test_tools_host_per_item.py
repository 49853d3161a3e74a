"""tools/host_per_item.py end to end on the CPU (the three services as processes with fake engines,
the clients in this process): both of the orchestrator's gRPC servers, the fake device time and the
per-service profiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("server", ["aio", "threads"])
def test_host_per_item_runs_with_device_time_and_profiles(tmp_path, server):
    out = tmp_path / "rows.json"
    prof = tmp_path / "prof"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "tools/host_per_item.py", "--streams", "2", "--modes", "ar,spec", "--tokens", "24",
                           "--grpc-server", server, "--device-ms", "5,2", "--cprofile", str(prof), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"ar", "spec"} and all(r["streams"] == 2 for r in rows)
    # every tick sleeps the fake device time (5 ms a Verify; 2 ms more a drafting tick's Propose): a
    # level's wall time is at least 5 ms a tick whatever else the box does, and its steady ticks
    # (instant engines: under 1 ms each here) take about that (a window's edges may miscount a tick)
    for r in rows:
        assert r["ticks"] > 0 and r["wall_s"] / r["ticks"] * 1e3 >= 5.0, r
        assert r["ms_tick"] >= 4.0, r
    for service, what in (("orchestrator", "_tick"), ("target", "_verify"), ("draft", "propose")):
        for mode in ("ar", "spec"):
            text = (prof / f"{service}-{mode}-2-0.txt").read_text()
            if (service, mode) != ("draft", "ar"):   # (plain decoding sends no Propose)
                assert what in text, (service, mode, text[:500])


def test_host_per_item_with_the_feature_ring(tmp_path):
    """--ring: the fake target writes its rows into a feature ring and the fake drafter reads them
    there; the orchestrator's Proposes name them (ring_rows) and carry none."""
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "tools/host_per_item.py", "--streams", "4", "--modes", "spec", "--tokens", "24",
                           "--ring", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert row["ring_rows"] > 0 and row["fallbacks"] == 0, row
