"""Newton–Schulz orthogonalization: the nonlinear map F at the heart of Muon.

F(M) approximates the polar factor U Vᵀ of M = U S Vᵀ by iterating an odd matrix polynomial
X ← c₀ X + c₁ (X Xᵀ) X + c₂ (X Xᵀ)² X + … on a normalized copy of M. Inputs may carry leading
batch dimensions; same-shape matrices are orthogonalized in one batched call.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

import torch

from .choices import NS_NORMALIZATIONS

# Tuned quintic of the reference Muon implementation: steepest slope at zero, converges to
# singular values in roughly [0.7, 1.2] rather than exactly 1.
QUINTIC_TUNED = (3.4445, -4.7750, 2.0315)

CoefficientSpec = str | Sequence[float]


def series_coefficients(kappa: int) -> tuple[float, ...]:
    """Coefficients of p_κ(λ) = Σ_{s≤κ} C(2s,s)/4^s (1−λ)^s in powers of λ.

    p_κ is the degree-κ Taylor polynomial of λ^{-1/2} at λ = 1, so X ← X p_κ(XᵀX) converges to
    the exact polar factor for singular values in (0, 1]. κ=1 gives the cubic (1.5, −0.5),
    κ=2 the quintic (1.875, −1.25, 0.375).
    """
    if kappa < 1:
        raise ValueError(f"series order must be >= 1, got {kappa}")
    coefficients = [0.0] * (kappa + 1)
    for s in range(kappa + 1):
        weight = comb(2 * s, s) / 4**s
        for j in range(s + 1):
            coefficients[j] += weight * comb(s, j) * (-1) ** j
    return tuple(coefficients)


def resolve_coefficients(spec: CoefficientSpec) -> tuple[float, ...]:
    """Turn `"quintic"`, `"series:K"` or an explicit tuple (c₀, c₁, …) into coefficients."""
    if isinstance(spec, str):
        if spec == "quintic":
            return QUINTIC_TUNED
        if spec.startswith("series:"):
            order = spec.split(":", 1)[1]
            if not order.isdigit():
                raise ValueError(f"expected 'series:K' with an integer K, got {spec!r}")
            return series_coefficients(int(order))
        raise ValueError(f"unknown Newton–Schulz coefficients {spec!r}; expected 'quintic', 'series:K' or an explicit tuple (a, b, c)")
    coefficients = tuple(float(c) for c in spec)
    if not coefficients:
        raise ValueError("Newton–Schulz coefficients must not be empty")
    return coefficients


def _addmm(bias: torch.Tensor, left: torch.Tensor, right: torch.Tensor, beta: float, alpha: float = 1.0):
    """beta·bias + alpha·left@right, batched over leading dimensions."""
    if left.ndim == 2:
        return torch.addmm(bias, left, right, beta=beta, alpha=alpha)
    lead = left.shape[:-2]
    out = torch.baddbmm(
        bias.reshape(-1, *bias.shape[-2:]),
        left.reshape(-1, *left.shape[-2:]),
        right.reshape(-1, *right.shape[-2:]),
        beta=beta,
        alpha=alpha,
    )
    return out.reshape(*lead, *out.shape[-2:])


def newton_schulz(
    M: torch.Tensor,
    steps: int = 5,
    coefficients: CoefficientSpec = "quintic",
    normalize: str = "frobenius",
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Orthogonalize M (shape [..., m, n]) with `steps` Newton–Schulz iterations.

    normalize: "frobenius" divides by ‖M‖_F (clamped at eps), as reference Muon does, so that
    every singular value is ≤ 1; "max1" divides by max(1, ‖M‖_F), which leaves small matrices
    unscaled. dtype: compute precision (e.g. torch.bfloat16 on GPU); the result is cast back.
    """
    if M.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {tuple(M.shape)}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    coeffs = resolve_coefficients(coefficients)
    X = M.to(dtype or M.dtype)
    # Iterate on the side with fewer rows: X Xᵀ is then the smaller Gram matrix.
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    norm = torch.linalg.matrix_norm(X, keepdim=True)
    if normalize == "frobenius":
        X = X / norm.clamp(min=eps)
    elif normalize == "max1":
        X = X / norm.clamp(min=1.0)
    else:
        raise ValueError(f"unknown normalization {normalize!r}; expected one of {NS_NORMALIZATIONS}")
    for _ in range(steps):
        if len(coeffs) == 1:
            X = coeffs[0] * X
            continue
        gram = X @ X.mT
        # Horner in the Gram matrix: poly = c₁ A + c₂ A² + … ; X ← c₀ X + poly·X.
        if len(coeffs) == 2:
            poly = coeffs[1] * gram
        else:
            poly = _addmm(gram, gram, gram, beta=coeffs[-2], alpha=coeffs[-1])
            for c in reversed(coeffs[1:-2]):
                poly = _addmm(gram, poly, gram, beta=c)
        X = _addmm(X, poly, X, beta=coeffs[0])
    if transposed:
        X = X.mT
    return X.to(M.dtype)
