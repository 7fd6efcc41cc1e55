"""B_max of constant-time lots: the truncation's δ charge stays under DELTA_SHARE·δ (δ/2000), and B_max is the
smallest bound that achieves it — checked against an independent log-space sum of the pmf."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpmuon.privacy.lot_bound import DELTA_SHARE, log_tail, lot_bound


def exact_log_tail(n: int, q: float, bound: int) -> float:
    """log P(Binomial(n, q) > bound) by summing the pmf's logs (no underflow at any depth)."""
    if bound >= n:
        return -math.inf
    terms = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(q) + (n - k) * math.log1p(-q) for k in range(bound + 1, n + 1)]
    return float(np.logaddexp.reduce(terms))


def log_charge(n, q, steps, epsilon, bound):
    return np.logaddexp(0.0, epsilon) + math.log(steps) + exact_log_tail(n, q, bound)


# slack: rows above the smallest sufficient bound. At ε = 1024 the tail needed (~e^-1050) is
# past scipy's range and the Chernoff bound, a slight overestimate, decides instead.
@pytest.mark.parametrize(
    ("n", "lot", "steps", "epsilon", "delta", "slack"),
    [(42057, 1024, 411, 8.0, 8e-6, 0), (42057, 256, 100, 128.0, 8e-6, 0), (42057, 256, 100, 1024.0, 8e-6, 5), (200, 16, 6, 8.0, 1e-3, 0)],
)
def test_bound_is_the_smallest_whose_charge_is_within_a_thousandth_of_delta(n, lot, steps, epsilon, delta, slack):
    """The charge is that of the add/remove neighbour with N + 1 examples (its lots are the larger)."""
    q = lot / n
    bound, p = lot_bound(n, q, steps, epsilon, delta)
    allowed = math.log(DELTA_SHARE * delta)
    assert log_charge(n + 1, q, steps, epsilon, bound) <= allowed
    assert log_charge(n + 1, q, steps, epsilon, bound - 1 - slack) > allowed  # fewer rows would not do
    assert p == pytest.approx(math.exp(exact_log_tail(n + 1, q, bound)), rel=1e-6, abs=1e-300)
    assert lot < bound < n


@pytest.mark.parametrize(("n", "lot"), [(157, 16), (185, 8), (185, 32)])
def test_the_bound_covers_the_neighbour_with_one_example_more(n, lot):
    """Sets where the smallest bound sufficient at N is not sufficient at N + 1: the neighbour's
    lots, at the same q, would be truncated more often than the charge says."""
    q, steps, epsilon, delta = lot / n, 6, 8.0, 1e-3
    bound, p = lot_bound(n, q, steps, epsilon, delta)
    assert log_charge(n + 1, q, steps, epsilon, bound) <= math.log(DELTA_SHARE * delta)
    assert p >= math.exp(exact_log_tail(n + 1, q, bound)) * (1 - 1e-9)


def test_tail_matches_sampled_lots_and_never_underestimates_past_float_range():
    rng = np.random.default_rng(0)
    sizes = rng.binomial(200, 0.08, size=400_000)
    for bound in (16, 20, 24):
        sampled = float(np.mean(sizes > bound))
        assert math.exp(log_tail(200, 0.08, bound)) == pytest.approx(sampled, rel=0.05)
    # Deep in the tail scipy's logsf is -inf; the bound used instead must stay at or above the truth.
    for bound in (3000, 5000, 20000):
        exact = exact_log_tail(42057, 256 / 42057, bound)
        assert exact < -745 and exact <= log_tail(42057, 256 / 42057, bound) < 0


def test_a_lot_of_everything_needs_no_truncation():
    assert lot_bound(100, 1.0, 5, 8.0, 1e-3) == (101, 0.0)  # the neighbour with 101 examples: every one in its lot
    with pytest.raises(ValueError, match="q"):
        lot_bound(100, 0.0, 5, 8.0, 1e-3)
