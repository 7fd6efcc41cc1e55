"""DP-MuonBC removes the O(s²) smoothing bias of Newton–Schulz under Gaussian noise.

Monte Carlo with antithetic noise pairs (S, −S), which cancel the odd orders exactly, and the
same noise draws for the plain and corrected maps, so the comparison is not drowned by
sampling error. F is Newton–Schulz with the series family (a smooth map converging to the
polar factor); the tuned quintic's small-noise regime is narrower (see scripts/bench_bias.py).
"""

from __future__ import annotations

import pytest
import torch

from dpmuon.optim import bias_corrected_newton_schulz
from dpmuon.optim.newton_schulz import newton_schulz

NS = dict(steps=8, coefficients="series:2")


def signal(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    k = min(m, n)
    return (U[:, :k] * torch.linspace(1.0, 2.0, k, dtype=torch.float64)) @ V[:k, :]


def biases(M0: torch.Tensor, s: float, samples: int, seed: int, ns: dict = NS) -> tuple[float, float]:
    """(‖E F(M₀+S) − F(M₀)‖, ‖E F_BC(M₀+S) − F(M₀)‖) by antithetic Monte Carlo."""
    g = torch.Generator().manual_seed(seed)
    S = s * torch.randn(samples, *M0.shape, dtype=M0.dtype, generator=g)
    noisy = torch.cat([M0 + S, M0 - S])
    target = newton_schulz(M0, **ns)
    plain = newton_schulz(noisy, **ns).mean(0)
    corrected = bias_corrected_newton_schulz(noisy, s, generator=torch.Generator().manual_seed(seed + 1), **ns).mean(0)
    return float((plain - target).norm()), float((corrected - target).norm())


@pytest.mark.parametrize("shape", [(4, 8), (8, 4), (6, 6)], ids=["wide", "tall", "square"])
def test_corrected_bias_is_much_smaller_and_shrinks_like_s4(shape):
    M0 = signal(*shape, seed=sum(shape))
    # Noise std relative to singular values in [1, 2]. The Monte Carlo error of the corrected
    # mean is O(s²/√N), so the s⁴ residual is only resolvable down to s ≈ 0.1 at this N.
    plain_hi, bc_hi = biases(M0, 0.2, 40_000, seed=1)
    plain_lo, bc_lo = biases(M0, 0.1, 40_000, seed=2)
    assert plain_hi / bc_hi >= 4 and plain_lo / bc_lo >= 4
    # Halving s divides the plain bias by ~4 (s²) and the corrected one by ~16 (s⁴); higher
    # orders only steepen the corrected curve at the larger s.
    assert plain_hi / plain_lo == pytest.approx(4.0, rel=0.15)
    assert bc_hi / bc_lo > 8.0


def test_correction_works_with_the_classical_series_and_max1_prescaling():
    """The variant of a third-party reading of the paper: series:2 run to convergence on a matrix
    that max(1, ‖M‖_F) leaves unscaled (‖M₀‖_F ≈ 0.3)."""
    ns = dict(steps=14, coefficients="series:2", normalize="max1")
    plain, corrected = biases(0.1 * signal(4, 8, seed=3), 0.02, 20_000, seed=4, ns=ns)
    assert plain / corrected >= 3


def test_probe_scale_and_count_are_honoured():
    M0 = signal(4, 8, seed=0)
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    one = bias_corrected_newton_schulz(M0, 0.1, generator=g(), **NS)
    # ρ = s: F_BC = 2F(M) − A, with A from antithetic probes at scale s.
    U = torch.randn((1, *M0.shape), dtype=M0.dtype, generator=g())[0]
    A = 0.5 * (newton_schulz(M0 + 0.1 * U, **NS) + newton_schulz(M0 - 0.1 * U, **NS))
    assert torch.allclose(one, 2 * newton_schulz(M0, **NS) - A, atol=1e-12)
    # ρ = 2s extrapolates with weight (s/ρ)² = 1/4.
    U2 = torch.randn((1, *M0.shape), dtype=M0.dtype, generator=g())[0]
    A2 = 0.5 * (newton_schulz(M0 + 0.2 * U2, **NS) + newton_schulz(M0 - 0.2 * U2, **NS))
    F = newton_schulz(M0, **NS)
    assert torch.allclose(bias_corrected_newton_schulz(M0, 0.1, probe_scale=2.0, generator=g(), **NS), F - 0.25 * (A2 - F), atol=1e-12)
    assert torch.equal(bias_corrected_newton_schulz(M0, 0.1, num_probes=0, **NS), F)
    assert torch.equal(bias_corrected_newton_schulz(M0, 0.0, **NS), F)


def test_match_norm_keeps_the_correction_direction_at_the_plain_length():
    """At low SNR F_BC is longer than F; match_norm rescales it to ‖F(M)‖_F per matrix, and only that."""
    g = torch.Generator().manual_seed(3)
    M = signal(6, 10, seed=4) * 0.05 + torch.randn(3, 6, 10, dtype=torch.float64, generator=g)  # SNR ≪ 1
    s = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64).view(-1, 1, 1)
    longer = bias_corrected_newton_schulz(M, s, generator=torch.Generator().manual_seed(5), **NS)
    matched = bias_corrected_newton_schulz(M, s, generator=torch.Generator().manual_seed(5), match_norm=True, **NS)
    plain = newton_schulz(M, **NS)
    norm = torch.linalg.matrix_norm
    assert torch.all(norm(longer) > 1.2 * norm(plain))  # the step-length confound
    assert torch.allclose(norm(matched), norm(plain))
    cosine = (matched * longer).sum((-2, -1)) / (norm(matched) * norm(longer))
    assert torch.allclose(cosine, torch.ones(3, dtype=torch.float64))
