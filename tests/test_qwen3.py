"""Qwen3 dense targets (GGUF architecture ``qwen3``): logits against transformers, the synthetic
writer, the batched engine against the reference engine (and, with ``-m gpu`` on CUDA, its Triton
kernels and graphs), a drafter trained for a qwen3 target, and greedy lossless decoding through the
three services.

Models are random (``fixtures.tiny_models.write_tiny_qwen3``, ``fixtures.synth.write_qwen3``) with
``head_dim != hidden / heads`` (as in Qwen3-0.6B); the oracle is ``transformers.Qwen3ForCausalLM``
built from the same HF-layout weights, and, for a file with ``head_dim`` 128, transformers' own
GGUF loader reading the file.
"""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from fixtures.synth import QWEN3_PRESETS, hf_tensor_specs, hf_to_gguf_tensor, main as synth_main, write_qwen3
from fixtures.tiny_models import write_tiny_qwen3
from runtime.gguf_loader import GGUFError, open_gguf
from runtime.tree import chain
from target_service.batched_engine import BatchedEngine
from target_service.engine import Sampling, TargetEngine
from target_service.models import load_model
from target_service.models.llama import LlamaModel
from tests.test_batched_engine import ar_stream, speculative_streams

transformers = pytest.importorskip("transformers")

# float32 on both sides from the same weights: differences are summation order (observed < 1e-5
# for these models, whose logits are O(1..5)); a missing q/k norm or a permuted row is O(1).
LOGIT_ATOL = 1e-4
GREEDY = Sampling.checked(0.0, 0, 0.0, 0)


