"""Convert DFlash drafters between the project's GGUF layout and z-lab checkpoint directories.

    python -m draft_service.convert SRC DST [--target TARGET.gguf]

``SRC`` and ``DST`` are each a drafter ``.gguf`` (:mod:`draft_service.gguf_io`) or a checkpoint
directory as z-lab publishes them (``config.json`` + ``model.safetensors``, the layout of
z-lab/dflash's ``DFlashDraftModel``); a path that exists as a directory, or a ``DST`` not ending in
``.gguf``, is a directory. Either direction, and GGUF -> GGUF / directory -> directory (a re-write).

The checkpoint directory:

* ``config.json``: ``architectures: ["DFlashDraftModel"]``, ``model_type: "qwen3"``, the Qwen3
  fields (``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
  ``head_dim``, ``rms_norm_eps``, ``rope_theta``, ``vocab_size``, ``num_hidden_layers``,
  ``max_position_embeddings``, ``attention_bias``; ``layer_types``, ``use_sliding_window`` and
  ``sliding_window`` for sliding-window layers, read as transformers' ``Qwen3Config`` reads them:
  :func:`draft_service.checkpoint._layer_windows`), ``block_size``, ``num_target_layers`` and
  ``dflash_config: {mask_token_id, target_layer_ids}``. When ``target_layer_ids`` is absent it is
  derived as the reference does (:func:`zlab_target_layer_ids`). What the project needs beyond
  that (the target's fingerprint and architecture, ``trained``, the name) is kept under the key
  ``"dflash_grpc"``, which the reference ignores.
* ``model.safetensors`` (or shards listed by ``model.safetensors.index.json``): ``fc.weight``
  ``[H, N*H]``, ``hidden_norm.weight``, ``norm.weight`` and per layer
  ``layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
  self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.weight`` (:data:`gguf_io.HF_TO_GGUF`). No
  embedding and no LM head: the target's are used.

Dtypes are kept: bf16 / fp16 / fp32 matrices stay BF16 / F16 / F32 in either direction (1-D norms
are F32 in a GGUF, as :mod:`draft_service.gguf_io` stores them: an exact widening). GGUF ->
directory -> GGUF gives back every tensor bit for bit and the same metadata.

A directory carries no target fingerprint unless this converter wrote it. ``--target`` fills it
(and ``num_target_layers``, ``max_position_embeddings``) from the target GGUF and checks that the
drafter fits it (:func:`check_fits`); without it the converter says what is left unknown. The
draft service loads a directory directly (:func:`draft_service.gguf_io.load_drafter` calls
:func:`draft_service.checkpoint.read_directory`, in memory, no temporary file).
"""

from __future__ import annotations

import argparse
import os
import sys

from draft_service.checkpoint import (  # noqa: F401 - the directory format's API, re-exported
    CONFIG_NAME, DEFAULT_MAX_POSITIONS, EXTRA_KEY, INDEX_NAME, WEIGHTS_NAME, Checkpoint, check_fits, config_from_json,
    config_to_json, directory_sha256, gguf_to_hf_name, hf_to_gguf_name, is_checkpoint_dir, read_directory,
    write_directory, zlab_target_layer_ids, GGML_TO_TORCH, TORCH_TO_GGML,
)
from draft_service.drafter import DrafterError
from draft_service.gguf_io import ARCH, checked_tensors, config_metadata, read_drafter_config
from runtime.gguf_loader import GGUFFile, open_gguf, write_gguf


