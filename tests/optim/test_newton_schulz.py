"""Newton–Schulz: coefficient families, convergence to the polar factor, shapes, batching."""

from __future__ import annotations

import pytest
import torch

from dpmuon.optim.newton_schulz import QUINTIC_TUNED, newton_schulz, resolve_coefficients, series_coefficients


def polar_factor(M: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    return U @ Vh


def conditioned(m: int, n: int, low: float = 0.3, high: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    k = min(m, n)
    return (U[:, :k] * torch.linspace(low, high, k, dtype=torch.float64)) @ V[:k, :]


def test_series_coefficients_are_the_taylor_family():
    assert series_coefficients(1) == pytest.approx((1.5, -0.5))
    assert series_coefficients(2) == pytest.approx((1.875, -1.25, 0.375))
    # p_κ(1) = 1: the polar factor is a fixed point of every member.
    for k in range(1, 6):
        assert sum(series_coefficients(k)) == pytest.approx(1.0)


def test_coefficient_specs():
    assert resolve_coefficients("quintic") == QUINTIC_TUNED
    assert resolve_coefficients("series:3") == series_coefficients(3)
    assert resolve_coefficients((3.4445, -4.7750, 2.0315)) == QUINTIC_TUNED
    for bad in ("cubic", "series:x", ()):
        with pytest.raises(ValueError):
            resolve_coefficients(bad)


@pytest.mark.parametrize("shape", [(6, 6), (5, 12), (12, 5)], ids=["square", "wide", "tall"])
@pytest.mark.parametrize("kappa", [1, 2, 3])
def test_series_family_converges_to_polar_factor(shape, kappa):
    M = conditioned(*shape)
    target = polar_factor(M)
    errors = [float((newton_schulz(M, steps=s, coefficients=f"series:{kappa}") - target).norm()) for s in (1, 2, 3, 5, 40)]
    # Every extra step improves, until the error reaches round-off.
    assert all(b < a or b < 1e-12 for a, b in zip(errors, errors[1:]))
    assert errors[0] > 0.1 and errors[-1] < 1e-12


@pytest.mark.parametrize("shape", [(8, 8), (4, 16), (16, 4)], ids=["square", "wide", "tall"])
def test_tuned_quintic_lands_near_orthogonal(shape):
    M = conditioned(*shape, low=0.05, high=1.0)
    X = newton_schulz(M, steps=5)
    assert X.shape == M.shape
    sv = torch.linalg.svdvals(X)
    assert float(sv.min()) > 0.6 and float(sv.max()) < 1.25  # the tuned map is only approximate
    # Same singular vectors as the exact polar factor: X Pᵀ (or Pᵀ X) is symmetric positive.
    P = polar_factor(M)
    S = P.mT @ X if shape[0] >= shape[1] else X @ P.mT
    assert torch.allclose(S, S.mT, atol=1e-6)
    assert float(torch.linalg.eigvalsh(S).min()) > 0.5


def test_batched_call_equals_individual_calls():
    mats = torch.stack([conditioned(6, 10, seed=s) for s in range(4)])
    batched = newton_schulz(mats, steps=5)
    for i in range(4):
        assert torch.allclose(batched[i], newton_schulz(mats[i], steps=5), atol=1e-12)
    nested = newton_schulz(mats.reshape(2, 2, 6, 10), steps=5).reshape(4, 6, 10)
    assert torch.allclose(nested, batched, atol=1e-12)


def test_normalizations():
    M = conditioned(4, 6) * 0.1  # ‖M‖_F < 1
    assert torch.equal(newton_schulz(M, steps=0, normalize="max1"), M)  # small matrices unscaled
    assert float(torch.linalg.matrix_norm(newton_schulz(M, steps=0))) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="normalization"):
        newton_schulz(M, normalize="spectral")


def test_transpose_equivariance_and_dtype():
    M = conditioned(5, 9).float()
    assert torch.allclose(newton_schulz(M.mT), newton_schulz(M).mT, atol=1e-6)
    low = newton_schulz(M, dtype=torch.bfloat16)
    assert low.dtype == torch.float32
    assert torch.allclose(low, newton_schulz(M), atol=0.05)
