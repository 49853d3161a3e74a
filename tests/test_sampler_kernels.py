"""Device sampling: Philox noise, exact top-k / top-p thresholds, the fused Triton sampler.

* Philox-4x32-10 against the Random123 known-answer vectors and an independent pure-Python
  implementation.
* The Triton kernels (run on the CPU through ``TRITON_INTERPRET=1``, set by conftest.py) against
  the plain-PyTorch reference: noise words and Gumbel values bit for bit, thresholds exactly,
  tokens token for token.
* Semantics: the reference's kept set against a brute-force float64 definition; the sampler's
  distribution against the filtered softmax (chi-square, p > 1e-3, with a power check).
* ``gpu`` tests repeat the comparisons at real sizes on CUDA (and inside a CUDA graph).

Every test is deterministic (fixed seeds).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels.sampling import filtered_logprobs, select_tokens
from kernels.sampling import reference as ref
from kernels.sampling import triton as tri
from tests.test_sampling import chi_square_p

# Triton's interpreter converts 1-element arrays to loop bounds with a numpy deprecation warning.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

M32 = 0xFFFFFFFF
#: Where the Triton kernels run in the comparison tests: the GPU when there is one, else the CPU
#: through Triton's interpreter (the reference always runs on the CPU, so on a GPU machine these
#: tests also check that the device kernels equal the CPU reference bit for bit).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def dev(*ts):
    """The tensors on ``DEV``."""
    return [t.to(DEV) for t in ts]

# Random123 (D. E. Shaw Research), tests/kat_vectors, lines 27-29, at commit
# 9545ff6413f258be2f04c1d319d99aaef7521150 of https://github.com/DEShawResearch/random123
# (columns: counter[4], key[2], expected output[4]):
#   philox4x32 10 00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
#   philox4x32 10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
#   philox4x32 10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def py_philox(ctr, key, rounds=10):
    """Philox-4x32 from the paper, in Python ints (independent of the tensor version)."""
    x = list(ctr)
    k = list(key)
    for r in range(rounds):
        p0 = 0xD2511F53 * x[0]
        p1 = 0xCD9E8D57 * x[2]
        x = [((p1 >> 32) ^ x[1] ^ k[0]) & M32, p1 & M32, ((p0 >> 32) ^ x[3] ^ k[1]) & M32, p0 & M32]
        k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
    return x


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (float32 compared as int32: -0.0 != +0.0, NaN == same NaN)."""
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def random_logits(rows: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Logits with the awkward cases: integer-valued rows (ties everywhere), -inf / NaN / +inf
    entries, a row of -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    if rows > 1:
        x[1] = torch.randint(-4, 5, (vocab,), generator=g).float()  # ties
    if rows > 2:
        x[2, ::7] = float("-inf")
        x[2, 5] = float("nan")
    return x.to(dtype)


# ------------------------------------------------------------------------------ Philox
def test_philox_known_answers():
    for ctr, key, want in KAT:
        args = [torch.tensor(v, dtype=torch.int64) for v in (*ctr, *key)]
        assert [int(v) for v in ref.philox4x32_10(*args)] == list(want)
        assert [int(v) for v in ref._philox_limbs(*args)] == list(want)   # the CUDA path, run on the CPU
        assert [int(v) for v in tri.philox4x32_10(*dev(*[a.reshape(1) for a in args]))] == list(want)
        assert py_philox(ctr, key) == list(want)


def test_philox_matches_python_ints():
    rng = random.Random(1)
    n = 300
    words = [[rng.getrandbits(32) for _ in range(n)] for _ in range(6)]
    for i in range(0, n, 10):  # extremes: all-ones and zero words, seeds >= 2**63 (high key word >= 2**31)
        words[rng.randrange(6)][i] = M32
        words[rng.randrange(6)][i] = 0
        words[5][i + 1] = rng.randrange(1 << 31, 1 << 32)
    cols = [torch.tensor(w, dtype=torch.int64) for w in words]
    want = torch.tensor([py_philox([w[i] for w in words[:4]], [w[i] for w in words[4:]]) for i in range(n)]).T
    got_ref = torch.stack(ref.philox4x32_10(*cols))
    got_limbs = torch.stack(ref._philox_limbs(*cols))   # the reference's CUDA path (host uint64 on the CPU)
    got_tri = torch.stack(tri.philox4x32_10(*dev(*cols))).cpu()
    assert torch.equal(got_ref, want)
    assert torch.equal(got_limbs, want)
    assert torch.equal(got_tri, want)
    # broadcasting: a [2, 1] key against [1, n] counters, Python ints among the words
    k0 = torch.tensor([[5], [M32]])
    for philox in (ref.philox4x32_10, ref._philox_limbs):
        out = philox(cols[0][None], 0, 0, 0, k0, 7)
        assert all(w.shape == (2, n) and w.dtype == torch.int64 for w in out)
        assert int(out[0][1, 3]) == py_philox([words[0][3], 0, 0, 0], [M32, 7])[0]


def test_noise_counter_and_key_layout():
    """Noise word of (seed, position, token) = Philox word 0 at counter (token, pos lo, pos hi, 0),
    key (seed lo, seed hi); uint64 seeds >= 2**63 arrive as negative int64."""
    seeds_u = [0, 1, 2**63, 2**64 - 1, 0x123456789ABCDEF0]
    positions = [0, 1, 2**32 + 3, 5, 2**40 - 1]
    seeds = torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds_u], dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    bits = ref.noise_bits(seeds, pos, 40)
    for r, (s, p) in enumerate(zip(seeds_u, positions)):
        for t in (0, 1, 39):
            assert int(bits[r, t]) == py_philox([t, p & M32, p >> 32, 0], [s & M32, s >> 32])[0]


