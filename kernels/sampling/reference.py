"""Token selection and the tree acceptance walk, plain PyTorch (CPU or CUDA tensors).

Sampling is a deterministic function of ``(seed, position, logits)`` through the Gumbel-max
trick: the token chosen at absolute position ``p`` is ``argmax_i(x_i + G_i)`` over the tokens
the filters keep, where ``x`` are the temperature-scaled logits and ``G_i`` standard Gumbel
noise. ``argmax(log pi + G)`` is an exact sample of ``softmax`` (Gumbel 1954; Maddison, Tarlow
and Minka, "A* Sampling", NeurIPS 2014). The noise is a pure function of ``(seed, p, token id)``:
Philox-4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
SC'11) with counter ``(token, p mod 2**32, p div 2**32, 0)`` and key ``(seed mod 2**32,
seed div 2**32)``. Because it depends only on the position, the target's choice at every tree
node equals the choice autoregressive decoding would make after the same prefix, so the
speculative walk emits exactly the target-only sample stream for the same seed, and the output
distribution is the target's whatever the drafter proposes (docs/ARCHITECTURE.md, "Sampling"). Being counter
based, the noise needs no host RNG and no state: any device computes any entry on its own, and
``kernels.sampling.triton`` computes it inside the sampling kernel.

Everything here is defined so that the Triton kernels equal it *bit for bit*:

* Philox is integer arithmetic (:func:`philox4x32_10`, 16-bit limbs, no int64 overflow).
* The two logarithms of the Gumbel transform and the exponential of the top-p weights are fixed
  float32 polynomials (:func:`_log_f32`, :func:`_exp_f32`) built from single IEEE operations
  (add, multiply, floor, bit moves), never a libm call, so every backend rounds the same way
  (libm / libdevice / SLEEF ``log`` differ in the last bit). Their accuracy is < 1 ulp (log) and
  < 1.3 ulp (exp) against float64; the log polynomial was fitted here (weighted Lawson minimax
  of ``(log1p(f) - f + f**2/2) / f**3`` on ``f`` in ``[sqrt(1/2) - 1, sqrt(2) - 1]``), the exp
  polynomial is the degree-7 Taylor series after Cody-Waite reduction by ``ln 2``.
* The top-p mass is summed in integers (weights quantised to multiples of ``2**-40`` of the
  largest one), so its value does not depend on the order of summation.

Contents: :func:`philox4x32_10`, :func:`noise_bits`, :func:`gumbel_noise` (the seeded stream);
:func:`filter_thresholds`, :func:`sample_tokens` (the device-shaped sampler, also in Triton);
:func:`select_tokens`, :func:`filtered_logprobs` (the engine's per-session API and the test
oracle); :func:`accept_path` (the tree walk).
"""

from __future__ import annotations

import numpy as np
import torch

# Philox-4x32 round multipliers and Weyl key increments (Salmon et al. 2011, Random123).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
_M32 = 0xFFFFFFFF

#: ``u = ((x0 >> UNIFORM_SHIFT) + 0.5) * 2**-UNIFORM_BITS``: the uniform variate of one token.
#: 23 bits, not 24: ``(m + 0.5)`` needs ``UNIFORM_BITS + 1`` significant bits, which float32 has
#: only for 23 (with 24 bits the top value rounds to ``u = 1.0`` and ``G = +inf``).
UNIFORM_BITS = 23
UNIFORM_SHIFT = 32 - UNIFORM_BITS
UNIFORM_SCALE = 2.0**-UNIFORM_BITS
#: Upper bound of every Gumbel value :func:`gumbel_noise` can return (the true maximum,
#: ``-log(-log(1 - 2**-24))``, is 16.6355); used to skip tokens that cannot win.
GUMBEL_BOUND = 16.75

#: Top-p weights are ``floor(exp(x - max) * 2**MASS_BITS)`` in int64: sums are exact for
#: vocabularies up to ``MAX_VOCAB`` tokens.
MASS_BITS = 40
MASS_SCALE = float(2**MASS_BITS)
MAX_VOCAB = 1 << (63 - MASS_BITS)

