"""bench/concurrency_report.py: llama-batched-bench's table parsed, the table and figure from a sweep."""

from __future__ import annotations

import pytest

from bench.concurrency_report import main, markdown, parse_llama_batched

LLAMA = """
llama_batched_bench: n_kv_max = 32768, n_batch = 2048, n_ubatch = 512, flash_attn = 1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.023 |  5477.81 |    0.146 |   875.41 |    0.170 |  1509.57 |
|   128 |    128 |    4 |   1024 |    0.010 | 50542.94 |    0.187 |  2733.03 |    0.197 |  5185.65 |
"""


def _level(n, tok_s, mismatches):
    return {"concurrency": n, "aggregate_tokens_per_second": tok_s, "mean_stream_tokens_per_second": tok_s / n,
            "itl_p50_ms": 1.0, "itl_p99_ms": 2.5, "mismatches": mismatches, "errors": 0}


SWEEP = {"levels": [1, 4], "modes": {"ar": [_level(1, 800.0, 0), _level(4, 2000.0, 0)],
                                     "spec": [_level(1, 1200.0, 0), _level(4, 2733.03, 2)]}}


def test_parse_and_table(tmp_path):
    assert parse_llama_batched(LLAMA) == {1: 875.41, 4: 2733.03}
    assert parse_llama_batched("no table") == {}
    lines = markdown(SWEEP, parse_llama_batched(LLAMA)).splitlines()
    assert lines[2].startswith("| 1 | 875 | 800 | 0.91x | 1,200 | 1.37x | 1.50x |") and lines[2].endswith("| yes / yes |")
    assert lines[3].startswith("| 4 | 2,733 | 2,000 | 0.73x | 2,733 | 1.00x | 1.37x |") and "NO (2, 0 err)" in lines[3]
    assert "| - |" in markdown(SWEEP, {}).splitlines()[2]   # no llama.cpp figures
    assert "Where a tick went" not in markdown(SWEEP, {})       # a sweep without tick_ms: no second table
    assert "Time to first token" not in markdown(SWEEP, {})     # nor without ttft (older JSON)
    import json

    ticked = json.loads(json.dumps(SWEEP))
    ticked["modes"]["spec"][1].update(tau=3.2, tick_ms={"tick": 10.0, "draft_exchange": 3.0, "draft_compute": 2.0,
                                                        "draft_device": 1.0, "verify_exchange": 5.0, "verify_compute": 4.0,
                                                        "verify_device": 2.5, "orchestrator": 2.0})
    ticked["modes"]["ar"][0].update(ttft_p50_ms=3.0, ttft_p99_ms=9.5)
    ticked["modes"]["spec"][0].update(ttft_p50_ms=4.25, ttft_p99_ms=12.0)
    text = markdown(ticked, {})
    assert "| spec | 4 | 3.20 | 10.00 | 3.00 (2.00 / 1.00) | 5.00 (4.00 / 2.50) | 2.00 | 250.0 / 375.0 / 500.0 |" \
        in text.splitlines()   # host per item: (2.00 - 1.00) / 4, (4.00 - 2.50) / 4, 2.00 / 4 ms
    assert "| 1 | 3.00 / 4.25 | 9.50 / 12.00 |" in text.splitlines()
    assert "| 4 |" not in text.split("Time to first token")[1].split("Where a tick went")[0]   # no TTFT there
    assert "What the scheduler counted" not in text   # no counters recorded: no table
    ticked["modes"]["spec"][1]["scheduler"] = {"ticks": 40, "refeatures": 3, "drafter_sessions_given_up": 5,
                                               "admitted_plain": 1200}
    counted = markdown(ticked, {}).split("What the scheduler counted")[1].splitlines()
    assert "| spec | 4 | 40 | 0 | 3 | 5 | 1,200 | 0 | 0 | 0 | - | - | - | - |" in counted   # (an older JSON: no seconds)
    assert len([x for x in counted if x.startswith("| spec")]) == 1
    ticked["modes"]["spec"][1]["scheduler"].update(tick_seconds=0.5, exchange_seconds=0.42, tick_cpu_seconds=0.2,
                                                   exchange_cpu_seconds=0.16, verify_queue_seconds=0.01,
                                                   propose_queue_seconds=0.002)
    counted = markdown(ticked, {}).split("What the scheduler counted")[1].splitlines()
    # (0.5 - 0.42) / 40 s, (0.2 - 0.16) / 40, 0.01 / 40, 0.002 / 40
    assert "| spec | 4 | 40 | 0 | 3 | 5 | 1,200 | 0 | 0 | 0 | 2.00 | 1.00 | 0.25 | 0.05 |" in counted


def test_cli_writes_table_and_png(tmp_path):
    import json

    pytest.importorskip("matplotlib")
    (tmp_path / "c.json").write_text(json.dumps({"concurrency": SWEEP}))
    (tmp_path / "l.txt").write_text(LLAMA)
    assert main([str(tmp_path / "c.json"), "--llama", str(tmp_path / "l.txt"), "--png", str(tmp_path / "c.png"),
                 "--out", str(tmp_path / "c.md")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2,733" in (tmp_path / "c.md").read_text()


def test_projected_speculative_throughput_at_a_reference_tau(tmp_path):
    """``--project-tau``: spec tok/s x tau_reference / tau_measured per level both sweeps ran (a
    level without a tau on either side has none), with the ratios to llama.cpp and to AR."""
    import json

    from bench.concurrency_report import projected

    sweep = json.loads(json.dumps(SWEEP))
    sweep["modes"]["spec"][0]["tau"] = 1.2
    sweep["modes"]["spec"][1]["tau"] = None
    ref = {"levels": [1, 4], "modes": {"spec": [{"concurrency": 1, "tau": 3.6, "aggregate_tokens_per_second": 1.0},
                                                {"concurrency": 4, "tau": 3.0, "aggregate_tokens_per_second": 1.0}]}}
    assert projected(sweep, ref) == {1: pytest.approx(1200.0 * 3.6 / 1.2)}
    lines = markdown(sweep, parse_llama_batched(LLAMA), ref).splitlines()
    assert lines[0].endswith("| spec projected | projected / llama.cpp | projected / AR |")
    assert lines[2].endswith("| 1.20 | 3.60 | 3,600 | 4.11x | 4.50x |")
    assert lines[3].endswith("| - | 3.00 | - | - | - |")
    (tmp_path / "c.json").write_text(json.dumps({"concurrency": sweep}))
    (tmp_path / "r.json").write_text(json.dumps({"concurrency": ref}))
    assert main([str(tmp_path / "c.json"), "--project-tau", str(tmp_path / "r.json"), "--out", str(tmp_path / "c.md")]) == 0
    assert "3,600" in (tmp_path / "c.md").read_text()
