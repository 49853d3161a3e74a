"""The quantized skinny kernel compiled offline for a GPU this machine does not have: registers per
thread, shared memory, and the SASS instruction mix of one launch's kernel (issue 19's kernel work
between GPU sessions; no GPU needed, Triton's bundled ``ptxas`` / ``cuobjdump``).

    python tools/quant_sass.py --type Q4_K --n 4096 --k 4096            # the launch config_for picks
    python tools/quant_sass.py --type Q6_K --n 4096 --k 12288 --warps 4 --block-n 64 --no-swap --top 12

The kernel is specialised as a launch would specialise it (Triton's rule: pointers 16-byte aligned,
``N``, ``K`` and the strides marked divisible by 16 where they are; ``M`` never specialised), so the
register count is the one the GPU runs: Nsight Compute reported 103 registers per thread for the
Q4_K 4096 x 4096 launch on an H200 (``benchmarks/gpu/quant/run6/ncu-skinny.txt``), as this prints.
Without the divisibility marks the same kernel compiles to 255. Registers bound a program's
occupancy (65536 per SM over its threads): the skinny kernel is latency-bound at low occupancy
(``kernels/quant/triton.py``, "Reads and dots"), so this is a proxy worth watching; a speed claim
still needs the GPU (``tools/quant_config_ab.py``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys

sys.path[:0] = [".", "proto"]

#: a SASS instruction line of ``cuobjdump -sass``: its opcode (the predicate, if any, skipped)
_OPCODE = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def compile_skinny(qtype: str, n: int, k: int, config=None, words: bool | None = None, swap: bool | None = None,
                   arch: int = 90, stride: int | None = None):
    """Compile the skinny path's kernel for an ``[n, k]`` weight of ``qtype`` and bfloat16 ``x``
    (``config``: a :class:`kernels.quant.triton.Config`, default ``config_for``; ``words`` /
    ``swap``: ``WORD_LOADS`` / ``SWAP_AB``, default the module's; ``stride``: bytes per stored
    block, default the GGUF size: ``kernels.quant.weight``'s padded blocks) for ``sm_<arch>``;
    returns the compiled kernel (``.asm["cubin"]``, ``.metadata``)."""
    import torch
    import triton
    from gguf.constants import GGML_QUANT_SIZES
    from triton.backends.compiler import GPUTarget

    from kernels.quant import triton as T
    from kernels.quant.weight import as_qtype

    cfg = config or T.config_for(n, k, qtype, stride)
    saved = (T.WORD_LOADS, T.SWAP_AB)
    try:
        if words is not None:
            T.WORD_LOADS = words
        if swap is not None:
            T.SWAP_AB = swap
        consts = T.kernel_constants(qtype, torch.bfloat16, T.BLOCK_M, cfg.block_n, False, False, cfg.unroll, cfg.split_k,
                                    stride=stride)
    finally:
        T.WORD_LOADS, T.SWAP_AB = saved
    qk, bs = GGML_QUANT_SIZES[as_qtype(qtype)]
    bs = stride or bs
    ints = {"N": n, "K": k, "sxm": k, "swn": k // qk * bs, "sym": n}
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "y_ptr": "*fp32" if cfg.split_k > 1 else "*bf16", "M": "i32",
           **{name: "i32" for name in ints}}
    names = list(sig)
    sig.update({name: "constexpr" for name in consts})
    divisible = ["x_ptr", "w_ptr", "y_ptr"] + [name for name, v in ints.items() if v % 16 == 0]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = triton.compiler.ASTSource(fn=T._qlinear_kernel, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.maxnreg is not None:
        opts["maxnreg"] = cfg.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def sass_report(cubin: bytes) -> dict:
    """``{"registers", "stack", "instructions", "mix"}`` of a cubin (``cuobjdump -res-usage`` and
    ``-sass`` of Triton's NVIDIA backend; ``stack``: bytes of stack frame per thread, where
    registers spill)."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    mix = collections.Counter(m.group(1) for m in map(_OPCODE.match, sass.splitlines()) if m)
    return {"registers": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
            "instructions": sum(mix.values()), "mix": mix}


def main(argv: list[str] | None = None) -> int:
    from kernels.quant import triton as T

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", default="Q4_K", help="GGUF block type (default %(default)s)")
    p.add_argument("--n", type=int, default=4096, help="output features")
    p.add_argument("--k", type=int, default=4096, help="input features")
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--split-k", type=int, default=None)
    p.add_argument("--maxnreg", type=int, default=None)
    p.add_argument("--bytes", action="store_true", help="byte gathers (WORD_LOADS off)")
    p.add_argument("--no-swap", action="store_true", help="dot(x, q^T) (SWAP_AB off)")
    p.add_argument("--stride", type=int, default=None,
                   help="bytes per stored block (default: the loader's, kernels.quant.weight.stride_for: Q6_K padded)")
    p.add_argument("--arch", type=int, default=90, help="sm_ARCH (default 90: H100 / H200)")
    p.add_argument("--top", type=int, default=10, help="opcodes listed")
    a = p.parse_args(argv)
    from kernels.quant.weight import stride_for

    stride = a.stride or stride_for(a.type)
    cfg = T.config_for(a.n, a.k, a.type, stride)
    cfg = dataclasses.replace(cfg, **{f: v for f, v in (("block_n", a.block_n), ("num_warps", a.warps), ("num_stages", a.stages),
                                                        ("split_k", a.split_k), ("maxnreg", a.maxnreg)) if v is not None})
    ck = compile_skinny(a.type, a.n, a.k, cfg, words=not a.bytes, swap=not a.no_swap, arch=a.arch, stride=stride)
    r = sass_report(ck.asm["cubin"])
    threads = 32 * cfg.num_warps
    per_sm = 65536 // (r["registers"] * threads) if r["registers"] else None
    print(f"{a.type} [{a.n}, {a.k}] {cfg} sm_{a.arch}: {r['registers']} registers per thread "
          f"(about {per_sm} programs of {threads} threads per SM by registers, before the hardware's allocation "
          f"granularity), {r['stack']} bytes of stack (spills), shared {ck.metadata.shared} bytes, "
          f"{r['instructions']} SASS instructions")
    print("  " + ", ".join(f"{op} {c}" for op, c in r["mix"].most_common(a.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
