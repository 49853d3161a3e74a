"""z-lab DFlash checkpoint directories: ``config.json`` + ``model.safetensors`` (the layout of
z-lab/dflash's ``DFlashDraftModel``), read, written and checked against a target.

The format, the ``dflash_grpc`` extras and the conversions: :mod:`draft_service.convert`. This
module stands below :mod:`draft_service.gguf_io` (which loads a directory through
:func:`read_directory`) and imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

import torch
from gguf import GGMLQuantizationType

from draft_service.drafter import FULL, LAYER_TYPES, SLIDING, DrafterConfig, DrafterError
from runtime.gguf_loader import GGUFFile, vocab_size

logger = logging.getLogger(__name__)

LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)

#: Hugging Face DFlash checkpoint names (z-lab ``DFlashDraftModel``) -> GGUF names, for converters.
HF_TO_GGUF = {
    "fc.weight": "dflash.fc.weight",
    "hidden_norm.weight": "dflash.hidden_norm.weight",
    "norm.weight": "output_norm.weight",
    "layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: config.json key holding what the project needs beyond the reference's fields.
EXTRA_KEY = "dflash_grpc"
#: ``sliding_window`` of transformers' ``Qwen3Config`` when config.json has no such key.
QWEN3_DEFAULT_WINDOW = 4096
#: ``max_position_embeddings`` written when neither the source nor ``--target`` knows it
#: (``transformers.Qwen3Config``'s default; the drafter itself does not use it).
DEFAULT_MAX_POSITIONS = 32768

GGML_TO_TORCH = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
TORCH_TO_GGML = {v: k for k, v in GGML_TO_TORCH.items()}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _gguf_to_hf() -> dict[str, str]:
    return {g: h for h, g in HF_TO_GGUF.items()}


def hf_to_gguf_name(name: str) -> str | None:
    """z-lab checkpoint tensor name -> GGUF tensor name (``layers.3.self_attn.q_proj.weight`` ->
    ``blk.3.attn_q.weight``), or None when the name is not part of a DFlash drafter."""
    if name in HF_TO_GGUF:
        return HF_TO_GGUF[name]
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        pattern = ".".join(["layers", "{i}", *parts[2:]])
        if pattern in HF_TO_GGUF:
            return HF_TO_GGUF[pattern].replace("{i}", parts[1])
    return None


def gguf_to_hf_name(name: str) -> str:
    """Inverse of :func:`hf_to_gguf_name`.

    Raises:
        DrafterError: not a drafter tensor name.
    """
    table = _gguf_to_hf()
    if name in table:
        return table[name]
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        pattern = ".".join(["blk", "{i}", *parts[2:]])
        if pattern in table:
            return table[pattern].replace("{i}", parts[1])
    raise DrafterError(f"{name}: not a DFlash drafter tensor")


def tensor_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> PyTorch-order shape of every tensor of a drafter of ``c``, in file order."""
    H, D, F_ = c.hidden_size, c.head_dim, c.intermediate_size
    per_layer = {
        "attn_norm": (H,), "attn_q": (c.num_heads * D, H), "attn_k": (c.num_kv_heads * D, H),
        "attn_v": (c.num_kv_heads * D, H), "attn_output": (H, c.num_heads * D), "attn_q_norm": (D,),
        "attn_k_norm": (D,), "ffn_norm": (H,), "ffn_gate": (F_, H), "ffn_up": (F_, H), "ffn_down": (H, F_),
    }
    shapes: dict[str, tuple[int, ...]] = {"dflash.fc.weight": (H, c.feature_size), "dflash.hidden_norm.weight": (H,)}
    for i in range(c.num_layers):
        for t in LAYER_TENSORS:
            shapes[f"blk.{i}.{t}.weight"] = per_layer[t]
    shapes["output_norm.weight"] = (H,)
    return shapes