# ------------------------------------------------------------------------- float32 maths
def test_gumbel_transform_over_all_inputs():
    """All 2**23 uniform values: finite, increasing, under GUMBEL_BOUND, within 1e-6 of float64;
    the kernels' transform equals the reference bit for bit (among the inputs are the few where
    ``-log(u)`` rounds to exactly 1.0, so ``G`` is zero: +0.0 in both)."""
    bits = torch.arange(2**23, dtype=torch.int64) << ref.UNIFORM_SHIFT
    g = ref.gumbel_from_bits(bits)
    assert torch.isfinite(g).all()
    assert (g[1:] >= g[:-1]).all()
    assert float(g.max()) <= ref.GUMBEL_BOUND
    u = ((bits >> ref.UNIFORM_SHIFT).double() + 0.5) * 2.0**-23
    assert float((g.double() + torch.log(-torch.log(u))).abs().max()) < 1e-6
    assert int((g == 0).sum()) > 0 and not torch.signbit(g[g == 0]).any()
    assert bits_equal(tri.gumbel_from_bits(bits.to(DEV)).cpu(), g)


def test_log_and_exp_accuracy():
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0x00800000, 0x7F800000, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    got = ref._log_f32(x).double()
    want = torch.log(x.double())
    ulp = torch.from_numpy(np.spacing(want.abs().float().numpy())).double()
    assert float(((got - want).abs() / ulp).max()) < 1.0
    d = -torch.rand(200_000, generator=gen) * 80
    got = ref._exp_f32(d).double()
    want = torch.exp(d.double())
    ulp = torch.from_numpy(np.spacing(want.float().numpy())).double()
    assert float(((got - want).abs() / ulp).max()) < 1.5
    assert float(ref._exp_f32(torch.tensor([0.0]))) == 1.0
    assert int(ref.mass_weights(torch.tensor([0.0, float("-inf")]))[0]) == 2**40
    assert int(ref.mass_weights(torch.tensor([float("-inf")]))[0]) == 0


