"""Drafter GGUF files (llama.cpp-style DFlash drafter layout).

``general.architecture = "qwen3"``. Tensors (PyTorch order ``[out, in]``; llama.cpp's Qwen3 uses
NeoX RoPE, so unlike ``llama`` the q/k rows are **not** permuted)::

    dflash.fc.weight            [H, N*H]       context projection
    dflash.hidden_norm.weight   [H]            RMSNorm after fc
    output_norm.weight          [H]
    blk.{i}.attn_norm.weight    [H]
    blk.{i}.attn_q.weight       [nh*D, H]
    blk.{i}.attn_k.weight       [nkv*D, H]
    blk.{i}.attn_v.weight       [nkv*D, H]
    blk.{i}.attn_output.weight  [H, nh*D]
    blk.{i}.attn_q_norm.weight  [D]
    blk.{i}.attn_k_norm.weight  [D]
    blk.{i}.ffn_norm.weight     [H]
    blk.{i}.ffn_gate.weight     [F, H]
    blk.{i}.ffn_up.weight       [F, H]
    blk.{i}.ffn_down.weight     [H, F]

Metadata: ``qwen3.block_count``, ``qwen3.embedding_length``, ``qwen3.feed_forward_length``,
``qwen3.attention.head_count``, ``qwen3.attention.head_count_kv``, ``qwen3.attention.key_length``,
``qwen3.attention.value_length``, ``qwen3.attention.layer_norm_rms_epsilon``,
``qwen3.rope.freq_base``, ``qwen3.vocab_size``, ``qwen3.dflash.block_size``,
``qwen3.dflash.target_layer_ids`` (int32 array), ``qwen3.dflash.mask_token_id``,
``dflash.target_fingerprint``, ``dflash.target_architecture``, ``dflash.trained`` (bool; False for
a random init), ``general.name``. A drafter with sliding-window layers also has llama.cpp's
``qwen3.attention.sliding_window`` (``W``, int) and ``qwen3.attention.sliding_window_pattern``
(bool array, one per layer, True = ``"sliding_attention"``); drafters without them have neither
key (their files are unchanged).

There is no embedding or LM head: the drafter borrows the target's.

Storage: matrices F16 by default (``"bf16"`` or ``"f32"`` on request); 1-D norms always F32.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator, Mapping

import torch
from gguf import GGMLQuantizationType

# HF_TO_GGUF (z-lab checkpoint names -> GGUF names) lives with the directory format; re-exported here
from draft_service.checkpoint import (  # noqa: F401
    CONFIG_NAME, EXTRA_KEY, HF_TO_GGUF, LAYER_TENSORS, check_fits, read_directory, tensor_shapes,
)
from draft_service.drafter import FULL, SLIDING, DFlashDrafter, DrafterConfig, DrafterError
from kernels.quant import QuantizedWeight
from runtime.fingerprint import model_fingerprint
from runtime.gguf_loader import FLOAT_TYPES, GGUFError, GGUFFile, open_gguf, write_gguf

logger = logging.getLogger(__name__)

ARCH = "qwen3"

#: Storage dtype names accepted by :func:`write_drafter`.
STORAGE_TYPES = {
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
    "f32": GGMLQuantizationType.F32,
}

def module_to_gguf_name(name: str) -> str:
    """:class:`DFlashDrafter` parameter name -> GGUF tensor name
    (``layers.3.attn_q.weight`` -> ``blk.3.attn_q.weight``, ``fc.weight`` -> ``dflash.fc.weight``)."""
    if name.startswith("layers."):
        return "blk." + name[len("layers."):]
    if name in ("fc.weight", "hidden_norm.weight"):
        return "dflash." + name
    return name


def gguf_to_module_name(name: str) -> str:
    """Inverse of :func:`module_to_gguf_name`."""
    if name.startswith("blk."):
        return "layers." + name[len("blk."):]
    if name.startswith("dflash."):
        return name[len("dflash."):]
    return name


def expected_tensor_names(config: DrafterConfig) -> list[str]:
    """Every GGUF tensor name a drafter of ``config`` has."""
    names = ["dflash.fc.weight", "dflash.hidden_norm.weight"]
    for i in range(config.num_layers):
        names += [f"blk.{i}.{t}.weight" for t in LAYER_TENSORS]
    return names + ["output_norm.weight"]


def config_metadata(config: DrafterConfig, name: str = "dflash-drafter", trained: bool = True) -> dict[str, Any]:
    """GGUF metadata (keys with ``{arch}``) for ``config``."""
    c = config
    windows = {}
    if c.sliding_window:
        windows = {
            "{arch}.attention.sliding_window": int(c.sliding_window),
            "{arch}.attention.sliding_window_pattern": [t == SLIDING for t in c.layer_types],
        }
    return {
        "general.name": name,
        "general.type": "model",
        "{arch}.block_count": c.num_layers,
        "{arch}.embedding_length": c.hidden_size,
        "{arch}.feed_forward_length": c.intermediate_size,
        "{arch}.attention.head_count": c.num_heads,
        "{arch}.attention.head_count_kv": c.num_kv_heads,
        "{arch}.attention.key_length": c.head_dim,
        "{arch}.attention.value_length": c.head_dim,
        "{arch}.attention.layer_norm_rms_epsilon": float(c.rms_eps),
        "{arch}.rope.freq_base": float(c.rope_theta),
        "{arch}.vocab_size": c.vocab_size,
        "{arch}.dflash.block_size": c.block_size,
        "{arch}.dflash.target_layer_ids": [int(i) for i in c.target_layer_ids],
        "{arch}.dflash.mask_token_id": c.mask_token_id,
        **windows,
        "dflash.target_fingerprint": c.target_fingerprint,
        "dflash.target_architecture": c.target_architecture,
        "dflash.trained": bool(trained),
    }


def write_drafter(
    path: str | os.PathLike[str],
    config: DrafterConfig,
    state: Mapping[str, torch.Tensor] | DFlashDrafter,
    *,
    dtype: str = "f16",
    name: str = "dflash-drafter",
    trained: bool = True,
) -> None:
    """Write a drafter GGUF.

    Args:
        path: output file (written in place; see :func:`draft_service.init_random` for an
            atomic variant).
        config: the drafter config.
        state: a :class:`DFlashDrafter` or its ``state_dict()`` (module names, see
            :func:`module_to_gguf_name`); GGUF names are accepted too.
        dtype: storage of the matrices, ``"f16"`` (default), ``"bf16"`` or ``"f32"``; norms F32.
        name: ``general.name``.
        trained: value of ``dflash.trained``.

    Raises:
        DrafterError: a tensor is missing or has the wrong shape; unknown ``dtype``.
    """
    config.validate()
    if dtype not in STORAGE_TYPES:
        raise DrafterError(f"unknown storage dtype {dtype!r}; use one of {sorted(STORAGE_TYPES)}")
    if isinstance(state, DFlashDrafter):
        state = state.state_dict()
    tensors = {}
    for k, v in state.items():
        gname = k if k.startswith(("blk.", "dflash.", "output_norm")) else module_to_gguf_name(k)
        tensors[gname] = v.detach().to(device="cpu", dtype=torch.float32)
    shapes = tensor_shapes(config)
    missing = [n for n in shapes if n not in tensors]
    extra = [n for n in tensors if n not in shapes]
    if missing or extra:
        raise DrafterError(f"drafter tensors: missing {missing}, unexpected {extra}")
    for n, shape in shapes.items():
        if tuple(tensors[n].shape) != shape:
            raise DrafterError(f"{n}: shape {tuple(tensors[n].shape)}, expected {shape}")
    ordered = {n: tensors[n] for n in shapes}
    write_gguf(path, ARCH, config_metadata(config, name, trained), ordered, default_type=STORAGE_TYPES[dtype])


def read_drafter_config(g: GGUFFile | str | os.PathLike[str]) -> DrafterConfig:
    """The :class:`DrafterConfig` stored in a drafter GGUF's metadata.

    Raises:
        DrafterError: not a DFlash drafter file (architecture or keys missing) or inconsistent.
    """
    if not isinstance(g, GGUFFile):
        g = open_gguf(g)
    try:
        if g.architecture != ARCH or g.get("{arch}.dflash.block_size") is None:
            raise DrafterError(f"{g.path}: not a DFlash drafter (architecture {g.architecture!r}, no {ARCH}.dflash.block_size)")
        ids = g.require("{arch}.dflash.target_layer_ids")
        window = int(g.get("{arch}.attention.sliding_window", 0) or 0)
        pattern = g.get("{arch}.attention.sliding_window_pattern")
        if window and not isinstance(pattern, list):
            raise DrafterError(f"{g.path}: {ARCH}.attention.sliding_window without {ARCH}.attention.sliding_window_pattern")
        types = [SLIDING if bool(p) else FULL for p in pattern] if window else []
        config = DrafterConfig(
            hidden_size=int(g.require("{arch}.embedding_length")),
            num_layers=int(g.require("{arch}.block_count")),
            num_heads=int(g.require("{arch}.attention.head_count")),
            num_kv_heads=int(g.require("{arch}.attention.head_count_kv")),
            head_dim=int(g.require("{arch}.attention.key_length")),
            intermediate_size=int(g.require("{arch}.feed_forward_length")),
            rms_eps=float(g.require("{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(g.require("{arch}.rope.freq_base")),
            block_size=int(g.require("{arch}.dflash.block_size")),
            target_layer_ids=[int(i) for i in (ids if isinstance(ids, list) else [ids])],
            mask_token_id=int(g.require("{arch}.dflash.mask_token_id")),
            vocab_size=int(g.require("{arch}.vocab_size")),
            target_fingerprint=str(g.get("dflash.target_fingerprint", "")),
            target_architecture=str(g.get("dflash.target_architecture", "")),
            layer_types=types,
            sliding_window=window,
        )
    except GGUFError as e:
        raise DrafterError(str(e)) from e
    return config.validate()


def read_drafter(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Read a drafter GGUF.

    Returns:
        ``(config, state)``: ``state`` maps :class:`DFlashDrafter` parameter names to ``dtype``
        tensors on ``device`` (``model.load_state_dict(state)`` accepts it).

    ``path`` may also be a z-lab checkpoint directory (:func:`draft_service.checkpoint.read_directory`,
    read in memory).

    Raises:
        DrafterError: not a drafter, or a tensor is missing / of the wrong shape.
    """
    if os.path.isdir(path):
        ck = read_directory(path)
        return ck.config, {gguf_to_module_name(n): t.to(device=device, dtype=dtype) for n, t in ck.tensors.items()}
    g = open_gguf(path)
    config = read_drafter_config(g)
    state = {gguf_to_module_name(name): g.load_tensor(name, dtype=dtype, device=device)
             for name, _ in checked_tensors(g, config, path)}
    return config, state


