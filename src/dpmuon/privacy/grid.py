"""The release on an integer grid: a Gaussian mechanism that stays private as computed in floats.

Adding float noise to a float sum is not the Gaussian mechanism: `fl(S + std·z)` rounds to a
grid that depends on S, so some outputs of a neighbouring S′ cannot come from S at all (Mironov
2012; Jin et al. 2022), and one release can reveal membership. Here each block's clipped sum S
(float64) is instead released as a whole number of grid steps γ, a power of two with std/γ = s in
[8, 16):

    m = round(S/γ + s·Z),   released m·γ

— the ideal form, a rounding of the Gaussian mechanism on S/γ (std s, sensitivity Δ/γ), hence
post-processing of the Gaussian mechanism on S with noise multiplier σ exactly: the grid costs no
privacy, only a rounding error of std γ/√12 ≤ 3.6% of the noise std (+0.13% of its variance).

As computed: S/γ = k + f splits exactly (a power-of-two scaling, `floor`, Sterbenz), so m = k +
round(f + s·ẑ), whose float arithmetic moves the cell edges (cells in z are ≥ 1/16 wide) by a
few ulps of s·|ẑ| + 2. How discrete ẑ is depends on where it lies, so the bound is by band of a
cell's reach t (its largest |z|; at most |ẑ| + 1/8): η(t) = `cell_eta(t)` bounds |ln P̃/P| for
every cell within t (ulp = 2⁻⁵²):

- every cell: the arithmetic, 4 ulps of s·t + 2 (the sum, both edges) and 4 of s·t (the
  sampler's own rounding of ẑ), times (t/8)/(1 − e^{−t/8}) (an edge's density over the mean);
- its numpy-ziggurat body (|z| < r = 3.654): 2⁵² atoms a layer, ≥ 7.2e13 in a cell (±1: 63 ulps),
  exp's and the tables' rounding: 128 ulps. η(r) = 1.6e-13;
- the ziggurat's tail (r < |z| ≤ 8): r + xx, xx = −log1p(−u)/r on 53-bit u, kept if
  −2·log1p(−u₂) > xx²: a cell holds u-measure e^{−r·x}·(e^{r/16} − 1), x = t − r, three atoms of
  weight ≤ e^{x/8} (two edges, the Riemann sum) err by 3·2⁻⁵³·e^{x/8}/that, the acceptance count
  by 2⁻⁵³ of e^{−x²/2}; the tail's sign is bit 8 of a word drawn ≥ 0xEF33D8025EF6A (150 more
  one way: 5.1e-13), its mass 1.7e-14 low (measured; 2e-14 charged). η = 9.6e-13 at 5, 4.0e-10
  at 7, 1.8e-8 at 8. Deeper the atoms thin out as e^{r·(t−r)} (3.6e-7 apart at 10, none past
  12.23: a uniform bound fails there), so
- draws beyond ±8 (TAIL_REDRAW, probability 1.2e-15) are redrawn at full resolution
  (privacy/randomness.py `gaussian_tail`, atoms 2⁻⁵²/x apart up to 15.5): 16 ulps, plus the
  ziggurat's error at 8 for a cell that straddles 8.

A release of d coordinates then costs 2·(d·η(r) + Σ_b N_b·(η(e_b) − η(e_{b−1}))) in ε, N_b the
coordinates whose reach passes band edge e_{b−1} (BAND_EDGES), on the neighbour's side as on its
own. N_b ≤ #{|ẑ| > e_{b−1} − 1/8} is bounded by k_b, the least count whose binomial tail
(Chernoff, `binomial_tail`, at twice the Gaussian tail probability, which the sampler's own is
within a factor e^{η} < 2 of) is ≤ COUNT_TAIL; some N_b > k_b, or a reach past Z_MAX = 12
(probability ≤ 2·d·P(|Z| > 11.875)), is the bad event the accountant charges in δ
(`release_slack`), as likely under the computed mechanism as the ideal. A cell reached only past
Z_MAX under either neighbour lies in that event: where a sampler's support ends a neighbour's
shifted cell could have probability under one dataset and none under the other, and the redrawn
tail reaches 15.5 (secure mode's Box–Muller radius 13.4), both past 12. At GPT-2 small (d =
1.24e8): ε 4.0e-5 per release (the body's 3.97e-5, the tail bands 3.6e-7) and δ 4e-24; at d = 1e4,
ε 1.2e-7 (the one coordinate each deep band may hold).
"""