# ------------------------------------------------------------------ Triton == reference
def test_triton_noise_bit_exact():
    seeds = torch.tensor([0, 1, -1, -(2**63), 2**62 + 12345, 987654321], dtype=torch.int64)
    pos = torch.tensor([0, 1, 2**32, 77, 2**33 + 9, 4095], dtype=torch.int64)
    bits, gumbel = (t.cpu() for t in tri.noise(*dev(seeds, pos), 2100))
    assert torch.equal(bits, ref.noise_bits(seeds, pos, 2100))
    assert bits_equal(gumbel, ref.gumbel_noise(seeds, pos, 2100))
    assert torch.equal(tri.noise_bits(*dev(seeds[:2], pos[:2]), 5).cpu(), bits[:2, :5])


def _settings(rows: int, vocab: int, seed: int):
    """Per-row settings cycling through greedy, plain, top-k, top-p, top-k + top-p, off values."""
    rng = random.Random(seed)
    temps = [0.0, 1.0, 0.7, 1.3, 0.5, 2.0]
    ks = [0, 0, 5, 0, 40, vocab + 3, 1]
    ps = [0.0, 0.0, 0.0, 0.9, 0.8, 1.0, 0.0]
    inv_t = torch.tensor([1.0 / temps[i % 6] if temps[i % 6] else 0.0 for i in range(rows)], dtype=torch.float32)
    k = torch.tensor([ks[(i + 1) % 7] for i in range(rows)], dtype=torch.int64)
    p = torch.tensor([ps[(i + 2) % 7] for i in range(rows)], dtype=torch.float32)
    seeds = torch.tensor([rng.getrandbits(64) - 2**63 for _ in range(rows)], dtype=torch.int64)
    pos = torch.tensor([rng.randrange(0, 2**34) for _ in range(rows)], dtype=torch.int64)
    return inv_t, k, p, seeds, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_sample_tokens_equal_reference(dtype, monkeypatch):
    rows, vocab = 6, 2600
    inv_t, k, p, seeds, pos = _settings(rows, vocab, 3)
    for trial in range(3):
        logits = random_logits(rows, vocab, 10 + trial, dtype)
        thr = ref.filter_thresholds(logits, inv_t, k, p)
        want = ref.sample_tokens(logits, inv_t, thr, seeds + trial, pos)
        assert torch.equal(tri.sample_tokens(*dev(logits, inv_t, thr, seeds + trial, pos)).cpu(), want)
    # one chunk of several blocks per row, and a strided (non-contiguous rows) input
    monkeypatch.setattr(tri, "TARGET_PROGRAMS", 1)
    wide = torch.cat([logits, logits[:, :7]], dim=1).to(DEV)[:, :vocab]
    assert torch.equal(tri.sample_tokens(*dev(wide, inv_t, thr, seeds + 2, pos)).cpu(), want)


def test_triton_sample_ties_and_special_values():
    """Ties across chunks (lowest id wins), NaN in greedy rows (torch.argmax: first NaN), +inf,
    rows of -inf, and the -0.0 / +0.0 pair."""
    vocab = 2500
    logits = torch.full((6, vocab), -5.0)
    logits[0, [1500, 30, 2400]] = 9.0  # greedy tie across chunks: 30
    logits[1, [2000, 1100]] = float("nan")  # greedy: first NaN, 1100
    logits[2, [700, 2300]] = float("inf")  # sampling: +inf tokens win, the lower id
    logits[3] = float("-inf")  # sampling, nothing finite: token 0
    logits[4, :] = 0.0
    logits[4, :1200] = -0.0
    logits[5, 17] = float("nan")
    inv_t = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    thr = torch.full((6,), float("-inf"))
    seeds = torch.arange(6, dtype=torch.int64)
    pos = torch.arange(6, dtype=torch.int64) + 100
    want = ref.sample_tokens(logits, inv_t, thr, seeds, pos)
    assert want[:5].tolist() == [30, 1100, 700, 0, 0]
    assert int(want[5]) != 17
    assert torch.equal(tri.sample_tokens(*dev(logits, inv_t, thr, seeds, pos)).cpu(), want)


