"""Constant-time lots bucketed by width: the confidence bounds from the released length histogram
hold as often as claimed, a Poisson lot misses the buckets no more often than the charged p, the
greedy placement fits every lot that can fit, DDP's per-rank shares fit whenever the lot does,
and the buckets cut the padded tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpmuon.privacy.lot_bound import (
    ROWS_PART,
    bucketed_lot_bound,
    count_bounds,
    fit_lot,
    length_histogram,
    lot_bound,
    width_buckets,
)
from dpmuon.privacy.noise import GaussianNoise
from dpmuon.privacy.randomness import SecretStream
from dpmuon.training.batching import rank_share

MAX_LENGTH = 100


def e2e_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Lengths shaped like E2E's (mean ≈ 53, 20 … 100 GPT-2 tokens)."""
    return np.clip(np.random.default_rng(seed).normal(53, 13, n).round(), 20, MAX_LENGTH).astype(int)


def longer_than(lengths: np.ndarray) -> np.ndarray:
    return np.array([(lengths > w).sum() for w in range(MAX_LENGTH + 1)])


def test_the_count_bounds_hold_together_at_least_as_often_as_claimed():
    """With a failure of 5% allowed, the bounds from 400 grid releases (σ = 20) all hold in
    ≥ 95% of them — and they are not vacuous: far below N where few examples are long."""
    lengths = e2e_like_lengths(5000)
    counts, truth = length_histogram(lengths, MAX_LENGTH), longer_than(lengths)
    failures, tightest = 0, []
    for trial in range(400):
        released = GaussianNoise(SecretStream(trial + 1, domain=1), threads=1).grid_release(torch.from_numpy(counts.copy()), 20.0).numpy()
        bounds = np.array(count_bounds(released, 20.0, len(lengths), math.log(0.05)))
        failures += bool((bounds < truth).any())
        tightest.append(bounds[80] - truth[80])
    assert failures <= 0.05 * 400
    assert 0 < np.median(tightest) < 1000 and bounds[0] == len(lengths) and bounds[-1] == 0
    assert all(a >= b for a, b in zip(bounds, bounds[1:]))


def test_a_noiseless_histogram_bounds_the_counts_to_one_example():
    lengths = e2e_like_lengths(300)
    slack = np.array(count_bounds(length_histogram(lengths, MAX_LENGTH), 1e-12, len(lengths), math.log(1e-9))) - longer_than(lengths)
    assert slack.min() == 0 and slack.max() <= 1  # the rounding up of a margin of ~1e-11


def test_the_bounds_hold_past_float_range():
    """At ε = 1024 the failure allowed is ~e^-1050, where the normal quantile's probability
    underflows: the bounds are still finite, and still bounds."""
    lengths = e2e_like_lengths(500)
    bounds = np.array(count_bounds(length_histogram(lengths, MAX_LENGTH), 20.0, len(lengths), -1100.0))
    assert (bounds >= longer_than(lengths)).all() and bounds[0] == len(lengths)
    buckets, p = bucketed_lot_bound(length_histogram(lengths, MAX_LENGTH), 20.0, len(lengths), 0.05, 100, 1024.0, 1e-5, 8)
    assert sum(rows for _, rows in buckets) <= len(lengths) + 1 and 0 <= p < 1e-300


def placeable(lengths, buckets) -> bool:
    """Whether the lot fits: for each width, no more examples longer than the next narrower one
    than rows at least this wide, and no more examples than rows."""
    slots, widths = np.cumsum([rows for _, rows in buckets]), [w for w, _ in buckets]
    lengths = np.asarray(lengths)
    if len(lengths) > slots[-1] or (lengths > widths[0]).any():
        return False
    return all((lengths > narrower).sum() <= slots[k] for k, narrower in enumerate(widths[1:]))


