"""bench/quant_report.py: the quantized-weights table (QUANT.md) from engine results and llama-bench
lines, and the file summary (tensor bytes, file type) the engine benchmark records."""

from __future__ import annotations

import json

import torch
from gguf.constants import GGMLQuantizationType

from bench import quant_report as QR


def _engine(name, path, ftype, weights, wbytes, tbytes, dec, pre, v1, v16, bw=2000.0):
    return {"name": name, "path": path, "file_type": ftype, "weights": weights, "weight_bytes": wbytes,
            "tensor_bytes": tbytes, "copy_bandwidth_GBps": bw, "ar_tok_s": {"median": dec, "min": dec, "max": dec, "n": 3},
            "prefill512_tok_s": {"median": pre}, "ar_step_device_ms": {"median": 1000 / dec},
            "verify_width": {"1": {"chain": {"device_ms": {"median": v1}}}, "16": {"chain": {"device_ms": {"median": v16}},
                                                                              "tree": {"device_ms": {"median": v16}}}},
            "load_s": 3.0, "capture_s": 2.0}


def test_report_rows_ratios_and_goals(tmp_path):
    gib = 2**30
    res = [
        _engine("qwen35-9b", "q35-9b-Q4_K_M.gguf", "Q4_K_M", "quantized", int(5.2 * gib), 5 * gib, 400.0, 7000.0, 2.0, 2.4),
        _engine("qwen35-9b", "q35-9b-bf16.gguf", "BF16", "bf16", 17 * gib, 17 * gib, 210.0, 9000.0, 4.0, 4.4),
        _engine("qwen35-9b", "q35-9b-Q8_0.gguf", "Q8_0", "quantized", 9 * gib, 9 * gib, 250.0, 6000.0, 3.0, 4.5),
        _engine("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1", "quantized", 92 << 20, 92 << 20, 900.0, 30000.0, 1, 1.1),
    ]
    for i, r in enumerate(res):
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    (tmp_path / "not-an-engine.json").write_text(json.dumps({"device": "x"}))
    (tmp_path / "env.json").write_text(json.dumps({"device": "NVIDIA H100", "versions": "torch x"}))
    lines = [{"model_filename": "/tmp/models/q35-9b-Q4_K_M.gguf", "n_prompt": 512, "n_gen": 0, "avg_ts": 8000.0},
             {"model_filename": "/tmp/models/q35-9b-Q4_K_M.gguf", "n_prompt": 0, "n_gen": 128, "avg_ts": 256.0},
             {"model_filename": "/tmp/models/q35-9b-Q8_0.gguf", "n_prompt": 0, "n_gen": 128, "avg_ts": 236.0},
             {"model_filename": "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "n_prompt": 0, "n_gen": 128, "avg_ts": 800.0}]
    (tmp_path / "llamacpp.jsonl").write_text("build log line\n" + "\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "QUANT.md"
    text = QR.report(str(tmp_path), str(out), command="bash tools/gpu_quant.sh")
    assert out.read_text() == text and "NVIDIA H100" in text and "bash tools/gpu_quant.sh" in text
    table = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines()
             if ln.startswith("| qwen35-9b") or ln.startswith("| smollm2")]
    # first table: per model, BF16 before Q8_0 before Q4_K_M
    assert [c[1] for c in table[:4]] == ["BF16", "Q8_0", "Q4_K_M", "Q4_1"]
    q4 = table[2]
    floor = 2000e9 / (5 * gib)                                   # ~373 tok/s
    assert q4[3] == "5.20" and q4[4] == "1.040x"                 # resident GiB, / tensor bytes
    assert q4[5:8] == ["400", "256", "1.56x"]                    # decode, llama.cpp, ratio
    assert q4[8] == f"{floor:.0f}" and q4[9] == f"{100 * 400 / floor:.1f}%" and q4[10] == f"{100 * 256 / floor:.1f}%"
    assert q4[11] == "1.20x" and q4[12:15] == ["7000", "8000", "0.88x"]
    bf = table[0]
    assert bf[6] == bf[7] == bf[14] == "-"                       # no llama.cpp line for the bf16 file
    got = {(g, r): v for g, r, v in QR.goals([QR.row(r, QR.load(str(tmp_path))[1]) for r in res])}
    assert got[("decode >= 1.3x llama.cpp", "qwen35-9b Q4_K_M")] == "yes (1.56)"
    assert got[("decode >= 1.3x llama.cpp", "qwen35-9b Q8_0")] == "NO (1.06)"
    assert got[("decode >= 60% of the quantized-bytes floor", "qwen35-9b Q4_K_M")].startswith("yes")
    assert got[("verify-16 / verify-1 <= 1.3", "qwen35-9b Q8_0")] == "NO (1.50)"
    assert got[("prefill-512 >= 0.8x llama.cpp", "qwen35-9b Q8_0")] == "n/a"
    assert got[("decode >= 1.0x llama.cpp", "smollm2-135m Q4_1")] == "yes (1.12)"
    assert got[("resident <= 1.05x the file's tensor bytes", "qwen35-9b Q4_K_M")] == "yes (1.04)"
    assert not any(r.endswith("BF16") for _, r in got)           # goals are for the quantized rows only
    assert "| decode >= 1.3x llama.cpp | qwen35-9b Q8_0 | NO (1.06) |" in text


def test_file_summary(tmp_path):
    """Tensor bytes as stored (what ``load_raw`` returns, summed) and the file type: the metadata's
    ``general.file_type`` when present, else the type holding the most bytes."""
    from runtime.gguf_loader import GGUFFile, write_gguf

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(8, 64, generator=gen), "b": torch.randn(4, 96, generator=gen), "n": torch.randn(64, generator=gen)}
    types = {"a": GGMLQuantizationType.Q4_1, "b": GGMLQuantizationType.Q8_0}
    write_gguf(tmp_path / "q.gguf", "llama", {}, tensors, types)
    g = GGUFFile(tmp_path / "q.gguf")
    s = QR.file_summary(g)
    assert s["tensor_bytes"] == sum(g.load_raw(n).data.numel() for n in g.tensor_names()) == 8 * 2 * 20 + 4 * 3 * 34 + 64 * 4
    assert s["tensor_types"] == {"Q4_1": 320, "Q8_0": 408, "F32": 256} and s["file_type"] == "Q8_0"
    write_gguf(tmp_path / "r.gguf", "llama", {"general.file_type": 15}, tensors, types)
    assert QR.file_summary(GGUFFile(tmp_path / "r.gguf"))["file_type"] == "Q4_K_M"