def test_triton_thresholds_equal_reference(monkeypatch):
    vocab = 1500
    combos = [(1, 0.9), (3, 0.25), (37, 0.999), (vocab - 1, 0.9), (0, 0.25), (0, 0.999), (vocab, 0.9),
              (vocab + 9, 0.25), (37, 0.0), (1, 0.0), (vocab - 1, 0.0), (vocab, 0.0), (0, 1.0), (3, 1.0)]
    rows = len(combos)
    k = torch.tensor([c[0] for c in combos], dtype=torch.int64)
    p = torch.tensor([c[1] for c in combos], dtype=torch.float32)
    inv_t = torch.tensor([1.0, 1.0 / 0.7, 2.0, 0.0] * 4, dtype=torch.float32)[:rows]
    logits = random_logits(rows, vocab, 21)
    logits[4] = torch.randint(-3, 3, (vocab,), generator=torch.Generator().manual_seed(2)).float()  # ties
    want = ref.filter_thresholds(logits, inv_t, k, p)
    assert torch.equal(tri.filter_thresholds(*dev(logits, inv_t, k, p)).cpu(), want)
    # several blocks per pass, bfloat16 input
    monkeypatch.setattr(tri, "FILTER_BLOCK", 1024)
    sub = slice(0, 4)
    logits2 = random_logits(4, 2500, 22, torch.bfloat16)
    k2, p2 = torch.tensor([5, 0, 600, 2500]), torch.tensor([0.0, 0.95, 0.5, 0.3])
    assert torch.equal(tri.filter_thresholds(*dev(logits2, inv_t[sub], k2, p2)).cpu(),
                       ref.filter_thresholds(logits2, inv_t[sub], k2, p2))


# --------------------------------------------------------------------------- semantics
def brute_force_kept(x: np.ndarray, k: int, p: float) -> np.ndarray:
    """The kept set by definition, in float64: the k-th largest value with ties, then the largest
    data value whose upper set has softmax mass >= p."""
    vocab = x.size
    thr = -np.inf
    if 0 < k < vocab:
        thr = np.sort(x)[::-1][k - 1]
    if 0 < p < 1:
        kept = x[x >= thr]
        w = np.exp(kept - kept.max())
        for t in np.unique(kept)[::-1]:
            if w[kept >= t].sum() / w.sum() >= p:
                thr = max(thr, t)
                break
    return x >= thr


def test_kept_set_matches_brute_force():
    rows, vocab = 48, 300
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.5, 6, rows)[:, None]
    logits[::5] = torch.randint(-6, 6, (len(range(0, rows, 5)), vocab), generator=g).float()
    rng = random.Random(9)
    k = torch.tensor([rng.choice([0, 1, 2, 10, 50, 299, 300, 400]) for _ in range(rows)])
    p = torch.tensor([rng.choice([0.0, 0.1, 0.5, 0.8, 0.95, 0.999, 1.0]) for _ in range(rows)], dtype=torch.float32)
    inv_t = torch.tensor([rng.choice([1.0, 1.0 / 0.7, 0.5]) for _ in range(rows)], dtype=torch.float32)
    thr = ref.filter_thresholds(logits, inv_t, k, p)
    x = ref.scaled_logits(logits, inv_t)
    for r in range(rows):
        want = brute_force_kept(x[r].double().numpy(), int(k[r]), float(p[r]))
        assert np.array_equal((x[r] >= thr[r]).numpy(), want), r
        assert bool(torch.isin(thr[r], x[r])) or thr[r] == float("-inf")  # a data value
    # greedy rows and rows with the filters off keep everything
    off = ref.filter_thresholds(logits[:3], torch.tensor([0.0, 1.0, 1.0]), torch.tensor([5, 0, vocab]),
                                torch.tensor([0.5, 0.0, 1.0]))
    assert off.tolist() == [float("-inf")] * 3


def test_reference_sampler_equals_definition():
    """The reference's pruned sampler equals argmax over kept tokens of x + gumbel_noise."""
    rows, vocab = 8, 700
    for trial in range(4):
        logits = random_logits(rows, vocab, 40 + trial)
        logits[4] *= 10  # sharp: few candidates survive pruning
        logits[5] *= 0.05  # flat: almost all do
        inv_t, k, p, seeds, pos = _settings(rows, vocab, trial)
        thr = ref.filter_thresholds(logits, inv_t, k, p)
        x = ref.scaled_logits(logits, inv_t)
        score = torch.where(x >= thr[:, None], x + ref.gumbel_noise(seeds, pos, vocab), float("-inf"))
        want = torch.where(inv_t == 0, logits.argmax(-1), score.argmax(-1))
        assert torch.equal(ref.sample_tokens(logits, inv_t, thr, seeds, pos), want)