from __future__ import annotations

import contextlib
import math
from functools import lru_cache
from typing import TypeVar

import numpy as np
import torch

from .accountant import ReleaseSlack
from .randomness import TAIL_REDRAW

Array = TypeVar("Array", torch.Tensor, np.ndarray)  # what the release noises in place: a tensor, or on the CPU a numpy view

GRID_NOISE_STD = (8.0, 16.0)  # s = std/γ, in grid units
CELL_REACH = 1 / GRID_NOISE_STD[0]  # a cell is at most 1/8 wide in z: its reach is within |ẑ| + 1/8
ULP = 2.0**-52
EXACT_INTEGERS = 2.0**52  # |S/γ| below this: k, f and m are exact in float64

# numpy's ziggurat (numpy/random/src/distributions: random_standard_normal), measured through a
# scripted bit generator in tests/privacy/test_grid_tail.py.
ZIGGURAT_R = 3.6541528853610088  # |z| beyond it comes from the exponential tail
ZIGGURAT_TAIL_WORDS = 2**52 - 0xEF33D8025EF6A  # base-layer words (of 2⁵²) that enter the tail
ZIGGURAT_SIGN_BIAS = 150 / ZIGGURAT_TAIL_WORDS  # the tail's sign bit, 150 more words one way
ZIGGURAT_TAIL_MASS = 2e-14  # the tail's mass against the Gaussian's: measured 1.67e-14 low
ZIGGURAT_BODY = 128 * ULP  # its body: ±1 of ≥ 7.2e13 atoms a cell (63 ulps), exp and the tables
REDRAWN_TAIL = 16 * ULP  # gaussian_tail: 3 atoms of ≥ 2⁵²·0.39 a cell, acceptance, normalization

# Upper edges of the reach bands; the last is Z_MAX, past which is the bad event.
BAND_EDGES = (ZIGGURAT_R, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, TAIL_REDRAW, 12.0)
Z_MAX = BAND_EDGES[-1]
COUNT_TAIL = 1e-30  # per release and band: the chance that a band holds more than its bound k_b


def cell_eta(reach: float) -> float:
    """A bound on |ln P̃/P| for every output cell whose |z| stays within `reach` (module docstring)."""
    t = max(reach, ZIGGURAT_R)
    width = CELL_REACH * t  # ln-density change across the widest cell
    edge_density = width / -math.expm1(-width)
    eta = edge_density * ULP * (4 * (GRID_NOISE_STD[1] * t + 2) + 4 * GRID_NOISE_STD[1] * t)
    if reach <= ZIGGURAT_R:
        return eta + ZIGGURAT_BODY
    return eta + ZIGGURAT_BODY + _ziggurat_tail(min(t, TAIL_REDRAW)) + (REDRAWN_TAIL if t > TAIL_REDRAW else 0.0)


def _ziggurat_tail(t: float) -> float:
    x = t - ZIGGURAT_R
    cell_mass = math.exp(-ZIGGURAT_R * x) * math.expm1(ZIGGURAT_R / GRID_NOISE_STD[1])  # in u, the narrowest cell
    atoms = 3 * 2.0**-53 * math.exp(x * CELL_REACH) / cell_mass
    acceptance = 2.0**-53 * (math.exp(x * x / 2) + 1.5 * x * x)
    return atoms + acceptance + ZIGGURAT_SIGN_BIAS + ZIGGURAT_TAIL_MASS


