"""The mechanism's randomness — which examples join a lot, and the Gaussian noise — kept secret.

Whoever can regenerate these draws can undo the mechanism: re-derive every lot, subtract the
noise from a released gradient and read off the exact clipped sum. So they never come from the
published `seed`. By default each run draws its own secret from OS entropy; an explicit integer
(`privacy.mechanism_seed`) makes lots and noise reproducible for tests and paired studies, and
the guarantee then assumes that integer stays secret. In secure mode nothing is seeded at all:
lots and noise come straight from the OS CSPRNG, so even a leaked seed or generator state
reveals nothing.
"""

from __future__ import annotations

import math
import secrets

import numpy as np
import torch

OS_ENTROPY = "os entropy"
USER_SEED = "user seed (the guarantee assumes it stays secret)"
SECURE = "os csprng (secure mode: every draw from the OS, nothing seeded)"


class MechanismRandomness:
    """The lot sampler's and the noise's generators, seeded from a secret."""

    def __init__(self, mechanism_seed: int | None, device: torch.device | str = "cpu", secure: bool = False):
        self.secure = secure
        self.source = SECURE if secure else (OS_ENTROPY if mechanism_seed is None else USER_SEED)
        self.sampler = torch.Generator()
        self.noise = torch.Generator(device=device)
        self._seed(secrets.randbits(64) if mechanism_seed is None else int(mechanism_seed))

    def _seed(self, secret: int) -> None:
        # Two independent streams from one secret: neither generator's state reveals the other's.
        sampler_seed, noise_seed = np.random.SeedSequence(secret).generate_state(2, dtype=np.uint64)
        self.sampler.manual_seed(int(sampler_seed))
        self.noise.manual_seed(int(noise_seed))

    def reseed_from_os_entropy(self) -> None:
        """Fresh, never-used draws from here on (after a replay that did not reproduce its output)."""
        self._seed(secrets.randbits(64))
        if not self.secure:
            self.source = OS_ENTROPY + " (reseeded on resume)"

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.get_state(), "noise": self.noise.get_state(), "source": self.source}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.set_state(state["sampler"])
        self.noise.set_state(state["noise"])
        self.source = state["source"]


def secure_uniform(n: int) -> np.ndarray:
    """n uniforms in (0, 1) — never exactly 0 or 1 — from 53 random bits each of the OS CSPRNG."""
    bits = np.frombuffer(secrets.token_bytes(8 * n), dtype=np.uint64)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def secure_standard_normal(shape, device, dtype) -> torch.Tensor:
    """N(0, 1) by Box–Muller on CSPRNG uniforms: no seed exists to recover or replay."""
    n = math.prod(shape)
    u = secure_uniform(2 * ((n + 1) // 2)).reshape(2, -1)
    radius = np.sqrt(-2.0 * np.log(u[0]))
    angle = 2.0 * np.pi * u[1]
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
    return torch.from_numpy(z).to(device=device, dtype=dtype).reshape(shape)