def zlab_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a z-lab drafter reads when its config names none (z-lab/dflash
    ``build_target_layer_ids``): ``[L // 2]`` for one draft layer, else
    ``round(1 + i * (L - 4) / (n - 1))`` for ``i < n`` (``L`` target layers, ``n`` draft layers;
    Python rounding)."""
    L, n = int(num_target_layers), int(num_draft_layers)
    if n == 1:
        return [L // 2]
    span = (L - 3) - 1
    return [int(round(1 + (i * span) / (n - 1))) for i in range(n)]


@dataclasses.dataclass
class Checkpoint:
    """A drafter read from a checkpoint directory or a GGUF (:func:`draft_service.convert.read_gguf`),
    with its tensors as stored.

    Attributes:
        config: the drafter shape (``target_fingerprint`` / ``target_architecture`` empty when
            the source does not know them).
        tensors: GGUF tensor name -> tensor in its stored dtype (float32, float16 or bfloat16), CPU.
        name: ``general.name``.
        trained: ``dflash.trained``.
        num_target_layers: the target's layer count when known (config.json's
            ``num_target_layers``, or the target GGUF's block count), else None.
        max_position_embeddings: when known, else None.
    """

    config: DrafterConfig
    tensors: dict[str, torch.Tensor]
    name: str = "dflash-drafter"
    trained: bool = True
    num_target_layers: int | None = None
    max_position_embeddings: int | None = None


def is_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory (a checkpoint directory, or meant to be one)."""
    return os.path.isdir(path)


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def _field(cfg: dict[str, Any], key: str, where: str, default: Any = None, required: bool = True) -> Any:
    v = cfg.get(key, default)
    if v is None and required:
        raise DrafterError(f"{where}: missing field {key!r}")
    return v


def _layer_windows(cfg: dict[str, Any], layers: int, where: str) -> tuple[list[str], int]:
    """``(layer_types, sliding_window)`` of a z-lab config as the reference runs it.

    The reference's config is transformers' ``Qwen3Config``, whose ``sliding_window`` is the
    file's ``sliding_window`` (:data:`QWEN3_DEFAULT_WINDOW` when the key is absent) when
    ``use_sliding_window`` is true and None otherwise, and whose
    ``layer_types`` default to sliding for layers ``i >= max_window_layers`` (default 28) when a
    window is on; ``Qwen3DFlashAttention`` gives a ``"sliding_attention"`` layer that
    ``sliding_window``. So a layer slides exactly when its type says so **and** the window is on;
    ``layer_types`` naming sliding layers with ``use_sliding_window`` false or
    ``sliding_window: null`` run full attention (logged as a warning). Normalised as
    :class:`DrafterConfig` keeps it: ``([], 0)`` when no layer slides.

    Raises:
        DrafterError: ``layer_types`` not one known type per layer, or a window below 1.
    """
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types)):
        raise DrafterError(f"{where}: layer_types {types!r}: expected {layers} entries, each one of {LAYER_TYPES}")
    raw = cfg.get("sliding_window", QWEN3_DEFAULT_WINDOW)   # absent: Qwen3Config's default; null: none
    on = bool(cfg.get("use_sliding_window", False)) and raw is not None
    if on and (not isinstance(raw, int) or isinstance(raw, bool) or raw < 1):
        raise DrafterError(f"{where}: sliding_window {raw!r}: expected a positive integer")
    if types is None:
        first = cfg.get("max_window_layers")
        first = 28 if first is None else int(first)
        types = [SLIDING if on and i >= first else FULL for i in range(layers)]
    if SLIDING not in types:
        return [], 0
    if not on:
        logger.warning("drafter config names sliding layers but no window is on: full attention, as the reference runs it",
                       extra={"config": where, "use_sliding_window": cfg.get("use_sliding_window"), "sliding_window": raw})
        return [], 0
    return [str(t) for t in types], int(raw)


