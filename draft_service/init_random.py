"""Write a randomly initialised DFlash drafter for a target GGUF.

    python -m draft_service.init_random --target TARGET.gguf --out DRAFTER.gguf \\
        [--layers 2] [--block-size 16] [--num-target-layers 5] [--seed 0] [--dtype f16]

The shape comes from :meth:`DrafterConfig.for_target` (hidden size, heads, ffn, RoPE, eps copied
from the target; ``target_layer_ids`` evenly spaced; a mask token chosen from the target's
vocabulary). Weights are initialised like Hugging Face's ``_init_weights``: every linear
``N(0, 0.02)``, every norm weight 1; the file is marked ``dflash.trained = false``.

An untrained drafter is valid but proposes almost nothing the target accepts (acceptance length
τ ≈ 1: the speculative loop then runs at about autoregressive speed). It exists so the services
run end to end before a drafter is trained.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from draft_service.drafter import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_LAYERS,
    DEFAULT_NUM_TARGET_LAYERS,
    DFlashDrafter,
    DrafterConfig,
)
from draft_service.gguf_io import STORAGE_TYPES, write_drafter
from runtime.gguf_loader import GGUFFile


def random_drafter(config: DrafterConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random float32 drafter weights (module names) for ``config``: linears ``N(0, std)`` drawn
    from ``torch.Generator().manual_seed(seed)`` in parameter order, norms 1."""
    with torch.device("meta"):
        model = DFlashDrafter(config, torch.empty(config.vocab_size, config.hidden_size))
    gen = torch.Generator().manual_seed(int(seed))
    state = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(p.shape)
        else:
            state[name] = torch.randn(p.shape, generator=gen) * std
    return state


def write_random_drafter(
    target_path: "str | os.PathLike[str] | GGUFFile",
    out_path: str | os.PathLike[str],
    *,
    layers: int = DEFAULT_NUM_LAYERS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_target_layers: int = DEFAULT_NUM_TARGET_LAYERS,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
    std: float = 0.02,
    dtype: str = "f16",
    name: str | None = None,
) -> DrafterConfig:
    """Write a randomly initialised drafter for the target at ``target_path`` to ``out_path``.

    The file is written to a temporary name in the same directory and renamed into place, so a
    reader never sees a partial file (concurrent writers of the same drafter are harmless).

    Args:
        target_path: the target GGUF (path or an open :class:`GGUFFile`).
        out_path: the drafter GGUF to write.
        layers, block_size, num_target_layers, target_layer_ids, mask_token_id: see
            :meth:`DrafterConfig.for_target`.
        seed, std: weights ``N(0, std)`` from ``seed`` (norms 1).
        dtype: storage, ``"f16"``, ``"bf16"`` or ``"f32"``.
        name: ``general.name`` (default ``"dflash-random-<target arch>"``).

    Returns:
        the drafter's :class:`DrafterConfig`.
    """
    config = DrafterConfig.for_target(
        target_path,
        num_layers=layers,
        block_size=block_size,
        num_target_layers=num_target_layers,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
    )
    state = random_drafter(config, seed=seed, std=std)
    out_path = os.fspath(out_path)
    directory = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".drafter-", suffix=".gguf.tmp", dir=directory)
    os.close(fd)
    try:
        write_drafter(tmp, config, state, dtype=dtype, name=name or f"dflash-random-{config.target_architecture}", trained=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m draft_service.init_random",
        description="Write a randomly initialised (untrained) DFlash drafter for a target GGUF. "
        "It accepts almost nothing until trained.",
    )
    ap.add_argument("--target", required=True, help="target GGUF")
    ap.add_argument("--out", required=True, help="drafter GGUF to write")
    ap.add_argument("--layers", type=int, default=DEFAULT_NUM_LAYERS, help="draft decoder layers (default 2)")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="block size B (default 16)")
    ap.add_argument("--num-target-layers", type=int, default=DEFAULT_NUM_TARGET_LAYERS, help="target layers tapped (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(STORAGE_TYPES), default="f16", help="matrix storage (default f16)")
    args = ap.parse_args(argv)
    config = write_random_drafter(
        args.target, args.out, layers=args.layers, block_size=args.block_size,
        num_target_layers=args.num_target_layers, seed=args.seed, dtype=args.dtype,
    )
    print(
        f"wrote {args.out}: {config.num_layers} layers, block {config.block_size}, "
        f"target layers {config.target_layer_ids}, mask token {config.mask_token_id} (untrained)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
