"""The GDN tree conv (``kernels/conv``) and the KV commit (``kernels/attention/kv_commit.py``) in
Triton against their plain-PyTorch references, on the CPU through Triton's interpreter
(tests/conftest.py sets ``TRITON_INTERPRET=1`` without CUDA; with CUDA the compiled kernels run).

Everything here is compared bit for bit: the conv before SiLU does the reference's operations in
the reference's order, the commits copy rows. SiLU's ``exp`` is Triton's, so the activated output
is compared with a tolerance against ``F.silu`` but bit for bit across widths and block shapes
(a chain node verified in a wide tree must give what the width-1 step gives). bfloat16 runs on a
GPU only (the interpreter rounds float32 to bfloat16 by truncation).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
K = 4


def rand_parents(gen: torch.Generator, b: int, w: int, pad: float = 0.15) -> torch.Tensor:
    """Random trees ``[b, w]`` (topological parents; some padded nodes: parent -1 past the root)."""
    parents = torch.full((b, w), -1, dtype=torch.long)
    for r in range(b):
        for i in range(1, w):
            if torch.rand(1, generator=gen).item() >= pad:
                parents[r, i] = int(torch.randint(0, i, (1,), generator=gen))
    return parents.to(DEV)


def conv_inputs(gen: torch.Generator, dtype, b: int, w: int, c: int = 40, s: int = 6):
    """``x`` as a column slice of a wider projection, a pool of ``s`` conv states, weights and
    ``b`` distinct slots."""
    proj = torch.randn(b, w, c + 7, generator=gen).to(DEV, dtype)
    x = proj[..., 3 : 3 + c]
    pool = torch.randn(s, K - 1, c, generator=gen).to(DEV, dtype)
    weight = torch.randn(c, K, generator=gen).to(DEV, dtype)
    slots = torch.randperm(s, generator=gen)[:b].to(DEV)
    return x, pool, weight, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,w", [(1, 1), (3, 1), (2, 5), (2, 12)])
def test_conv_tree_matches_reference(dtype, b, w):
    """Random trees: the conv equals the reference bit for bit for every block shape, the SiLU
    output agrees to rounding and does not depend on the block shape; the pool is not touched."""
    from kernels.conv import reference as R
    from kernels.conv import triton as T

    gen = torch.Generator().manual_seed(17 * w + b)
    x, pool, weight, slots = conv_inputs(gen, dtype, b, w)
    win = R.conv_window_index(rand_parents(gen, b, w), K)
    before = pool.clone()
    # the reference on the CPU, whose sum runs in tap order (a GPU reduction may pair the terms)
    ref = R.pool_conv_tree(*(t.cpu() for t in (x, pool, slots, win, weight))).to(DEV)
    ref_silu = R.pool_conv_silu(x, pool, slots, win, weight)
    first = None
    for bw, bc in ((None, None), (1, 64), (2, 16), (8, 32)):
        assert torch.equal(T.pool_conv_tree(x, pool, slots, win, weight, block_w=bw, block_c=bc), ref)
        out = T.pool_conv_silu(x, pool, slots, win, weight, block_w=bw, block_c=bc)
        if first is None:
            first = out
            tol = 1e-6 if dtype == torch.float32 else 1e-3
            assert (out.float() - ref_silu.float()).abs().max().item() <= tol * (1 + ref_silu.float().abs().max().item())
        assert torch.equal(out, first)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,w", [(1, 1), (3, 2), (2, 9)])
def test_conv_commit_matches_reference(dtype, b, w):
    """The new conv state of each row from a random last node equals the reference's bit for bit;
    other slots are untouched."""
    from kernels.conv import reference as R
    from kernels.conv import triton as T

    gen = torch.Generator().manual_seed(5 * w + b)
    x, pool, _, slots = conv_inputs(gen, dtype, b, w)
    win = R.conv_window_index(rand_parents(gen, b, w), K)
    last = torch.randint(0, w, (b,), generator=gen).to(DEV)
    pr, pt = pool.clone(), pool.clone()
    R.pool_conv_commit(x, pr, slots, win, last)
    T.pool_conv_commit(x, pt, slots, win, last)
    assert torch.equal(pt, pr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_commit_layers(dtype):
    """The conv commit of several layers in one launch, from the inputs the conv kernel saved
    (``x_save``) and with the output written into ``out``, equals each layer's own conv and commit
    bit for bit."""
    from kernels.conv import reference as R
    from kernels.conv import triton as T

    gen = torch.Generator().manual_seed(23)
    nl, b, w = 3, 2, 7
    layers = [conv_inputs(gen, dtype, b, w) for _ in range(nl)]
    slots = layers[0][3]
    win = R.conv_window_index(rand_parents(gen, b, w), K)
    last = torch.randint(0, w, (b,), generator=gen).to(DEV)
    c = layers[0][0].shape[-1]
    pools = torch.stack([p for _, p, _, _ in layers])
    for mod in (R, T):
        xs = torch.empty(nl, b, w, c, device=DEV, dtype=dtype)
        outs = torch.empty(nl, b, w, c, device=DEV, dtype=dtype)
        one, every = pools.clone(), pools.clone()
        for layer, (x, _, weight, _) in enumerate(layers):
            ref = mod.pool_conv_silu(x, pools[layer].clone(), slots, win, weight)
            got = mod.pool_conv_silu(x, every[layer], slots, win, weight, out=outs[layer], x_save=xs[layer])
            assert got.data_ptr() == outs[layer].data_ptr() and torch.equal(got, ref)
            assert torch.equal(xs[layer], x)
            mod.pool_conv_commit(x, one[layer], slots, win, last)
        assert torch.equal(every, pools)                    # a tree's conv does not touch the state
        mod.pool_conv_commit_layers(xs, every, slots, win, last)
        assert torch.equal(every, one)
    with pytest.raises(ValueError):
        T.pool_conv_silu(layers[0][0], pools[0], slots, win, layers[0][2], out=outs[0, :, :3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_conv_chain_commit(dtype, n):
    """``commit=True`` (a chain committed whole): fused into the conv launch when a row is one node
    block, a separate commit launch otherwise; both write the reference's state bit for bit and
    give the same outputs."""
    from kernels.conv import reference as R
    from kernels.conv import triton as T

    b = 3
    gen = torch.Generator().manual_seed(n)
    x, pool, weight, slots = conv_inputs(gen, dtype, b, n)
    win = R.conv_window_index((torch.arange(n, device=DEV) - 1).expand(b, n).contiguous(), K)
    pr = pool.clone()
    R.pool_conv_silu(x, pr, slots, win, weight, commit=True)
    outs = []
    for bw in (None, 1, 16):                       # default, several node blocks, one node block
        pt = pool.clone()
        outs.append(T.pool_conv_silu(x, pt, slots, win, weight, commit=True, block_w=bw))
        assert torch.equal(pt, pr)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], T.pool_conv_silu(x, pool.clone(), slots, win, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w", [5, 16])
def test_conv_width_invariance(dtype, w):
    """A path through a random tree verified in one width-``w`` step gives, node for node, bit for
    bit the outputs of width-1 steps along the path (each committing its state), whatever the block
    shape; committing the path's last node afterwards gives the state of the width-1 steps."""
    from kernels.conv import reference as R
    from kernels.conv import triton as T

    b = 2
    gen = torch.Generator().manual_seed(3 * w)
    x, pool, weight, slots = conv_inputs(gen, dtype, b, w)
    parents = rand_parents(gen, b, w, pad=0.0)
    win = R.conv_window_index(parents, K)
    paths = []
    for r in range(b):                             # the ancestry of the row's deepest last node
        j, p = w - 1, []
        while j >= 0:
            p.append(j)
            j = int(parents[r, j])
        paths.append(p[::-1])
    depth = min(len(p) for p in paths)
    path = torch.tensor([p[:depth] for p in paths], device=DEV)
    # width-1 steps along the path
    seq_pool = pool.clone()
    one = R.conv_window_index(torch.full((b, 1), -1, dtype=torch.long, device=DEV), K)
    seq = []
    for d in range(depth):
        xd = x.gather(1, path[:, d, None, None].expand(b, 1, x.shape[2])).contiguous()
        seq.append(T.pool_conv_silu(xd, seq_pool, slots, one, weight, commit=True))
    seq = torch.cat(seq, dim=1)
    for bw, bc in ((None, None), (1, 32), (4, 16), (16, 64)):
        out = T.pool_conv_silu(x, pool, slots, win, weight, block_w=bw, block_c=bc)
        got = out.gather(1, path[..., None].expand(b, depth, x.shape[2]))
        assert torch.equal(got, seq)
    tree_pool = pool.clone()
    T.pool_conv_commit(x, tree_pool, slots, win, path[:, -1].contiguous())
    assert torch.equal(tree_pool, seq_pool)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,w", [(1, 1), (3, 6), (2, 13)])