def read_gguf(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a drafter GGUF with its tensors as stored (F32 / F16 / BF16 -> float32 / float16 /
    bfloat16, bit for bit).

    Raises:
        DrafterError: not a drafter, a tensor missing / of the wrong shape, or quantized (a
            quantized drafter cannot keep its dtype in a checkpoint directory).
    """
    g = open_gguf(path)
    config = read_drafter_config(g)
    tensors = {}
    for name, shape in checked_tensors(g, config, path):
        raw = g.load_raw(name)
        if raw.qtype not in GGML_TO_TORCH:
            raise DrafterError(f"{path}: {name} is {raw.qtype.name}; only F32, F16 and BF16 drafters convert")
        tensors[name] = raw.data.view(GGML_TO_TORCH[raw.qtype]).reshape(shape).clone()
    return Checkpoint(
        config=config,
        tensors=tensors,
        name=str(g.get("general.name", "dflash-drafter")),
        trained=bool(g.get("dflash.trained", True)),
    )


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """:func:`read_directory` for a directory, else :func:`read_gguf`."""
    return read_directory(path) if is_checkpoint_dir(path) else read_gguf(path)


def write_gguf_drafter(ck: Checkpoint, path: str | os.PathLike[str]) -> None:
    """Write ``ck`` as a drafter GGUF (:mod:`draft_service.gguf_io` layout and metadata), each
    matrix in its own dtype (F32 / F16 / BF16), norms F32."""
    ck.config.validate()
    types = {n: TORCH_TO_GGML[t.dtype] for n, t in ck.tensors.items()}
    write_gguf(path, ARCH, config_metadata(ck.config, ck.name, ck.trained), ck.tensors, tensor_types=types)


def complete_from_target(ck: Checkpoint, target: GGUFFile) -> None:
    """Check ``ck`` fits ``target`` (:func:`check_fits`) and fill what the target knows: its
    fingerprint and architecture (refused when ``ck`` names another target), its layer count and
    context length.

    Raises:
        DrafterError: the drafter does not fit, or was built for another target.
    """
    from runtime.fingerprint import model_fingerprint

    check_fits(ck.config, target)
    fp = model_fingerprint(target)
    if ck.config.target_fingerprint and ck.config.target_fingerprint != fp:
        raise DrafterError(f"the drafter was built for target {ck.config.target_fingerprint[:16]}..., "
                           f"not for {target.path} ({fp[:16]}...)")
    ck.config.target_fingerprint = fp
    ck.config.target_architecture = target.architecture
    layers = target.get("{arch}.block_count")
    if layers is not None:
        ck.num_target_layers = int(layers)
    ctx = target.get("{arch}.context_length")
    if ctx and not ck.max_position_embeddings:
        ck.max_position_embeddings = int(ctx)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def convert(src: str, dst: str, target: str | None = None) -> list[str]:
    """Convert the drafter at ``src`` to ``dst`` (see the module docstring for the formats).

    Args:
        src: a drafter ``.gguf`` or checkpoint directory.
        dst: the output: a directory when it is one already or does not end in ``.gguf``.
        target: the target GGUF: checked against (:func:`check_fits`) and the source of the
            target fingerprint, architecture, layer count and context length.

    Returns:
        notes on what the output lacks (empty when complete).

    Raises:
        DrafterError: unreadable or inconsistent source, or it does not fit ``target``.
    """
    ck = read_checkpoint(src)
    notes = []
    if target is not None:
        complete_from_target(ck, open_gguf(target))
    to_dir = os.path.isdir(dst) or not dst.lower().endswith(".gguf")
    if not ck.config.target_fingerprint:
        notes.append("no target fingerprint (pass --target TARGET.gguf): the draft service will check the "
                     "drafter's shapes against the target it is given, not which target it was trained for")
    if to_dir:
        if ck.num_target_layers is None:
            notes.append("num_target_layers unknown (pass --target TARGET.gguf): config.json leaves it out; "
                         "z-lab's DFlashDraftModel reads it")
        if ck.max_position_embeddings is None:
            notes.append(f"max_position_embeddings unknown (pass --target TARGET.gguf): written as {DEFAULT_MAX_POSITIONS}")
        write_directory(ck, dst)
    else:
        tmp = dst + ".tmp"
        try:
            write_gguf_drafter(ck, tmp)
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return notes


def main(argv: list[str] | None = None) -> int:
    """``python -m draft_service.convert SRC DST [--target TARGET.gguf]``; exit status 2 on a
    drafter that cannot be converted (the reason on stderr)."""
    ap = argparse.ArgumentParser(
        prog="python -m draft_service.convert",
        description="Convert a DFlash drafter between the project's GGUF layout and a z-lab checkpoint "
        "directory (config.json + model.safetensors), either way; dtypes are kept.",
    )
    ap.add_argument("src", help="drafter .gguf or checkpoint directory")
    ap.add_argument("dst", help="output: a .gguf file, or a directory (created)")
    ap.add_argument("--target", default=None, help="target GGUF: checks the drafter fits it and records its fingerprint")
    args = ap.parse_args(argv)
    try:
        notes = convert(args.src, args.dst, args.target)
    except (DrafterError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ck = read_checkpoint(args.dst)
    c = ck.config
    print(f"wrote {args.dst}: {c.num_layers} layers, hidden {c.hidden_size}, block {c.block_size}, "
          f"target layers {c.target_layer_ids}, mask token {c.mask_token_id}")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