def checked_tensors(g: GGUFFile, config: DrafterConfig, path: str | os.PathLike[str]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of each tensor a drafter of ``config`` has (:func:`tensor_shapes`),
    each checked present in ``g`` with that shape.

    Raises:
        DrafterError: a tensor missing or of another shape (``path`` names the file).
    """
    for name, shape in tensor_shapes(config).items():
        if not g.has_tensor(name):
            raise DrafterError(f"{path}: missing tensor {name}")
        got = g.tensor_info(name).shape
        if tuple(got) != shape:
            raise DrafterError(f"{path}: {name} has shape {tuple(got)}, expected {shape}")
        yield name, shape


def is_trained(path: str | os.PathLike[str]) -> bool:
    """``dflash.trained`` of a drafter file or checkpoint directory (True when the key is absent)."""
    if os.path.isdir(path):
        with open(os.path.join(path, CONFIG_NAME), encoding="utf-8") as f:
            return bool((json.load(f).get(EXTRA_KEY) or {}).get("trained", True))
    return bool(open_gguf(path).get("dflash.trained", True))


def borrowed_tensor(target: GGUFFile, name: str, dtype: torch.dtype, device: "str | torch.device",
                    quantized: bool) -> "torch.Tensor | QuantizedWeight":
    """Tensor ``name`` of the target GGUF for the drafter (:meth:`GGUFFile.load_weight`): dequantized
    to ``dtype`` on ``device``, or with ``quantized`` and a type of :data:`kernels.quant.QTYPES`, its
    blocks on ``device`` (:class:`kernels.quant.QuantizedWeight`). A block type the kernels do not
    read (Q2_K, IQ...) is dequantized, with a warning naming it; float types (F32, F16, BF16) load
    as floats.

    Raises:
        runtime.gguf_loader.GGUFError: the tensor is missing or unreadable.
    """
    w = target.load_weight(name, dtype, device, quantized)
    t = target.tensor_info(name).type_name
    if quantized and not isinstance(w, QuantizedWeight) and t not in FLOAT_TYPES:
        logger.warning("target tensor %s is %s, which has no quantized kernel: dequantized for the drafter", name, t,
                       extra={"tensor": name, "type": t})
    return w


def load_drafter(
    drafter_path: str | os.PathLike[str],
    target_path: "str | os.PathLike[str] | Any",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    check_target: bool = True,
    weights: str = "bf16",
) -> "DFlashDrafter":
    """Load a drafter GGUF or z-lab checkpoint directory (:func:`read_drafter`), check it fits the
    target (:func:`draft_service.checkpoint.check_fits`) and borrow the target's embedding and LM head
    from the target GGUF. A drafter that names no target (a z-lab directory) takes the target's
    fingerprint once it fits.

    Args:
        drafter_path: the drafter ``.gguf`` or checkpoint directory.
        target_path: the target ``.gguf`` it was built for (a path or an open
            :class:`runtime.gguf_loader.GGUFFile`, to avoid parsing it twice).
        device, dtype: where and in which float dtype the module lives.
        check_target: refuse a target whose model fingerprint differs from the drafter's
            ``dflash.target_fingerprint`` (empty stored fingerprints are not checked).
        weights: ``"bf16"`` (the target's embedding and LM head dequantized to ``dtype``) or
            ``"quantized"``: each of them stored in a type of :data:`kernels.quant.QTYPES` is kept
            as the file's blocks on ``device`` (:class:`kernels.quant.QuantizedWeight`: no float
            copy of a ``[vocab, H]`` table), any other type dequantized with a warning naming it.

    Raises:
        DrafterError: the drafter does not belong to that target (fingerprint, hidden size,
            vocabulary, target_layer_ids or mask_token_id: the message names the field) or the
            file is malformed.
        ValueError: ``weights`` is neither ``"bf16"`` nor ``"quantized"``.
    """
    if weights not in ("bf16", "quantized"):
        raise ValueError(f"weights must be 'bf16' or 'quantized', got {weights!r}")
    config, state = read_drafter(drafter_path, dtype=dtype, device=device)
    target = target_path if isinstance(target_path, GGUFFile) else GGUFFile(target_path)
    target_path = target.path
    fp = model_fingerprint(target) if check_target else ""
    if check_target and config.target_fingerprint:
        if fp != config.target_fingerprint:
            raise DrafterError(
                f"drafter {drafter_path} was built for target {config.target_fingerprint[:16]}..., "
                f"not for {target_path} ({fp[:16]}...)"
            )
    if check_target:
        check_fits(config, target)
        if not config.target_fingerprint:
            config.target_fingerprint, config.target_architecture = fp, target.architecture
    embed = borrowed_tensor(target, "token_embd.weight", dtype, device, weights == "quantized")
    head = borrowed_tensor(target, "output.weight", dtype, device, weights == "quantized") if target.has_tensor("output.weight") else None
    if embed.shape[1] != config.hidden_size or embed.shape[0] != config.vocab_size:
        raise DrafterError(
            f"target embedding {tuple(embed.shape)} does not match the drafter (vocab {config.vocab_size}, hidden {config.hidden_size})"
        )
    with torch.device("meta"):
        model = DFlashDrafter(config, torch.empty(config.vocab_size, config.hidden_size))
    model.load_state_dict(state, strict=True, assign=True)
    model.borrow(embed, head)
    logger.info("loaded drafter", extra={"drafter": os.fspath(drafter_path), "layers": config.num_layers, "device": str(device),
                                         "target_weights": weights})
    return model.eval()
