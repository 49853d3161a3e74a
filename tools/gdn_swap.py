"""Run a command with the software-pipelined GDN recurrence kernels
(``kernels/gated_delta/triton_pipelined.py``) in place of the shipped ones
(``kernels/gated_delta/triton.py``), for engine-level A/B runs without editing either.

Usage (from the repository root)::

    python tools/gdn_swap.py [--config BV,NUM_WARPS] -m MODULE [ARGS ...]
    python tools/gdn_swap.py [--config BV,NUM_WARPS] SCRIPT.py [ARGS ...]

    # the engine benchmark of tools/gpu_run.sh, swapped:
    python tools/gdn_swap.py -m target_service.bench_gpu engine --model M.gguf --name q35-4b-pipelined --out x.json

``kernels.gated_delta`` looks ``pool_gdn_tree`` / ``pool_gdn_commit`` up on the ``triton`` module at
every call, so replacing those two attributes before the command runs swaps the kernels everywhere
(eager steps, CUDA graphs captured after the swap, tests). ``--config`` fixes ``(BV, num_warps)``
instead of ``triton_pipelined.GDN_CONFIGS``. The kernel names stay ``_tree_kernel`` /
``_commit_kernel``, so profiles attribute them as before.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def swap(config: tuple[int, int] | None = None) -> None:
    """Point ``kernels.gated_delta.triton.pool_gdn_tree`` / ``pool_gdn_commit`` at the pipelined
    kernels (with ``config`` when given)."""
    from kernels.gated_delta import triton as shipped
    from kernels.gated_delta import triton_pipelined as new

    kw = {} if config is None else {"config": config}
    shipped.pool_gdn_tree = functools.partial(new.pool_gdn_tree, **kw)
    shipped.pool_gdn_commit = functools.partial(new.pool_gdn_commit, **kw)


def main(argv: list[str]) -> None:
    config = None
    if argv[:1] == ["--config"]:
        config = tuple(int(v) for v in argv[1].split(","))
        argv = argv[2:]
    if not argv:
        raise SystemExit(__doc__)
    swap(config)
    if argv[0] == "-m":
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
