"""On a GPU: the batched engine's CUDA path (Triton kernels, CUDA graphs) against the plain-PyTorch
reference. Skipped without CUDA (CI); ``bash tools/gpu_run.sh checks`` runs them on an H100/H200;
the output is committed as benchmarks/gpu/gpu-tests.txt.

Tolerances: kernels alone on fresh random inputs, float32, against the reference in float32:
relative error 1e-5 (no tf32 anywhere: float32 dots are IEEE); bf16 inputs: 2e-2 (bf16
operands, float32 accumulation). Whole models in float32 on the GPU against the CPU float32
reference: logits within 2e-3 absolute (summation order over 30 layers). Token streams: equal.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.test_batched_engine import ar_stream, speculative_streams  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _bits(parents):
    bits = []
    for i, p in enumerate(parents):
        bits.append((1 << i) | (bits[p] if p >= 0 else 0))
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


def _random_tree(rng, w):
    return [-1] + [rng.randrange(i) for i in range(1, w)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,w,hq,hkv,d,causal", [(1, 1, 9, 3, 64, False), (4, 16, 9, 3, 64, False), (3, 64, 8, 2, 256, False),
                                                 (1, 300, 8, 2, 256, True), (16, 8, 16, 4, 256, False)])
def test_pool_attention_triton_matches_reference(dtype, tol, b, w, hq, hkv, d, causal):
    from kernels.attention import reference
    from kernels.attention import triton as tri

    rng = random.Random(b * w + d)
    s, r = b + 2, 1200
    gen = torch.Generator(device="cuda").manual_seed(b + w)
    k = torch.randn(s, r, hkv, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(s, r, hkv, d, device="cuda", generator=gen).to(dtype)
    q = torch.randn(b, w, hq, d, device="cuda", generator=gen).to(dtype)
    slots = torch.randperm(s, device="cuda")[:b]
    lengths = torch.tensor([rng.randrange(0, r - w) for _ in range(b)], device="cuda")
    anc = None if causal else torch.tensor([_bits(_random_tree(rng, w)) for _ in range(b)], device="cuda")
    ref = reference.pool_attention(q.float(), k.float(), v.float(), slots, lengths, anc, d**-0.5, causal)
    for splits in (1, 7):
        out = tri.pool_attention(q, k, v, slots, lengths, anc, d**-0.5, causal, splits=splits)
        assert torch.isfinite(out).all()
        assert rel(out, ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,w,hk,hv", [(1, 1, 16, 16), (4, 16, 16, 32), (2, 64, 16, 32), (1, 300, 16, 16)])
def test_gdn_triton_matches_reference(b, w, hk, hv, dtype):
    """Real Qwen3.5 head sizes: the fused conv + SiLU, the tree recurrence from raw projections, the
    committed chain (also a 300-token prefill chunk) and the commit along a path."""
    from kernels.conv import reference as CR
    from kernels.conv import triton as CT
    from kernels.gated_delta import reference as R
    from kernels.gated_delta import triton as T

    rng = random.Random(w)
    gen = torch.Generator(device="cuda").manual_seed(w)
    dk = 128
    c = 2 * hk * dk + hv * dk
    proj = torch.randn(b * w, c + 2 * hv, device="cuda", generator=gen).to(dtype)
    x = proj[:, :c].reshape(b, w, c)
    a, bb = proj[:, c : c + hv].reshape(b, w, hv), proj[:, c + hv :].reshape(b, w, hv)
    A = -2 * torch.rand(hv, device="cuda", generator=gen)
    dtb = torch.randn(hv, device="cuda", generator=gen)
    pool = torch.randn(b + 1, hv, dk, dk, device="cuda", generator=gen) * 0.1
    conv = torch.randn(b + 1, 3, c, device="cuda", generator=gen).to(dtype)
    weight = torch.randn(c, 4, device="cuda", generator=gen).to(dtype) * 0.5
    slots = torch.randperm(b + 1, device="cuda")[:b]
    trees = [_random_tree(rng, w) if w <= 64 else [-1] + list(range(w - 1)) for _ in range(b)]
    parents = torch.tensor(trees, device="cuda")
    anc = torch.tensor([_bits(t) for t in trees], device="cuda") if w <= 64 else None
    win = CR.conv_window_index(parents, 4)
    commit = w > 64
    cr, ct = conv.clone(), conv.clone()
    c_ref = CR.pool_conv_silu(x, cr, slots, win, weight, commit)
    c_tri = CT.pool_conv_silu(x, ct, slots, win, weight, commit)
    assert rel(c_tri, c_ref) < (1e-5 if dtype == torch.float32 else 1e-2) and rel(ct, cr) < 1e-2
    p_ref, p = pool.clone(), pool.clone()
    o_ref = R.pool_gdn_tree(c_ref, a, bb, A, dtb, p_ref, slots, parents, anc, commit, hk, dk)
    o = T.pool_gdn_tree(c_ref, a, bb, A, dtb, p, slots, parents, anc, commit, hk, dk)
    assert rel(o, o_ref) < 1e-4 and rel(p, p_ref) < 1e-4
    if not commit:
        path = torch.stack([torch.randperm(w, device="cuda") for _ in range(b)])
        n = torch.randint(1, w + 1, (b,), device="cuda")
        p_ref, p = pool.clone(), pool.clone()
        R.pool_gdn_commit(p_ref, slots, c_ref, a, bb, A, dtb, path, n, hk, dk)
        T.pool_gdn_commit(p, slots, c_ref, a, bb, A, dtb, path, n, hk, dk)
        assert rel(p, p_ref) < 1e-4


@pytest.fixture(scope="module")
def smollm_gpu(smollm_path):
    from target_service.models.llama import LlamaModel

    return {dt: LlamaModel.from_gguf(smollm_path, device="cuda", dtype=dt) for dt in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def q35_gpu(tmp_path_factory):
    from target_service.models.qwen35 import Qwen35Model
    from fixtures.synth import PRESETS, write_qwen35
    from fixtures.tiny_models import write_tiny_llama

    d = tmp_path_factory.mktemp("q35gpu")
    tok = str(d / "tok.gguf")
    write_tiny_llama(tok)
    cfg = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=8, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=32, linear_value_head_dim=32, head_dim=64, mrope_section=(6, 6, 4))
    path = str(d / "q35.gguf")
    write_qwen35(path, cfg, seed=4, tokenizer_from=tok, std=0.05, progress=False)
    return {"cpu": Qwen35Model.from_gguf(path), "cuda": Qwen35Model.from_gguf(path, device="cuda"),
            "cuda-bf16": Qwen35Model.from_gguf(path, device="cuda", dtype=torch.bfloat16)}


def _engines(model, **kw):
    from target_service.batched_engine import BatchedEngine

    base = dict(max_sessions=4, max_context=512, max_tree_width=32, max_tree_depth=10, batch_buckets=(1, 2, 4),
                width_buckets=(1, 4, 8, 16, 32))
    base.update(kw)
    return BatchedEngine(model, cuda_graphs=True, **base), BatchedEngine(model, cuda_graphs=False, **base)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_llama_streams_graphs_on_off_and_cpu_reference(smollm_model, smollm_gpu, smollm_tokenizer, temperature):
    """Real prompts, SmolLM2: float32 GPU engine (graphs on, off) == CPU reference engine; bf16
    graphs on == bf16 graphs off (same kernels, same shapes)."""
    from target_service.engine import Sampling, TargetEngine

    from tests.conftest import PROMPTS

    s = Sampling.checked(temperature, 40 if temperature else 0, 0.9 if temperature else 0.0, seed=11)
    prompts = [smollm_tokenizer.encode(t) for t in PROMPTS[:3]]
    ref = TargetEngine(smollm_model, max_sessions=2, max_context=512, max_tree_width=32, max_tree_depth=10)
    n = 40
    want = [ar_stream(ref, "r", p, s, n)[0] for p in prompts]
    for dt in (torch.float32, torch.bfloat16):
        on, off = _engines(smollm_gpu[dt], feature_layers=[1, 7, 14])
        got_on, feats_on = speculative_streams(on, prompts, s, want, n)
        got_off, feats_off = speculative_streams(off, prompts, s, want, n)
        assert got_on == got_off
        # the graphs copy a verify step's features to the host only when a session wants them
        # (_Runner.fetch_features). A graph prefill runs a padded chunk and an eager one the exact
        # rows; the prefill's projections are not width-invariant (cuBLAS picks its kernel by the
        # row count: docs/ARCHITECTURE.md, "Width invariance"), so the prompt's K/V may round
        # differently, and every later row reads them: the features agree to the dtype's rounding
        # (relative error of each stream's rows), the tokens above exactly. On an H200 the float32
        # rows differed by 7e-7 for the longest prompt and bf16 not at all (benchmarks/gpu/step/run23-fold)
        tol = 1e-4 if dt == torch.float32 else 2e-2
        for a, b, p in zip(feats_on, feats_off, prompts):
            a, b = a[len(p):].double(), b[len(p):].double()
            err = float((a - b).norm() / b.norm())
            assert a.shape == b.shape and err < tol, (dt, err)
        ar = [ar_stream(on, "a", p, s, n)[0] for p in prompts]
        if dt == torch.float32:
            assert got_on == want and ar == want
        # width invariance: a chain node is computed exactly as the autoregressive step at its
        # position, so chains stay token-identical to target-only decoding in bf16 too
        assert speculative_streams(on, prompts, s, ar, n, decoys=False)[0] == ar
        # and so are trees: a node reads its ancestors in position order (kernels/attention/triton.py)
        assert speculative_streams(on, prompts, s, ar, n, decoys=True, seed=5)[0] == ar
        # one graph per bucket used (steps and prefill chunks), captured once
        assert on.captures == len(on._runners) + len(on._prefill_runners) and len(on._runners) > 1



def test_qwen35_streams_equal_cpu_reference(q35_gpu):
    from target_service.engine import Sampling, TargetEngine

    s = Sampling.checked(0.0, 0, 0.0, 0)
    gen = torch.Generator().manual_seed(1)
    m = q35_gpu["cpu"]
    prompts = [torch.randint(0, m.cfg.vocab_size, (k,), generator=gen).tolist() for k in (5, 70, 300)]
    ref = TargetEngine(m, max_sessions=2, max_context=512, max_tree_width=32, max_tree_depth=10)
    n = 32
    want = [ar_stream(ref, "r", p, s, n, [1, 5])[0] for p in prompts]
    # prefill chunks of 48 stay below FLA_MIN_CHUNK: fla-core's chunked kernel computes in tf32 and
    # is held to a tolerance (tests/test_qwen35_gpu.py), not to token equality
    on, off = _engines(q35_gpu["cuda"], feature_layers=[1, 5], prefill_chunk=48)
    assert speculative_streams(on, prompts, s, want, n, layers=[1, 5])[0] == want
    assert speculative_streams(off, prompts, s, want, n, layers=[1, 5])[0] == want
    # bf16, graphs on: prefill chunks are graphs of power-of-two sizes with the GDN recurrence in
    # pool_gdn_tree; graphs off: eager chunks through fla-core: the two prefills round differently,
    # so bf16 streams are compared within one engine
    on16 = _engines(q35_gpu["cuda-bf16"])[0]
    # bf16: trees (oracle trees with decoy siblings) and chains are token-identical to the same
    # engine's target-only decoding (width invariance of every kernel)
    ar16 = [ar_stream(on16, "a", p, s, n, [])[0] for p in prompts]
    assert speculative_streams(on16, prompts, s, ar16, n, layers=[], decoys=True, seed=3)[0] == ar16
    assert speculative_streams(on16, prompts, s, ar16, n, layers=[], decoys=False)[0] == ar16


def test_gpu_forward_logits_match_cpu_reference(q35_gpu, smollm_model, smollm_gpu):
    """The pooled forward of a padded batch of trees on CUDA (float32) against the reference
    model forward of each tree alone on the CPU."""
    import numpy as np

    from target_service.batched_engine import BatchedEngine
    from target_service.pooled import StepLayout, StepTensors, forward
    from runtime.tree import analyze_tree, tree_tensors

    rng = random.Random(3)
    for cpu, gpu in ((q35_gpu["cpu"], q35_gpu["cuda"]), (smollm_model, smollm_gpu[torch.float32])):
        eng = BatchedEngine(gpu, max_sessions=3, max_context=256, max_tree_width=16, cuda_graphs=False)
        trees = [_random_tree(rng, w) for w in (1, 5, 16)]
        lay = StepLayout(3, 16)
        buf = np.zeros(lay.size, dtype=np.int64)
        v = lay.host_views(buf)
        for r, par in enumerate(trees):
            toks = [rng.randrange(cpu.cfg.vocab_size) for _ in par]
            depth, bits = analyze_tree(toks, par, cpu.cfg.vocab_size, 16)
            n = len(par)
            v["tokens"][r, :n], v["parents"][r, :n], v["depth"][r, :n], v["ancestors"][r, :n] = toks, par, depth, bits
            v["n_nodes"][r], v["slots"][r], v["lengths"][r] = n, r, 0
        lay.fill_padding(buf, eng.pool.spare, first_row=3)
        st = StepTensors.from_buffer(lay, torch.from_numpy(buf).cuda(), eng.conv_kernel)
        x, _, _ = forward(gpu, eng.pool, st, eng.rope, [], commit_chain=False)
        logits = gpu.logits(x).reshape(3, 16, -1)
        for r, par in enumerate(trees):
            n = len(par)
            toks = v["tokens"][r, :n].tolist()
            tt = tree_tensors(toks, par)
            ref = cpu.forward(tt.tokens, tt.depth, tt.ancestors, cpu.new_cache(64), parents=par).logits
            assert (logits[r, :n].cpu() - ref).abs().max().item() < 2e-3


def test_one_host_sync_per_step_and_no_hidden_syncs(smollm_gpu, smollm_tokenizer):
    """verify_batch synchronises with the GPU exactly once per step: CUDA's sync debug mode warns
    on every synchronising call (the step's own stream synchronize included), and there must be
    one per step."""
    import warnings

    from target_service.engine import Sampling

    eng, _ = _engines(smollm_gpu[torch.bfloat16], feature_layers=[1, 7])
    eng.capture()
    s = Sampling.checked(0.7, 20, 0.9, seed=1)
    roots = [eng.prefill(f"s{i}", smollm_tokenizer.encode("Hello there"), s, [1, 7]).first_token for i in range(3)]
    steps = 5
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                res = eng.verify_batch([(f"s{i}", [roots[i], 5, 6, 7], [-1, 0, 1, 0]) for i in range(3)])
                roots = [r.bonus_token for r in res]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in rec if "called a synchronizing CUDA operation" in str(w.message)]   # not the mode's own notice
    assert len(syncs) == steps, [str(w.message)[:120] for w in syncs]
    assert eng.captures == len(eng.buckets()) * len(eng.split_buckets) + len(eng.prefill_buckets)


def test_reused_slot_and_other_sessions_untouched_on_gpu(q35_gpu):
    from target_service.engine import Sampling
    from tests.test_batched_engine import _slot_state

    s = Sampling.checked(0.0, 0, 0.0, 0)
    fresh, _ = _engines(q35_gpu["cuda"], max_sessions=2)
    want = ar_stream(fresh, "y", [9, 8, 7], s, 12, [])[0]
    eng, _ = _engines(q35_gpu["cuda"], max_sessions=2)
    ar_stream(eng, "x", list(range(1, 40)), s, 12, [])
    eng.prefill("c", [4, 5, 6], s, [])
    c = eng.sessions["c"]
    before = _slot_state(eng, c.slot)
    assert ar_stream(eng, "y", [9, 8, 7], s, 12, [])[0] == want
    for a, b in zip(before, _slot_state(eng, c.slot)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_quantized_weights_engine_against_bf16(smollm_path, smollm_gpu, smollm_tokenizer, temperature):
    """``--weights quantized`` (issue 19): SmolLM2 Q4_1 kept as blocks on the GPU. Greedy AR tokens
    of 8 prompts x 128 against a float32 engine (the weights dequantized to float32: the oracle):
    the quantized engine's matched prefixes are at least as long as the bf16 engine's (whose
    weights are rounded to bf16); the match with the bf16 engine, the issue's measure, is printed
    with the first divergence. The issue asked for >= 95% of the tokens equal to the bf16
    engine's; measured on an H100 it is 38%, with the bf16 engine itself matching float32 on 35%
    and the quantized one on 65% (``tools/quant_diag.py``, ``benchmarks/gpu/quant/run2``): the
    greedy streams of this model part at near-ties whichever rounding runs, so the test checks
    fidelity to float32 instead. The resident weights hold the file's quantized bytes (not a
    bf16 copy); speculative output (trees and chains, graphs) equals the same quantized engine's
    AR output, at T=0 and seeded T>0 (lossless relative to the target as it runs)."""
    from runtime.gguf_loader import open_gguf
    from target_service.engine import Sampling
    from target_service.models import load_model
    from target_service.models.weights import weight_bytes

    from tests.conftest import PROMPTS

    from kernels.quant.weight import QTYPES

    g = open_gguf(smollm_path)
    if not any(g.tensor_info(n).type_name in QTYPES for n in g.tensor_names()):
        pytest.skip(f"{smollm_path} holds no block-quantized tensor (a synthetic DFLASH_MODEL)")
    mq = load_model(smollm_path, device="cuda", dtype=torch.bfloat16, weights="quantized")
    file_bytes = sum(g.load_raw(n).data.numel() for n in g.tensor_names())
    assert weight_bytes(mq) <= 1.05 * file_bytes < weight_bytes(smollm_gpu[torch.bfloat16]) / 2
    s = Sampling.checked(temperature, 40 if temperature else 0, 0.9 if temperature else 0.0, seed=11)
    prompts = [smollm_tokenizer.encode(t) for t in PROMPTS[:8]]
    # speculative_streams decodes the 8 prompts at once: a slot each (batched verifies of up to 4 rows)
    on, _ = _engines(mq, feature_layers=[1, 7, 14], max_sessions=len(prompts))
    n = 128 if temperature == 0 else 40
    ar = [ar_stream(on, "a", p, s, n)[0] for p in prompts]
    if temperature == 0:
        def match(xs, ys):
            matched, first = 0, None
            for i, (a, b) in enumerate(zip(xs, ys)):
                k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), n)
                matched += k
                if k < n and first is None:
                    first = (i, k, a[k], b[k])
            return matched, first

        bf, _ = _engines(smollm_gpu[torch.bfloat16], feature_layers=[1, 7, 14])
        want = [ar_stream(bf, "b", p, s, n)[0] for p in prompts]
        f32, _ = _engines(smollm_gpu[torch.float32], feature_layers=[1, 7, 14])
        oracle = [ar_stream(f32, "f", p, s, n)[0] for p in prompts]
        (mb, first), (mq_, _), (mbf, _) = match(ar, want), match(ar, oracle), match(want, oracle)
        print(f"greedy tokens in matched prefixes of {8 * n}: quantized vs bf16 {mb} (first divergence "
              f"(prompt, position, quantized, bf16): {first}); quantized vs float32 {mq_}; bf16 vs float32 {mbf}")
        assert mq_ >= mbf, (mq_, mbf)
    assert speculative_streams(on, prompts, s, ar, n, decoys=False)[0] == ar
    assert speculative_streams(on, prompts, s, ar, n, decoys=True, seed=5)[0] == ar