def grid_step(std: float) -> float:
    """The power of two γ with std/γ in [8, 16)."""
    if not std > 0:
        raise ValueError(f"grid step of a noise std must be > 0, got {std}")
    _, exponent = math.frexp(std)  # std = mantissa·2^exponent, mantissa in [0.5, 1)
    return math.ldexp(1.0, exponent - 4)


def release_on_grid(total: Array, std: float, z: Array) -> Array:
    """round(total/γ + (std/γ)·z)·γ, computed in place in `total` (float64; z is consumed).

    A torch tensor on any device, or a numpy array: the CPU release noises each chunk in numpy,
    one thread per chunk, where torch's elementwise ops would each start their own parallel
    region inside the chunk's thread: 2 threads ran 4 wide (scripts/bench_noise.py, 1.24e8
    coordinates: 1.9–2.0 s a release against 1.7 s in numpy). The same IEEE operations in the same
    order, so the same bits (tests/privacy/test_grid_release.py)."""
    xp = np if isinstance(total, np.ndarray) else torch
    gamma = grid_step(std)
    s = std / gamma  # exact: γ is a power of two
    total /= gamma  # exact, the same scaling
    peak = float(abs(total).max()) if math.prod(total.shape) else 0.0
    if math.isfinite(peak) and peak >= EXACT_INTEGERS:  # a non-finite sum passes through, for the caller to refuse
        raise OverflowError(f"a clipped sum of {peak * gamma:g} is too large for the grid of step {gamma:g}")
    # A non-finite sum turns into NaN silently in numpy as in torch (inf − inf warns otherwise).
    with np.errstate(invalid="ignore") if xp is np else contextlib.nullcontext():
        k = xp.floor(total)
        total -= k  # f, in [0, 1): exact
        z = z.to(device=total.device, dtype=torch.float64) if xp is torch else z.astype(np.float64, copy=False)
        z *= s
        total += z
        xp.round(total, out=total)  # ties to even, both
        total += k
        total *= gamma
    return total


def beyond(t: float) -> float:
    """An upper bound on P(|ẑ| > t), ideal or as sampled: twice the Gaussian's."""
    return 2 * math.erfc(max(t, 0.0) / math.sqrt(2))


def binomial_tail(n: int, p: float, k: int) -> float:
    """An upper bound on P(Binomial(n, p) ≥ k): Chernoff's exp(−n·KL(k/n ‖ p)) above the mean, else 1."""
    if k <= n * p:
        return 1.0
    if k > n:
        return 0.0
    a = k / n
    kl = a * math.log(a / p) + ((1 - a) * (math.log1p(-a) - math.log1p(-p)) if a < 1 else -math.log1p(-p))
    return math.exp(-n * kl)


def band_count(n: int, p: float) -> int:
    """k_b: the least count k with P(Binomial(n, p) > k) ≤ COUNT_TAIL."""
    hi = max(1, math.ceil(n * p))
    while binomial_tail(n, p, hi + 1) > COUNT_TAIL:
        hi *= 2
    lo = -1  # P(N > −1) = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if binomial_tail(n, p, mid + 1) <= COUNT_TAIL else (mid, hi)
    return hi


@lru_cache(maxsize=256)
def release_slack(coordinates: int) -> ReleaseSlack:
    """What one release of `coordinates` grid-noised values costs beyond the ideal Gaussian."""
    if coordinates <= 0:
        return ReleaseSlack()
    eta = [cell_eta(edge) for edge in BAND_EDGES]
    loss, bad = coordinates * eta[0], 0.0
    for lower, step in zip(BAND_EDGES[:-1], (b - a for a, b in zip(eta, eta[1:])), strict=True):
        p = min(1.0, beyond(lower - CELL_REACH))
        count = band_count(coordinates, p)
        loss += count * step
        bad += binomial_tail(coordinates, p, count + 1)
    bad += coordinates * beyond(Z_MAX - CELL_REACH)
    return ReleaseSlack(epsilon=2 * loss, bad_event=bad)
