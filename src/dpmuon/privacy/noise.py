"""Gaussian noise for the joint release, calibrated to the joint sensitivity Δ.

`uniform`: every coordinate of every block gets std σ·Δ. `proportional`: block W gets std
σ·sqrt(K)·C_W. Whitening each block by its std turns the release into one Gaussian mechanism
with sensitivity sqrt(Σ_W C_W²/std_W²), which is 1/σ in both cases: the effective noise
multiplier is σ, and the accountant sees exactly one subsampled Gaussian per step.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .blocks import BlockPartition
from .grid import release_on_grid
from .randomness import CHUNK, KEY_BITS, SecretStream, secure_standard_normal

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


class GaussianNoise:
    """Source of N(0, 1) draws in float64: a secret stream (privacy/randomness.py; by default a
    fresh one keyed from OS entropy), or the OS CSPRNG in secure mode. One call is one draw of the
    stream: CHUNK-sized pieces from their own generators, filled by parallel threads (numpy and
    torch release the GIL), so the result does not depend on the number of threads."""

    def __init__(self, stream: SecretStream | None = None, secure: bool = False, threads: int | None = None):
        self.secure = secure
        self.stream = stream if stream is not None else SecretStream(secrets.randbits(KEY_BITS))
        self.threads = threads or torch.get_num_threads()

    def standard_normal(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.float64)
        self._chunks(n, _store, out)
        return out

    def grid_release(self, total: torch.Tensor, std: float) -> torch.Tensor:
        """`release_on_grid(total, std, z)` with this source's next draw z, in place in `total`.

        On the CPU each chunk is noised where it is drawn, while it is in cache; on an accelerator
        the draw crosses over once and the grid arithmetic runs there."""
        if total.device.type != "cpu":
            z = torch.from_numpy(self.standard_normal(total.numel())).view(total.shape)
            return release_on_grid(total, std, z)
        flat = total.view(-1)
        self._chunks(total.numel(), lambda piece, z: release_on_grid(piece, std, torch.from_numpy(z)), flat)
        return total

    def _chunks(self, n: int, consume: Callable, target) -> None:
        """consume(target[chunk], z_chunk) for every chunk of one draw of n normals."""
        count = max(1, -(-n // CHUNK))
        sources = None if self.secure else self.stream.normal_sources(count)

        def one(chunk: int) -> None:
            piece = target[chunk * CHUNK : (chunk + 1) * CHUNK]
            z = secure_standard_normal(len(piece)) if sources is None else sources[chunk](len(piece))
            consume(piece, z)

        if count == 1 or self.threads == 1:
            for chunk in range(count):
                one(chunk)
        else:
            with ThreadPoolExecutor(min(self.threads, count)) as pool:
                list(pool.map(one, range(count)))


def _store(piece: np.ndarray, z: np.ndarray) -> None:
    piece[:] = z
