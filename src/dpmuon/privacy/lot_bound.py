"""The largest lot a constant-time run processes: B_max, and the chance a Poisson lot exceeds it.

Constant-time steps pad every lot to B_max rows, so the step's cost says nothing about how
many examples it saw. A Poisson lot larger than B_max is cut down to B_max (a uniformly random
subset); the mechanism then differs from the accounted subsampled Gaussian only on that bad
event, whose probability p per step is charged in δ as (1 + e^ε)·T·p over T steps
(truncated-Poisson DP-SGD). B_max is chosen so that this charge is at most δ/2000 — half the
share of δ the accountant sets aside for bad events (the grid noise's tail has the rest): negligible
next to δ, yet B_max stays near the expected lot: Nq + 8√(Nq) for E2E at ε = 8 (1280 rows
for lots of 1024), Nq + 20√(Nq) at ε = 128, and Nq + 55√(Nq) at ε = 1024, where e^ε makes any
truncation expensive.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import xlogy
from scipy.stats import binom

from .accountant import BAD_EVENT_SHARE

# The truncation's charge may use at most this fraction of δ: half the accountant's bad-event share.
DELTA_SHARE = BAD_EVENT_SHARE / 2


def lot_bound(dataset_size: int, sample_rate: float, steps: int, target_epsilon: float, delta: float) -> tuple[int, float]:
    """(B_max, p): the smallest B_max with (1 + e^ε)·T·P(Binomial(N + 1, q) > B_max) ≤ DELTA_SHARE·δ,
    and that per-step truncation probability p (an upper bound when it is below float range).

    N + 1, not N: the guarantee compares the data set with its neighbours under add/remove, and
    the larger one — N + 1 examples, sampled at the same q — has the larger lots, so the bad
    event must be bounded there (at N the charge came out a few percent low on small sets)."""
    if dataset_size < 1 or steps < 1:
        raise ValueError(f"lot_bound needs N >= 1 and steps >= 1, got N={dataset_size}, steps={steps}")
    if not 0 < sample_rate <= 1 or not delta > 0:
        raise ValueError(f"lot_bound needs 0 < q <= 1 and δ > 0, got q={sample_rate}, δ={delta}")
    # Everything in log space: at ε = 1024, e^ε overflows and the tail needed is ~e^-1050.
    allowed = math.log(DELTA_SHARE * delta) - np.logaddexp(0.0, target_epsilon) - math.log(steps)
    neighbour = dataset_size + 1
    low, high = math.floor(neighbour * sample_rate), neighbour  # high always fits: P(X > N + 1) = 0
    while low < high:
        middle = (low + high) // 2
        if log_tail(neighbour, sample_rate, middle) <= allowed:
            high = middle
        else:
            low = middle + 1
    return high, math.exp(log_tail(neighbour, sample_rate, high))


def log_tail(n: int, q: float, bound: int) -> float:
    """log P(Binomial(n, q) > bound), or an upper bound on it where scipy's value underflows."""
    if bound >= n:
        return -math.inf
    exact = float(binom.logsf(bound, n, q))
    if math.isfinite(exact):
        return exact
    # logsf reaches -inf near e^-745 (sf underflows before its log is taken). The Chernoff
    # bound P(X >= a) <= exp(-n·KL(a/n ‖ q)) for a > nq holds at any depth, and only an upper
    # bound is safe here: an underestimate would charge too little.
    a = (bound + 1) / n
    if a <= q:
        return 0.0
    return -n * (xlogy(a, a / q) + xlogy(1 - a, (1 - a) / (1 - q)))  # q < 1 here: at q = 1 logsf is 0