def config_from_json(cfg: dict[str, Any], where: str = CONFIG_NAME) -> tuple[DrafterConfig, dict[str, Any]]:
    """The :class:`DrafterConfig` of a z-lab ``config.json`` (parsed) and its ``dflash_grpc``
    extras (``{}`` when absent).

    Raises:
        DrafterError: not a DFlash drafter config, or a field the project cannot run (attention
            bias, RoPE scaling, another activation) or that is malformed (``layer_types``,
            ``sliding_window``), named in the message.
    """
    archs = cfg.get("architectures") or []
    if "DFlashDraftModel" not in archs:
        raise DrafterError(f"{where}: architectures {archs!r} does not name DFlashDraftModel: not a DFlash drafter")
    if cfg.get("model_type", "qwen3") != "qwen3":
        raise DrafterError(f"{where}: model_type {cfg.get('model_type')!r} is not supported (qwen3 only)")
    if cfg.get("attention_bias"):
        raise DrafterError(f"{where}: attention_bias = true is not supported (the drafter's projections have no bias)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise DrafterError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise DrafterError(f"{where}: rope_scaling {rope!r} is not supported (plain RoPE only)")
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise DrafterError(f"{where}: missing field 'rope_theta'")
    hidden = int(_field(cfg, "hidden_size", where))
    heads = int(_field(cfg, "num_attention_heads", where))
    layers = int(_field(cfg, "num_hidden_layers", where))
    layer_types, window = _layer_windows(cfg, layers, where)
    dflash = cfg.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids")
    if ids is None:
        n_target = cfg.get("num_target_layers")
        if n_target is None:
            raise DrafterError(f"{where}: neither dflash_config.target_layer_ids nor num_target_layers is given")
        ids = zlab_target_layer_ids(int(n_target), layers)
    mask = dflash.get("mask_token_id")
    if mask is None:
        raise DrafterError(f"{where}: missing field 'dflash_config.mask_token_id'")
    extra = dict(cfg.get(EXTRA_KEY) or {})
    config = DrafterConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_field(cfg, "intermediate_size", where)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        # (some published configs carry it inside dflash_config only)
        block_size=int(_field(cfg, "block_size", where, default=dflash.get("block_size"))),
        target_layer_ids=[int(i) for i in ids],
        mask_token_id=int(mask),
        vocab_size=int(_field(cfg, "vocab_size", where)),
        target_fingerprint=str(extra.get("target_fingerprint", "")),
        target_architecture=str(extra.get("target_architecture", "")),
        layer_types=layer_types,
        sliding_window=window,
    )
    try:
        config.validate()
    except DrafterError as e:
        raise DrafterError(f"{where}: {e}") from None
    return config, extra


def _short(x: float) -> float:
    """The shortest decimal of ``x`` as float32 (GGUF keeps floats as float32: ``1e-05``, not
    ``9.999999747378752e-06``); it converts back to the same float32."""
    import numpy as np

    return float(str(np.float32(x)))


def config_to_json(ck: Checkpoint) -> dict[str, Any]:
    """The ``config.json`` of ``ck`` (z-lab fields plus the ``dflash_grpc`` extras)."""
    c = ck.config
    dtypes = {t.dtype for t in ck.tensors.values() if t.dim() == 2}
    torch_dtype = _DTYPE_NAMES[dtypes.pop()] if len(dtypes) == 1 else "float32"
    out: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_layers,
        "rms_norm_eps": _short(c.rms_eps),
        "rope_theta": _short(c.rope_theta),
        "rope_scaling": None,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": ck.max_position_embeddings or DEFAULT_MAX_POSITIONS,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "block_size": c.block_size,
        "layer_types": list(c.layer_types) or [FULL] * c.num_layers,
        "use_sliding_window": bool(c.sliding_window),
        "sliding_window": c.sliding_window or None,
    }
    if ck.num_target_layers is not None:
        out["num_target_layers"] = int(ck.num_target_layers)
    out["dflash_config"] = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)}
    out[EXTRA_KEY] = {
        "name": ck.name,
        "trained": bool(ck.trained),
        "target_fingerprint": c.target_fingerprint,
        "target_architecture": c.target_architecture,
    }
    return out


# --------------------------------------------------------------------------------------------
# Reading and writing
# --------------------------------------------------------------------------------------------


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(path, WEIGHTS_NAME)
    if not os.path.exists(single):
        raise DrafterError(f"{path}: no {WEIGHTS_NAME} (nor {INDEX_NAME})")
    return [single]


