"""DFlash drafter: numerics against an independent float64 implementation, cached vs uncached
context, block bidirectionality, GGUF round trips, defaults (layer ids, mask token), random init
and the default-drafter cache. Everything runs on a tiny synthetic llama target (tests/tiny_models)."""

from __future__ import annotations

import hashlib
import logging
import math
import os

import pytest
import torch

from draft_service import default_drafter_path
from draft_service.drafter import (
    DFlashDrafter,
    DrafterConfig,
    DrafterError,
    choose_mask_token,
    default_target_layer_ids,
)
from draft_service.gguf_io import (
    load_drafter,
    expected_tensor_names,
    is_trained,
    module_to_gguf_name,
    read_drafter,
    read_drafter_config,
    write_drafter,
)
from draft_service.init_random import main as init_random_main
from draft_service.init_random import write_random_drafter
from draft_service.tree import build_chain
from runtime.fingerprint import model_fingerprint
from runtime.gguf_loader import GGUFFile

from fixtures.tiny_models import write_tiny_llama


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_factory):
    return tiny_llama_factory(seed=1)


def make_drafter(tiny, seed: int = 0, dtype=torch.float32, **opts) -> DFlashDrafter:
    """An in-memory drafter for ``tiny`` with random weights and random (not all-one) norms, so a
    missing norm weight or a transposed matrix cannot go unnoticed."""
    config = DrafterConfig.for_target(tiny.path, **opts)
    model = DFlashDrafter(config, tiny.gguf_tensors["token_embd.weight"], tiny.gguf_tensors.get("output.weight"))
    gen = torch.Generator().manual_seed(seed)
    model.reset_parameters(std=0.1, generator=gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def drafter(tiny):
    return make_drafter(tiny, block_size=8, num_target_layers=3)


def features_for(config: DrafterConfig, rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, config.feature_size, generator=torch.Generator().manual_seed(seed))


def block_tokens(config: DrafterConfig, root: int, length: int | None = None) -> torch.Tensor:
    length = config.block_size if length is None else length
    return torch.tensor([root] + [config.mask_token_id] * (length - 1))


# ------------------------------------------------------------------------------------------------
# independent float64 reference: per row, per head loops, explicit softmax
# ------------------------------------------------------------------------------------------------


def naive_logits(model: DFlashDrafter, features: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
    """Logits ``[B, V]`` of the block ``tokens`` at positions ``start..`` over context rows
    ``features[:start]`` (positions ``0..start-1``), computed in float64 straight from the DFlash
    formulas, without any of the module's functions."""
    c = model.config
    W = {module_to_gguf_name(k): v.detach().to(torch.float64) for k, v in model.state_dict().items()}
    embed = model.embed_weight.to(torch.float64)
    head = model.head_weight.to(torch.float64)
    D, nh, nkv, eps = c.head_dim, c.num_heads, c.num_kv_heads, c.rms_eps
    group = nh // nkv

    def rms(x, w):
        return x / math.sqrt(float((x * x).mean()) + eps) * w

    def rope(v, pos):
        out = v.clone()
        half = D // 2
        for i in range(half):
            ang = pos * c.rope_theta ** (-2.0 * i / D)
            x1, x2 = float(v[i]), float(v[i + half])
            out[i] = x1 * math.cos(ang) - x2 * math.sin(ang)
            out[i + half] = x2 * math.cos(ang) + x1 * math.sin(ang)
        return out

    feats = features[:start].to(torch.float64)
    ctx = [rms(W["dflash.fc.weight"] @ f, W["dflash.hidden_norm.weight"]) for f in feats]
    x = [embed[t].clone() for t in tokens]
    B = len(tokens)
    for li in range(c.num_layers):
        p = f"blk.{li}."
        h = [rms(xi, W[p + "attn_norm.weight"]) for xi in x]
        att = [torch.zeros(nh * D, dtype=torch.float64) for _ in range(B)]
        for hq in range(nh):
            kv = hq // group
            Wq = W[p + "attn_q.weight"][hq * D : (hq + 1) * D]
            Wk = W[p + "attn_k.weight"][kv * D : (kv + 1) * D]
            Wv = W[p + "attn_v.weight"][kv * D : (kv + 1) * D]
            keys, vals = [], []
            for j, r in enumerate(ctx):  # context rows: the layer's own k/v projections of ctx
                keys.append(rope(rms(Wk @ r, W[p + "attn_k_norm.weight"]), j))
                vals.append(Wv @ r)
            for j, r in enumerate(h):  # block rows
                keys.append(rope(rms(Wk @ r, W[p + "attn_k_norm.weight"]), start + j))
                vals.append(Wv @ r)
            for i in range(B):
                q = rope(rms(Wq @ h[i], W[p + "attn_q_norm.weight"]), start + i)
                scores = [float(q @ k) / math.sqrt(D) for k in keys]
                m = max(scores)
                e = [math.exp(s - m) for s in scores]
                total = sum(e)
                o = sum((w / total) * v for w, v in zip(e, vals))
                att[i][hq * D : (hq + 1) * D] = o
        x = [xi + W[p + "attn_output.weight"] @ a for xi, a in zip(x, att)]
        new_x = []
        for xi in x:
            h2 = rms(xi, W[p + "ffn_norm.weight"])
            g = W[p + "ffn_gate.weight"] @ h2
            u = W[p + "ffn_up.weight"] @ h2
            new_x.append(xi + W[p + "ffn_down.weight"] @ (g / (1 + torch.exp(-g)) * u))
        x = new_x
    return torch.stack([head @ rms(xi, W["output_norm.weight"]) for xi in x])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max())


# ------------------------------------------------------------------------------------------------
# numerics
# ------------------------------------------------------------------------------------------------


def test_block_logits_match_naive_float64(drafter):
    c = drafter.config
    feats = features_for(c, 6, seed=3)
    ctx = drafter.new_context()
    drafter.append_context(ctx, feats)
    got = drafter.block_logits(ctx, 42)
    assert got.dtype == torch.float32 and got.shape == (c.block_size - 1, c.vocab_size)
    ref = naive_logits(drafter, feats, block_tokens(c, 42).tolist(), start=6)
    assert rel_err(got, ref[1:]) < 1e-5
    # the uncached path returns every block row, the root's included
    full = drafter.forward_block(feats, block_tokens(c, 42))
    assert full.shape == (c.block_size, c.vocab_size)
    assert rel_err(full, ref) < 1e-5


def test_float64_model_matches_naive_tightly(tiny, drafter):
    m64 = make_drafter(tiny, block_size=8, num_target_layers=3).to(torch.float64)
    c = m64.config
    feats = features_for(c, 5, seed=4)
    got = m64.forward_block(feats, block_tokens(c, 7))
    assert got.dtype == torch.float64
    assert rel_err(got, naive_logits(m64, feats, block_tokens(c, 7).tolist(), start=5)) < 1e-10


def test_batched_blocks_with_start_positions(drafter):
    """forward_block over several anchors: block j sees context rows < start_pos[j] only."""
    c = drafter.config
    feats = features_for(c, 9, seed=5)
    starts = [0, 3, 9]
    toks = torch.stack([block_tokens(c, r) for r in (5, 17, 250)])
    batched = drafter.forward_block(feats, toks, torch.tensor(starts))
    for j, s in enumerate(starts):
        alone = drafter.forward_block(feats[:s], toks[j])
        assert rel_err(batched[j], alone) < 1e-5
        assert rel_err(batched[j], naive_logits(drafter, feats, toks[j].tolist(), start=s)) < 1e-5


def test_cached_context_in_pieces_equals_uncached(drafter):
    c = drafter.config
    feats = features_for(c, 80, seed=6)  # > 64 rows: the cache buffers grow (copy) twice
    ctx = drafter.new_context()
    pos = 0
    for n in (3, 1, 0, 5, 60, 11):
        drafter.append_context(ctx, feats[pos : pos + n])
        pos += n
        cached = drafter.block_logits(ctx, 99)
        uncached = drafter.forward_block(feats[:pos], block_tokens(c, 99))[1:]
        assert ctx.length == pos
        assert rel_err(cached, uncached) < 1e-5
    assert ctx.capacity >= 80


def test_features_any_float_dtype(drafter):
    c = drafter.config
    feats = features_for(c, 4, seed=7).to(torch.bfloat16)
    a, b = drafter.new_context(), drafter.new_context()
    drafter.append_context(a, feats)
    drafter.append_context(b, feats.float())
    assert torch.equal(drafter.block_logits(a, 3), drafter.block_logits(b, 3))


def test_block_logits_do_not_modify_context(drafter):
    c = drafter.config
    ctx = drafter.new_context()
    drafter.append_context(ctx, features_for(c, 5, seed=8))
    keys = [ctx.k(i).clone() for i in range(c.num_layers)]
    first = drafter.block_logits(ctx, 11)
    drafter.block_logits(ctx, 12)
    assert ctx.length == 5
    assert all(torch.equal(k, ctx.k(i)) for i, k in enumerate(keys))
    assert torch.equal(first, drafter.block_logits(ctx, 11))


def test_bad_inputs_are_rejected_without_touching_the_context(drafter):
    c = drafter.config
    ctx = drafter.new_context()
    drafter.append_context(ctx, features_for(c, 2))
    with pytest.raises(ValueError):
        drafter.append_context(ctx, torch.randn(3, c.feature_size + 1))
    with pytest.raises(ValueError):
        drafter.append_context(ctx, torch.randn(c.feature_size))
    with pytest.raises(ValueError):
        drafter.block_logits(ctx, c.vocab_size)
    with pytest.raises(ValueError):
        drafter.block_logits(ctx, -1)
    assert ctx.length == 2


def test_block_attention_is_bidirectional(drafter):
    """Depth-1 logits see later block rows: no causal mask inside the block."""
    c = drafter.config
    feats = features_for(c, 4, seed=9)
    short = drafter.forward_block(feats, block_tokens(c, 5, length=2))
    long = drafter.forward_block(feats, block_tokens(c, 5, length=5))
    assert (short[1] - long[1]).abs().max() > 1e-3
    # changing only the LAST token of the block changes the logits of the root and depth 1
    a = block_tokens(c, 5, length=4)
    b = a.clone()
    b[-1] = 123
    la, lb = drafter.forward_block(feats, a), drafter.forward_block(feats, b)
    assert (la[0] - lb[0]).abs().max() > 1e-3 and (la[1] - lb[1]).abs().max() > 1e-3


def test_context_rows_all_matter(drafter):
    c = drafter.config
    feats = features_for(c, 6, seed=10)
    base = drafter.forward_block(feats, block_tokens(c, 5))
    for row in (0, 5):
        changed = feats.clone()
        changed[row] += 1.0
        assert (drafter.forward_block(changed, block_tokens(c, 5)) - base).abs().max() > 1e-4


def test_lower_precision_models(tiny, drafter):
    c = drafter.config
    feats = features_for(c, 6, seed=11)
    ref = drafter.forward_block(feats, block_tokens(c, 5))
    for dtype, tol in ((torch.bfloat16, 0.1), (torch.float16, 0.02)):
        m = make_drafter(tiny, block_size=8, num_target_layers=3).to(dtype)
        ctx = m.new_context()
        m.append_context(ctx, feats)
        got = m.block_logits(ctx, 5)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert rel_err(got, ref[1:]) < tol


# ------------------------------------------------------------------------------------------------
# defaults
# ------------------------------------------------------------------------------------------------


def test_default_target_layer_ids():
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the z-lab Qwen3-8B drafter's
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(4, 4) == [0, 1, 2, 3]
    for L in range(1, 48):
        for n in range(1, min(L, 6) + 1):
            ids = default_target_layer_ids(L, n)
            assert len(ids) == n and ids == sorted(ids) and all(0 <= i < L for i in ids)
            assert len(set(ids)) == n
    with pytest.raises(DrafterError):
        default_target_layer_ids(4, 5)


def test_choose_mask_token():
    smol_tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>", "a", "b"]
    types = [3, 3, 3, 3, 3, 1, 1]
    ids = {"bos": 1, "eos": 2, "unknown": 0, "padding": 2}
    tmpl = "<|im_start|>{{ role }}<|im_end|>"
    assert choose_mask_token(smol_tokens, types, ids, tmpl) == 4  # last free control token
    assert choose_mask_token(smol_tokens + ["<|MASK|>"], types + [4], ids, tmpl) == 7
    assert choose_mask_token(smol_tokens, types, {**ids, "padding": 5}, tmpl) == 5
    assert choose_mask_token(smol_tokens + ["[PAD7]", "[PAD8]"], types + [5, 5], ids, tmpl) == 7
    reserved = smol_tokens + ["<|reserved_0|>", "c"]
    assert choose_mask_token(reserved, types + [3, 1], ids, tmpl) == 7
    # no free control token: the unknown token, else the last id
    assert choose_mask_token(smol_tokens[:3] + ["a"], [3, 3, 3, 1], ids, tmpl) == 0
    assert choose_mask_token(smol_tokens[:3] + ["a"], [3, 3, 3, 1], {"bos": 0, "eos": 2}, tmpl) == 3


def test_config_for_tiny_target(tiny):
    c = DrafterConfig.for_target(tiny.path)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (64, 4, 2, 16, 128)
    assert (c.num_layers, c.block_size, c.vocab_size) == (2, 16, tiny.vocab)
    assert c.target_layer_ids == [0, 1, 2, 3]  # min(5, 4 layers), spread: [1, L-3] is too short
    assert c.rope_theta == tiny.rope_theta and c.rms_eps == pytest.approx(tiny.rms_eps)
    assert c.mask_token_id == 0  # bos/eos/pad and the chat markers are taken: the unknown token
    assert c.target_fingerprint == model_fingerprint(GGUFFile(tiny.path))
    assert c.target_architecture == "llama"
    with pytest.raises(DrafterError):
        DrafterConfig.for_target(tiny.path, target_layer_ids=[0, 4])


def test_config_for_smollm2():
    import target_service

    try:
        path = target_service.default_model_path()
    except FileNotFoundError:
        pytest.skip("default model not installed")
    c = DrafterConfig.for_target(path)
    assert c.target_layer_ids == [1, 8, 14, 20, 27]
    assert c.mask_token_id == 16  # <empty_output>: padding == eos, 0..2 are unk/bos/eos
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (576, 9, 3, 64, 1536)
    assert c.vocab_size == 49152 and c.rope_theta == 100000.0


# ------------------------------------------------------------------------------------------------
# GGUF files
# ------------------------------------------------------------------------------------------------


def test_gguf_round_trip(tiny, drafter, tmp_path):
    c = drafter.config
    feats = features_for(c, 7, seed=12)
    ctx = drafter.new_context()
    drafter.append_context(ctx, feats)
    ref = drafter.block_logits(ctx, 77)

    path = tmp_path / "d32.gguf"
    write_drafter(path, c, drafter, dtype="f32", name="test-drafter")
    g = GGUFFile(path)
    assert g.architecture == "qwen3" and g.get("general.name") == "test-drafter"
    assert sorted(g.tensor_names()) == sorted(expected_tensor_names(c))
    assert g.get("qwen3.dflash.target_layer_ids") == c.target_layer_ids
    assert g.get("qwen3.dflash.block_size") == 8 and g.get("qwen3.dflash.mask_token_id") == c.mask_token_id
    assert g.get("dflash.target_fingerprint") == c.target_fingerprint
    assert g.tensor_info("blk.0.attn_q.weight").type_name == "F32"
    assert read_drafter_config(path) == c

    loaded = load_drafter(path, tiny.path)
    assert loaded.config == c and not loaded.tied
    ctx2 = loaded.new_context()
    loaded.append_context(ctx2, feats)
    assert torch.equal(loaded.block_logits(ctx2, 77), ref)

    for dtype, type_name, tol in (("f16", "F16", 5e-3), ("bf16", "BF16", 5e-2)):
        p = tmp_path / f"d-{dtype}.gguf"
        write_drafter(p, c, drafter.state_dict(), dtype=dtype)
        gg = GGUFFile(p)
        assert gg.tensor_info("dflash.fc.weight").type_name == type_name
        assert gg.tensor_info("blk.1.attn_k_norm.weight").type_name == "F32"
        m = load_drafter(p, tiny.path)
        ctx3 = m.new_context()
        m.append_context(ctx3, feats)
        assert rel_err(m.block_logits(ctx3, 77), ref) < tol


def test_tied_target_uses_the_embedding_as_head(tmp_path):
    tied = write_tiny_llama(tmp_path / "tied.gguf", tied=True, seed=2)
    out = tmp_path / "d.gguf"
    write_random_drafter(tied.path, out, block_size=4, dtype="f32")
    m = load_drafter(out, tied.path)
    assert m.tied and m.head_weight is m.embed_weight
    assert torch.equal(m.embed_weight, tied.gguf_tensors["token_embd.weight"])


def test_from_gguf_refuses_another_target(tiny, tmp_path):
    other = write_tiny_llama(tmp_path / "other.gguf", layers=5)
    out = tmp_path / "d.gguf"
    write_random_drafter(tiny.path, out, block_size=4)
    with pytest.raises(DrafterError, match="built for target"):
        load_drafter(out, other.path)


def test_write_drafter_checks_shapes(drafter, tmp_path):
    state = dict(drafter.state_dict())
    state.pop("layers.1.ffn_up.weight")
    with pytest.raises(DrafterError, match="missing"):
        write_drafter(tmp_path / "x.gguf", drafter.config, state)
    with pytest.raises(DrafterError):
        read_drafter(write_tiny_llama(tmp_path / "t.gguf").path)  # a target, not a drafter


# ------------------------------------------------------------------------------------------------
# random init, CLI, default drafter
# ------------------------------------------------------------------------------------------------


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_init_random_cli(tiny, tmp_path, capsys):
    out = tmp_path / "r.gguf"
    assert init_random_main(["--target", tiny.path, "--out", str(out), "--layers", "3", "--block-size", "12",
                             "--num-target-layers", "2", "--seed", "5", "--dtype", "f32"]) == 0
    assert "untrained" in capsys.readouterr().out
    config, state = read_drafter(out)
    assert (config.num_layers, config.block_size, config.num_target_layers) == (3, 12, 2)
    assert not is_trained(out)
    assert torch.equal(state["output_norm.weight"], torch.ones(64))
    assert abs(float(state["fc.weight"].std()) - 0.02) < 0.002 and abs(float(state["fc.weight"].mean())) < 0.002
    # deterministic in the seed, different across seeds
    again = tmp_path / "r2.gguf"
    write_random_drafter(tiny.path, again, layers=3, block_size=12, num_target_layers=2, seed=5, dtype="f32")
    assert _sha(out) == _sha(again)
    write_random_drafter(tiny.path, again, layers=3, block_size=12, num_target_layers=2, seed=6, dtype="f32")
    assert _sha(out) != _sha(again)
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o644)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".drafter-")] == []


