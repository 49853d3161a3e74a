"""Qwen3-MoE targets (GGUF architecture ``qwen3moe``): logits against transformers, the router
really routing, the synthetic writer and llama.cpp's names and shapes, the batched engine against
the reference engine (and, with ``-m gpu`` on CUDA, its Triton kernels and graphs), and greedy
lossless decoding through the three services.

Models are random (``fixtures.tiny_models.write_tiny_qwen3moe``, ``fixtures.synth.write_qwen3moe``):
4 experts of width 32, 2 per token, qwen3's attention with ``head_dim != hidden / heads``. The
oracle is ``transformers.Qwen3MoeForCausalLM`` (its eager expert loop, ``Qwen3MoeSparseMoeBlock``)
built from the same HF-layout weights, and transformers' own GGUF loader reading the file.
"""

from __future__ import annotations

import dataclasses
import logging

import gguf
import pytest
import torch

from fixtures.synth import QWEN3MOE_PRESETS, hf_tensor_specs, hf_to_gguf_tensor, main as synth_main, write_qwen3moe
from fixtures.tiny_models import write_tiny_qwen3moe
from runtime.gguf_loader import GGUFError, open_gguf, write_gguf
from runtime.tree import chain
from target_service.batched_engine import BatchedEngine
from target_service.engine import Sampling, TargetEngine
from target_service.models import load_model
from target_service.models.layers import moe_ffn
from target_service.models.llama import MOE_TENSORS, LlamaModel, stack_experts
from tests.test_batched_engine import ar_stream, speculative_streams
from tests.test_qwen3 import logits_and_cached_logits, tiny_tokenizer

transformers = pytest.importorskip("transformers")

