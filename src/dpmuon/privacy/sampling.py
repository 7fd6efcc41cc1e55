"""Lot sampling. Poisson (the default) is what the subsampled-Gaussian accountant assumes."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from opacus.utils.uniform_sampler import UniformWithReplacementSampler

from .randomness import secure_uniform

SAMPLINGS = ("poisson", "shuffle")


class PoissonLotSampler:
    """Each step, every example joins the lot independently with probability q.

    Draws come from Opacus' UniformWithReplacementSampler driven by our own (secretly seeded)
    generator, so the sampler position is just the generator state: save it and the next lots
    replay. `secure=True` draws each example's coin from the OS CSPRNG instead: nothing to
    replay, nothing to leak. Lots may be empty; the step is still a valid, accounted
    (noise-only) release.
    """

    def __init__(self, num_samples: int, sample_rate: float, generator: torch.Generator, secure: bool = False):
        if num_samples <= 0:
            raise ValueError(f"cannot sample lots from an empty dataset (N={num_samples})")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.generator = generator
        self.secure = secure
        self._sampler = UniformWithReplacementSampler(
            num_samples=num_samples, sample_rate=sample_rate, generator=generator, steps=1
        )

    def next_lot(self) -> list[int]:
        if self.secure:
            return np.flatnonzero(secure_uniform(self.num_samples) < self.sample_rate).tolist()
        return next(iter(self._sampler))

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class ShuffleLotSampler:
    """Fixed-size lots from a fresh permutation each epoch — NOT what the accountant assumes.

    Earlier E2E/DART code trained this way while accounting for Poisson sampling; it is kept
    only to reproduce such runs, and warns.
    """

    def __init__(self, num_samples: int, lot_size: int, generator: torch.Generator):
        if not 0 < lot_size <= num_samples:
            raise ValueError(f"lot size must be in [1, N={num_samples}], got {lot_size}")
        warnings.warn(
            "privacy.sampling=shuffle: fixed-size shuffled lots do not match the Poisson-subsampled "
            "Gaussian accountant; the reported ε is not a valid guarantee for this run.",
            stacklevel=2,
        )
        self.num_samples = num_samples
        self.lot_size = lot_size
        self.generator = generator
        self._order: list[int] = []
        self._cursor = 0

    def next_lot(self) -> list[int]:
        if self._cursor + self.lot_size > len(self._order):
            self._order = torch.randperm(self.num_samples, generator=self.generator).tolist()
            self._cursor = 0
        lot = self._order[self._cursor : self._cursor + self.lot_size]
        self._cursor += self.lot_size
        return lot

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "order": list(self._order), "cursor": self._cursor}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self._order = list(state["order"])
        self._cursor = int(state["cursor"])


def build_lot_sampler(kind: str, num_samples: int, expected_lot_size: int, generator: torch.Generator, secure: bool = False):
    if kind == "poisson":
        return PoissonLotSampler(num_samples, expected_lot_size / num_samples, generator, secure)
    if secure:
        raise ValueError("privacy.secure_noise=true needs privacy.sampling=poisson (shuffled lots are seeded)")
    if kind == "shuffle":
        return ShuffleLotSampler(num_samples, expected_lot_size, generator)
    raise ValueError(f"unknown sampling {kind!r}; valid: {', '.join(SAMPLINGS)}")
