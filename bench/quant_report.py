"""The quantized-weights table of issue 19 (``tools/gpu_quant.sh`` writes it as ``QUANT.md``).

    python -m bench.quant_report --dir /tmp/quant/res --out QUANT.md [--command "..."]

Input: a directory of engine results (``python -m bench.gpu engine --quick --weights ...``: one
JSON per file and weights mode, each with ``weights``, ``file_type``, ``tensor_bytes``,
``weight_bytes``, ``copy_bandwidth_GBps``, ``ar_tok_s``, ``prefill512_tok_s``, ``verify_width``),
``llamacpp.jsonl`` (``llama-bench -o jsonl`` lines on the same files, matched by file name) and
optionally ``env.json`` (``python -m bench.gpu env``).

One row per engine result: file type, resident weight GiB and its ratio to the file's tensor bytes,
decode tok/s (128 tokens, AR) beside llama.cpp's tg128 on the same file and their ratio, the
memory floor of the file's tensor bytes (``copy bandwidth / tensor bytes``, tok/s) with our and
llama.cpp's decode as a percentage of it, verify of 16 rows over verify of 1 (device time of the
replayed step, a chain of 16 nodes vs the AR step), prefill-512 tok/s beside llama.cpp's pp512
and their ratio. Then the issue's goals, each checked against the rows it applies to.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: the issue's targets (issue 19, "Speed" and "Memory")
MEM_MAX = 1.05          # resident / file tensor bytes, quantized weights
DECODE_MIN = 1.3        # our decode / llama.cpp's, Q4_K_M and Q8_0 files
DECODE_MIN_SMALL = 1.0  # our decode / llama.cpp's, SmolLM2 Q4_1
FLOOR_MIN = 60.0        # % of the quantized-bytes floor, 9B Q4_K_M
VERIFY_MAX = 1.3        # verify-16 / verify-1
PREFILL_MIN = 0.8       # our prefill-512 / llama.cpp's

#: row order of the file types
_TYPE_ORDER = ("BF16", "F16", "F32", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0")


def file_summary(g) -> dict:
    """The stored size of a GGUF file's tensors: ``{"tensor_bytes": int, "file_type": str,
    "tensor_types": {type name: bytes}}``. ``file_type``: ``general.file_type`` as llama.cpp names
    it (``Q4_K_M``, ``Q8_0``, ``BF16``, ...: gguf-py's ``LlamaFileType`` without ``MOSTLY_``),
    else the type holding the most bytes. ``g``: a :class:`runtime.gguf_loader.GGUFFile`; nothing
    is read but the header."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

    by_type: dict[str, int] = {}
    for name in g.tensor_names():
        info = g.tensor_info(name)
        qk, bs = GGML_QUANT_SIZES[GGMLQuantizationType[info.type_name]]
        n = 1
        for d in info.shape:
            n *= int(d)
        by_type[info.type_name] = by_type.get(info.type_name, 0) + n // qk * bs
    ft = g.get("general.file_type")
    try:
        ftype = LlamaFileType(int(ft)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        ftype = max(by_type, key=by_type.get) if by_type else "?"
    return {"tensor_bytes": sum(by_type.values()), "file_type": ftype, "tensor_types": by_type}


def load(d: str) -> tuple[list[dict], dict, dict]:
    """``(engine results, llama.cpp by file name, env)`` from a results directory: every
    ``*.json`` with ``ar_tok_s`` (an engine result), ``llamacpp.jsonl`` (``{file name: {"tg128":
    tok/s, "pp512": tok/s}}``; several runs of a file: the last), ``env.json``."""
    engines, llama, env = [], {}, {}
    for f in sorted(os.listdir(d)):
        p = os.path.join(d, f)
        if f == "env.json":
            env = json.load(open(p))
        elif f.endswith(".json"):
            try:
                r = json.load(open(p))
            except ValueError:
                continue
            if isinstance(r, dict) and "ar_tok_s" in r:
                engines.append(r)
        elif f == "llamacpp.jsonl":
            for line in open(p):
                line = line.strip()
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                test = "pp512" if r.get("n_prompt") else "tg128"
                llama.setdefault(os.path.basename(r.get("model_filename", "")), {})[test] = float(r["avg_ts"])
    return engines, llama, env


def row(r: dict, llama: dict) -> dict:
    """The table's numbers for one engine result (``None`` where a measurement is missing)."""
    lc = llama.get(r.get("path", ""), {})
    bw = r.get("copy_bandwidth_GBps", 0.0) * 1e9
    tb = r.get("tensor_bytes") or 0
    floor = bw / tb if bw and tb else None
    dec = r["ar_tok_s"]["median"]
    pre = r.get("prefill512_tok_s", {}).get("median")
    vw = {int(k): v for k, v in r.get("verify_width", {}).items()}
    try:
        v16 = vw[16]["chain"]["device_ms"]["median"] / vw[1]["chain"]["device_ms"]["median"]
    except (KeyError, ZeroDivisionError):
        v16 = None
    tg, pp = lc.get("tg128"), lc.get("pp512")
    return {"name": r["name"], "file": r.get("path", ""), "file_type": r.get("file_type", "?"), "weights": r.get("weights", "?"),
            "resident_gib": r["weight_bytes"] / 2**30, "resident_ratio": r["weight_bytes"] / tb if tb else None,
            "decode": dec, "llama_decode": tg, "decode_ratio": dec / tg if tg else None,
            "floor": floor, "pct_floor": 100 * dec / floor if floor else None,
            "llama_pct_floor": 100 * tg / floor if floor and tg else None,
            "verify_ratio": v16, "prefill": pre, "llama_prefill": pp, "prefill_ratio": pre / pp if pre and pp else None,
            "ar_step_ms": r.get("ar_step_device_ms", {}).get("median"),
            "v1_ms": vw.get(1, {}).get("chain", {}).get("device_ms", {}).get("median"),
            "v16_ms": vw.get(16, {}).get("chain", {}).get("device_ms", {}).get("median"),
            "load_s": r.get("load_s"), "capture_s": r.get("capture_s")}


def _f(v, fmt: str = ".0f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{suffix}"


def goals(rows: list[dict]) -> list[tuple[str, str, str]]:
    """``(goal, row, "yes" / "NO" / "n/a")`` for the issue's targets, each on the quantized rows it
    applies to: memory and verify on every one, decode >= 1.3x llama.cpp on Q4_K_M / Q8_0 files
    and >= llama.cpp's on a Q4_1 file (SmolLM2), >= 60% of the floor on a 9B Q4_K_M (a name with
    ``9b``), prefill >= 0.8x llama.cpp on every one."""
    out = []

    def check(goal, r, v, ok):
        out.append((goal, f"{r['name']} {r['file_type']}", "n/a" if v is None else ("yes" if ok(v) else "NO") + f" ({v:.2f})"))

    for r in rows:
        if r["weights"] != "quantized":
            continue
        check(f"resident <= {MEM_MAX}x the file's tensor bytes", r, r["resident_ratio"], lambda v: v <= MEM_MAX)
        if r["file_type"] in ("Q4_K_M", "Q8_0"):
            check(f"decode >= {DECODE_MIN}x llama.cpp", r, r["decode_ratio"], lambda v: v >= DECODE_MIN)
        elif r["file_type"] == "Q4_1":
            check(f"decode >= {DECODE_MIN_SMALL}x llama.cpp", r, r["decode_ratio"], lambda v: v >= DECODE_MIN_SMALL)
        if r["file_type"] == "Q4_K_M" and "9b" in r["name"].lower():
            check(f"decode >= {FLOOR_MIN:.0f}% of the quantized-bytes floor", r, r["pct_floor"], lambda v: v >= FLOOR_MIN)
        check(f"verify-16 / verify-1 <= {VERIFY_MAX}", r, r["verify_ratio"], lambda v: v <= VERIFY_MAX)
        check(f"prefill-512 >= {PREFILL_MIN}x llama.cpp", r, r["prefill_ratio"], lambda v: v >= PREFILL_MIN)
    return out


def _key(r: dict):
    t = r["file_type"]
    return (r["name"], _TYPE_ORDER.index(t) if t in _TYPE_ORDER else len(_TYPE_ORDER), t, r["weights"] != "quantized")


def report(d: str, out_path: str | None = None, command: str = "") -> str:
    """QUANT.md text for a results directory (module docstring), written to ``out_path`` when
    given.

    Raises:
        FileNotFoundError: ``d`` does not exist.
    """
    engines, llama, env = load(d)
    rows = sorted((row(r, llama) for r in engines), key=_key)
    L = ["# Quantized weights (issue 19)", ""]
    if command:
        L += ["Command:", "", "```", command, "```", ""]
    if env:
        L += [f"Device: {env.get('device')}; {env.get('versions')}", ""]
    bws = sorted({round(r.get("copy_bandwidth_GBps", 0)) for r in engines})
    L += ["Our engine: `python -m bench.gpu engine --quick --weights W` (`BatchedEngine`, bf16 activations, CUDA graphs; "
          "`quantized`: the GGUF blocks on the GPU, `kernels/quant`; `bf16`: dequantized at load). Decode: 128 tokens AR "
          "after an 8-token prompt, median of the repeats; verify-16 / verify-1: device time of the replayed step, a 16-node "
          "chain over one token; prefill-512: a 512-token prompt to its first token. llama.cpp: `llama-bench -ngl 99 -fa 1 "
          "-p 512 -n 128 -r 3` on the same file in the same call. Floor: copy bandwidth "
          f"({', '.join(str(b) for b in bws)} GB/s, read + written, measured in each run) / the file's tensor bytes.", "",
          "| model | file type | weights | resident GiB | / file tensor bytes | decode tok/s | llama.cpp decode | decode / llama.cpp "
          "| floor tok/s | % of floor | llama.cpp % of floor | verify-16 / verify-1 | prefill-512 tok/s | llama.cpp prefill-512 "
          "| prefill / llama.cpp |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['name']} | {r['file_type']} | {r['weights']} | {r['resident_gib']:.2f} | {_f(r['resident_ratio'], '.3f', 'x')} | "
                 f"{r['decode']:.0f} | {_f(r['llama_decode'])} | {_f(r['decode_ratio'], '.2f', 'x')} | {_f(r['floor'])} | "
                 f"{_f(r['pct_floor'], '.1f', '%')} | {_f(r['llama_pct_floor'], '.1f', '%')} | {_f(r['verify_ratio'], '.2f', 'x')} | "
                 f"{_f(r['prefill'])} | {_f(r['llama_prefill'])} | {_f(r['prefill_ratio'], '.2f', 'x')} |")
    L += ["", "Device times (ms) and start-up (s):", "",
          "| model | file type | weights | AR step | verify-1 | verify-16 | load s | capture s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['name']} | {r['file_type']} | {r['weights']} | {_f(r['ar_step_ms'], '.3f')} | {_f(r['v1_ms'], '.3f')} | "
                 f"{_f(r['v16_ms'], '.3f')} | {_f(r['load_s'], '.1f')} | {_f(r['capture_s'], '.1f')} |")
    g = goals(rows)
    if g:
        L += ["", "Goals of issue 19 (quantized rows):", "", "| goal | row | met |", "|---|---|---|"]
        L += [f"| {a} | {b} | {c} |" for a, b, c in g]
    text = "\n".join(L) + "\n"
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="engine results (*.json), llamacpp.jsonl, env.json")
    p.add_argument("--out", default=None, help="write the markdown here too")
    p.add_argument("--command", default="", help="the command that made the results (shown in the report)")
    args = p.parse_args(argv)
    print(report(args.dir, args.out, args.command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