def read_directory(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a z-lab checkpoint directory; tensors keep their stored dtype (bf16 / fp16 / fp32).

    Raises:
        DrafterError: no config.json / weights, not a DFlash drafter, a tensor missing, unexpected,
            of the wrong shape or of an unsupported dtype (named in the message).
    """
    from safetensors import safe_open

    path = os.fspath(path)
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(cfg_path):
        raise DrafterError(f"{path}: no {CONFIG_NAME}: not a checkpoint directory")
    with open(cfg_path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise DrafterError(f"{cfg_path}: not JSON: {e}") from None
    config, extra = config_from_json(raw, cfg_path)
    shapes = tensor_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    unexpected = []
    for file in _weight_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                gname = hf_to_gguf_name(name)
                if gname is None or gname not in shapes:
                    unexpected.append(name)
                    continue
                t = f.get_tensor(name)
                if t.dtype not in TORCH_TO_GGML:
                    raise DrafterError(f"{file}: {name} has dtype {t.dtype}; bf16, fp16 or fp32 expected")
                if tuple(t.shape) != shapes[gname]:
                    raise DrafterError(f"{file}: {name} has shape {tuple(t.shape)}, expected {shapes[gname]} from {CONFIG_NAME}")
                tensors[gname] = t
    missing = [gguf_to_hf_name(n) for n in shapes if n not in tensors]
    if missing or unexpected:
        raise DrafterError(f"{path}: drafter tensors missing {missing}, unexpected {unexpected}")
    return Checkpoint(
        config=config,
        tensors={n: tensors[n] for n in shapes},
        name=str(extra.get("name") or os.path.basename(os.path.normpath(path))),
        trained=bool(extra.get("trained", True)),
        num_target_layers=raw.get("num_target_layers"),
        max_position_embeddings=raw.get("max_position_embeddings"),
    )


def write_directory(ck: Checkpoint, path: str | os.PathLike[str]) -> None:
    """Write ``ck`` as a z-lab checkpoint directory (created if needed): ``config.json`` and
    ``model.safetensors``, tensors in their dtype under the reference's names."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {gguf_to_hf_name(n): t.contiguous() for n, t in ck.tensors.items()}
    save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
    os.chmod(os.path.join(path, WEIGHTS_NAME), 0o644)
    with open(os.path.join(path, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config_to_json(ck), f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------------------------
# Target fit
# --------------------------------------------------------------------------------------------


def check_fits(config: DrafterConfig, target: GGUFFile) -> None:
    """Refuse a drafter that cannot draft for ``target``, naming the field.

    Checks ``hidden_size`` against the target's ``embedding_length``, ``vocab_size`` against the
    rows of its ``token_embd.weight``, every ``target_layer_ids`` entry against its ``block_count``
    and ``mask_token_id`` against its vocabulary.

    Raises:
        DrafterError: the first field that does not fit.
    """
    hidden = target.get("{arch}.embedding_length")
    layers = target.get("{arch}.block_count")
    vocab = vocab_size(target)
    where = f"drafter does not fit target {target.path}"
    if hidden is not None and int(hidden) != config.hidden_size:
        raise DrafterError(f"{where}: hidden_size {config.hidden_size} != target embedding_length {int(hidden)}")
    if config.vocab_size != vocab:
        raise DrafterError(f"{where}: vocab_size {config.vocab_size} != target vocabulary {vocab}")
    if layers is not None and any(not 0 <= i < int(layers) for i in config.target_layer_ids):
        raise DrafterError(f"{where}: target_layer_ids {config.target_layer_ids} beyond the target's {int(layers)} layers")
    if not 0 <= config.mask_token_id < vocab:
        raise DrafterError(f"{where}: mask_token_id {config.mask_token_id} outside the target vocabulary [0, {vocab})")


def directory_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 over a checkpoint directory's ``config.json`` and weight files (names and bytes):
    the drafter's ``ModelInfo.model_fingerprint``."""
    path = os.fspath(path)
    h = hashlib.sha256()
    files = [os.path.join(path, CONFIG_NAME), *_weight_files(path)]
    for file in files:
        h.update(os.path.basename(file).encode() + b"\x00")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