# float32 constants (every literal below is exactly representable in float32).
LN2_HI = 0.693359375  # 355/512: n * LN2_HI is exact for |n| < 2**15
LN2_LO = -0.00021219444170128554  # float32(ln 2 - LN2_HI)
LOG2E = 1.4426950216293335  # float32(1 / ln 2)
SQRT2_BITS = 0x3FB504F3  # float32(sqrt 2)
#: log1p(f) ~= f - f^2/2 + f^3 * P(f), P's coefficients from degree 0 up (fitted in float64, rounded).
LOG_POLY = (
    0.3333331048488617, -0.24999986588954926, 0.20002226531505585, -0.16669251024723053,
    0.14218658208847046, -0.12384343147277832, 0.11872965842485428, -0.1178983524441719,
    0.06915424764156342,
)
#: exp(r) ~= sum_k r^k / k!, k = 0..7 (coefficients rounded to float32).
EXP_POLY = (
    1.0, 1.0, 0.5, 0.1666666716337204, 0.0416666679084301, 0.008333333767950535,
    0.0013888889225199819, 0.00019841270113829523,
)
EXP_MIN = -87.0  # exp argument floor: 2**n stays a normal float


# ------------------------------------------------------------------------------------ Philox
def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * m`` (``a`` int64 in [0, 2**32), ``m`` a uint32 constant),
    from two 32x16-bit products (each < 2**48): nothing overflows int64."""
    p_lo = a * (m & 0xFFFF)
    p_hi = a * (m >> 16)
    t = p_hi + (p_lo >> 16)  # < 2**49
    return t >> 16, ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32 with 10 rounds: the block function of a counter-based generator.

    Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11; the
    same function as Random123's ``philox4x32_R(10, ...)`` and cuRAND's Philox4_32_10. A round
    maps counter ``(c0, c1, c2, c3)`` with key ``(k0, k1)`` to ``(hi(M1*c2) ^ c1 ^ k0, lo(M1*c2),
    hi(M0*c0) ^ c3 ^ k1, lo(M0*c0))`` with ``M0 = 0xD2511F53``, ``M1 = 0xCD9E8D57``; the key
    grows by ``(0x9E3779B9, 0xBB67AE85)`` (mod 2**32) between rounds.

    Args:
        c0, c1, c2, c3: counter words; k0, k1: key words. int64 tensors (or Python ints) holding
            uint32 values in ``[0, 2**32)``, mutually broadcastable, all on one device (CPU or
            CUDA). Values outside that range give undefined results (not checked: no host sync).

    Returns:
        The four output words, int64 tensors of the broadcast shape holding uint32 values.

    Pure integer arithmetic, the same bits on every device: on the CPU in numpy ``uint64``, where
    a 32 x 32-bit product is exact (:func:`_philox_host`; a few times faster on the small tensors
    of a sampled step), elsewhere in int64 tensor ops with 16-bit limb products (no overflow:
    :func:`_philox_limbs`).
    """
    words = [c0, c1, c2, c3, k0, k1]
    device = next((w.device for w in words if isinstance(w, torch.Tensor)), torch.device("cpu"))
    if device.type == "cpu":
        return _philox_host(*words)
    return _philox_limbs(*words, device=device)


_U32 = np.uint64(_M32)
_U_SHIFT = np.uint64(32)
_U_M0, _U_M1, _U_W0, _U_W1 = (np.uint64(x) for x in (PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1))