def tiny_tokenizer(path: str) -> dict:
    """The ``tokenizer.*`` metadata of a tiny model (a small GPT-2 style tokenizer) as a mapping."""
    g = open_gguf(path)
    return {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny qwen3 target of this module: untied, head_dim 32 with hidden 64 / 4 heads."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("q3") / "tiny-qwen3.gguf", seed=3)


@pytest.fixture(scope="module")
def tiny_model(tiny):
    return load_model(tiny.path)


def hf_oracle(config_kwargs: dict, state_dict: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**config_kwargs))
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def logits_and_cached_logits(model: LlamaModel, ids: torch.Tensor, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits of ``ids`` in one forward, and the same rows from a prefill of ``ids[:split]``
    committed to the cache followed by a forward of the rest over it."""
    n = ids.shape[0]
    tr = chain(ids.tolist())
    whole = model.forward(tr.tokens, torch.arange(n), tr.ancestors, model.new_cache(n + 8)).logits
    cache = model.new_cache(n + 8)
    head = chain(ids[:split].tolist())
    out = model.forward(head.tokens, torch.arange(split), head.ancestors, cache)
    model.commit(cache, out, torch.arange(split))
    tail = chain(ids[split:].tolist())
    rest = model.forward(tail.tokens, torch.arange(split, n), tail.ancestors, cache).logits
    return whole, torch.cat([out.logits, rest])


def test_tiny_qwen3_logits_match_transformers(tiny, tiny_model):
    cfg = tiny_model.cfg
    assert (tiny_model.__class__, cfg.qk_norm, cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.hidden_size) == \
        (LlamaModel, True, 32, 128, 64)
    hf = hf_oracle(tiny.hf_config(), tiny.hf_state_dict)
    ids = torch.randint(0, tiny.vocab, (48,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    whole, cached = logits_and_cached_logits(tiny_model, ids, 29)
    assert (whole - ref).abs().max().item() < LOGIT_ATOL
    assert (cached - ref).abs().max().item() < LOGIT_ATOL
    # the q/k norm is what makes the difference (so the oracle would see it missing)
    plain = LlamaModel(dataclasses.replace(cfg, qk_norm=False), tiny.gguf_tensors)
    tr = chain(ids.tolist())
    wrong = plain.forward(tr.tokens, torch.arange(48), tr.ancestors, plain.new_cache(64)).logits
    assert (wrong - ref).abs().max().item() > 0.1


def test_synth_qwen3_tied_logits_match_transformers(tmp_path, tiny):
    cfg = dataclasses.replace(QWEN3_PRESETS["tiny"], tie_word_embeddings=True, num_hidden_layers=3)
    res = write_qwen3(str(tmp_path / "q3-tied.gguf"), cfg, tokenizer_from=tiny_tokenizer(tiny.path), seed=4)
    assert "output.weight" not in res.tensor_types and res.tied
    ours = load_model(res.path)
    assert ours.cfg.tied_embeddings and ours.cfg.arch == "qwen3"
    hf = hf_oracle(res.hf_config(), res.hf_model_state_dict())
    ids = torch.randint(0, res.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    whole, cached = logits_and_cached_logits(ours, ids, 17)
    assert (whole - ref).abs().max().item() < LOGIT_ATOL
    assert (cached - ref).abs().max().item() < LOGIT_ATOL


def test_transformers_gguf_loader_agrees(tmp_path, tiny):
    """transformers reading the synthetic file itself (its own qwen3 GGUF rules: names, no q/k
    un-permute) gives our logits. Its loader takes head_dim from Qwen3Config's default (128), not
    from ``qwen3.attention.key_length``, hence head_dim 128 here (!= hidden 64 / 2 heads)."""
    from transformers import AutoModelForCausalLM

    cfg = dataclasses.replace(QWEN3_PRESETS["tiny"], num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                              num_hidden_layers=2)
    res = write_qwen3(str(tmp_path / "q3-hd128.gguf"), cfg, tokenizer_from=tiny_tokenizer(tiny.path), seed=5)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q3-hd128.gguf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ours = load_model(res.path)
    ids = torch.arange(5, 37)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    tr = chain(ids.tolist())
    out = ours.forward(tr.tokens, torch.arange(32), tr.ancestors, ours.new_cache(64))
    assert (out.logits - ref).abs().max().item() < LOGIT_ATOL


def test_names_match_gguf_py_tensor_map():
    cfg = dataclasses.replace(QWEN3_PRESETS["tiny"], vocab_size=300)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg.num_hidden_layers)
    names = set()
    for spec in hf_tensor_specs(cfg):
        for gname, t in hf_to_gguf_tensor(spec.name, torch.empty(spec.shape, device="meta"), cfg):
            assert tmap.get_name(spec.name, try_suffixes=(".weight", ".bias")) == gname, spec.name
            assert t.shape == spec.shape
            names.add(gname)
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "blk.0.ffn_norm.weight"} <= names


def test_cli_writes_qwen3_metadata(tmp_path, tiny):
    out = tmp_path / "cli.gguf"
    assert synth_main(["--arch", "qwen3", "--preset", "tiny", "--dtype", "f32", "--out", str(out),
                       "--vocab-from", tiny.path, "--no-progress"]) == 0
    g = open_gguf(str(out))
    assert g.architecture == "qwen3"
    assert (g.get("qwen3.attention.key_length"), g.get("qwen3.attention.value_length"), g.get("qwen3.embedding_length"),
            g.get("qwen3.attention.head_count")) == (32, 32, 64, 4)
    assert g.get("qwen3.rope.dimension_count") is None            # llama.cpp writes none for qwen3
    assert "not a trained model" in g.get("general.name")
    assert load_model(g).cfg.rope_dim == 32
    with pytest.raises(SystemExit):
        synth_main(["--arch", "qwen3", "--preset", "27b", "--out", str(tmp_path / "x.gguf")])


def test_load_model_refuses_a_drafter(tiny, tmp_path):
    """A DFlash drafter file is ``qwen3`` too: loading it as a target names the problem."""
    from draft_service.init_random import write_random_drafter

    drafter = tmp_path / "d.gguf"
    write_random_drafter(tiny.path, drafter, layers=1, block_size=4, num_target_layers=2, dtype="f32")
    with pytest.raises(GGUFError, match="drafter"):
        load_model(str(drafter))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 0.0), (0.8, 40, 0.9)])
def test_batched_engine_equals_reference(tiny_model, temperature, top_k, top_p):
    """The GPU engine's step code (eager on the CPU, padded to the buckets as on a GPU, prompts
    prefilled in chunks of 4) gives the reference engine's tokens and tapped features, target-only
    and with oracle trees."""
    s = Sampling.checked(temperature, top_k, top_p, seed=7)
    prompts = [[5, 17, 200, 33, 9], [100, 101, 102], [7] * 11]
    layers, n = [0, 2, 3], 20
    ref = TargetEngine(tiny_model, max_sessions=3, max_context=128, max_tree_width=32, max_tree_depth=8)
    want = [ar_stream(ref, "r", p, s, n, layers) for p in prompts]
    engine = BatchedEngine(tiny_model, max_sessions=3, max_context=128, max_tree_width=32, max_tree_depth=8,
                           feature_layers=layers, prefill_chunk=4, pad_to_buckets=True)
    toks, feats = ar_stream(engine, "b", prompts[2], s, n, layers)
    assert toks == want[2][0]
    torch.testing.assert_close(feats, want[2][1], atol=1e-4, rtol=1e-4)
    got, feats = speculative_streams(engine, prompts, s, [w[0] for w in want], n, layers=layers)
    assert got == [w[0] for w in want]
    for f, (_, wf) in zip(feats, want):
        m = min(len(f), len(wf))
        torch.testing.assert_close(f[:m], wf[:m], atol=1e-4, rtol=1e-4)
    assert engine.pool.free == engine.max_sessions


def test_training_a_drafter_for_a_qwen3_target(tiny, tmp_path):
    """``training.train`` on a qwen3 target (its transformers twin, with head_dim != 128, gives
    the responses and features): the loss falls, and the exported drafter loads for the target."""
    from draft_service.gguf_io import load_drafter
    from training.data import SequenceData, generate_responses, load_hf_target
    from training.train import list_checkpoints, parse_args, train

    hf = load_hf_target(tiny.path)
    assert hf.config.head_dim == 32
    gen = torch.Generator().manual_seed(4)
    prompts = [[1] + torch.randint(3, tiny.vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 12, (12,), generator=gen)]
    responses = generate_responses(hf, prompts, max_new_tokens=40, batch_size=6, eos_token_ids=[tiny.eos_id],
                                   pad_token_id=tiny.pad_id, progress=False)
    args = parse_args([
        "--target", tiny.path, "--out-dir", str(tmp_path / "run"), "--device", "cpu", "--no-progress",
        "--layers", "1", "--block-size", "8", "--num-target-layers", "2", "--steps", "40", "--seq-per-step", "4",
        "--batch-anchors", "8", "--lr", "3e-3", "--warmup-steps", "4", "--eval-prompts", "2",
        "--eval-max-new-tokens", "8", "--checkpoint-every", "40", "--log-every", "0", "--export-dtype", "f32",
    ])
    summary = train(args, sequences=SequenceData.from_lists(prompts, responses, {"kind": "tiny-qwen3"}),
                    eval_prompts=[[1, 40, 41, 42], [1, 90, 91]])
    losses = [h["loss"] for h in torch.load(list_checkpoints(args.out_dir)[-1][1], weights_only=False)["history"]]
    assert summary["steps"] == 40 and sum(losses[-5:]) < 0.7 * sum(losses[:5])
    drafter = load_drafter(args.output, tiny.path)
    assert drafter.config.target_architecture == "qwen3" and drafter.config.hidden_size == tiny.hidden


def near_rank_one_head(tiny, path: str) -> str:
    """``tiny``'s target with an LM head close to rank one (``a u^T`` plus small noise): the target
    and a random drafter (which borrows the head) then both pick mostly among the same few tokens,
    so some drafts are accepted and the services' accept path runs (with the plain random head a
    random drafter gets nothing accepted)."""
    from runtime.gguf_loader import write_gguf

    gen = torch.Generator().manual_seed(0)
    u, a = torch.randn(tiny.hidden, generator=gen), torch.randn(tiny.vocab, generator=gen)
    tensors = dict(tiny.gguf_tensors, **{"output.weight": 0.3 * a[:, None] * u[None, :] +
                                         0.02 * torch.randn(tiny.vocab, tiny.hidden, generator=gen)})
    metadata = {k: v for k, v in open_gguf(tiny.path).metadata.items() if k != "general.architecture"}
    write_gguf(path, "qwen3", metadata, tensors)
    return path


def test_greedy_lossless_through_the_services(tiny, tmp_path):
    """Target, draft service and orchestrator (in this process, real gRPC on loopback) on a qwen3
    target with a random drafter made for it (``init_random``): speculative greedy output (chains
    and trees) equals target-only greedy output, and some drafted tokens are accepted."""
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
        assert info.target.architecture == "qwen3"
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
    """On CUDA (skipped elsewhere): the batched engine on a qwen3 target with the Triton kernels
    (the q/k norm through ``kernels.norm``'s Triton RMSNorm), CUDA graphs on and off, float32 ==
    the CPU reference engine; bf16 graphs on: chains and trees == the same engine's target-only
    decoding (width invariance)."""
    tiny = write_tiny_qwen3(tmp_path / "q3.gguf", hidden=128, heads=4, kv_heads=2, head_dim=64, layers=4, seed=6, std=0.05)
    cpu = load_model(tiny.path)
    s, n, layers = GREEDY, 32, [1, 2]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, tiny.vocab, (k,), generator=gen).tolist() for k in (5, 70, 300)]
    ref = TargetEngine(cpu, max_sessions=2, max_context=512, max_tree_width=32, max_tree_depth=10)
    want = [ar_stream(ref, "r", p, s, n, layers)[0] for p in prompts]
    base = dict(max_sessions=4, max_context=512, max_tree_width=32, max_tree_depth=10, batch_buckets=(1, 2, 4),
                width_buckets=(1, 4, 8, 16, 32), feature_layers=layers, prefill_chunk=64)
    gpu = load_model(tiny.path, device="cuda")
    for graphs in (True, False):
        engine = BatchedEngine(gpu, cuda_graphs=graphs, **base)
        assert speculative_streams(engine, prompts, s, want, n, layers=layers)[0] == want
        assert [ar_stream(engine, "a", p, s, n, layers)[0] for p in prompts] == want
    on16 = BatchedEngine(load_model(tiny.path, device="cuda", dtype=torch.bfloat16), cuda_graphs=True, **base)
    ar16 = [ar_stream(on16, "a", p, s, n, layers)[0] for p in prompts]
    assert speculative_streams(on16, prompts, s, ar16, n, layers=layers, decoys=True, seed=3)[0] == ar16
    assert speculative_streams(on16, prompts, s, ar16, n, layers=layers, decoys=False)[0] == ar16
    assert on16.captures == len(on16._runners) + len(on16._prefill_runners)
