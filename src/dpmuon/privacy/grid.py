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
round(f + s·ẑ) needs float arithmetic only on values below s·|ẑ| + 1, whose rounding moves the
cell boundaries by at most `ulp_budget` ulps; ẑ comes from numpy's ziggurat on Philox words (or
Box–Muller on CSPRNG words), whose discreteness (2⁻⁵² of a layer's width, against cells 1/s ≥
1/16 wide) and rounded acceptance tests perturb each cell's probability by a few ulps more. So
for every output cell with |ẑ| ≤ Z_MAX the computed probability is within a factor e^{±η} of the
ideal, η = ETA below, and each coordinate that neighbours can move adds at most 2η to the
privacy loss: a release of d coordinates costs ε + 2·d·η, plus the event that some |ẑ| > Z_MAX
(probability d·P(|Z| > 12) ≈ d·3.6e-33 per release), which the accountant charges in δ
(`release_slack`). At GPT-2 small (d = 1.24e8) that is 4.6e-5 in ε per step.
"""

from __future__ import annotations

import math

import torch

from .accountant import ReleaseSlack

GRID_NOISE_STD = (8.0, 16.0)  # s = std/γ, in grid units
Z_MAX = 12.0  # |z| the per-cell bound covers; beyond it is the charged bad event
# Rounding budget per cell, in units of 2⁻⁵²: 4 ulps of the largest value touched
# (s·Z_MAX + 2 grid units: round(f + s·ẑ) and the product s·ẑ, each cell edge both ways), plus 64
# for the sampler's own discreteness and rounded acceptance tests.
ETA = 2.0**-52 * (4 * (GRID_NOISE_STD[1] * Z_MAX + 2) + 64)
EXACT_INTEGERS = 2.0**52  # |S/γ| below this: k, f and m are exact in float64


def grid_step(std: float) -> float:
    """The power of two γ with std/γ in [8, 16)."""
    if not std > 0:
        raise ValueError(f"grid step of a noise std must be > 0, got {std}")
    _, exponent = math.frexp(std)  # std = mantissa·2^exponent, mantissa in [0.5, 1)
    return math.ldexp(1.0, exponent - 4)


def release_on_grid(total: torch.Tensor, std: float, z: torch.Tensor) -> torch.Tensor:
    """round(total/γ + (std/γ)·z)·γ, computed in place in `total` (float64, any device; z is consumed)."""
    gamma = grid_step(std)
    s = std / gamma  # exact: γ is a power of two
    total.div_(gamma)  # exact, the same scaling
    peak = float(total.abs().max()) if total.numel() else 0.0
    if math.isfinite(peak) and peak >= EXACT_INTEGERS:  # a non-finite sum passes through, for the caller to refuse
        raise OverflowError(f"a clipped sum of {peak * gamma:g} is too large for the grid of step {gamma:g}")
    k = torch.floor(total)
    total.sub_(k)  # f, in [0, 1): exact
    total.add_(z.to(device=total.device, dtype=torch.float64).mul_(s)).round_()
    return total.add_(k).mul_(gamma)


def release_slack(coordinates: int) -> ReleaseSlack:
    """What one release of `coordinates` grid-noised values costs beyond the ideal Gaussian."""
    return ReleaseSlack(epsilon=2 * coordinates * ETA, bad_event=coordinates * math.erfc(Z_MAX / math.sqrt(2)))