def _philox_host(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`philox4x32_10` of CPU tensors or ints in numpy ``uint64``: ``hi, lo`` of ``M * c`` are
    the top and bottom 32 bits of one exact 64-bit product. Returns CPU int64 tensors."""
    c0, c1, c2, c3, k0, k1 = (np.asarray(w.numpy() if isinstance(w, torch.Tensor) else w, dtype=np.int64).astype(np.uint64)
                              for w in (c0, c1, c2, c3, k0, k1))
    for r in range(10):
        if r:
            k0 = (k0 + _U_W0) & _U32
            k1 = (k1 + _U_W1) & _U32
        p0 = c0 * _U_M0
        p1 = c2 * _U_M1
        c0, c1, c2, c3 = (p1 >> _U_SHIFT) ^ c1 ^ k0, p1 & _U32, (p0 >> _U_SHIFT) ^ c3 ^ k1, p0 & _U32
    return tuple(torch.from_numpy(w.astype(np.int64)) for w in np.broadcast_arrays(c0, c1, c2, c3))  # type: ignore[return-value]


def _philox_limbs(c0, c1, c2, c3, k0, k1, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`philox4x32_10` in int64 tensor ops on ``device`` (default: the tensors' or the
    CPU), each 32 x 32-bit product from two 32 x 16-bit ones (:func:`_mulhilo32`)."""
    if device is None:
        device = next((w.device for w in (c0, c1, c2, c3, k0, k1) if isinstance(w, torch.Tensor)), torch.device("cpu"))
    c0, c1, c2, c3, k0, k1 = (torch.as_tensor(w, dtype=torch.int64, device=device) for w in (c0, c1, c2, c3, k0, k1))
    for r in range(10):
        if r:
            k0 = (k0 + PHILOX_W0) & _M32
            k1 = (k1 + PHILOX_W1) & _M32
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return tuple(torch.broadcast_tensors(c0, c1, c2, c3))  # type: ignore[return-value]


def _key_words(seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Philox key of a uint64 seed stored in int64 (two's complement): (low, high) 32-bit words."""
    return seeds & _M32, (seeds >> 32) & _M32


def _noise_bits_at(seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Word 0 of Philox at counter ``(token, pos lo, pos hi, 0)``, key ``(seed lo, seed hi)``
    (broadcastable int64 tensors)."""
    k0, k1 = _key_words(seeds)
    return philox4x32_10(tokens, positions & _M32, (positions >> 32) & _M32, 0, k0, k1)[0]


def noise_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The raw 32-bit noise word of every (row, token): ``[R, vocab]`` int64 in ``[0, 2**32)``.

    Entry ``[r, t]`` is output word 0 of :func:`philox4x32_10` at counter ``(t, positions[r] mod
    2**32, positions[r] div 2**32, 0)`` with key ``(seeds[r] mod 2**32, seeds[r] div 2**32)``.

    Args:
        seeds: ``[R]`` int64; a uint64 seed is stored as its two's complement bit pattern (seeds
            >= 2**63 are negative int64 values).
        positions: ``[R]`` int64 absolute positions (>= 0) of the tokens being chosen.
        vocab: number of token ids ``V``.
    """
    tokens = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    return _noise_bits_at(seeds.long()[:, None], positions.long()[:, None], tokens[None, :])


# ------------------------------------------------------------------ float32 log / exp, exact
def _log_f32(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 values, < 1 ulp, bit-identical to the Triton
    version (every line one IEEE operation). ``x = 2**e * m``, ``m`` in ``[sqrt(1/2), sqrt(2)]``,
    ``log x = e ln2 + log1p(m - 1)``."""
    b = x.view(torch.int32)
    e = (b >> 23) - 127
    mb = (b & 0x7FFFFF) | 0x3F800000  # mantissa as a float in [1, 2)
    big = mb > SQRT2_BITS
    mb = torch.where(big, mb - 0x800000, mb)  # halve it: [sqrt(1/2), sqrt(2)]
    e = torch.where(big, e + 1, e)
    f = mb.view(torch.float32) - 1.0  # exact (Sterbenz)
    z = f * f
    p = f * LOG_POLY[8]
    for c in LOG_POLY[7:0:-1]:
        p = p + c
        p = p * f
    p = p + LOG_POLY[0]
    y = p * f
    y = y * z
    ef = e.to(torch.float32)
    y = y + ef * LN2_LO
    y = y - z * 0.5
    r = f + y
    return r + ef * LN2_HI


def _exp_f32(d: torch.Tensor) -> torch.Tensor:
    """``exp(d)`` for float32 ``d <= 0`` (clamped at ``EXP_MIN``), < 1.3 ulp, bit-identical to the
    Triton version: ``n = round(d / ln2)``, ``r = d - n ln2`` (Cody-Waite, two parts), degree-7
    Taylor polynomial of ``exp(r)`` times ``2**n`` built from its bits."""
    d = torch.clamp_min(d, EXP_MIN)
    t = d * LOG2E
    n = torch.floor(t + 0.5)
    r = d - n * LN2_HI
    r = r - n * LN2_LO
    p = r * EXP_POLY[7]
    for c in EXP_POLY[6:0:-1]:
        p = p + c
        p = p * r
    p = p + EXP_POLY[0]
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return p * scale


def _uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """``u = ((bits >> 9) + 0.5) * 2**-23``: float32, exact, in ``[2**-24, 1 - 2**-24]``."""
    return ((bits >> UNIFORM_SHIFT).to(torch.float32) + 0.5) * UNIFORM_SCALE


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel variates ``G = -log(-log(u))`` (float32) of noise words (int64 uint32
    values), ``u`` from :func:`_uniform_from_bits`. Range ``[-2.8116, 16.6356]``, increasing in
    ``u``, within 6e-7 of the float64 value."""
    v = 0.0 - _log_f32(_uniform_from_bits(bits))  # "0 - y", as Triton negates: log 1 = 0 gives +0.0
    return 0.0 - _log_f32(v)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise of every (row, token): ``[R, vocab]`` float32.

    ``G[r, t] = -log(-log(u))`` with ``u = ((x0 >> 9) + 0.5) * 2**-23`` and ``x0 =
    noise_bits(seeds, positions, vocab)[r, t]`` (Gumbel 1954). A pure function of ``(seeds[r],
    positions[r], t)``: equal on every device and in the Triton sampler, bit for bit.

    Args:
        seeds: ``[R]`` int64 (uint64 bit patterns, see :func:`noise_bits`).
        positions: ``[R]`` int64 absolute positions of the tokens being chosen.
        vocab: ``V``.
    """
    return gumbel_from_bits(noise_bits(seeds, positions, vocab))


def _gumbel_at(seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Gumbel noise of (row, token) pairs given as broadcastable int64 tensors."""
    return gumbel_from_bits(_noise_bits_at(seeds, positions, tokens))


# ------------------------------------------------------------------------------ filtering
def scaled_logits(logits: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """The sampling domain ``x = float32(logits) * inv_temperature[row]`` (one float32 multiply),
    with NaN replaced by ``-inf`` and ``-0.0`` by ``+0.0``: ``[R, V]`` float32."""
    x = logits.float() * inv_temperature.float()[:, None]
    x = torch.where(torch.isnan(x), float("-inf"), x)
    return x + 0.0


def mass_weights(d: torch.Tensor) -> torch.Tensor:
    """Integer top-p weights ``floor(exp(d) * 2**40)`` (int64) of ``d = x - max(x) <= 0``
    (``d = 0`` where ``x == max``): sums of them are exact and order-free."""
    return (_exp_f32(d) * MASS_SCALE).to(torch.int64)


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    if t.dim() != 1 or t.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}], got {list(t.shape)}")


def filter_thresholds(
    logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-row keep threshold of top-k / top-p filtering, in the scaled domain.

    With ``x = scaled_logits(logits, inv_temperature)``, a token is kept iff ``x >= threshold``.

    * top-k (``0 < k < V``): ``thr_k`` = the k-th largest ``x`` counted with multiplicity (all
      tokens tied with it are kept, so ties can keep more than k).
    * top-p (``0 < p < 1``), after top-k (Holtzman et al., "The Curious Case of Neural Text
      Degeneration", ICLR 2020): over the tokens with ``x >= thr_k``, ``thr_p`` = the largest data
      value ``t`` whose upper set ``{x >= t}`` has probability mass ``>= p``. The mass is computed
      exactly in integers: weights ``w = floor(exp(x - max x) * 2**40)`` (:func:`mass_weights`),
      ``mass{x >= t} >= p`` iff ``float64(sum_{x >= t} w) >= float64(p) * float64(sum w)``; the
      quantisation moves a mass by less than ``V * 2**-40`` of the largest weight.
    * threshold = ``max(thr_k, thr_p)``, always a value of ``x`` (so exact comparisons work).

    Args:
        logits: ``[R, V]`` any float dtype, ``V <= MAX_VOCAB`` (2**23).
        inv_temperature: ``[R]`` float32, ``float32(1 / temperature)``; 0 marks a greedy row.
        top_k: ``[R]`` int64, 0 (or >= V) = off.
        top_p: ``[R]`` float32, 0 or >= 1 = off.

    Returns:
        ``[R]`` float32 thresholds; ``-inf`` for greedy rows and rows whose filters are off.

    Raises:
        ValueError: bad shapes, or ``V > MAX_VOCAB``.

    NaN logits count as ``-inf`` (:func:`scaled_logits`). Plain PyTorch with data-dependent
    shapes (host syncs): the CPU path and the oracle of ``kernels.sampling.triton``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {list(logits.shape)}")
    rows_n, vocab = logits.shape
    if vocab > MAX_VOCAB:
        raise ValueError(f"vocabulary {vocab} exceeds {MAX_VOCAB} (exact top-p mass in int64)")
    for name, t in (("inv_temperature", inv_temperature), ("top_k", top_k), ("top_p", top_p)):
        _check_rows(name, t, rows_n)
    out = torch.full((rows_n,), float("-inf"), dtype=torch.float32, device=logits.device)
    inv_t, k, p = inv_temperature.float(), top_k.long(), top_p.float()
    sampling = inv_t != 0
    k_on = sampling & (k > 0) & (k < vocab)
    p_on = sampling & (p > 0) & (p < 1)
    rows = torch.nonzero(k_on | p_on).flatten()
    if rows.numel() == 0:
        return out
    x = scaled_logits(logits.index_select(0, rows), inv_t[rows])
    kr, pr, kon, pon = k[rows], p[rows], k_on[rows], p_on[rows]
    kk = torch.where(kon, kr, vocab)  # how much of the sorted row each row needs
    big_k = int(kk.max())
    if big_k < vocab:
        sx = torch.topk(x, big_k, dim=-1).values  # descending
    else:
        sx = torch.sort(x, dim=-1, descending=True).values
    neg_inf = torch.full_like(sx[:, 0], float("-inf"))
    thr_k = torch.where(kon, sx.gather(1, (kk - 1).clamp(max=big_k - 1)[:, None])[:, 0], neg_inf)
    # The kept tokens in descending order: sx[:k], then the ties of thr_k beyond position k.
    n_kept = (x >= thr_k[:, None]).sum(-1)
    j = torch.arange(int(n_kept.max()), device=x.device)
    vals = torch.where(j[None, :] < kk[:, None], sx[:, j.clamp(max=big_k - 1)], thr_k[:, None])
    valid = j[None, :] < n_kept[:, None]
    top = sx[:, :1]
    d = torch.where(vals == top, 0.0, vals - top)
    w = torch.where(valid, mass_weights(d), 0)
    cum = torch.cumsum(w, dim=-1)
    reach = valid & (cum.double() >= pr.double()[:, None] * cum[:, -1:].double())
    first = reach.to(torch.int32).argmax(-1)  # first position whose prefix mass reaches p
    thr_p = vals.gather(1, first[:, None])[:, 0]
    out[rows] = torch.where(pon, thr_p, thr_k)
    return out


# -------------------------------------------------------------------------------- sampling
def sample_tokens(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    threshold: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Choose one token per row: greedy argmax, or a Gumbel-max sample of the filtered softmax.

    Greedy rows (``inv_temperature == 0``): ``argmax(logits)`` (torch semantics: the lowest id
    among ties; a NaN counts as the largest value). Other rows: with ``x = scaled_logits(...)``
    and ``G = gumbel_noise(seeds, positions, V)``, the lowest id maximising ``x + G`` over the
    kept tokens ``x >= threshold`` (Gumbel-max trick: an exact sample of ``softmax(x)``
    restricted to the kept set; Gumbel 1954, Maddison et al. 2014). NaN logits count as
    ``-inf``; a row whose kept tokens are all ``-inf`` returns token 0.

    Args:
        logits: ``[R, V]`` any float dtype.
        inv_temperature: ``[R]`` float32 ``float32(1 / temperature)``; 0 = greedy.
        threshold: ``[R]`` float32 from :func:`filter_thresholds` (``-inf`` keeps everything).
        seeds: ``[R]`` int64 (uint64 bit patterns).
        positions: ``[R]`` int64 absolute position of the token being chosen.

    Returns:
        ``[R]`` int64 token ids on ``logits.device``.

    Noise is computed only where it can matter: for each row, the kept token of largest ``x``
    gives a score ``s``, and only tokens with ``x + GUMBEL_BOUND >= s`` can reach it (float
    addition is monotone), so the result equals the full definition while computing far less
    on typical logits. Data-dependent shapes (host syncs): see ``kernels.sampling.triton`` for
    the device version.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {list(logits.shape)}")
    rows_n, vocab = logits.shape
    for name, t in (("inv_temperature", inv_temperature), ("threshold", threshold), ("seeds", seeds),
                    ("positions", positions)):
        _check_rows(name, t, rows_n)
    greedy_tok = torch.argmax(logits, dim=-1)
    sampling = inv_temperature.float() != 0
    if rows_n == 0 or not bool(sampling.any()):
        return greedy_tok
    seeds, positions = seeds.long(), positions.long()
    x = scaled_logits(logits, inv_temperature)
    kept = (x >= threshold.float()[:, None]) & sampling[:, None]
    xs = torch.where(kept, x, float("-inf"))
    lead = xs.argmax(-1)
    s = xs.gather(1, lead[:, None])[:, 0] + _gumbel_at(seeds, positions, lead)
    cand = kept & ((xs + GUMBEL_BOUND) >= s[:, None])
    r, c = cand.nonzero(as_tuple=True)
    score = torch.full_like(x, float("-inf"))
    score[r, c] = x[r, c] + _gumbel_at(seeds[r], positions[r], c)
    return torch.where(sampling, score.argmax(-1), greedy_tok)


def _as_int64(seed: int) -> int:
    """A uint64 (or any int) seed as the int64 with the same low 64 bits."""
    s = int(seed) & ((1 << 64) - 1)
    return s - (1 << 64) if s >= 1 << 63 else s


def sampling_tensors(
    rows: int, device, temperature: float, top_k: int, top_p: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row settings of one request as tensors: ``inv_temperature`` ``[R]`` float32
    (``float32(1 / T)``, 0 when ``T <= 0``), ``top_k`` ``[R]`` int64, ``top_p`` ``[R]`` float32 and
    ``seeds`` ``[R]`` int64 (``seed`` taken mod 2**64, as a two's complement bit pattern)."""
    inv_t = 1.0 / temperature if temperature > 0 else 0.0
    return (
        torch.full((rows,), inv_t, dtype=torch.float32, device=device),
        torch.full((rows,), int(top_k), dtype=torch.int64, device=device),
        torch.full((rows,), float(top_p), dtype=torch.float32, device=device),
        torch.full((rows,), _as_int64(seed), dtype=torch.int64, device=device),
    )


def select_with(filter_fn, sample_fn, logits, next_positions, temperature, top_k, top_p, seed) -> torch.Tensor:
    """:func:`select_tokens` with the given ``filter_thresholds`` / ``sample_tokens``
    implementations (``kernels.sampling`` passes its device dispatchers)."""
    if temperature <= 0.0:
        return torch.argmax(logits, dim=-1)
    rows = logits.shape[0]
    inv_t, k, p, seeds = sampling_tensors(rows, logits.device, temperature, top_k, top_p, seed)
    positions = torch.as_tensor(list(next_positions), dtype=torch.int64).to(logits.device)
    if positions.shape != (rows,):
        raise ValueError(f"next_positions must have {rows} entries, got {positions.shape[0]}")
    threshold = filter_fn(logits, inv_t, k, p)
    return sample_fn(logits, inv_t, threshold, seeds, positions)


def select_tokens(
    logits: torch.Tensor,
    next_positions: list[int],
    temperature: float,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """The target's token choice at each row: argmax at temperature 0, else a Gumbel-max sample.

    Args:
        logits: ``[T, V]`` logits of ``T`` nodes (any float dtype).
        next_positions: absolute position of the token each row chooses (node position + 1).
        temperature: >= 0 (0 = greedy); top_k: 0 = off; top_p: 0 or >= 1 = off.
        seed: request seed (any int; taken mod 2**64); with ``next_positions`` it fixes the noise.

    Returns:
        ``[T]`` int64 token ids on ``logits.device``.

    Raises:
        ValueError: ``len(next_positions) != T``.

    :func:`filter_thresholds` then :func:`sample_tokens` with one request's settings on every
    row (``kernels.sampling.select_tokens`` is the same with the Triton kernels on CUDA).
    """
    return select_with(filter_thresholds, sample_tokens, logits, next_positions, temperature, top_k, top_p, seed)


def filtered_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Log-probabilities of the sampling distribution after temperature, top-k and top-p.

    The distribution :func:`select_tokens` samples from: ``x = float32(logits) * float32(1 / T)``,
    tokens with ``x < filter_thresholds(...)`` removed (see there for the exact top-k / top-p
    rule), softmax of the rest.

    Args:
        logits: ``[T, V]`` any float dtype.
        temperature: > 0.
        top_k: keep the ``top_k`` largest (with ties) tokens (0 = all).
        top_p: keep the largest tokens whose mass reaches ``top_p`` (0 or >= 1 = all).

    Returns:
        ``[T, V]`` float32 log-softmax of the kept tokens; removed tokens are ``-inf``.

    Raises:
        ValueError: ``temperature <= 0``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    inv_t, k, p, _ = sampling_tensors(logits.shape[0], logits.device, temperature, top_k, top_p, 0)
    x = scaled_logits(logits, inv_t)
    thr = filter_thresholds(logits, inv_t, k, p)
    return torch.log_softmax(x.masked_fill(x < thr[:, None], float("-inf")), dim=-1)


# ------------------------------------------------------------------------------ tree walk
def accept_path(
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    ancestors: torch.Tensor,
    depth: torch.Tensor,
    choice: torch.Tensor,
) -> torch.Tensor:
    """Walk a verified tree from the root and return the accepted path as a node mask.

    A non-root node ``i`` with parent ``p`` *matches* when ``tree_tokens[i] == choice[p]`` (the
    target, at ``p``, chose ``i``'s token). A node is on the accepted path when it and all of its
    ancestors match; the path ends at the deepest such node (the lowest index among equals, i.e.
    the first matching sibling). This is the walk of step 3 of docs/ARCHITECTURE.md, "One
    speculative step", done with tensor ops: no host synchronisation.

    Args:
        tree_tokens: ``[T]`` int64 node tokens (node 0 = root).
        parents: ``[T]`` int64 parent indices (``parents[0]`` is ignored).
        ancestors: ``[T, T]`` bool, ``ancestors[i, j]`` = ``j`` is ``i`` or an ancestor of ``i``.
        depth: ``[T]`` int64 node depths (root 0).
        choice: ``[T]`` int64 the target's token choice at each node.

    Returns:
        ``[T]`` bool mask of the path nodes (root included); the path end is its deepest node.
    """
    t = tree_tokens.shape[0]
    match = tree_tokens == choice[parents.clamp(min=0)]
    match[0] = True
    on_path = ~(ancestors & ~match.unsqueeze(0)).any(dim=1)
    order = torch.arange(t, device=depth.device)
    score = torch.where(on_path, depth * (t + 1) + (t - order), torch.full_like(depth, -1))
    return ancestors[torch.argmax(score)]


def step_nodes(lengths: torch.Tensor, depth: torch.Tensor, n_nodes: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify step's per-node bookkeeping from its inputs.

    Args:
        lengths: ``[B]`` int64 committed rows ``L`` of each batch row.
        depth: ``[B, W]`` int64 depth of each node (root 0).
        n_nodes: ``[B]`` int64 real nodes of each row (the rest are padding).

    Returns:
        ``(positions, next_positions, valid)``: ``[B, W]`` int64 ``L + depth`` (a node's
        position), ``L + depth + 1`` (the position of the token chosen after it) and bool
        ``j < n_nodes`` (a real node).
    """
    positions = lengths[:, None] + depth
    j = torch.arange(depth.shape[1], device=depth.device)
    return positions, positions + 1, j[None, :] < n_nodes[:, None]