SETTINGS = [(1.0, 0, 0.0), (0.7, 12, 0.0), (1.3, 0, 0.8), (0.8, 20, 0.9)]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
@pytest.mark.parametrize("vary", ["seed", "position"])
def test_sampler_matches_filtered_softmax(temperature, top_k, top_p, vary):
    """4000 draws of one logits row, over seeds (or over positions with one seed), follow the
    filtered softmax; the same counts reject a distribution biased by 8 points."""
    n, vocab = 4000, 48
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(11))
    probs = filtered_logprobs(logits, temperature, top_k, top_p)[0].exp()
    inv_t, k, p, _ = ref.sampling_tensors(n, "cpu", temperature, top_k, top_p, 0)
    many = logits.expand(n, vocab)
    thr = ref.filter_thresholds(many, inv_t, k, p)
    if vary == "seed":
        seeds, pos = torch.arange(n, dtype=torch.int64) * 7919 + 1, torch.full((n,), 1234, dtype=torch.int64)
    else:
        seeds, pos = torch.full((n,), 42, dtype=torch.int64), torch.arange(n, dtype=torch.int64) + 10
    tokens = ref.sample_tokens(many, inv_t, thr, seeds, pos)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    assert chi_square_p(counts, probs) > 1e-3
    biased = probs.clone()
    top = int(probs.argmax())
    biased[top] -= 0.08
    biased[probs > 0] += 0.08 / int((probs > 0).sum())
    assert chi_square_p(counts, biased) < 1e-6


def test_select_tokens_api():
    """select_tokens = filter_thresholds + sample_tokens with one request's settings; a row's
    choice depends only on (seed, its position, its logits); greedy at temperature 0; seeds are
    taken mod 2**64."""
    logits = random_logits(5, 400, 60)
    positions = [9, 10, 11, 12, 13]
    got = select_tokens(logits, positions, 0.8, 30, 0.9, seed=2**64 - 3)
    inv_t, k, p, seeds = ref.sampling_tensors(5, "cpu", 0.8, 30, 0.9, -3)
    thr = ref.filter_thresholds(logits, inv_t, k, p)
    assert torch.equal(got, ref.sample_tokens(logits, inv_t, thr, seeds, torch.tensor(positions)))
    assert torch.equal(select_tokens(logits, positions, 0.8, 30, 0.9, seed=-3), got)
    for i in range(5):  # alone, in another batch arrangement
        assert torch.equal(select_tokens(logits[i:i + 1], [positions[i]], 0.8, 30, 0.9, seed=-3), got[i:i + 1])
    assert torch.equal(select_tokens(logits, positions, 0.0), logits.argmax(-1))
    with pytest.raises(ValueError):
        select_tokens(logits, positions[:2], 1.0)
    with pytest.raises(ValueError):
        filtered_logprobs(logits, 0.0)


