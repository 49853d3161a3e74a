"""The software-pipelined Gated DeltaNet recurrence (``kernels/gated_delta/triton_pipelined.py``:
``pool_gdn_tree``, ``pool_gdn_commit``) on small shapes, on the CPU through Triton's interpreter
(tests/conftest.py) or compiled on a GPU.

* Against the reference (``kernels/gated_delta/reference.py``): outputs, committed states and the
  untouched pool of a tree step, within the float32 tolerance of tests/test_kernels.py (the
  kernel moves scalings past reductions, so rounding differs).
* Bit for bit against itself across widths: a chain in one committed call equals the same nodes
  one ``W = 1`` call at a time (outputs and state), and a tree verify plus the commit of a
  root-to-leaf path equals the ``W = 1`` calls along that path. This is what keeps a verified
  token's logits equal to the autoregressive step's. (The interpreter runs the same numpy ops for
  every call shape; on a GPU the single binary of every mode is what makes it hold:
  tools/sweep_gdn.py checks it there.)
* Trees of every shape the depth-first walk distinguishes: chains, stars, deep bushy trees, the
  bench's spine with siblings, padded nodes (extra roots), the full 64 nodes (bit 63 of the
  masks), several ``(BV, num_warps)`` configurations, head dims too small for the default block.
* What only the compiler shows, compiled for sm_90 on any machine (no GPU needed): the loop
  carries the spare tile, and the tree and commit entry points are the same code.

Gate projections are column slices of one wide projection, as the engine passes them.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from kernels.gated_delta import reference as R  # noqa: E402
from kernels.gated_delta import triton_pipelined as T  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def masks(parents: list[int]) -> list[int]:
    """Ancestor bit masks (node itself included), as int64 values."""
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((1 << i) | (bits[p] if p >= 0 else 0))
    return [x - (1 << 64) if x >= 1 << 63 else x for x in bits]


def tree(kind: str, w: int, rng: random.Random) -> list[int]:
    """Parents of a ``w``-node tree (topological, node 0 the root)."""
    if kind == "chain":
        return [i - 1 for i in range(w)]
    if kind == "star":
        return [-1] + [0] * (w - 1)
    if kind == "spine":                       # target_service.bench_gpu._tree_shape
        chain = max(1, (w + 1) // 2)
        return ([-1] + list(range(chain - 1)) + [d % chain for d in range(w)])[:w]
    if kind == "random":                      # uniform parents, a few padded nodes (extra roots)
        return [-1] + [-1 if rng.random() < 0.1 else rng.randrange(i) for i in range(1, w)]
    if kind == "ddtree":                      # DDTree-like: interleaved branches that keep growing
        par, tips = [-1], [0]
        for i in range(1, w):
            if rng.random() < 0.3 or not tips:
                p = rng.randrange(i)          # a new branch anywhere
            else:
                p = rng.choice(tips)          # extend a recent tip
                tips.remove(p)
            par.append(p)
            tips = (tips + [i])[-3:]
        return par
    raise ValueError(kind)


def inputs(b: int, w: int, hk: int, hv: int, dk: int, dtype=torch.float32, seed: int = 0):
    """Random layer inputs: conv output ``[B, W, C]``; gate projections ``a``, ``b`` as column slices
    of one projection ``[B, W, C + HV * Dv + 2 HV]`` (the engine's ``[q|k|v | z | b | a]``);
    ``A``, ``dt_bias``; a pool of states and the rows' slots."""
    gen = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dk
    x = torch.randn(b, w, c, generator=gen).to(DEV, dtype)
    proj = torch.randn(b, w, c + hv * dk + 2 * hv, generator=gen).to(DEV, dtype)
    bb, a = proj[..., c + hv * dk : c + hv * dk + hv], proj[..., c + hv * dk + hv :]
    A = (-2 * torch.rand(hv, generator=gen)).to(DEV)
    dtb = torch.randn(hv, generator=gen).to(DEV)
    pool = (torch.randn(b + 2, hv, dk, dk, generator=gen) * 0.1).to(DEV)
    slots = torch.randperm(b + 2, generator=gen)[:b].to(DEV)
    return x, a, bb, A, dtb, pool, slots


def as_tensors(trees: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(trees, device=DEV), torch.tensor([masks(t) for t in trees], device=DEV)


@pytest.mark.parametrize("kind,w,hk,hv,config", [("random", 9, 1, 2, None), ("ddtree", 13, 2, 2, None),
                                                 ("star", 6, 1, 2, (4, 1)), ("chain", 7, 2, 4, (16, 2)),
                                                 ("spine", 10, 1, 2, (8, 2))])
def test_tree_and_commit_match_reference(kind, w, hk, hv, config):
    """A tree step (outputs; the pool untouched) and the commit of a path, against the reference."""
    rng = random.Random(w)
    b, dk = 2, 16
    x, a, bb, A, dtb, pool, slots = inputs(b, w, hk, hv, dk, seed=w)
    parents, anc = as_tensors([tree(kind, w, rng) for _ in range(b)])
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = R.pool_gdn_tree(x, a, bb, A, dtb, p_ref, slots, parents, anc, False, hk, dk)
    o_tri = T.pool_gdn_tree(x, a, bb, A, dtb, p_tri, slots, parents, anc, False, hk, dk, config=config)
    assert rel(o_tri, o_ref) < TOL
    assert torch.equal(p_tri, pool)
    path = torch.stack([torch.randperm(w) for _ in range(b)]).to(DEV)
    n_acc = torch.tensor([1, w], device=DEV)
    R.pool_gdn_commit(p_ref, slots, x, a, bb, A, dtb, path, n_acc, hk, dk)
    T.pool_gdn_commit(p_tri, slots, x, a, bb, A, dtb, path, n_acc, hk, dk, config=config)
    assert rel(p_tri, p_ref) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("w,config", [(1, None), (6, None), (70, (8, 1))])
def test_committed_chain_matches_reference(dtype, w, config):
    """``commit=True`` (a decode step, a prefill chunk; wider than a tree may be): outputs and the
    committed state."""
    b, hk, hv, dk = (2, 1, 2, 16) if w < 64 else (1, 1, 1, 16)
    x, a, bb, A, dtb, pool, slots = inputs(b, w, hk, hv, dk, dtype, seed=w)
    chain = (torch.arange(w, device=DEV) - 1).expand(b, w).contiguous()
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = R.pool_gdn_tree(x, a, bb, A, dtb, p_ref, slots, chain, None, True, hk, dk)
    o_tri = T.pool_gdn_tree(x, a, bb, A, dtb, p_tri, slots, chain, None, True, hk, dk, config=config)
    assert rel(o_tri, o_ref) < TOL and rel(p_tri, p_ref) < TOL


def one_node_calls(x, a, bb, A, dtb, pool, slots, nodes: torch.Tensor, hk, dk, config):
    """``W = 1`` committed calls, node ``nodes[r, d]`` of row ``r`` at call ``d``: ``([B, D, HV, Dv]
    outputs, pool after)``."""
    pool = pool.clone()
    rows = torch.arange(x.shape[0], device=DEV)
    outs = []
    root = torch.full((x.shape[0], 1), -1, device=DEV)
    for d in range(nodes.shape[1]):
        j = nodes[:, d]
        o = T.pool_gdn_tree(x[rows, j][:, None], a[rows, j][:, None], bb[rows, j][:, None], A, dtb, pool, slots, root,
                            None, True, hk, dk, config=config)
        outs.append(o[:, 0])
    return torch.stack(outs, 1), pool


@pytest.mark.parametrize("config", [None, (4, 1), (16, 2)])
def test_chain_bit_exact_across_widths(config):
    """A committed chain of ``W`` nodes in one call == ``W`` calls of one node: outputs and state."""
    b, w, hk, hv, dk = 2, 8, 1, 2, 16
    x, a, bb, A, dtb, pool, slots = inputs(b, w, hk, hv, dk, torch.float16, seed=3)
    chain = (torch.arange(w, device=DEV) - 1).expand(b, w).contiguous()
    p_one = pool.clone()
    o_one = T.pool_gdn_tree(x, a, bb, A, dtb, p_one, slots, chain, None, True, hk, dk, config=config)
    o_steps, p_steps = one_node_calls(x, a, bb, A, dtb, pool, slots, torch.arange(w, device=DEV).expand(b, w), hk, dk,
                                      config)
    assert torch.equal(o_one, o_steps) and torch.equal(p_one, p_steps)


def root_to_leaf(parents: list[int], rng: random.Random) -> list[int]:
    """The path from the root down to a random leaf, root first."""
    leaves = sorted(set(range(len(parents))) - set(parents))
    node, path = rng.choice(leaves), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("kind,w,config,b,hv", [("ddtree", 16, None, 2, 2), ("random", 12, (4, 1), 1, 1),
                                                 ("ddtree", 64, (16, 1), 1, 1)])
def test_tree_verify_and_commit_bit_exact_vs_steps(kind, w, config, b, hv):
    """A tree verify (``commit=False``), then the commit of a root-to-leaf path == ``W = 1`` calls
    along that path: the path nodes' outputs and the committed state, bit for bit. The 64-node
    tree uses bit 63 of the masks."""
    rng = random.Random(w + len(kind))
    hk, dk = 1, 16
    x, a, bb, A, dtb, pool, slots = inputs(b, w, hk, hv, dk, torch.float16, seed=w)
    trees = [tree(kind, w, rng) for _ in range(b)]
    parents, anc = as_tensors(trees)
    paths = [root_to_leaf(t, rng) for t in trees]
    n = min(len(p) for p in paths)
    path = torch.tensor([p[:n] + [0] * (w - n) for p in paths], device=DEV)
    p_tree = pool.clone()
    o_tree = T.pool_gdn_tree(x, a, bb, A, dtb, p_tree, slots, parents, anc, False, hk, dk, config=config)
    assert torch.equal(p_tree, pool)
    T.pool_gdn_commit(p_tree, slots, x, a, bb, A, dtb, path, torch.full((b,), n, device=DEV), hk, dk, config=config)
    o_steps, p_steps = one_node_calls(x, a, bb, A, dtb, pool, slots, path[:, :n], hk, dk, config)
    assert torch.equal(o_tree.gather(1, path[:, :n, None, None].expand(-1, -1, hv, dk)), o_steps)
    assert torch.equal(p_tree, p_steps)


def test_configs_and_limits():
    """The default table fits small head dims; bad configs and over-wide trees are refused."""
    assert T.default_config(128, 128) == T.GDN_CONFIGS[(128, 128)]
    assert T.default_config(16, 16) == (8, 1) and T.default_config(16, 4) == (4, 1)
    assert T._config(16, 16, (32, 4)) == (16, 4)
    with pytest.raises(ValueError):
        T._config(16, 16, (6, 1))
    x, a, bb, A, dtb, pool, slots = inputs(1, 65, 1, 1, 16)
    parents = torch.arange(65, device=DEV)[None] - 1
    with pytest.raises(ValueError):
        T.pool_gdn_tree(x, a, bb, A, dtb, pool, slots, parents, None, False, 1, 16)


@pytest.mark.skipif(DEV == "cuda", reason="counts the interpreter's calls of the step function")
def test_tree_walk_steps(monkeypatch):
    """The kernel applies exactly the steps :func:`tree_walk` lists: one per node for chains, stars,
    two interleaved branches and the bench's spine with siblings, few replays for a DDTree-like
    tree."""
    calls = [0]
    step = T._step

    def counting(*args):
        calls[0] += 1
        return step(*args)

    monkeypatch.setattr(T, "_step", counting)
    rng = random.Random(5)
    w = 24
    x, a, bb, A, dtb, pool, slots = inputs(1, w, 1, 1, 16)
    cases = {"chain": tree("chain", w, rng), "star": tree("star", w, rng), "spine": tree("spine", w, rng),
             "two": [-1, 0, 0] + [i - 2 for i in range(3, w)], "ddtree": tree("ddtree", w, rng)}
    for kind, par in cases.items():
        parents, anc = as_tensors([par])
        calls[0] = 0
        T.pool_gdn_tree(x, a, bb, A, dtb, pool, slots, parents, anc, False, 1, 16, config=(16, 1))
        assert calls[0] == len(T.tree_walk(par)), kind
        assert calls[0] == w or kind == "ddtree"
    assert len(T.tree_walk(cases["ddtree"])) < 1.5 * w


_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.gated_delta import triton_pipelined as T

bv, nw = T.default_config(128, 128)
cs = min(bv, max(1, 32 * nw * 8 // 128))
sig = dict(x_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", A_ptr="*fp32", dtb_ptr="*fp32", state_ptr="*fp32",
           slots_ptr="*i64", idx_ptr="*i64", n_ptr="*i64", o_ptr="*fp32", W="i32", HK="i32", HV="i32", C="i32",
           sab="i32", q_scale="fp32", mode="i32", DK="constexpr", DV="constexpr", BV="constexpr", WB="constexpr",
           VEC="constexpr", CS="constexpr")
const = dict(DK=128, DV=128, BV=bv, WB=T.MAX_TREE, VEC=8, CS=cs)
out = {}
for name in ("_tree_kernel", "_commit_kernel"):
    k = triton.compile(ASTSource(getattr(T, name), sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": nw})
    types = re.search(r"scf.while \(.*?\) : \((.*?)\) ->", k.asm["ttir"]).group(1)
    ptx = k.asm["ptx"].split(".section")[0]                     # the debug sections name the kernel
    code = [re.sub(r"//.*", "", ln).strip() for ln in ptx.replace(name, "KERNEL").splitlines()]
    out[name] = dict(tiles=types.count(f"tensor<16x8x{cs}x{bv // cs}xf32>"),
                     ptx=[ln for ln in code if ln and not ln.startswith((".loc", ".file"))])
print(json.dumps(dict(tiles=out["_tree_kernel"]["tiles"],
                      same=out["_tree_kernel"]["ptx"] == out["_commit_kernel"]["ptx"])))
"""


def test_compiled_kernel_for_sm90():
    """Compiled for an H100 / H200 on any machine (the interpreter runs the loop as Python, so only
    the compiler shows these): the loop carries both the state and the spare tile (a carried
    variable that Triton misses makes every tree restore start from the committed state: wrong
    outputs on the GPU, right ones in the interpreter), and the tree and commit entry points are
    the same code."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _COMPILE], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    if res.returncode != 0 and ("ptxas" in res.stderr or "backend" in res.stderr.lower()):
        pytest.skip(f"no CUDA compiler backend: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"tiles": 2, "same": True}