# float32 on both sides from the same weights: differences are summation order (observed < 1e-5);
# a wrong expert, a missing renormalisation or a swapped gate/up is O(0.1..1).
LOGIT_ATOL = 1e-4
GREEDY = Sampling.checked(0.0, 0, 0.0, 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny qwen3moe target of this module: untied, 3 layers, 4 experts (2 used) of width 32."""
    return write_tiny_qwen3moe(tmp_path_factory.mktemp("q3m") / "tiny-qwen3moe.gguf", seed=3)


@pytest.fixture(scope="module")
def tiny_model(tiny):
    return load_model(tiny.path)


def hf_oracle(config_kwargs: dict, state_dict: dict):
    """``Qwen3MoeForCausalLM`` with transformers' eager expert loop (``Qwen3MoeExperts.forward``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config_kwargs, experts_implementation="eager"))
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    tr = chain(ids.tolist())
    return model.forward(tr.tokens, torch.arange(len(ids)), tr.ancestors, model.new_cache(len(ids) + 8)).logits


@pytest.fixture(scope="module")
def oracle_logits(tiny):
    ids = torch.randint(0, tiny.vocab, (48,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ids, hf_oracle(tiny.hf_config(), tiny.hf_state_dict)(ids[None]).logits[0]


def test_tiny_qwen3moe_logits_match_transformers(tiny, tiny_model, oracle_logits):
    cfg = tiny_model.cfg
    assert (cfg.arch, cfg.qk_norm, cfg.num_experts, cfg.num_experts_used, cfg.expert_ffn, cfg.norm_topk_prob) == \
        ("qwen3moe", True, 4, 2, 32, True)
    ids, ref = oracle_logits
    whole, cached = logits_and_cached_logits(tiny_model, ids, 29)
    assert (whole - ref).abs().max().item() < LOGIT_ATOL
    assert (cached - ref).abs().max().item() < LOGIT_ATOL
    # the renormalisation of the top-k is in effect (and means what transformers means by it)
    plain = LlamaModel(dataclasses.replace(cfg, norm_topk_prob=False), tiny.gguf_tensors)
    wrong = logits(plain, ids)
    assert (wrong - ref).abs().max().item() > 0.1
    with torch.no_grad():
        ref_plain = hf_oracle(dict(tiny.hf_config(), norm_topk_prob=False), tiny.hf_state_dict)(ids[None]).logits[0]
    assert (wrong - ref_plain).abs().max().item() < LOGIT_ATOL


def test_moe_ffn_matches_the_sparse_moe_block(tiny, tiny_model):
    """``moe_ffn`` alone against transformers' ``Qwen3MoeSparseMoeBlock`` (router, top-k, eager
    expert loop) on random rows, layer 1's weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**tiny.hf_config(), experts_implementation="eager")).eval()
    p = "model.layers.1.mlp."
    block.load_state_dict({"gate.weight": tiny.hf_state_dict[p + "gate.weight"],
                           "experts.gate_up_proj": tiny.hf_state_dict[p + "experts.gate_up_proj"],
                           "experts.down_proj": tiny.hf_state_dict[p + "experts.down_proj"]})
    h = torch.randn(37, tiny.hidden, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = block(h[None])[0]
    got = moe_ffn(h, tiny_model.layers[1], top_k=2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_router_routes(tiny, tiny_model, oracle_logits):
    """The experts really differ and the router picks among them: on the oracle prompt every
    expert is chosen in every layer and tokens choose different pairs; permuting the experts
    changes the logits unless the router's rows are permuted the same way."""
    ids, ref = oracle_logits
    cfg = tiny_model.cfg
    h = torch.randn(48, tiny.hidden, generator=torch.Generator().manual_seed(2))
    for lw in tiny_model.layers:
        chosen = torch.topk(h @ lw["router"].T, cfg.num_experts_used, dim=-1).indices.sort(dim=-1).values
        assert set(chosen.flatten().tolist()) == set(range(cfg.num_experts))
        assert len({tuple(r) for r in chosen.tolist()}) >= 4      # of the 6 possible pairs
    perm = torch.tensor([2, 0, 3, 1])
    experts_only = dict(tiny.gguf_tensors)
    for i in range(cfg.num_layers):
        for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            experts_only[f"blk.{i}.{n}.weight"] = tiny.gguf_tensors[f"blk.{i}.{n}.weight"][perm]
    both = dict(experts_only, **{f"blk.{i}.ffn_gate_inp.weight": tiny.gguf_tensors[f"blk.{i}.ffn_gate_inp.weight"][perm]
                                 for i in range(cfg.num_layers)})
    assert (logits(LlamaModel(cfg, experts_only), ids) - ref).abs().max().item() > 0.1
    assert (logits(LlamaModel(cfg, both), ids) - ref).abs().max().item() < LOGIT_ATOL


def test_transformers_gguf_loader_agrees(tiny, tiny_model):
    """transformers reading the file itself (its qwen3moe GGUF rules: the stacked experts and
    router names, ``norm_topk_prob`` true) gives our logits; ``training.data.load_hf_target``
    passes it the experts' width, which its config map drops."""
    from training.data import load_hf_target

    hf = load_hf_target(tiny.path)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert (hf.config.moe_intermediate_size, hf.config.norm_topk_prob, hf.config.head_dim) == (32, True, 32)
    ids = torch.arange(5, 37)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (logits(tiny_model, ids) - ref).abs().max().item() < LOGIT_ATOL


def test_synth_qwen3moe_tied_logits_match_transformers(tmp_path, tiny):
    cfg = dataclasses.replace(QWEN3MOE_PRESETS["tiny"], tie_word_embeddings=True, num_hidden_layers=2)
    res = write_qwen3moe(str(tmp_path / "q3m-tied.gguf"), cfg, tokenizer_from=tiny_tokenizer(tiny.path), seed=4)
    assert "output.weight" not in res.tensor_types and res.tied
    assert res.tensor_types["blk.0.ffn_gate_inp.weight"] == "F32"
    ours = load_model(res.path)
    assert ours.cfg.tied_embeddings and (ours.cfg.num_experts, ours.cfg.num_experts_used, ours.cfg.expert_ffn) == (4, 2, 32)
    hf = hf_oracle(res.hf_config(), res.hf_model_state_dict())
    ids = torch.randint(0, res.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    whole, cached = logits_and_cached_logits(ours, ids, 17)
    assert (whole - ref).abs().max().item() < LOGIT_ATOL
    assert (cached - ref).abs().max().item() < LOGIT_ATOL


def test_names_and_shapes_are_llama_cpps(tmp_path, tiny):
    """Every tensor name is one of gguf-py's ``MODEL_ARCH.QWEN3MOE`` names, resolved by its
    ``TensorNameMap`` from the HF name (the router) or from llama.cpp's stacked expert names, and
    the file's GGML dims are what llama.cpp's ``qwen3moe.cpp`` creates: ``ffn_gate_inp``
    ``{H, E}``, ``ffn_{gate,up}_exps`` ``{H, F, E}``, ``ffn_down_exps`` ``{F, H, E}``."""
    cfg = dataclasses.replace(QWEN3MOE_PRESETS["tiny"], vocab_size=300, num_hidden_layers=2)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, cfg.num_hidden_layers)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=i) + ".weight" for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE]
               for i in range(cfg.num_hidden_layers)}
    stacked = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
    names = set()
    for spec in hf_tensor_specs(cfg):
        for gname, _ in hf_to_gguf_tensor(spec.name, torch.empty(spec.shape, device="meta"), cfg):
            assert gname in allowed, gname
            leaf = gname.split(".")[-2]
            hf_name = f"model.layers.{gname.split('.')[1]}.{stacked[leaf]}.weight" if leaf in stacked else spec.name
            assert tmap.get_name(hf_name, try_suffixes=(".weight", ".bias")) == gname, hf_name
            names.add(gname)
    assert {f"blk.1.{n}.weight" for n in MOE_TENSORS} <= names and "blk.0.ffn_gate.weight" not in names
    res = write_qwen3moe(str(tmp_path / "shapes.gguf"), cfg, tokenizer_from=tiny_tokenizer(tiny.path))
    dims = {t.name: t.shape.tolist() for t in gguf.GGUFReader(res.path).tensors}
    H, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    assert (dims["blk.1.ffn_gate_inp.weight"], dims["blk.1.ffn_gate_exps.weight"], dims["blk.1.ffn_up_exps.weight"],
            dims["blk.1.ffn_down_exps.weight"]) == ([H, E], [H, F, E], [H, F, E], [F, H, E])
    # the GGUF halves are the HF fused gate_up_proj's gate rows and up rows
    hf = res.hf_state_dict["model.layers.1.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(res.gguf_tensors["blk.1.ffn_gate_exps.weight"], hf[:, :F], rtol=0, atol=0)
    torch.testing.assert_close(res.gguf_tensors["blk.1.ffn_up_exps.weight"], hf[:, F:], rtol=0, atol=0)


def test_cli_writes_qwen3moe_metadata(tmp_path, tiny):
    out = tmp_path / "cli.gguf"
    assert synth_main(["--arch", "qwen3moe", "--preset", "tiny", "--dtype", "bf16", "--out", str(out),
                       "--vocab-from", tiny.path, "--no-progress"]) == 0
    g = open_gguf(str(out))
    assert g.architecture == "qwen3moe"
    assert (g.get("qwen3moe.expert_count"), g.get("qwen3moe.expert_used_count"), g.get("qwen3moe.expert_feed_forward_length"),
            g.get("qwen3moe.feed_forward_length"), g.get("qwen3moe.attention.key_length")) == (4, 2, 32, 128, 32)
    assert "not a trained model" in g.get("general.name") and "Qwen3-MoE" in g.get("general.name")
    assert g.tensor_info("blk.0.ffn_gate_inp.weight").type_name == "F32"
    assert g.tensor_info("blk.0.ffn_down_exps.weight").type_name == "BF16"
    assert load_model(g).cfg.num_experts == 4
    with pytest.raises(SystemExit):
        synth_main(["--arch", "qwen3moe", "--preset", "0.6b", "--out", str(tmp_path / "x.gguf")])


def test_quantized_weights_dequantize_the_experts(tmp_path, tiny, caplog):
    """A Q8_0 file with ``--weights quantized``: attention keeps its blocks, the experts are
    dequantized with a warning naming their type, and the logits are the dequantized model's."""
    from kernels.quant import QuantizedWeight

    q = write_tiny_qwen3moe(tmp_path / "q8.gguf", layers=2, seed=7, tensor_type=gguf.GGMLQuantizationType.Q8_0)
    assert open_gguf(q.path).tensor_info("blk.0.ffn_gate_inp.weight").type_name == "F32"
    with caplog.at_level(logging.WARNING, logger="target_service.models.llama"):
        kept = load_model(q.path, weights="quantized")
    assert any("Q8_0" in r.getMessage() and "expert" in r.getMessage() for r in caplog.records)
    assert isinstance(kept.layers[0]["qkv"], QuantizedWeight) and kept.layers[0]["gate_up_exps"].dtype == torch.float32
    ids = torch.arange(3, 30)
    torch.testing.assert_close(logits(kept, ids), logits(load_model(q.path), ids), atol=1e-4, rtol=1e-4)


def test_bad_expert_metadata_is_refused(tmp_path, tiny):
    meta = {k: v for k, v in open_gguf(tiny.path).metadata.items() if k != "general.architecture"}
    for change, match in (({"qwen3moe.expert_used_count": 5}, "expert_used_count"),
                          ({"qwen3moe.expert_count": None}, "expert_count"),
                          ({"qwen3moe.expert_feed_forward_length": 16}, "ffn_gate_exps")):
        m = {k: v for k, v in {**meta, **change}.items() if v is not None}
        path = tmp_path / "bad.gguf"
        write_gguf(path, "qwen3moe", m, tiny.gguf_tensors)
        with pytest.raises(GGUFError, match=match):
            load_model(str(path))
    with pytest.raises(GGUFError, match="ffn_down_exps"):
        t = tiny.gguf_tensors
        stack_experts(load_model(tiny.path).cfg, t["blk.0.ffn_gate_inp.weight"], t["blk.0.ffn_gate_exps.weight"],
                      t["blk.0.ffn_up_exps.weight"], t["blk.0.ffn_gate_exps.weight"], device="cpu", dtype=torch.float32)


def test_batched_engine_equals_reference(tiny_model):
    """The GPU engine's step code (eager on the CPU, padded to the buckets as on a GPU, prompts
    prefilled in chunks of 4) gives the reference engine's greedy tokens and tapped features,
    target-only and with oracle trees."""
    prompts = [[5, 17, 200, 33, 9], [100, 101, 102], [7] * 11]
    layers, n = [0, 2], 16
    ref = TargetEngine(tiny_model, max_sessions=3, max_context=128, max_tree_width=32, max_tree_depth=8)
    want = [ar_stream(ref, "r", p, GREEDY, n, layers) for p in prompts]
    engine = BatchedEngine(tiny_model, max_sessions=3, max_context=128, max_tree_width=32, max_tree_depth=8,
                           feature_layers=layers, prefill_chunk=4, pad_to_buckets=True)
    toks, feats = ar_stream(engine, "b", prompts[2], GREEDY, n, layers)
    assert toks == want[2][0]
    torch.testing.assert_close(feats, want[2][1], atol=1e-4, rtol=1e-4)
    got, _ = speculative_streams(engine, prompts, GREEDY, [w[0] for w in want], n, layers=layers)
    assert got == [w[0] for w in want]
    assert engine.pool.free == engine.max_sessions


def near_rank_one_head(tiny, path: str) -> str:
    """``tiny``'s target with an LM head close to rank one (tests/test_qwen3.py's trick: then a
    random drafter, which borrows the head, gets some drafts accepted)."""
    gen = torch.Generator().manual_seed(0)
    u, a = torch.randn(tiny.hidden, generator=gen), torch.randn(tiny.vocab, generator=gen)
    tensors = dict(tiny.gguf_tensors, **{"output.weight": 0.3 * a[:, None] * u[None, :] +
                                         0.02 * torch.randn(tiny.vocab, tiny.hidden, generator=gen)})
    metadata = {k: v for k, v in open_gguf(tiny.path).metadata.items() if k != "general.architecture"}
    write_gguf(path, "qwen3moe", metadata, tensors)
    return path


def test_greedy_lossless_through_the_services(tiny, tmp_path):
    """Target, draft service and orchestrator (in this process, real gRPC on loopback) on a
    qwen3moe target with a random drafter made for it (``init_random``): speculative greedy output
    (chains and trees) equals target-only greedy output, and some drafted tokens are accepted."""
    import client as sdk
    from draft_service.init_random import write_random_drafter
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    target = near_rank_one_head(tiny, str(tmp_path / "target.gguf"))
    drafter = str(tmp_path / "drafter.gguf")
    write_random_drafter(target, drafter, layers=1, block_size=8, num_target_layers=2, std=0.1, dtype="f32", seed=1)
    accepted = 0
    with target_in_process(target, max_sessions=2, max_context=128) as tport, \
            draft_in_process(drafter, target, max_sessions=2, max_context=128) as (_, dport), \
            orchestrator_in_process(target, tport, dport, max_sessions=2, max_tokens=16) as (_, oport), \
            sdk.Client(f"127.0.0.1:{oport}", timeout=120) as c:
        info = c.info()
        assert info.target.architecture == "qwen3moe"
        assert info.drafter.available and info.drafter.compatible
        for prompt in ["def fibonacci(n):", "The quick brown fox"]:
            ar = c.generate(prompt, max_tokens=16, ignore_eos=True, speculative=False)
            spec = c.generate(prompt, max_tokens=16, ignore_eos=True)
            tree = c.generate(prompt, max_tokens=16, ignore_eos=True, tree_budget=12, top_k_draft=3)
            assert len(ar.token_ids) == 16
            assert spec.token_ids == ar.token_ids and tree.token_ids == ar.token_ids
            assert spec.stats.drafts > 0 and tree.stats.drafts > 0 and ar.stats.drafts == 0
            accepted += spec.stats.accepted_tokens + tree.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.gpu
def test_gpu_streams_equal_cpu_reference(tmp_path):
    """On CUDA (skipped elsewhere): the batched engine on a qwen3moe target with the Triton
    kernels (the MoE's two projections through the skinny linear kernel) and CUDA graphs on,
    float32 == the CPU reference engine; bf16 graphs on: chains and trees == the same engine's
    target-only decoding (width invariance of the MoE step)."""
    tiny = write_tiny_qwen3moe(tmp_path / "q3m.gguf", hidden=128, heads=4, kv_heads=2, head_dim=64, layers=4, experts=8,
                               experts_used=2, expert_ffn=64, seed=6, std=0.05, router_std=0.2)
    cpu = load_model(tiny.path)
    s, n, layers = GREEDY, 32, [1, 2]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, tiny.vocab, (k,), generator=gen).tolist() for k in (5, 70, 300)]
    ref = TargetEngine(cpu, max_sessions=2, max_context=512, max_tree_width=32, max_tree_depth=10)
    want = [ar_stream(ref, "r", p, s, n, layers)[0] for p in prompts]
    base = dict(max_sessions=4, max_context=512, max_tree_width=32, max_tree_depth=10, batch_buckets=(1, 2, 4),
                width_buckets=(1, 4, 8, 16, 32), feature_layers=layers, prefill_chunk=64)
    engine = BatchedEngine(load_model(tiny.path, device="cuda"), cuda_graphs=True, **base)
    assert speculative_streams(engine, prompts, s, want, n, layers=layers)[0] == want
    assert [ar_stream(engine, "a", p, s, n, layers)[0] for p in prompts] == want
    on16 = BatchedEngine(load_model(tiny.path, device="cuda", dtype=torch.bfloat16), cuda_graphs=True, **base)
    ar16 = [ar_stream(on16, "a", p, s, n, layers)[0] for p in prompts]
    assert speculative_streams(on16, prompts, s, ar16, n, layers=layers, decoys=True, seed=3)[0] == ar16
    assert speculative_streams(on16, prompts, s, ar16, n, layers=layers, decoys=False)[0] == ar16
    assert on16.captures == len(on16._runners) + len(on16._prefill_runners)
