"""Momentum forms and the public noise bookkeeping of a momentum buffer.

Every form is linear in the released gradients: m_t = a·m_{t−1} + b·g̃_t, and the matrix handed
to Newton–Schulz is u_t = c_g·g̃_t + c_m·m_t. The Gaussian noise in each g̃_t is independent
across steps with a public per-entry std, so the per-entry noise variance of m_t and u_t follows
from the same recursion with squared coefficients — no data needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .choices import MOMENTUM_KINDS


@dataclass(frozen=True)
class MomentumRule:
    """m_t = decay·m_{t−1} + gain·g_t; u_t = grad_weight·g_t + buffer_weight·m_t."""

    decay: float
    gain: float
    grad_weight: float
    buffer_weight: float

    @classmethod
    def create(cls, beta: float, kind: str = "heavy_ball", nesterov: bool = False) -> MomentumRule:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"momentum beta must be in [0, 1), got {beta}")
        if kind == "heavy_ball":
            # Nesterov look-ahead for heavy ball: u = g + β m_t.
            return cls(beta, 1.0, 1.0 if nesterov else 0.0, beta if nesterov else 1.0)
        if kind == "ema":
            # torch.optim.Muon's form: m = lerp(m, g, 1−β); Nesterov u = lerp(g, m, β).
            return cls(beta, 1.0 - beta, 1.0 - beta if nesterov else 0.0, beta if nesterov else 1.0)
        raise ValueError(f"unknown momentum kind {kind!r}; expected one of {MOMENTUM_KINDS}")

    def buffer_variance(self, previous: float, grad_variance: float) -> float:
        """Per-entry noise variance of m_t given that of m_{t−1} and of g̃_t."""
        return self.decay**2 * previous + self.gain**2 * grad_variance

    def update_variance(self, previous: float, grad_variance: float) -> float:
        """Per-entry noise variance of u_t (g̃_t enters both directly and through m_t)."""
        direct = self.grad_weight + self.buffer_weight * self.gain
        return direct**2 * grad_variance + (self.buffer_weight * self.decay) ** 2 * previous


def advance(buffer: torch.Tensor, grad: torch.Tensor, rule: MomentumRule) -> torch.Tensor:
    """Advance `buffer` in place with one gradient; return u_t, the matrix to orthogonalize."""
    if rule.gain == 1.0:
        buffer.mul_(rule.decay).add_(grad)
    else:
        buffer.lerp_(grad, rule.gain)  # EMA: β·m + (1−β)·g
    if rule.grad_weight == 0.0:
        return buffer
    if rule.grad_weight == 1.0:
        return grad.add(buffer, alpha=rule.buffer_weight)
    return grad.lerp(buffer, rule.buffer_weight)  # EMA Nesterov: (1−β)·g + β·m
