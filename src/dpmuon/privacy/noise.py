"""Gaussian noise for the joint release, calibrated to the joint sensitivity Δ.

`uniform`: every coordinate of every block gets std σ·Δ. `proportional`: block W gets std
σ·sqrt(K)·C_W. Whitening each block by its std turns the release into one Gaussian mechanism
with sensitivity sqrt(Σ_W C_W²/std_W²), which is 1/σ in both cases: the effective noise
multiplier is σ, and the accountant sees exactly one subsampled Gaussian per step.
"""

from __future__ import annotations

import math

import torch

from .blocks import BlockPartition
from .randomness import secure_standard_normal

NOISE_ALLOCATIONS = ("uniform", "proportional")


def block_noise_stds(partition: BlockPartition, noise_multiplier: float, allocation: str = "uniform") -> list[float]:
    """Std of the noise added to each block's clipped sum (before dividing by the lot size)."""
    if noise_multiplier < 0:
        raise ValueError(f"noise multiplier must be >= 0, got {noise_multiplier}")
    if allocation == "uniform":
        return [noise_multiplier * partition.sensitivity] * len(partition)
    if allocation == "proportional":
        k = len(partition)
        return [noise_multiplier * math.sqrt(k) * b.threshold for b in partition.blocks]
    raise ValueError(f"unknown noise allocation {allocation!r}; valid: {', '.join(NOISE_ALLOCATIONS)}")


def effective_noise_multiplier(partition: BlockPartition, stds: list[float]) -> float:
    """σ_eff = 1 / sqrt(Σ_W C_W² / std_W²): the multiplier of the whitened joint mechanism."""
    if any(s == 0 for s in stds):
        return 0.0
    return 1.0 / math.sqrt(sum((b.threshold / s) ** 2 for b, s in zip(partition.blocks, stds)))


class GaussianNoise:
    """Source of N(0, 1) draws: a secretly seeded torch generator, or the OS CSPRNG in secure mode."""

    def __init__(self, generator: torch.Generator | None = None, secure: bool = False):
        self.secure = secure
        self.generator = generator

    def standard_normal(self, shape: torch.Size, device: torch.device, dtype=torch.float32) -> torch.Tensor:
        if not self.secure:
            return torch.randn(shape, generator=self.generator, device=device, dtype=dtype)
        return secure_standard_normal(shape, device, dtype)
