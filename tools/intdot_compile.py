"""Every kernel of :mod:`kernels.quant.intdot` compiled offline for a GPU this machine need not have
(issue 19): the Triton interpreter, which the CPU tests run, never compiles them, and it cannot run
their PTX (``dp4a``), so this is where a kernel that would not compile for the GPU shows up
without one. Triton's bundled ``ptxas`` and ``cuobjdump`` (``tools/quant_sass.py``'s method).

    python tools/intdot_compile.py [--arch 90]

Prints, per kernel and type, registers per thread, stack bytes (spills) and SASS instructions of
the launch the engine makes (:func:`kernels.quant.intdot.linear`'s defaults: one row on 16
features and 1 warp, 16 rows on 64 features and 2 warps, ``K`` split 8), and checks each kernel's
PTX (:func:`ptx_problems`; exit status 1 and the rules broken on stderr when one is).
"""

from __future__ import annotations

import argparse
import sys

sys.path[:0] = [".", "proto", "tools"]

_X = {"h_ptr": "*i8", "l_ptr": "*i8", "s_ptr": "*fp32"}
_Y = {"y_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32"}   # (the split's sum in the kernel: FUSED)


def _cases() -> list[tuple[str, object, dict, dict, int]]:
    """``(label, kernel, signature, constexprs, warps)`` of every kernel and type."""
    from kernels.quant import intdot as I

    out = [("split_x", I._split_kernel, {"x_ptr": "*bf16", "h_ptr": "*i8", "l_ptr": "*i8", "s_ptr": "*fp32", "xs_ptr": "*fp32",
                                         "hs_ptr": "*i32", "ls_ptr": "*i32", "K": "i32", "sxm": "i32"}, {"GROUPS": 32, "EMULATE": False}, 4)]
    one = {"N": "i32", "K": "i32", "swn": "i32"}
    many = {"M": "i32", "N": "i32", "K": "i32", "swn": "i32"}
    for q5 in (False, True):
        name = "Q5_K" if q5 else "Q4_K"
        sig = {**_X, "xs_ptr": "*fp32", "w_ptr": "*u8", **_Y}
        out.append((f"dp4a {name}", I._q4k_dp4a_kernel, {**sig, **one}, dict(BLOCK_N=16, SPLIT_K=8, EMULATE=False, Q5=q5, FUSED=True), 1))
        out.append((f"mma {name}", I._q4k_mma_kernel, {**sig, **many}, dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=8, Q5=q5, FUSED=True), 2))
    sig = {**_X, "hs_ptr": "*i32", "ls_ptr": "*i32", "w_ptr": "*u8", **_Y}
    for stride in (210, 224):   # the file's layout and the padded one (kernels.quant.weight)
        tag = "" if stride == 210 else f"@{stride}"
        out.append((f"dp4a Q6_K{tag}", I._q6k_dp4a_kernel, {**sig, **one},
                    dict(BLOCK_N=16, SPLIT_K=8, EMULATE=False, FUSED=True, STRIDE=stride), 1))
        out.append((f"mma Q6_K{tag}", I._q6k_mma_kernel, {**_X, "w_ptr": "*u8", **_Y, **many},
                    dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=8, FUSED=True, STRIDE=stride), 2))
    sig = {**_X, "xs_ptr": "*fp32", "hs_ptr": "*i32", "ls_ptr": "*i32", "w_ptr": "*u8", **_Y}
    for name, bs in (("Q4_0", 18), ("Q4_1", 20), ("Q8_0", 34)):
        qt = I._LEGACY_CODE[name]
        out.append((f"dp4a {name}", I._legacy_dp4a_kernel, {**sig, **one},
                    dict(QT=qt, BS=bs, BLOCK_N=16, SPLIT_K=2, EMULATE=False, FUSED=True), 1))
        out.append((f"mma {name}", I._legacy_mma_kernel, {**sig, **many}, dict(QT=qt, BS=bs, BLOCK_M=16, BLOCK_N=64, SPLIT_K=2, FUSED=True), 2))
    return out


def compile_all(arch: int = 90) -> list[dict]:
    """Compile every kernel of :func:`_cases` for ``sm_<arch>``; returns one ``{"kernel", "registers",
    "stack", "instructions"}`` per kernel (the report of ``tools/quant_sass.sass_report``).

    Raises:
        triton.CompilationError (or the backend's error): a kernel that does not compile.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    from quant_sass import sass_report

    rows = []
    for label, fn, sig, consts, warps in _cases():
        names = list(sig)
        full = {**sig, **{name: "constexpr" for name in consts}}
        divisible = [n for n, t in sig.items() if t.startswith("*")] + [n for n in ("K", "swn") if n in sig]
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
        src = triton.compiler.ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs)
        ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        r = sass_report(ck.asm["cubin"])
        rows.append({"kernel": label, "registers": r["registers"], "stack": r["stack"], "instructions": r["instructions"],
                     "ptx_problems": ptx_problems(label, ck.asm["ptx"])})
    return rows


def ptx_problems(label: str, ptx: str) -> list[str]:
    """What the PTX of kernel ``label`` (of :func:`_cases`) must and must not hold, as the list of
    rules it breaks (empty: none). The Triton interpreter the CPU tests run never sees these:

    * the split of ``x`` is bit for bit ``intdot.quantize_x`` only with IEEE divisions (``div.rn``;
      Triton's ``/`` is ``div.full.f32``, approximate: the first GPU run found planes one apart), a
      product that ptxas cannot fuse with the next add (``mul.rn``) and no FMA at all;
    * the kernels that sum their split themselves (``FUSED``) need the program's barrier, the
      acquire-release atomic on the tile counter and the L2 reads of the partials
      (``kernels.quant.partials._store_split``).
    """
    bad = []
    if label == "split_x":
        for op in ("div.full", "div.approx", "fma.rn", "rcp.approx"):
            if op in ptx:
                bad.append(f"{label}: {op} (not IEEE: the planes would not be quantize_x's)")
        for op in ("div.rn.f32", "mul.rn.f32"):
            if op not in ptx:
                bad.append(f"{label}: no {op}")
    else:
        for op in ("bar.sync", "atom.global.gpu.acq_rel.add", "ld.global.cg"):
            if op not in ptx:
                bad.append(f"{label}: no {op} (the split's sum inside the kernel)")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="sm_ARCH (default 90: H100 / H200)")
    a = p.parse_args(argv)
    print(f"| kernel | registers / thread | stack bytes | SASS instructions |  (sm_{a.arch})")
    print("|---|---|---|---|")
    problems = []
    for r in compile_all(a.arch):
        print(f"| {r['kernel']} | {r['registers']} | {r['stack']} | {r['instructions']} |", flush=True)
        problems += r["ptx_problems"]
    for line in problems:
        print(f"PTX: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
