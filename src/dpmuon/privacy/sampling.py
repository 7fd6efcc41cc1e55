"""Lot sampling. Poisson (the default) is what the subsampled-Gaussian accountant assumes."""

from __future__ import annotations

import warnings

import numpy as np

from .randomness import SecretStream, secure_uniform
from .settings import SAMPLINGS


class PoissonLotSampler:
    """Each step, every example joins the lot independently with probability q.

    Lot k is a function of the secret stream's key and k (privacy/randomness.py), so the
    sampler's position is the stream's draw count: save it and the next lots replay. `secure=True`
    draws each example's coin from the OS CSPRNG instead: nothing to replay, nothing to leak. Lots
    may be empty; the step is still a valid, accounted (noise-only) release.

    `max_lot_size` (constant-time lots) truncates a larger lot to a uniformly random subset of
    that size, drawn from the same secret randomness; the accountant charges the probability
    that this happens (ReleaseSlack.bad_event).
    """

    def __init__(self, num_samples: int, sample_rate: float, stream: SecretStream, secure: bool = False, max_lot_size: int | None = None):
        if num_samples <= 0:
            raise ValueError(f"cannot sample lots from an empty dataset (N={num_samples})")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        if max_lot_size is not None and max_lot_size < 1:
            raise ValueError(f"max lot size must be >= 1, got {max_lot_size}")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.stream = stream
        self.secure = secure
        self.max_lot_size = max_lot_size

    def next_lot(self) -> list[int]:
        rng = None if self.secure else self.stream.generators()[0]
        coins = secure_uniform(self.num_samples) if rng is None else rng.random(self.num_samples)
        lot = np.flatnonzero(coins < self.sample_rate)
        if self.max_lot_size is not None and len(lot) > self.max_lot_size:  # the charged bad event
            order = np.argsort(secure_uniform(len(lot))) if rng is None else rng.permutation(len(lot))
            lot = np.sort(lot[order[: self.max_lot_size]])
        return lot.tolist()

    def state_dict(self) -> dict:
        return {"draws": self.stream.draws}

    def load_state_dict(self, state: dict) -> None:
        self.stream.draws = int(state["draws"])


class ShuffleLotSampler:
    """Fixed-size lots from a fresh permutation each epoch — NOT what the accountant assumes.

    Earlier E2E/DART code trained this way while accounting for Poisson sampling; it is kept
    only to reproduce such runs, and warns.
    """

    def __init__(self, num_samples: int, lot_size: int, stream: SecretStream):
        if not 0 < lot_size <= num_samples:
            raise ValueError(f"lot size must be in [1, N={num_samples}], got {lot_size}")
        warnings.warn(
            "privacy.sampling=shuffle: fixed-size shuffled lots do not match the Poisson-subsampled "
            "Gaussian accountant; the reported ε is not a valid guarantee for this run.",
            stacklevel=2,
        )
        self.num_samples = num_samples
        self.lot_size = lot_size
        self.stream = stream
        self._order: list[int] = []
        self._cursor = 0

    def next_lot(self) -> list[int]:
        if self._cursor + self.lot_size > len(self._order):
            (rng,) = self.stream.generators()
            self._order = rng.permutation(self.num_samples).tolist()
            self._cursor = 0
        lot = self._order[self._cursor : self._cursor + self.lot_size]
        self._cursor += self.lot_size
        return lot

    def state_dict(self) -> dict:
        return {"draws": self.stream.draws, "order": list(self._order), "cursor": self._cursor}

    def load_state_dict(self, state: dict) -> None:
        self.stream.draws = int(state["draws"])
        self._order = list(state["order"])
        self._cursor = int(state["cursor"])


def build_lot_sampler(kind: str, num_samples: int, expected_lot_size: int, stream: SecretStream, secure: bool = False, max_lot_size: int | None = None):
    if kind == "poisson":
        return PoissonLotSampler(num_samples, expected_lot_size / num_samples, stream, secure, max_lot_size)
    if secure:
        raise ValueError("privacy.secure_noise=true needs privacy.sampling=poisson (shuffled lots are seeded)")
    if kind == "shuffle":
        return ShuffleLotSampler(num_samples, expected_lot_size, stream)
    raise ValueError(f"unknown sampling {kind!r}; valid: {', '.join(SAMPLINGS)}")
