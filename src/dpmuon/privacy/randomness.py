"""The mechanism's randomness — which examples join a lot, and the Gaussian noise — kept secret.

Whoever can regenerate these draws can undo the mechanism: re-derive every lot, subtract the
noise from a released gradient and read off the exact clipped sum. So they never come from the
published `seed`, and the secret is large enough that nobody can search for it: two 128-bit keys
(one for lots, one for noise) of Philox4x64-10 counter-based generators. (torch's CPU generator,
used before, keeps only 32 bits of its seed: a search over 2³² candidates, testable against the
published lot sizes, recovered every lot.)

Draw k of a stream is `Philox(key, counter=(0, chunk, k, 0))`: a function of the key and k alone,
so a stream's position is one integer (what a resume restores), and the chunks of one large draw
come from disjoint counter ranges that threads fill in parallel. By default each run draws its
keys from OS entropy; a user secret (`DPMUON_MECHANISM_SEED`) is hashed into them with a 256-bit
`SeedSequence` pool, so every bit of it counts. In secure mode nothing is keyed at all: lots and
noise come straight from the OS CSPRNG, so even a leaked key reveals nothing.
"""

from __future__ import annotations

import math
import secrets

import numpy as np

OS_ENTROPY = "os entropy"
USER_SEED = "user seed (the guarantee assumes it stays secret)"
SECURE = "os csprng (secure mode: every draw from the OS, nothing seeded)"
KEY_BITS = 128  # Philox4x64's key
CHUNK = 1 << 16  # elements per generator of a draw: fits in cache while it is noised, and shares out over threads


class SecretStream:
    """Independent draws from one 128-bit key; the stream's position is the number of draws made."""

    def __init__(self, key: int):
        if not 0 <= key < 1 << KEY_BITS:
            raise ValueError(f"a stream key has {KEY_BITS} bits, got {key.bit_length()}")
        self.key = key
        self.draws = 0

    def generators(self, chunks: int = 1) -> list[np.random.Generator]:
        """The generators of the next draw, one per chunk (disjoint counter ranges)."""
        draw, self.draws = self.draws, self.draws + 1
        key = np.array([self.key & (2**64 - 1), self.key >> 64], dtype=np.uint64)
        return [np.random.Generator(np.random.Philox(key=key, counter=[0, chunk, draw, 0])) for chunk in range(chunks)]

    def state_dict(self) -> dict:
        return {"key": f"{self.key:032x}", "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.key, self.draws = int(state["key"], 16), int(state["draws"])


class MechanismRandomness:
    """The lot sampler's and the noise's secret streams (or, in secure mode, the OS CSPRNG)."""

    def __init__(self, secret: int | None, secure: bool = False):
        self.secure = secure
        self.source = SECURE if secure else (OS_ENTROPY if secret is None else USER_SEED)
        self.sampler, self.noise = SecretStream(0), SecretStream(0)
        self._key(fresh_secret() if secret is None else int(secret))

    def _key(self, secret: int) -> None:
        # Two independent keys from one secret: neither stream reveals the other's.
        words = np.random.SeedSequence(secret, pool_size=8).generate_state(4, dtype=np.uint64)
        self.sampler.key = int(words[0]) | int(words[1]) << 64
        self.noise.key = int(words[2]) | int(words[3]) << 64

    def reseed_from_os_entropy(self) -> None:
        """Fresh, never-used draws from here on (after a replay that did not reproduce its output)."""
        self._key(fresh_secret())
        if not self.secure:
            self.source = OS_ENTROPY + " (reseeded on resume)"

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "noise": self.noise.state_dict(), "source": self.source}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.noise.load_state_dict(state["noise"])
        self.source = state["source"]


def fresh_secret() -> int:
    return secrets.randbits(2 * KEY_BITS)


def secure_uniform(n: int) -> np.ndarray:
    """n uniforms in (0, 1) — never exactly 0 or 1 — from 53 random bits each of the OS CSPRNG."""
    bits = np.frombuffer(secrets.token_bytes(8 * n), dtype=np.uint64)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def secure_standard_normal(n: int) -> np.ndarray:
    """n draws of N(0, 1) in float64 by Box–Muller on OS CSPRNG bits: no seed exists to recover.

    The radius' uniform takes 106 bits (53, then 53 more below them), so draws reach |z| ≈ 12.1,
    past what the release's analysis covers (privacy/grid.py: |z| ≤ 12); with 53 bits alone they
    would stop at 8.6, inside it.
    """
    pairs = (n + 1) // 2
    words = np.frombuffer(secrets.token_bytes(16 * pairs), dtype=np.uint64).reshape(2, pairs) >> np.uint64(11)
    radius_u = (words[0].astype(np.float64) + (words[1].astype(np.float64) + 0.5) * 2.0**-53) * 2.0**-53
    radius = np.sqrt(-2.0 * np.log(radius_u))
    angle = 2.0 * math.pi * secure_uniform(pairs)
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