def test_default_drafter_path_caches_a_random_drafter(tiny, tmp_path, monkeypatch, caplog):
    import draft_service

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(draft_service, "DATA_DIR", str(tmp_path / "data"))
    with caplog.at_level(logging.WARNING, logger="draft_service"):
        p = default_drafter_path(tiny.path)
    fp = model_fingerprint(GGUFFile(tiny.path))
    assert p == str(tmp_path / "cache" / "drafters" / f"dflash-random-{fp[:16]}.gguf")
    assert "untrained" in caplog.text
    assert read_drafter_config(p).target_fingerprint == fp and not is_trained(p)
    mtime = os.stat(p).st_mtime_ns
    assert default_drafter_path(tiny.path) == p and os.stat(p).st_mtime_ns == mtime  # created once
    load_drafter(p, tiny.path)  # loads against its target

    # a shipped drafter for the same target wins
    os.makedirs(tmp_path / "data")
    shipped = tmp_path / "data" / "tiny-dflash.gguf"
    write_random_drafter(tiny.path, shipped, block_size=4)
    assert default_drafter_path(tiny.path) == str(shipped)


# ------------------------------------------------------------------------------------------------
# chain builder
# ------------------------------------------------------------------------------------------------


def test_build_chain():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 5.0, -1.0], [0.0, 0.0, 9.0]])
    assert build_chain(7, logits) == ([7, 1, 0, 2], [-1, 0, 1, 2])
    assert build_chain(7, logits[:0]) == ([7], [-1])
    with pytest.raises(ValueError):
        build_chain(7, logits[0])