def test_kv_commit_matches_reference(dtype, b, w):
    """Accepted paths of random trees (padded with the root past ``n_accept``, as
    ``accept_trees`` leaves them), and arbitrary paths: the pools equal the reference's bit for
    bit (all layers, K and V, rows past ``n_accept`` included)."""
    from kernels.attention import kv_commit
    from kernels.attention import reference as R

    gen = torch.Generator().manual_seed(11 * w + b)
    a, s, rows, hkv, d = 3, 4, 3 * w + 8, 2, 8
    k = torch.randn(a, s, rows, hkv, d, generator=gen).to(DEV, dtype)
    v = torch.randn(a, s, rows, hkv, d, generator=gen).to(DEV, dtype)
    slots = torch.randperm(s, generator=gen)[:b].to(DEV)
    lengths = torch.randint(0, rows - w + 1, (b,), generator=gen).to(DEV)
    parents = rand_parents(gen, b, w, pad=0.0).cpu()
    path = torch.zeros(b, w, dtype=torch.long)
    n_accept = torch.zeros(b, dtype=torch.long)
    for r in range(b):
        j, p = int(torch.randint(0, w, (1,), generator=gen)), []
        while j >= 0:
            p.append(j)
            j = int(parents[r, j])
        path[r, : len(p)] = torch.tensor(p[::-1])
        n_accept[r] = len(p)
    arbitrary = torch.randint(0, w, (b, w), generator=gen)
    for pth in (path, arbitrary):
        pth = pth.to(DEV)
        kr, vr, kt, vt = k.clone(), v.clone(), k.clone(), v.clone()
        R.pool_kv_commit(kr, vr, slots, lengths, pth, n_accept.to(DEV))
        kv_commit.pool_kv_commit(kt, vt, slots, lengths, pth, n_accept.to(DEV))
        assert torch.equal(kt, kr) and torch.equal(vt, vr)
