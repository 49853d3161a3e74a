"""Triton kernels against their plain-PyTorch references on fresh random inputs, on the CPU through
Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` without CUDA; with CUDA the
same tests run the compiled kernels on the GPU). Small shapes: the interpreter runs each program
in Python.

Tolerances: relative error ``||out - ref|| / ||ref||`` below 1e-5 in float32 (different reduction
order only: float32 dots are IEEE, no tf32) and 2e-3 in float16 (the interpreter's bfloat16 ``dot``
is broken, so bf16 runs in tests/test_batched_engine_gpu.py on a GPU).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.conftest import assert_bits_on_gpu  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rand_tree(gen: torch.Generator, b: int, w: int, pad: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random parents (with some padded nodes: parent -1 past the root) and ancestor bit masks."""
    parents = torch.full((b, w), -1, dtype=torch.long)
    anc = torch.zeros(b, w, dtype=torch.long)
    for r in range(b):
        bits = []
        for i in range(w):
            p = -1 if i == 0 or torch.rand(1, generator=gen).item() < pad else int(torch.randint(0, i, (1,), generator=gen))
            parents[r, i] = p
            bits.append((1 << i) | (bits[p] if p >= 0 else 0))
        anc[r] = torch.tensor([x - (1 << 64) if x >= 1 << 63 else x for x in bits])
    return parents.to(DEV), anc.to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
