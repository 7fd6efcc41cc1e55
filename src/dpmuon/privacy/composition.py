"""Composing the charged releases of several runs on one private dataset (the study's maths).

A run's charged releases are a (σ, q, count) history, as in PrivacyAccountant.history; releasing
several runs composes their histories. The study (dpmuon/eval/study.py) reads them from the run
folders and reports what releasing them all costs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .accountant import PrivacyAccountant, ReleaseSlack

ACCOUNTANT = "prv"

History = list[tuple[float, float, int]]  # (σ, q, releases), as in PrivacyAccountant.history


@dataclass(frozen=True)
class RunRecord:
    """One run's charged releases and the training set they came from."""

    path: Path
    dataset: str
    dataset_size: int | None
    fingerprint: str | None  # of the examples used; None: not recorded
    private: bool
    delta: float | None  # None: non-private runs record none
    history: tuple[tuple[float, float, int], ...]  # charged releases
    uncharged: int  # replays identical to an earlier release: free
    source: str  # FROM_LEDGER or RECONSTRUCTED
    optimizer: str | None = None
    user_seeded: bool = False  # lots and noise from a user's mechanism seed: maybe shared with other runs
    secret_randomness: bool = True  # False: lots and noise followed from a published seed
    published_seed: bool = False  # its mechanism seed was published (mechanism_seeds.json, or its summary says so)
    slack: ReleaseSlack = ReleaseSlack()  # per charged release, beyond the ideal mechanism (none before the grid release)

    @property
    def charged(self) -> int:
        return sum(n for _, _, n in self.history)

    @property
    def guaranteed(self) -> bool:
        """Whether any finite ε covers this run: noise, drawn from randomness nobody else knows."""
        return self.private and self.secret_randomness

    def describe(self) -> dict[str, Any]:
        return {
            "run": str(self.path),
            "optimizer": self.optimizer,
            "private": self.private,
            "secret_randomness": self.secret_randomness if self.private else None,
            "ledger": self.source,
            "dataset_size": self.dataset_size,
            "data_fingerprint": self.fingerprint,
            "charged_releases": self.charged,
            "uncharged_releases": self.uncharged,
        }


def merged_history(runs: Iterable[RunRecord]) -> History:
    """All charged releases, identical (σ, q) merged into one entry: composition is order-free,
    and PRV's cost grows with the number of distinct entries, not of releases."""
    counts: dict[tuple[float, float], int] = {}
    for run in runs:
        for sigma, q, n in run.history:
            counts[(sigma, q)] = counts.get((sigma, q), 0) + n
    return [(sigma, q, n) for (sigma, q), n in sorted(counts.items())]


def composed_epsilon(runs: Iterable[RunRecord], delta: float) -> float:
    """ε at δ of releasing every run: the least of PRV over the merged charged history and, where
    releases carry bad events, the sum of each run's own ε at δ/k; inf if any run has no
    guarantee (no noise, or noise anyone could regenerate).

    Why the sum: a bad event (a truncated constant-time lot) of probability β costs (1 + e^ε)·β of
    δ at the ε it is charged at. Each run sized its lot bound so that this fits its own ε; charged
    at the composed ε of every run, an ε = 1 run's β costs e^(ε_total − 1) times what it planned,
    and no share of δ may hold it. Basic composition charges each run's bad events at its own ε.
    """
    runs = list(runs)
    if not all(run.guaranteed for run in runs):
        return math.inf
    prv = _prv_epsilon(runs, delta)
    if len(runs) < 2 or not any(run.slack.bad_event for run in runs):
        return prv
    return min(prv, sum(_prv_epsilon([run], delta / len(runs)) for run in runs))


def _prv_epsilon(runs: list[RunRecord], delta: float) -> float:
    history = merged_history(runs)
    releases = sum(n for _, _, n in history)
    # Each run's releases bring their own slack; spread over all releases, the totals stay the same.
    slack = ReleaseSlack(*(sum(getattr(r.slack, f) * r.charged for r in runs) / max(releases, 1) for f in ("epsilon", "bad_event")))
    accountant = PrivacyAccountant(delta, ACCOUNTANT, slack)
    accountant.history = history
    return accountant.epsilon()