# --------------------------------------------------------------------------------- GPU
def _gpu_case(rows: int, vocab: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype).cuda()
    inv_t, k, p, seeds, pos = (t.cuda() for t in _settings(rows, vocab, seed))
    return logits, inv_t, k, p, seeds, pos


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [49152, 248320])
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_gpu_triton_equals_reference(rows, vocab):
    for dtype in (torch.bfloat16, torch.float32):
        logits, inv_t, k, p, seeds, pos = _gpu_case(rows, vocab, dtype, rows + vocab)
        if rows == 1:
            inv_t, k, p = torch.ones_like(inv_t), torch.full_like(k, 50), torch.full_like(p, 0.9)
        thr = tri.filter_thresholds(logits, inv_t, k, p)
        assert torch.equal(thr, ref.filter_thresholds(logits, inv_t, k, p))
        got = tri.sample_tokens(logits, inv_t, thr, seeds, pos)
        assert torch.equal(got, ref.sample_tokens(logits, inv_t, thr, seeds, pos))
        free = torch.full_like(thr, float("-inf"))
        assert torch.equal(tri.sample_tokens(logits, inv_t, free, seeds, pos),
                           ref.sample_tokens(logits, inv_t, free, seeds, pos))
        if rows <= 16:  # the reference gives the same bits on the CPU
            cpu = [t.cpu() for t in (logits, inv_t, k, p, seeds, pos)]
            assert torch.equal(thr.cpu(), ref.filter_thresholds(*cpu[:4]))
            assert torch.equal(got.cpu(), ref.sample_tokens(cpu[0], cpu[1], thr.cpu(), *cpu[4:]))
    bits, gumbel = tri.noise(seeds, pos, vocab)
    assert torch.equal(bits, ref.noise_bits(seeds, pos, vocab))
    assert bits_equal(gumbel, ref.gumbel_noise(seeds, pos, vocab))


@pytest.mark.gpu
def test_gpu_sampler_in_cuda_graph():
    """filter_thresholds + sample_tokens captured once, replayed with new logits and settings."""
    from kernels.sampling import filter_thresholds, sample_tokens

    rows, vocab = 16, 49152
    logits, inv_t, k, p, seeds, pos = _gpu_case(rows, vocab, torch.bfloat16, 1)
    static = [t.clone() for t in (logits, inv_t, k, p, seeds, pos)]

    def step():
        lg, it, kk, pp, sd, ps = static
        return sample_tokens(lg, it, filter_thresholds(lg, it, kk, pp), sd, ps)

    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(3):
        new = _gpu_case(rows, vocab, torch.bfloat16, 100 + trial)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        lg, it, kk, pp, sd, ps = new
        want = ref.sample_tokens(lg, it, ref.filter_thresholds(lg, it, kk, pp), sd, ps)
        assert torch.equal(out, want)


def _random_trees(bsz: int, w: int, seed: int, vocab: int = 3):
    """``bsz`` random trees of up to ``w`` nodes (padded rows past each tree's size, as the engine
    pads them: parent -1, invalid, ancestors of the root only) with the inputs of
    ``accept_trees``; a small vocabulary so that many nodes match."""
    rng = random.Random(seed)
    tokens = torch.zeros(bsz, w, dtype=torch.long)
    parents = torch.full((bsz, w), -1, dtype=torch.long)
    anc = torch.zeros(bsz, w, dtype=torch.long)
    depth = torch.zeros(bsz, w, dtype=torch.long)
    valid = torch.zeros(bsz, w, dtype=torch.bool)
    choice = torch.randint(0, vocab, (bsz, w), generator=torch.Generator().manual_seed(seed))
    for b in range(bsz):
        n = rng.randint(1, w)
        bits = [1] + [0] * (w - 1)
        for j in range(w):
            tokens[b, j] = rng.randrange(vocab)
            if 0 < j < n:
                p = rng.randrange(j)
                parents[b, j] = p
                depth[b, j] = depth[b, p] + 1
                bits[j] = bits[p] | (1 << j)
            elif j >= n:
                bits[j] = 1 << j   # (the engine's padding: a node's own bit, target_service/pooled.py)
            valid[b, j] = j < n
            anc[b, j] = bits[j] - (1 << 64) if bits[j] >= 1 << 63 else bits[j]   # (int64: bit 63 wraps)
    return tokens, parents, anc, depth, valid, choice