def test_pool_attention_tree_node_equals_ar_step(dtype, splits):
    """A tree node's attention is bit-identical to the target-only step at its position: the step
    where its ancestors were committed, in depth order, at rows ``L .. L + depth - 1`` and the node
    itself is the one new row (the kernel reads a node's ancestors in position order). Bit for bit
    on a GPU; under the interpreter the two calls' dots (different ``BLOCK_M``) run on the host
    BLAS, so there they agree to ``TOL`` (``assert_bits_on_gpu``)."""
    from kernels.attention import triton as tri

    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, w, r = 2, 1, 16, 12, 700     # one KV head of two query heads (test_pool_attention covers more heads)
    k = torch.randn(2, r, hkv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(2, r, hkv, d, generator=gen).to(DEV, dtype)
    q = torch.randn(1, w, hq, d, generator=gen).to(DEV, dtype)
    parents, anc = rand_tree(gen, 1, w, pad=0.0)
    L = 300                                  # the committed prefix crosses a 256-key split
    slots = torch.tensor([0], device=DEV)
    tree = tri.pool_attention(q, k, v, slots, torch.tensor([L], device=DEV), anc, 0.3, False, splits=splits)
    par = parents[0].tolist()
    for node in range(w):
        path = [node]
        while par[path[-1]] >= 0:
            path.append(par[path[-1]])
        path.reverse()                       # root .. node
        k2, v2 = k.clone(), v.clone()
        k2[1, :L], v2[1, :L] = k[0, :L], v[0, :L]
        k2[1, L : L + len(path)] = k[0, L + torch.tensor(path)]
        v2[1, L : L + len(path)] = v[0, L + torch.tensor(path)]
        ar = tri.pool_attention(q[:, node : node + 1], k2, v2, torch.tensor([1], device=DEV),
                                torch.tensor([L + len(path) - 1], device=DEV), torch.ones(1, 1, dtype=torch.long, device=DEV),
                                0.3, False, splits=splits)
        assert_bits_on_gpu(tree[0, node], ar[0, 0], TOL[dtype], node)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_pool_attention_fewer_splits_same_bits(dtype, causal):
    """A step run with the fewest splits of ``split_buckets`` that hold its keys
    (``splits_for``) equals the same step with every split: bit for bit on a GPU (the engine picks
    the split count per step, and a tree node must still match the target-only step), to ``TOL``
    under the interpreter; and ``splits_for`` picks by the longest row's keys."""
    from kernels.attention import CHUNK, split_buckets, splits_for
    from kernels.attention import triton as tri

    assert split_buckets(17) == (1, 4, 17) and split_buckets(3) == (1, 3) and split_buckets(1) == (1,)
    assert split_buckets(5, (1, 2)) == (1, 2, 5)
    assert [splits_for(n, (1, 4, 17)) for n in (1, CHUNK, CHUNK + 1, 4 * CHUNK, 4 * CHUNK + 1)] == [1, 1, 4, 4, 17]
    gen = torch.Generator().manual_seed(11)
    if DEV == "cpu" and dtype != torch.float32:
        pytest.skip("under the interpreter float32 covers it (slow); every dtype runs on the GPU")
    hq, hkv, d, w, r, full = 2, 1, 16, 6 if DEV == "cuda" else 3, 600, 5   # (the interpreter is slow)
    k = torch.randn(3, r, hkv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(3, r, hkv, d, generator=gen).to(DEV, dtype)
    q = torch.randn(2, w, hq, d, generator=gen).to(DEV, dtype)
    slots = torch.tensor([2, 0], device=DEV)
    _, anc = rand_tree(gen, 2, w, pad=0.0)
    for lengths in ([40, CHUNK - w], [300, 2 * CHUNK - w]):     # one split; two (of variants 1, 2)
        lens = torch.tensor(lengths, device=DEV)
        splits = splits_for(max(lengths) + w, split_buckets(full, (1, 2)))
        assert splits < full
        every = tri.pool_attention(q, k, v, slots, lens, anc, 0.3, causal, splits=full)
        fewer = tri.pool_attention(q, k, v, slots, lens, anc, 0.3, causal, splits=splits, max_splits=full)
        assert_bits_on_gpu(fewer, every, TOL[dtype], (lengths, splits))


def pool_inputs(gen: torch.Generator, b: int, w: int, hq: int, hkv: int, d: int, dtype, pad: float = 0.0):
    """``(k, v, q, slots, lengths, anc)`` for :func:`pool_attention`: a pool of 4 slots x 780 rows,
    ``b`` batch rows of ``w``-node random trees (``pad`` of the nodes padding) at random slots,
    committed lengths below ``780 - w`` (several 256-key chunks)."""
    s, r = 4, 780
    k = torch.randn(s, r, hkv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(s, r, hkv, d, generator=gen).to(DEV, dtype)
    q = torch.randn(b, w, hq, d, generator=gen).to(DEV, dtype)
    slots = torch.randperm(s, generator=gen)[:b].to(DEV)
    lengths = torch.randint(0, r - w, (b,), generator=gen).to(DEV)
    _, anc = rand_tree(gen, b, w, pad=pad)
    return k, v, q, slots, lengths, anc


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,w,hq,hkv,d,causal,splits", [(2, 5, 6, 2, 16, False, 1), (3, 7, 4, 1, 32, False, 3),
                                                          (2, 9, 4, 2, 16, True, 2), (1, 64, 2, 1, 16, False, 2)])
def test_pool_attention(dtype, b, w, hq, hkv, d, causal, splits):
    """Contexts up to 700 keys: several fixed 256-key chunks, the last split taking the rest."""
    from kernels.attention import reference
    from kernels.attention import triton as tri

    k, v, q, slots, lengths, anc = pool_inputs(torch.Generator().manual_seed(b * w + d), b, w, hq, hkv, d, dtype)
    ref = reference.pool_attention(q.float(), k.float(), v.float(), slots, lengths, anc, 0.3, causal)
    out = tri.pool_attention(q, k, v, slots, lengths, anc, 0.3, causal, splits=splits)
    assert rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,w,hq,hkv,d,splits", [(3, 7, 6, 2, 16, 1), (2, 12, 2, 1, 32, 3), (2, 5, 9, 3, 64, 2)])
def test_pool_attention_nodes_per_program_same_bits(dtype, b, w, hq, hkv, d, splits):
    """A tree step with several nodes per program (:func:`_pool_tree_nodes_kernel`: the context
    tiles read once for the nodes sharing a program, each node's own tail tile apart) gives every
    row the bits of one node per program (bit for bit on a GPU, where the batched verify takes it
    from ``NODES_FROM`` programs on; the interpreter within ``TOL``), and matches the reference.
    Trees with padded nodes, contexts of 0 to ~700 keys over one to three 256-key splits."""
    from kernels.attention import reference
    from kernels.attention import triton as tri

    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("the interpreter's bfloat16 dot is broken; bfloat16 runs on the GPU")
    k, v, q, slots, lengths, anc = pool_inputs(torch.Generator().manual_seed(w * d + splits), b, w, hq, hkv, d, dtype,
                                               pad=0.2)
    lengths[0] = 0
    fit = max(16, 1 << (hq // hkv - 1).bit_length()) // (hq // hkv)
    outs = {}
    saved = dict(tri.TREE_LAUNCH)
    try:
        for nodes in (1, 2, fit):
            tri.TREE_LAUNCH["nodes"] = nodes
            outs[nodes] = tri.pool_attention(q, k, v, slots, lengths, anc, 0.3, False, splits=splits)
    finally:
        tri.TREE_LAUNCH.clear()
        tri.TREE_LAUNCH.update(saved)
    tol = TOL.get(dtype, 2e-2)
    for nodes in (2, fit):
        assert_bits_on_gpu(outs[nodes], outs[1], tol, nodes)
    ref = reference.pool_attention(q.float(), k.float(), v.float(), slots, lengths, anc, 0.3, False)
    assert rel(outs[fit], ref) < tol


@pytest.mark.parametrize("w,window,causal,splits", [(4, 20, False, 2), (6, 3, False, 1), (5, 9, True, 2)],
                         ids=["drafter-block", "window-below-block", "causal"])
def test_pool_attention_sliding_window(w, window, causal, splits):
    """A sliding window (sliding drafter layers): the Triton kernel against the reference's mask
    (row ``L + i`` sees pool rows within ``window - 1`` of it, either side), float32, contexts
    past a 256-key split so whole splits and tiles lie below the window (skipped); the
    window changes the result, and a window wider than every row gives the windowless result."""
    from kernels.attention import reference
    from kernels.attention import triton as tri

    gen = torch.Generator().manual_seed(w + window)
    s, r, hq, hkv, d = 3, 330, 2, 1, 16
    k = torch.randn(s, r, hkv, d, generator=gen).to(DEV)
    v = torch.randn(s, r, hkv, d, generator=gen).to(DEV)
    q = torch.randn(2, w, hq, d, generator=gen).to(DEV)
    slots = torch.tensor([2, 0], device=DEV)
    lengths = torch.tensor([300, 3], device=DEV)               # one past the first 256-key split, one shorter than the window
    anc = torch.full((2, w), (1 << w) - 1, dtype=torch.long, device=DEV)   # the drafter's block: all rows visible
    ref = reference.pool_attention(q, k, v, slots, lengths, anc, 0.3, causal, window=window)
    out = tri.pool_attention(q, k, v, slots, lengths, anc, 0.3, causal, splits=splits, window=window)
    assert rel(out, ref) < TOL[torch.float32]
    # the reference's mask, spelled out for row 0 (L = 300): only rows within the window count
    L, i = 300, 2
    rows = torch.arange(max(0, L + i - window + 1), min(L + i + window, L + (i + 1 if causal else w)))
    kk, vv = k[2, rows].float(), v[2, rows].float()            # [n, hkv, D]
    sc = torch.einsum("hd,nhd->hn", q[0, i].float().view(hkv, hq // hkv, d).reshape(hq, d),
                      kk.repeat_interleave(hq // hkv, dim=1)) * 0.3
    want = torch.einsum("hn,nhd->hd", sc.softmax(-1), vv.repeat_interleave(hq // hkv, dim=1))
    torch.testing.assert_close(ref[0, i].float(), want, atol=1e-5, rtol=1e-5)
    full = reference.pool_attention(q, k, v, slots, lengths, anc, 0.3, causal)
    assert (ref[0] - full[0]).abs().max() > 1e-2                # the window bites
    short = (q[1:], k, v, slots[1:], lengths[1:], anc[1:], 0.3, causal)   # L = 3: cheap under the interpreter
    wide = tri.pool_attention(*short, splits=splits, window=w + 3)
    assert_bits_on_gpu(wide, tri.pool_attention(*short, splits=splits), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,w,hk,hv,dk", [(2, 6, 2, 4, 16), (3, 9, 1, 2, 16)])
def test_gated_delta_kernels(dtype, b, w, hk, hv, dk):
    """Tree conv + SiLU, the tree recurrence from raw projections, a committed chain (conv and
    recurrent state written), and the commit along a path."""
    from kernels.conv import reference as CR
    from kernels.conv import triton as CT
    from kernels.gated_delta import reference as R
    from kernels.gated_delta import triton as T

    gen = torch.Generator().manual_seed(w * hv)
    c, kk, s = 2 * hk * dk + hv * dk, 4, 5
    proj = torch.randn(b * w, c + 2 * hv + 3, generator=gen).to(DEV, dtype)   # a projection's column slices
    x = proj[:, :c].reshape(b, w, c)
    a, bb = proj[:, c : c + hv].reshape(b, w, hv), proj[:, c + hv : c + 2 * hv].reshape(b, w, hv)
    A = (-2 * torch.rand(hv, generator=gen)).to(DEV)
    dtb = torch.randn(hv, generator=gen).to(DEV)
    state = (torch.randn(s, hv, dk, dk, generator=gen) * 0.1).to(DEV)
    conv = torch.randn(s, kk - 1, c, generator=gen).to(DEV, dtype)
    weight = torch.randn(c, kk, generator=gen).to(DEV, dtype)
    slots = torch.randperm(s, generator=gen)[:b].to(DEV)
    parents, anc = rand_tree(gen, b, w)
    win = CR.conv_window_index(parents, kk)
    c_ref = CR.pool_conv_silu(x, conv.clone(), slots, win, weight)
    assert rel(CT.pool_conv_silu(x, conv.clone(), slots, win, weight), c_ref) < TOL[dtype]
    o_ref = R.pool_gdn_tree(c_ref, a, bb, A, dtb, state.clone(), slots, parents, anc, False, hk, dk)
    assert rel(T.pool_gdn_tree(c_ref, a, bb, A, dtb, state.clone(), slots, parents, anc, False, hk, dk), o_ref) < 1e-5
    chain = (torch.arange(w, device=DEV) - 1).expand(b, w).contiguous()
    cwin = CR.conv_window_index(chain, kk)
    for n in (1, w):                                       # fewer and more nodes than the conv window
        cr, ct, sr, st = conv.clone(), conv.clone(), state.clone(), state.clone()
        xc = x[:, :n]
        out_r = CR.pool_conv_silu(xc, cr, slots, cwin[:, :n].contiguous(), weight, commit=True)
        out_t = CT.pool_conv_silu(xc, ct, slots, cwin[:, :n].contiguous(), weight, commit=True)
        assert rel(out_t, out_r) < TOL[dtype] and torch.equal(ct, cr)
        R.pool_gdn_tree(out_r, a[:, :n], bb[:, :n], A, dtb, sr, slots, chain[:, :n].contiguous(), None, True, hk, dk)
        T.pool_gdn_tree(out_r, a[:, :n], bb[:, :n], A, dtb, st, slots, chain[:, :n].contiguous(), None, True, hk, dk)
        assert rel(st, sr) < 1e-5
    path = torch.stack([torch.randperm(w, generator=gen) for _ in range(b)]).to(DEV)
    n_acc = torch.randint(1, w + 1, (b,), generator=gen).to(DEV)
    sr, st = state.clone(), state.clone()
    R.pool_gdn_commit(sr, slots, c_ref, a, bb, A, dtb, path, n_acc, hk, dk)
    T.pool_gdn_commit(st, slots, c_ref, a, bb, A, dtb, path, n_acc, hk, dk)
    assert rel(st, sr) < 1e-5


def _anc_bits(parents: list[int]) -> list[int]:
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((1 << i) | (bits[p] if p >= 0 else 0))
    return [x - (1 << 64) if x >= 1 << 63 else x for x in bits]


@pytest.mark.parametrize("shape", ["ddtree", "branches", "random", "chain", "wide64"])
def test_gdn_tree_walks_same_bits(shape, monkeypatch):
    """The tree walk that computes leaf children from a copy of their parent's state and continues
    from an ancestor (``TREE_WALK = "leaves"``) gives exactly the outputs and gates of the walk that
    replays every restart from the committed state, on trees that exercise each case: a chain with a
    leaf off every node (bench.gpu's shape), side branches with children (continue from an
    ancestor, and restarts), random trees with padding, and a plain chain; and matches the reference
    to float32 rounding."""
    from kernels.gated_delta import reference as R
    from kernels.gated_delta import triton as T

    w = 16 if DEV == "cuda" else 12
    if shape == "wide64":                                  # node 63 (the sign bit) a leaf child
        w = 64
        par = [[-1] + list(range(31)) + [d % 32 for d in range(32)]]
    elif shape == "ddtree":
        half = w // 2
        par = [[-1] + list(range(half - 1)) + [d % half for d in range(w - half)]]
    elif shape == "branches":
        par = [[-1, 0, 1, 0, 3, 2, 4, 3, 7, 5, 0, 10][:w] + list(range(11, w - 1))]
    elif shape == "chain":
        par = [[-1] + list(range(w - 1))]
    else:
        gen0 = torch.Generator().manual_seed(3)
        p, _ = rand_tree(gen0, 2, w, pad=0.2)
        par = p.cpu().tolist()
    b, hk, hv, dk, s = len(par), 1, 2, 16, 4
    gen = torch.Generator().manual_seed(11 + w)
    c = 2 * hk * dk + hv * dk
    conv = torch.randn(b, w, c, generator=gen).to(DEV)
    a, bb = torch.randn(b, w, hv, generator=gen).to(DEV), torch.randn(b, w, hv, generator=gen).to(DEV)
    A, dtb = (-2 * torch.rand(hv, generator=gen)).to(DEV), torch.randn(hv, generator=gen).to(DEV)
    state = (torch.randn(s, hv, dk, dk, generator=gen) * 0.1).to(DEV)
    slots = torch.arange(b, device=DEV)
    parents = torch.tensor(par, device=DEV)
    anc = torch.tensor([_anc_bits(r) for r in par], device=DEV)
    outs = {}
    for walk in ("replay", "leaves"):
        monkeypatch.setattr(T, "TREE_WALK", walk)
        g = torch.empty(b, w, hv, 2, device=DEV)
        st = state.clone()
        outs[walk] = (T.pool_gdn_tree(conv, a, bb, A, dtb, st, slots, parents, anc, False, hk, dk, gates_out=g), g)
        assert torch.equal(st, state)
    assert torch.equal(outs["leaves"][0], outs["replay"][0]) and torch.equal(outs["leaves"][1], outs["replay"][1])
    kids_t = T.leaf_children(parents)
    assert torch.equal(kids_t, T.leaf_children_reference(parents))
    assert torch.equal(T.leaf_children(parents.int()), kids_t)              # int32 parents: the same int64 masks
    if shape == "wide64":
        monkeypatch.setattr(T, "TREE_WALK", "leaves")
        o32 = T.pool_gdn_tree(conv, a, bb, A, dtb, state.clone(), slots, parents.int(), anc, False, hk, dk)
        assert torch.equal(o32, outs["leaves"][0])
    kids = kids_t.cpu().tolist()
    for r, prow in enumerate(par):
        leaves = {j for j in range(w) if j not in prow}
        want = [sum(1 << j for j in range(w) if prow[j] == i and j in leaves) for i in range(w)]
        assert [k % (1 << 64) for k in kids[r]] == want
    ref = R.pool_gdn_tree(conv, a, bb, A, dtb, state.clone(), slots, parents, anc, False, hk, dk)
    assert rel(outs["leaves"][0], ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gdn_commit_layers(dtype):
    """The commit of several GDN layers in one launch, from the gates the tree forward stored
    (``gates_out``), against the single-layer reference commit of each layer from the raw
    projections: gates equal the reference's ``gdn_gates`` (1e-6), the states agree to float32
    rounding (1e-5), and the Triton commit of all layers gives bit for bit the single-layer Triton
    commit of each layer (same operations on the same values)."""
    from kernels.gated_delta import reference as R
    from kernels.gated_delta import triton as T

    gen = torch.Generator().manual_seed(17)
    nl, b, w, hk, hv, dk, s = 3, 2, 6, 1, 2, 16, 4
    c = 2 * hk * dk + hv * dk
    conv = torch.randn(nl, b, w, c, generator=gen).to(DEV, dtype)
    ab = torch.randn(nl, b, w, 2 * hv, generator=gen).to(DEV, dtype)
    A = (-2 * torch.rand(nl, hv, generator=gen)).to(DEV)
    dtb = torch.randn(nl, hv, generator=gen).to(DEV)
    state = (torch.randn(nl, s, hv, dk, dk, generator=gen) * 0.1).to(DEV)
    slots = torch.randperm(s, generator=gen)[:b].to(DEV)
    parents, anc = rand_tree(gen, b, w)
    gates_t = torch.empty(nl, b, w, hv, 2, device=DEV)
    gates_r = torch.empty(nl, b, w, hv, 2, device=DEV)
    for layer in range(nl):
        a, bb = ab[layer, ..., :hv], ab[layer, ..., hv:]
        T.pool_gdn_tree(conv[layer], a, bb, A[layer], dtb[layer], state[layer].clone(), slots, parents, anc, False,
                        hk, dk, gates_out=gates_t[layer])
        R.pool_gdn_tree(conv[layer], a, bb, A[layer], dtb[layer], state[layer].clone(), slots, parents, anc, False,
                        hk, dk, gates_out=gates_r[layer])
        g, beta = R.gdn_gates(a, bb, A[layer], dtb[layer])
        assert torch.equal(gates_r[layer], torch.stack([g, beta], -1))
    assert rel(gates_t, gates_r) < 1e-6
    path = torch.stack([torch.randperm(w, generator=gen) for _ in range(b)]).to(DEV)
    n_acc = torch.randint(1, w + 1, (b,), generator=gen).to(DEV)
    one_r, one_t, all_r, all_t = state.clone(), state.clone(), state.clone(), state.clone()
    for layer in range(nl):
        a, bb = ab[layer, ..., :hv], ab[layer, ..., hv:]
        R.pool_gdn_commit(one_r[layer], slots, conv[layer], a, bb, A[layer], dtb[layer], path, n_acc, hk, dk)
        T.pool_gdn_commit(one_t[layer], slots, conv[layer], a, bb, A[layer], dtb[layer], path, n_acc, hk, dk)
    R.pool_gdn_commit_layers(all_r, slots, conv, gates_r, path, n_acc, hk, dk)
    T.pool_gdn_commit_layers(all_t, slots, conv, gates_t, path, n_acc, hk, dk)
    assert rel(all_r, one_r) < 1e-6
    assert rel(all_t, one_r) < 1e-5
    assert torch.equal(all_t, one_t)
    others = torch.ones(s, dtype=torch.bool)
    others[slots.cpu()] = False
    assert torch.equal(all_t[:, others.to(DEV)], state[:, others.to(DEV)])       # other slots untouched
    with pytest.raises(ValueError):
        T.pool_gdn_commit_layers(all_t, slots, conv, gates_t[:2], path, n_acc, hk, dk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norms_swiglu_rope(dtype):
    from kernels.activation import reference as AR
    from kernels.activation import triton as AT
    from kernels.norm import reference as NR
    from kernels.norm import triton as NT
    from kernels.rope import reference as RR
    from kernels.rope import triton as RT
    from target_service.models.layers import rope_table

    gen = torch.Generator().manual_seed(7)
    x, d, w = (torch.randn(*sh, generator=gen).to(DEV, dtype) for sh in ((5, 3, 48), (5, 3, 48), (48,)))
    assert rel(NT.rms_norm(x, w, 1e-6), NR.rms_norm(x, w, 1e-6)) < TOL[dtype]
    for got, want in zip(NT.add_rms_norm(x, d, w, 1e-6), NR.add_rms_norm(x, d, w, 1e-6)):
        assert rel(got, want) < TOL[dtype]
    qg = torch.randn(5, 3, 32, generator=gen).to(DEV, dtype)               # per-head norm of a strided view
    assert rel(NT.rms_norm(qg[..., :16], w[:16], 1e-6), NR.rms_norm(qg[..., :16], w[:16], 1e-6)) < TOL[dtype]
    # the heads of a packed projection, sliced, are read in place: the bits of a norm of their copy
    packed = torch.randn(5, 7 * 16, generator=gen).to(DEV, dtype)
    heads = packed[:, 2 * 16 : 5 * 16].reshape(5, 3, 16)
    assert torch.equal(NT.rms_norm(heads, w[:16], 1e-6), NT.rms_norm(heads.contiguous(), w[:16], 1e-6))
    o, z = torch.randn(4, 6, 32, generator=gen).to(DEV), torch.randn(4, 6, 32, generator=gen).to(DEV, dtype)
    assert rel(NT.gated_rms_norm(o, z, w[:32], 1e-6), NR.gated_rms_norm(o, z, w[:32], 1e-6)) < TOL[dtype]
    gu = torch.randn(7, 80, generator=gen).to(DEV, dtype)
    assert rel(AT.silu_mul(gu), AR.silu_mul(gu)) < TOL[dtype]
    for dim, r in ((16, 16), (32, 8)):
        b, wd, hq, hkv = 2, 3, 4, 2
        qkv = torch.randn(b * wd, (hq + 2 * hkv) * dim, generator=gen).to(DEV, dtype)
        q = qkv[:, : hq * dim].reshape(-1, hq, dim)
        k = qkv[:, hq * dim : (hq + hkv) * dim].reshape(-1, hkv, dim)
        v = qkv[:, (hq + hkv) * dim :].reshape(-1, hkv, dim)
        cos, sin = rope_table(100, r, 10000.0, DEV)
        pos = torch.randint(0, 100, (b * wd,), generator=gen).to(DEV)
        pools = [torch.zeros(4, 12, hkv, dim, device=DEV, dtype=dtype) for _ in range(4)]
        slots = torch.tensor([3, 1], device=DEV)
        rows = torch.arange(b * wd, device=DEV).reshape(b, wd) + 2
        out_r = RR.rope_store(q, k, v, cos[pos], sin[pos], pools[0], pools[1], slots, rows)
        out_t = RT.rope_store(q, k, v, cos[pos], sin[pos], pools[2], pools[3], slots, rows)
        assert rel(out_t, out_r) < TOL[dtype] and rel(pools[2], pools[0]) < TOL[dtype] and torch.equal(pools[3], pools[1])
        # the tables read at the positions inside the launch: the same bits as gathered rows
        for mod, want, pk, pv in ((RR, out_r, pools[0], pools[1]), (RT, out_t, pools[2], pools[3])):
            tk, tv = torch.zeros_like(pk), torch.zeros_like(pv)
            got = mod.rope_store(q, k, v, cos, sin, tk, tv, slots, rows, positions=pos, table=True)
            assert torch.equal(got, want) and torch.equal(tk, pk) and torch.equal(tv, pv)
            # consecutive rows given by each batch row's first, positions = the rows (a drafter's)
            at = rows.reshape(-1)
            rk, rv, bk, bv = (torch.zeros_like(pk) for _ in range(4))
            want_rows = mod.rope_store(q, k, v, cos[at], sin[at], rk, rv, slots, rows)
            got_rows = mod.rope_store(q, k, v, cos, sin, bk, bv, slots, rows[:, 0], table=True)
            assert torch.equal(got_rows, want_rows) and torch.equal(bk, rk) and torch.equal(bv, rv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (5, 300, 64), (16, 33, 512)])
def test_skinny_linear(dtype, m, n, k):
    from kernels.linear import reference
    from kernels.linear import triton as tri

    gen = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    w = torch.randn(n, k, generator=gen).to(DEV, dtype)
    assert rel(tri.linear(x, w), reference.linear(x, w)) < TOL[dtype]
    # float32 out is the input-dtype result widened, exactly as F.linear(...).float()
    assert torch.equal(tri.linear(x, w, torch.float32).to(dtype), tri.linear(x, w))
    assert rel(tri.linear(x, w, torch.float32), reference.linear(x, w, torch.float32)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embed_rows_and_block(dtype):
    """The embedding launches copy the table's rows exactly (a drafter block: its root, then the
    mask token), cast once to the result's dtype, as the reference's indexing does."""
    from kernels.embed import reference as ER
    from kernels.embed import triton as ET

    gen = torch.Generator().manual_seed(3)
    table = torch.randn(50, 40, generator=gen).to(DEV, dtype)
    ids = torch.randint(0, 50, (3, 5), generator=gen).to(DEV)
    for out_dtype in (None, torch.float32):
        got, want = ET.embed_rows(table, ids, out_dtype), ER.embed_rows(table, ids, out_dtype)
        assert got.shape == (3, 5, 40) and torch.equal(got, want)
    roots = torch.tensor([7, 0, 49], device=DEV)
    got, want = ET.embed_block(table, roots, 11, 4), ER.embed_block(table, roots, 11, 4)
    assert got.shape == (12, 40) and torch.equal(got, want)
    assert torch.equal(got[4], table[0]) and torch.equal(got[5], table[11])


def test_rope_store_empty_batch():
    """A batch of no rows rotates and writes nothing, in both versions (no division by its size)."""
    from kernels.rope import reference as RR
    from kernels.rope import triton as RT
    from target_service.models.layers import rope_table

    cos, sin = rope_table(8, 16, 10000.0, DEV)
    for mod in (RR, RT):
        q, k = torch.zeros(0, 2, 16, device=DEV), torch.zeros(0, 1, 16, device=DEV)
        pool = torch.zeros(2, 4, 1, 16, device=DEV)
        empty = torch.zeros(0, dtype=torch.long, device=DEV)
        out = mod.rope_store(q, k, k, cos, sin, pool, pool.clone(), empty, empty, table=True)
        assert out.shape == (0, 2, 16) and not pool.any()


@pytest.mark.parametrize("width", [40, 1100])   # (one block of columns, and several)
def test_ring_store_equals_the_reference(width):
    """The feature ring's store launch (kernels.ring) writes what the reference's PyTorch ops
    write: each item's accepted rows at its slot's positions (wrapping past the slot's end), the
    rest to the dump row, which is not compared (several programs write it)."""
    from kernels.ring import reference as RR
    from kernels.ring import triton as RT

    gen = torch.Generator().manual_seed(5)
    slots, slot_rows, nodes, batch = 3, 8, 4, 5
    rows = slots * slot_rows + 1
    table = torch.randn(rows, width, generator=gen).to(DEV, torch.bfloat16)
    feats = torch.randn(batch, nodes, width, generator=gen).to(DEV, torch.bfloat16)
    counts = torch.tensor([1, 4, 2, 3, 4], device=DEV)
    items = torch.tensor([[1, 3, 4], [0, 2, 1], [6, 3, 0]], device=DEV)   # batch row, slot, first position
    got_t, want_t = table.clone(), table.clone()
    RT.store_rows(got_t, feats, items, counts, slot_rows, rows - 1)
    RR.store_rows(want_t, feats, items, counts, slot_rows, rows - 1)
    assert torch.equal(got_t[:-1], want_t[:-1])
    # item 0: batch row 1 (4 rows) at slot 0 from position 6: rows 6, 7, then 0, 1 (wrapped)
    assert torch.equal(got_t[[6, 7, 0, 1]], feats[1])
    assert torch.equal(got_t[19:22], feats[3, :3]) and torch.equal(got_t[8:12], feats[4])
    assert torch.equal(got_t[2], table[2])   # untouched


@pytest.mark.parametrize("width,dtype", [(40, torch.bfloat16), (1100, torch.float32)])
def test_ring_gather_equals_the_reference(width, dtype):
    """The drafter's ring read (kernels.ring.gather_rows) copies what the reference copies: the
    rows the meta buffer names, from the table at the address it holds, into the destination rows
    it names; rows past the count and the other rows of the destination untouched; a count of 0
    copies nothing."""
    import numpy as np

    from kernels.ring import META_HEAD, gather_meta
    from kernels.ring import reference as RR
    from kernels.ring import triton as RT

    gen = torch.Generator().manual_seed(7)
    table = torch.randn(25, width, generator=gen).to(DEV, dtype)
    dst = torch.randn(12, width, generator=gen).to(DEV, dtype)
    cap = 8
    meta = np.zeros(META_HEAD + 2 * cap, dtype=np.int64)
    src, to = np.array([3, 24, 0, 7, 7]), np.array([11, 0, 5, 6, 2])
    gather_meta(meta, table, src, to)
    meta[META_HEAD + 5], meta[META_HEAD + cap + 5] = 1, 1    # past the count: must not be copied
    got, want = dst.clone(), dst.clone()
    RT.gather_rows(got, torch.from_numpy(meta).to(DEV))
    RR.gather_rows(want, torch.from_numpy(meta), table)
    assert torch.equal(got, want)
    assert torch.equal(got[[11, 0, 5, 6, 2]], table[[3, 24, 0, 7, 7]])
    assert torch.equal(got[[1, 3, 4, 7, 8, 9, 10]], dst[[1, 3, 4, 7, 8, 9, 10]])
    gather_meta(meta, None, src[:0], to[:0])   # nothing to copy
    RT.gather_rows(got, torch.from_numpy(meta).to(DEV))
    assert torch.equal(got, want)
    with pytest.raises(ValueError):
        gather_meta(meta, table, np.arange(cap + 1), np.arange(cap + 1))
    for bad_src, bad_table in ((np.array([3, 25]), table), (np.array([0]), torch.empty(0))):   # (25: past the table; a closed ring's)
        meta[1] = 5
        with pytest.raises(ValueError):
            gather_meta(meta, bad_table, bad_src, np.array([0, 1])[: len(bad_src)])
        assert meta[1] == 0   # (nothing to copy after a refusal)
