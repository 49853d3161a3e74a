"""draft_service.convert: drafter GGUF <-> z-lab checkpoint directory, bit for bit; directories
served directly; drafters that do not fit the target refused, naming the field."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from draft_service.convert import (
    CONFIG_NAME, WEIGHTS_NAME, gguf_to_hf_name, main, read_checkpoint, read_gguf, zlab_target_layer_ids,
)
from draft_service.drafter import DrafterError
from draft_service.gguf_io import load_drafter, read_drafter
from runtime.gguf_loader import open_gguf

SHIPPED = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "draft_service", "data", "*.gguf")))


def _assert_same_tensors(a: str, b: str) -> None:
    ca, cb = read_checkpoint(a), read_checkpoint(b)
    assert ca.config == cb.config
    assert list(ca.tensors) == list(cb.tensors)
    for name in ca.tensors:
        ta, tb = ca.tensors[name], cb.tensors[name]
        assert ta.dtype == tb.dtype and ta.shape == tb.shape, name
        assert torch.equal(ta.contiguous().view(torch.uint8), tb.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_drafter_round_trip_is_bit_exact(path, tmp_path):
    d, back = tmp_path / "dir", tmp_path / "back.gguf"
    assert main([path, str(d)]) == 0
    cfg = json.loads((d / CONFIG_NAME).read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == read_gguf(path).config.target_layer_ids
    assert main([str(d), str(back)]) == 0
    _assert_same_tensors(path, str(back))
    with open(path, "rb") as fa, open(back, "rb") as fb:   # metadata and layout too
        assert fa.read() == fb.read()


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_random_drafter_round_trip_keeps_dtype(dtype, tiny_llama, tmp_path):
    from draft_service.init_random import write_random_drafter

    src = tmp_path / "src.gguf"
    write_random_drafter(tiny_llama.path, src, layers=2, block_size=4, num_target_layers=3, dtype=dtype, seed=5)
    d, back = tmp_path / "dir", tmp_path / "back.gguf"
    assert main([str(src), str(d), "--target", tiny_llama.path]) == 0
    from safetensors import safe_open

    with safe_open(str(d / WEIGHTS_NAME), framework="pt") as f:
        want = torch.bfloat16 if dtype == "bf16" else torch.float32
        assert f.get_tensor("fc.weight").dtype == want
        assert f.get_tensor("norm.weight").dtype == torch.float32
    cfg = json.loads((d / CONFIG_NAME).read_text())
    assert cfg["num_target_layers"] == tiny_llama.layers and cfg["max_position_embeddings"] == tiny_llama.context_length
    assert main([str(d), str(back)]) == 0
    _assert_same_tensors(str(src), str(back))
    assert open_gguf(back).tensor_info("dflash.fc.weight").type_name == open_gguf(src).tensor_info("dflash.fc.weight").type_name


def test_reference_layer_ids_formula():
    # z-lab build_target_layer_ids: Qwen3-8B (36 layers, 5 draft layers), a 32-layer target, one draft layer
    assert zlab_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert zlab_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert zlab_target_layer_ids(30, 1) == [15]


def _zlab_dir(path, tiny, *, dtype=torch.bfloat16, layers=2, ids=None, mask=5, hidden=None, vocab=None, seed=0, extra=None):
    """A checkpoint directory as z-lab publishes one: no ``dflash_grpc`` extras, no tokenizer,
    HF names; ``ids`` None leaves ``target_layer_ids`` out (derived from ``num_target_layers``);
    ``extra``: more config.json fields."""
    from safetensors.torch import save_file

    H, heads, kv, D, F = hidden or tiny.hidden, 4, 2, 16, 96
    n = len(ids) if ids is not None else layers
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(dtype)  # noqa: E731
    t = {"fc.weight": w(H, n * H), "hidden_norm.weight": torch.ones(H, dtype=dtype), "norm.weight": torch.ones(H, dtype=dtype)}
    for i in range(layers):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": torch.ones(H, dtype=dtype), p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype),
              p + "self_attn.q_proj.weight": w(heads * D, H), p + "self_attn.k_proj.weight": w(kv * D, H),
              p + "self_attn.v_proj.weight": w(kv * D, H), p + "self_attn.o_proj.weight": w(H, heads * D),
              p + "self_attn.q_norm.weight": torch.ones(D, dtype=dtype), p + "self_attn.k_norm.weight": torch.ones(D, dtype=dtype),
              p + "mlp.gate_proj.weight": w(F, H), p + "mlp.up_proj.weight": w(F, H), p + "mlp.down_proj.weight": w(H, F)}
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, WEIGHTS_NAME))
    dflash = {"mask_token_id": mask} | ({} if ids is None else {"target_layer_ids": ids})
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": F,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": D, "num_hidden_layers": layers,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab or tiny.vocab, "max_position_embeddings": 4096,
           "attention_bias": False, "block_size": 4, "num_target_layers": tiny.layers, "dflash_config": dflash} | (extra or {})
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(cfg, f)
    return str(path)


def test_zlab_directory_loads_and_serves(tiny_llama, tmp_path):
    from draft_service.servicer import DraftServiceServicer
    from runtime.fingerprint import model_fingerprint

    d = _zlab_dir(tmp_path / "zlab", tiny_llama)   # no target_layer_ids: derived from num_target_layers = 4
    model = load_drafter(d, tiny_llama.path)
    assert model.config.target_layer_ids == zlab_target_layer_ids(tiny_llama.layers, 2) == [1, 1]
    assert model.config.target_fingerprint == model_fingerprint(open_gguf(tiny_llama.path))
    servicer = DraftServiceServicer.from_paths(d, tiny_llama.path, max_sessions=2, max_context=64)
    try:
        info = servicer.info()
        assert info.target_fingerprint == model_fingerprint(open_gguf(tiny_llama.path))
        assert list(info.target_layer_ids) == [1, 1] and info.model.model_name == "zlab" and len(info.model.model_fingerprint) == 64
    finally:
        servicer.close()
    # block_size inside dflash_config only (as in some published configs) reads the same
    moved = _zlab_dir(tmp_path / "moved", tiny_llama, extra={"block_size": None})
    with open(os.path.join(moved, CONFIG_NAME)) as f:
        cfg = json.load(f)
    del cfg["block_size"]
    cfg["dflash_config"]["block_size"] = 4
    with open(os.path.join(moved, CONFIG_NAME), "w") as f:
        json.dump(cfg, f)
    assert load_drafter(moved, tiny_llama.path).config.block_size == 4
    from client.launcher import drafter_feature_layers

    assert drafter_feature_layers(_zlab_dir(tmp_path / "ids", tiny_llama, ids=[0, 2])) == [0, 2]
    # directory -> GGUF with --target gives the same drafter (bf16 matrices kept)
    g = tmp_path / "d.gguf"
    assert main([d, str(g), "--target", tiny_llama.path]) == 0
    assert open_gguf(g).tensor_info("blk.0.attn_q.weight").type_name == "BF16"
    (c1, s1), (c2, s2) = read_drafter(d), read_drafter(str(g))
    assert c1.target_layer_ids == c2.target_layer_ids and all(torch.equal(s1[k], s2[k]) for k in s1)


@pytest.mark.parametrize("field, kw", [
    ("hidden_size", dict(hidden=32)),
    ("vocab_size", dict(vocab=299)),
    ("target_layer_ids", dict(ids=[1, 4])),
    ("mask_token_id", dict(mask=300)),
])
def test_directory_that_does_not_fit_is_refused_naming_the_field(field, kw, tiny_llama, tmp_path, capsys):
    from draft_service.servicer import DraftServiceServicer

    d = _zlab_dir(tmp_path / "bad", tiny_llama, **kw)
    with pytest.raises(DrafterError, match=field):
        load_drafter(d, tiny_llama.path)
    with pytest.raises(DrafterError, match=field):   # the draft service does not start
        DraftServiceServicer.from_paths(d, tiny_llama.path, max_sessions=1, max_context=16)
    assert main([d, str(tmp_path / "out.gguf"), "--target", tiny_llama.path]) == 2
    assert field in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out.gguf")


def test_unsupported_or_broken_directories_are_refused(tiny_llama, tmp_path):
    d = _zlab_dir(tmp_path / "z", tiny_llama, ids=[1, 2])
    cfg_path = os.path.join(d, CONFIG_NAME)
    cfg = json.loads(open(cfg_path).read())
    for key, value, match in [("attention_bias", True, "attention_bias"), ("architectures", ["Qwen3ForCausalLM"], "DFlashDraftModel"),
                              ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
                              ("layer_types", ["full_attention"], "layer_types"),
                              ("layer_types", ["full_attention", "chunked_attention"], "layer_types")]:
        open(cfg_path, "w").write(json.dumps(cfg | {key: value}))
        with pytest.raises(DrafterError, match=match):
            read_checkpoint(d)
    for bad in (0, -3, 2.5, "16"):
        open(cfg_path, "w").write(json.dumps(cfg | {"use_sliding_window": True, "sliding_window": bad}))
        with pytest.raises(DrafterError, match="sliding_window"):
            read_checkpoint(d)
    open(cfg_path, "w").write(json.dumps(cfg | {"dflash_config": {"target_layer_ids": [1, 2]}}))
    with pytest.raises(DrafterError, match="mask_token_id"):
        read_checkpoint(d)
    open(cfg_path, "w").write(json.dumps(cfg | {"num_hidden_layers": 3}))
    with pytest.raises(DrafterError, match="layers.2"):
        read_checkpoint(d)


SLIDING_CFG = {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "use_sliding_window": True,
               "sliding_window": 7, "max_window_layers": 0}


def test_sliding_window_drafter_round_trips(tiny_llama, tmp_path):
    """A z-lab directory with sliding-window layers -> GGUF -> directory -> GGUF: the windows
    survive every hop (GGUF keys ``qwen3.attention.sliding_window`` / ``_pattern``, config.json's
    ``layer_types`` / ``use_sliding_window`` / ``sliding_window``), the two GGUFs are the same
    bytes, and the drafter loads with the windows."""
    d = _zlab_dir(tmp_path / "swa", tiny_llama, layers=3, ids=[0, 2], extra=SLIDING_CFG)
    first, back_dir, second = tmp_path / "a.gguf", tmp_path / "back", tmp_path / "b.gguf"
    assert main([d, str(first), "--target", tiny_llama.path]) == 0
    assert main([str(first), str(back_dir)]) == 0
    assert main([str(back_dir), str(second)]) == 0
    with open(first, "rb") as fa, open(second, "rb") as fb:
        assert fa.read() == fb.read()
    g = open_gguf(first)
    assert g.get("qwen3.attention.sliding_window") == 7
    assert [bool(x) for x in g.get("qwen3.attention.sliding_window_pattern")] == [True, False, True]
    cfg = json.loads((back_dir / CONFIG_NAME).read_text())
    assert (cfg["layer_types"], cfg["use_sliding_window"], cfg["sliding_window"]) == (SLIDING_CFG["layer_types"], True, 7)
    for src in (d, str(first), str(back_dir)):
        c = read_checkpoint(src).config
        assert (c.layer_types, c.sliding_window, c.layer_windows) == (SLIDING_CFG["layer_types"], 7, [7, 0, 7]), src
    assert load_drafter(str(second), tiny_llama.path).config.layer_windows == [7, 0, 7]
    # a drafter without windows writes them off explicitly, and its GGUF has no window keys
    plain = _zlab_dir(tmp_path / "plain", tiny_llama, ids=[0, 2])
    assert main([plain, str(tmp_path / "p.gguf"), "--target", tiny_llama.path]) == 0
    assert open_gguf(tmp_path / "p.gguf").get("qwen3.attention.sliding_window") is None
    assert main([str(tmp_path / "p.gguf"), str(tmp_path / "pdir")]) == 0
    cfg = json.loads((tmp_path / "pdir" / CONFIG_NAME).read_text())
    assert (cfg["layer_types"], cfg["use_sliding_window"], cfg["sliding_window"]) == (["full_attention"] * 2, False, None)


@pytest.mark.parametrize("fields, windows", [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 7}, [0, 0]),      # use_sliding_window off
    ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True}, [4096, 0]),   # Qwen3Config's default size
    ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True, "sliding_window": None}, [0, 0]),
    ({"use_sliding_window": True, "sliding_window": 7}, [0, 0]),                      # layers < max_window_layers (28)
    ({"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1}, [0, 7]),
    ({"use_sliding_window": False, "sliding_window": 7, "layer_types": ["full_attention"] * 2}, [0, 0]),
], ids=["window-off", "default-size", "null-size", "derived-none", "derived-from-max_window_layers", "all-full"])
def test_layer_windows_follow_transformers_qwen3_config(fields, windows, tiny_llama, tmp_path):
    """Which layers slide, as the reference's config (transformers' ``Qwen3Config``) decides:
    ``sliding_window`` only counts when ``use_sliding_window`` is true, and ``layer_types``
    defaults to sliding from layer ``max_window_layers`` on."""
    c = read_checkpoint(_zlab_dir(tmp_path / "z", tiny_llama, ids=[0, 2], extra=fields)).config
    assert c.layer_windows == windows
    qwen3 = pytest.importorskip("transformers").Qwen3Config(num_hidden_layers=2, **fields)
    assert [qwen3.sliding_window if t == "sliding_attention" else None for t in qwen3.layer_types] == [w or None for w in windows]


def test_names_map_both_ways():
    assert gguf_to_hf_name("blk.7.attn_q.weight") == "layers.7.self_attn.q_proj.weight"
    assert gguf_to_hf_name("dflash.fc.weight") == "fc.weight"
    assert gguf_to_hf_name("output_norm.weight") == "norm.weight"
    with pytest.raises(DrafterError):
        gguf_to_hf_name("token_embd.weight")


def test_orchestrator_refuses_a_drafter_that_does_not_fit():
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.peers import drafter_mismatch

    target = common_pb2.ModelInfo(vocab_size=300, hidden_size=64, num_layers=4, model_fingerprint="m")

    def info(**kw):
        model = dict(vocab_size=300, hidden_size=64) | kw.pop("model", {})
        return draft_pb2.DrafterInfo(model=common_pb2.ModelInfo(**model), target_fingerprint="m",
                                     target_layer_ids=kw.get("ids", [1, 2]), mask_token_id=kw.get("mask", 5))

    assert drafter_mismatch(info(), target) is None
    assert "hidden_size" in drafter_mismatch(info(model={"hidden_size": 32}), target)
    assert "target_layer_ids" in drafter_mismatch(info(ids=[1, 4]), target)
    assert "mask_token_id" in drafter_mismatch(info(mask=300), target)
