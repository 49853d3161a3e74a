"""tools/grpc_stream_cost.py (issue 23): both servers stream every event to every client and the
tool reports the server's CPU per message."""

from __future__ import annotations

import json
import sys


def test_grpc_stream_cost_small_run(tmp_path):
    sys.path.insert(0, "tools")   # (its spawned server and client processes import it by name too)
    try:
        import grpc_stream_cost as G

        out = tmp_path / "rows.json"
        assert G.main(["--streams", "3", "--messages", "6", "--tick-ms", "2", "--repeats", "1", "--json", str(out)]) == 0
    finally:
        sys.path.remove("tools")
    rows = json.loads(out.read_text())
    assert [r["server"] for r in rows] == ["sync", "aio"]
    for r in rows:
        # every stream got its events (merged into fewer messages only when it fell behind); the
        # window's count is of the messages sent while the producer ran
        assert r["events"] == 3 * 6 and 3 <= r["messages_received"] <= r["events"]
        assert 0 <= r["messages"] <= r["messages_received"]
        assert r["cpu_s"] > 0 and r["us_per_message"] >= r["us_per_event"] > 0