def test_the_greedy_placement_fits_every_lot_that_fits_and_only_into_wide_enough_rows():
    rng = np.random.default_rng(1)
    buckets = ((100, 3), (64, 4), (40, 5))
    fits = misses = 0
    for _ in range(2000):
        lengths = rng.integers(1, 101, rng.integers(0, 14)).tolist()
        placed, dropped = fit_lot(lengths, buckets)
        assert sorted([*dropped, *(i for members in placed for i in members)]) == list(range(len(lengths)))
        for (width, rows), members in zip(buckets, placed):
            assert len(members) <= rows and all(lengths[i] <= width for i in members)
        assert (not dropped) == placeable(lengths, buckets)
        fits, misses = fits + (not dropped), misses + bool(dropped)
    assert fits > 200 and misses > 200  # both cases were exercised


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_share_fits_whenever_the_lot_fits(world):
    """Dealt out longest first, the ranks' shares fit their buckets (same shapes on every rank,
    ⌈B_max / world⌉ rows each) whenever the whole lot fits the buckets."""
    rng = np.random.default_rng(world)
    buckets = ((100, 7), (72, 9), (56, 11), (40, 6))
    share = rank_share(buckets, world)
    assert sum(rows for _, rows in share) == -(-sum(rows for _, rows in buckets) // world)
    checked = 0
    for _ in range(1000):
        lengths = sorted(rng.integers(20, 101, rng.integers(0, 34)).tolist(), reverse=True)
        if fit_lot(lengths, buckets)[1]:
            continue
        checked += 1
        for rank in range(world):
            assert not fit_lot(lengths[rank::world], share)[1]
    assert checked > 300


def test_poisson_lots_miss_the_buckets_no_more_often_than_charged():
    """Allowances large enough to see misses (e^-3 rows, e^-3 widths): sampled lots of the data
    set miss the buckets at most as often as the p returned (plus the sampling error)."""
    lengths = e2e_like_lengths(4000, seed=2)
    q = 64 / len(lengths)
    bounds = count_bounds(length_histogram(lengths, MAX_LENGTH), 1e-12, len(lengths), math.log(1e-9))
    buckets, p = width_buckets(bounds, q, -3.0, -3.0, 4)
    assert len(buckets) == 4 and 0.01 < p < 0.2
    rng = np.random.default_rng(3)
    lots = 4000
    missed = sum(bool(fit_lot(lengths[rng.random(len(lengths)) < q].tolist(), buckets)[1]) for _ in range(lots))
    assert missed / lots <= p + 3 * math.sqrt(p * (1 - p) / lots)


def test_buckets_cut_the_padded_tokens_and_keep_b_max():
    """E2E-like lengths, lot 256, 1000 steps at ε = 8: eight widths pad to ≤ 0.7× the tokens of one
    width, with the rows of B_max at the rows' share of δ; one width is exactly lot_bound's."""
    lengths = e2e_like_lengths(42000, seed=4)
    released = GaussianNoise(SecretStream(7, domain=1), threads=1).grid_release(torch.from_numpy(length_histogram(lengths, MAX_LENGTH)), 20.0).numpy()
    q, args = 256 / len(lengths), (1000, 8.0, 8e-6)
    one, p_one = bucketed_lot_bound(released, 20.0, len(lengths), q, *args, 1)
    eight, p_eight = bucketed_lot_bound(released, 20.0, len(lengths), q, *args, 8)
    b_max = lot_bound(len(lengths), q, *args, part=ROWS_PART)[0]
    assert one == ((MAX_LENGTH, b_max),) and sum(rows for _, rows in eight) == b_max
    tokens = lambda buckets: sum(w * r for w, r in buckets)  # noqa: E731
    assert tokens(eight) <= 0.7 * tokens(one) and len(eight) == 8
    assert [w for w, _ in eight] == sorted({w for w, _ in eight}, reverse=True) and eight[0][0] == MAX_LENGTH
    assert max(p_one, p_eight) <= math.exp(math.log(5e-4 * 8e-6) - math.log1p(math.exp(8.0)) - math.log(1000))


def test_an_example_beyond_max_length_is_refused():
    with pytest.raises(ValueError, match="exceeds max_length=100"):
        length_histogram([5, 101], MAX_LENGTH)