@pytest.mark.parametrize("w", [1, 5, 16, 33, 64])
def test_accept_trees_kernel_equals_reference(w):
    """The acceptance walk as one Triton launch (``tri.accept_trees``) against its tensor-op
    reference (``accept_trees_reference``): the same path (0 in its unused positions, which the
    K/V and state commits read), accepted counts and bonus tokens, for random trees with padding,
    at 1 to 64 nodes (64: the ancestor masks' last bit is the sign bit); the dispatcher picks the
    kernel on CUDA."""
    from kernels.sampling.accept import accept_trees, accept_trees_reference

    for seed in range(3):
        ins = dev(*_random_trees(6, w, seed + 10 * w))
        want = accept_trees_reference(*ins)
        got = tri.accept_trees(*ins)
        for a, b in zip(got, want):
            assert a.dtype == torch.long and torch.equal(a, b), (w, seed)
        assert all(torch.equal(a, b) for a, b in zip(accept_trees(*ins), want))
    # a 64-node chain every node of which matches: the path ends at node 63 (the sign bit)
    tokens, parents, anc, depth, valid, choice = _random_trees(1, 64, 0)
    chain = torch.arange(64)
    parents[0] = chain - 1
    depth[0] = chain
    anc[0] = torch.tensor([(1 << (j + 1)) - 1 - (1 << 64) if j == 63 else (1 << (j + 1)) - 1 for j in range(64)])
    valid[0] = True
    choice[0, :63] = tokens[0, 1:]
    ins = dev(tokens, parents, anc, depth, valid, choice)
    got, want = tri.accept_trees(*ins), accept_trees_reference(*ins)
    assert int(got[1][0]) == 64 and all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="1 to 64"):
        tri.accept_trees(*dev(*_random_trees(1, 65, 0)))


def test_step_nodes_and_shared_settings():
    """The verify step's node bookkeeping in one launch equals its tensor ops; the sampler's
    settings read per request (``width`` rows each, float64 as stored in the step buffer) give
    the same thresholds and tokens as the settings repeated per row in float32, in the kernels
    and in the reference path."""
    from kernels import sampling as S

    gen = torch.Generator().manual_seed(5)
    b, w = 3, 5
    lengths = torch.tensor([0, 7, 300]).to(DEV)
    depth = torch.randint(0, 4, (b, w), generator=gen).to(DEV)
    n_nodes = torch.tensor([1, 5, 3]).to(DEV)
    for got, want in zip(tri.step_nodes(lengths, depth, n_nodes), ref.step_nodes(lengths, depth, n_nodes)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    logits = torch.randn(b * w, 50, generator=gen).to(DEV)
    inv = torch.tensor([0.0, 1.25, 0.5], dtype=torch.float64).to(DEV)     # one greedy request
    top_k = torch.tensor([0, 7, 0]).to(DEV)
    top_p = torch.tensor([0.0, 0.0, 0.9], dtype=torch.float64).to(DEV)
    seeds = torch.tensor([1, 2, 3]).to(DEV)
    positions = torch.arange(b * w).to(DEV) + 10
    rep = [t.repeat_interleave(w) for t in (inv.float(), top_k, top_p.float(), seeds)]
    for mod in (tri, S):   # (S: the dispatch, the reference path off CUDA)
        thr = mod.filter_thresholds(logits, inv, top_k, top_p, width=w)
        assert torch.equal(thr, ref.filter_thresholds(logits, rep[0], rep[1], rep[2]))
        tokens = mod.sample_tokens(logits, inv, thr, seeds, positions, width=w)
        assert torch.equal(tokens, ref.sample_tokens(logits, rep[0], thr, rep[3], positions))
    with pytest.raises(ValueError, match="whole number"):
        tri.filter_thresholds(logits, inv, top_k, top_p, width=4)   # 15 rows: not 4 per setting
    # only the settings the kernels round as they read them stay float64: a float64 threshold is
    # rounded before the launch, as the reference rounds it (a value between two float32 logits)
    two = torch.tensor([[1.0, 0.99999994]], device=DEV)
    thr = torch.tensor([0.99999995], dtype=torch.float64, device=DEV)
    one = torch.ones(1, dtype=torch.float64, device=DEV)
    picks = {int(tri.sample_tokens(two, one, thr, torch.tensor([s], device=DEV), torch.zeros(1, dtype=torch.long, device=DEV)))
             for s in range(40)}
    want = {int(ref.sample_tokens(two, one, thr, torch.tensor([s], device=DEV), torch.zeros(1, dtype=torch.long, device=DEV)))
            for s in range(40)}
    assert picks == want == {0, 1}
