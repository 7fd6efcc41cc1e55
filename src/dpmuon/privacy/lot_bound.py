"""The shape of a constant-time step: B_max rows in buckets of fixed widths, and the chance a
Poisson lot does not fit them.

Constant-time steps pad every lot to B_max rows, so the step's cost says nothing about how
many examples it saw. A Poisson lot larger than B_max is cut down to B_max (a uniformly random
subset); the mechanism then differs from the accounted subsampled Gaussian only on that bad
event, whose probability p per step is charged in δ as (1 + e^ε)·T·p over T steps
(truncated-Poisson DP-SGD). B_max is chosen so that this charge is at most δ/2000 — half the
share of δ the accountant sets aside for bad events (the grid noise's tail has the rest): negligible
next to δ, yet B_max stays near the expected lot: Nq + 8√(Nq) for E2E at ε = 8 (1280 rows
for lots of 1024), Nq + 20√(Nq) at ε = 128, and Nq + 55√(Nq) at ε = 1024, where e^ε makes any
truncation expensive.

Width buckets. Padding every row to `max_length` costs the ratio of the longest example to the
mean length again (1.9× on E2E). Narrower fixed widths fit a lot only if it holds few enough long
examples, and how many it holds depends on the training set's lengths — which are private (one
record moves the histogram by one count). So the driver first releases the length histogram
once, with the Gaussian mechanism (sensitivity 1 under add/remove, noise multiplier
`privacy.length_noise_multiplier`, on the grid like a step: privacy/grid.py), charged in the
ledger and composed by the accountant with the steps; everything below is post-processing of
that release. `count_bounds` turns it into upper bounds U(w) on the number of examples longer
than w, all holding together except with probability β (the noise and the grid's rounding bound
explicitly); `width_buckets` picks widths t₁ < … < t_K = max_length and rows R(t) for each, so
that a Poisson lot of the neighbour (U(w) + 1 examples longer than w, sampled at q) has more than
R(t_k) examples longer than t_k with probability ≤ p_k. A lot whose examples, longest first,
do not fit the slots, widest first, loses the examples that do not (`fit_lot`): the bad event,
charged like truncation, (1 + e^ε)·(β + T·(p_rows + Σ p_k)). The share: rows half, widths a
quarter, β a quarter of what B_max alone gets without buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from scipy.special import xlogy
from scipy.stats import binom, norm

from .accountant import BAD_EVENT_SHARE
from .grid import grid_step

# The truncation's charge may use at most this fraction of δ: half the accountant's bad-event share.
DELTA_SHARE = BAD_EVENT_SHARE / 2


# Candidate widths of a bucket below max_length: multiples of 8 (the kernels' friendly sizes).
WIDTH_STEP = 8
# Of the bad-event share B_max alone would get: rows, the width thresholds and the histogram's
# confidence bounds (β) when the lot is bucketed by width.
ROWS_PART, WIDTHS_PART, COUNTS_PART = 0.5, 0.25, 0.25

Buckets = tuple[tuple[int, int], ...]  # (width, rows), widest first


def allowed_log_tail(steps: int, target_epsilon: float, delta: float) -> float:
    """log of the bad-event probability one step may have: (1 + e^ε)·T·p ≤ DELTA_SHARE·δ."""
    # Log space: at ε = 1024, e^ε overflows and the tail needed is ~e^-1050.
    return math.log(DELTA_SHARE * delta) - float(np.logaddexp(0.0, target_epsilon)) - math.log(steps)


def lot_bound(dataset_size: int, sample_rate: float, steps: int, target_epsilon: float, delta: float, part: float = 1.0) -> tuple[int, float]:
    """(B_max, p): the smallest B_max with (1 + e^ε)·T·P(Binomial(N + 1, q) > B_max) ≤ part·DELTA_SHARE·δ,
    and that per-step truncation probability p (an upper bound when it is below float range).

    N + 1, not N: the guarantee compares the data set with its neighbours under add/remove, and
    the larger one — N + 1 examples, sampled at the same q — has the larger lots, so the bad
    event must be bounded there (at N the charge came out a few percent low on small sets)."""
    if dataset_size < 1 or steps < 1:
        raise ValueError(f"lot_bound needs N >= 1 and steps >= 1, got N={dataset_size}, steps={steps}")
    if not 0 < sample_rate <= 1 or not delta > 0:
        raise ValueError(f"lot_bound needs 0 < q <= 1 and δ > 0, got q={sample_rate}, δ={delta}")
    bound = rows_needed(dataset_size + 1, sample_rate, allowed_log_tail(steps, target_epsilon, delta) + math.log(part))
    return bound, math.exp(log_tail(dataset_size + 1, sample_rate, bound))


def rows_needed(n: int, q: float, allowed: float) -> int:
    """The least r with log P(Binomial(n, q) > r) ≤ allowed."""
    low, high = math.floor(n * q), n  # high always fits: P(X > n) = 0
    while low < high:
        middle = (low + high) // 2
        if log_tail(n, q, middle) <= allowed:
            high = middle
        else:
            low = middle + 1
    return high


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


def length_histogram(lengths: Sequence[int], max_length: int) -> np.ndarray:
    """Counts of the examples of each length 0 … max_length (float64: the release adds noise to it)."""
    counts = np.bincount(np.asarray(lengths, dtype=np.int64), minlength=max_length + 1)
    if len(counts) > max_length + 1:
        raise ValueError(f"an example of {len(counts) - 1} tokens exceeds max_length={max_length}")
    return counts.astype(np.float64)


def count_bounds(released: Sequence[float], noise_std: float, dataset_size: int, log_failure: float) -> list[int]:
    """U(w), w = 0 … max_length: upper bounds on the examples longer than w, from the released
    histogram (`released[l]`: the count of length l plus N(0, noise_std²), on the grid of
    `grid_step(noise_std)`), all true together except with probability ≤ e^log_failure.

    The sum of the m = max_length − w bins above w errs by a N(0, m·noise_std²) draw plus at
    most m half grid steps of rounding; each of the max_length − 1 inner bounds takes an equal
    part of the failure. U(0) = N is exact (public), U(max_length) = 0, and U never grows with w
    (a bound for fewer lengths holds for more)."""
    top = len(released) - 1
    log_each = log_failure - math.log(max(top - 1, 1))
    # Past float range (large ε leaves e^-1000 and less), Chernoff's P(Z > z) ≤ e^{-z²/2}: an over-estimate of z is safe.
    z = float(norm.isf(math.exp(log_each))) if log_each > -700 else math.sqrt(-2 * log_each)
    above = np.cumsum(np.asarray(released, dtype=np.float64)[::-1])[::-1]  # above[w] = Σ_{l ≥ w}
    bounds = [dataset_size]
    for w in range(1, top):
        m = top - w
        noisy = above[w + 1] + z * noise_std * math.sqrt(m) + m * grid_step(noise_std) / 2
        bounds.append(max(0, min(bounds[-1], math.ceil(noisy))))
    return bounds + [0]


def width_buckets(bounds: Sequence[int], sample_rate: float, allowed_rows: float, allowed_widths: float, max_buckets: int) -> tuple[Buckets, float]:
    """(buckets, p): at most `max_buckets` widths t₁ < … < t_K = max_length with their rows, the
    fewest padded tokens Σ_k R(t_{k−1})·(t_k − t_{k−1}) over inner widths on the WIDTH_STEP grid;
    p bounds the chance per step that a neighbour's Poisson lot does not fit them.

    R(0) = B_max at `allowed_rows` (log); each of the K − 1 inner thresholds t gets R(t) with
    log P(Binomial(U(t) + 1, q) > R(t)) ≤ allowed_widths − log(K − 1)."""
    top = len(bounds) - 1
    b_max = rows_needed(bounds[0] + 1, sample_rate, allowed_rows)
    candidates = list(range(WIDTH_STEP, top, WIDTH_STEP))
    best: tuple[float, list[int], list[int]] = (float(b_max * top), [], [])
    for inner in range(1, min(max_buckets, len(candidates) + 1)):
        allowed = allowed_widths - math.log(inner)
        rows = {t: min(b_max, rows_needed(bounds[t] + 1, sample_rate, allowed)) for t in candidates}
        # cost[j][t]: the fewest tokens below width t with j inner thresholds, the last at t.
        cost = {(0, 0): (0.0, [])}
        for j in range(1, inner + 1):
            for t in candidates:
                options = [(c + (b_max if s == 0 else rows[s]) * (t - s), path) for (i, s), (c, path) in cost.items() if i == j - 1 and s < t]
                if options:
                    c, path = min(options, key=lambda o: o[0])
                    cost[(j, t)] = (c, [*path, t])
        for (j, s), (c, path) in cost.items():
            total = c + rows[s] * (top - s) if j == inner else math.inf
            if total < best[0]:
                best = (total, path, [rows[t] for t in path])
    _, thresholds, rows_above = best
    edges = [b_max, *rows_above, 0]
    widths = [*thresholds, top]
    buckets = tuple((w, edges[k] - edges[k + 1]) for k, w in reversed(list(enumerate(widths))) if edges[k] > edges[k + 1])
    p = math.exp(log_tail(bounds[0] + 1, sample_rate, b_max)) + sum(math.exp(log_tail(bounds[t] + 1, sample_rate, r)) for t, r in zip(thresholds, rows_above))
    return buckets, p


def fit_lot(lengths: Sequence[int], buckets: Buckets) -> tuple[list[list[int]], list[int]]:
    """Place a lot's examples (their lengths, by position) in the buckets' rows: longest first into
    the widest rows left. Returns each bucket's positions and those that fit nowhere (the charged
    bad event: a row count or a width bound exceeded)."""
    placed: list[list[int]] = [[] for _ in buckets]
    dropped: list[int] = []
    bucket, free = 0, buckets[0][1] if buckets else 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        while bucket < len(buckets) and free == 0:
            bucket += 1
            free = buckets[bucket][1] if bucket < len(buckets) else 0
        if bucket < len(buckets) and lengths[i] <= buckets[bucket][0]:
            placed[bucket].append(i)
            free -= 1
        else:
            dropped.append(i)
    return placed, dropped


def bucket_micro_batches(buckets: Buckets, tokens: int, max_rows: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """Each bucket's fixed micro-batches, (width, count, rows each): its rows in equal micro-batches
    of at most ⌊tokens / width⌋ rows (so none holds more tokens than a full-width one) and at most
    `max_rows` (an engine that forms each row's gradient holds memory per row), the rows rounded
    up to a multiple of the count, which only adds room."""
    shapes = []
    for width, rows in buckets:
        fits = tokens // width if max_rows is None else min(tokens // width, max_rows)
        count = -(-rows // max(1, fits))
        shapes.append((width, count, -(-rows // count)))
    return tuple(shapes)


def micro_batch_members(lengths: Sequence[int], shapes: Sequence[tuple[int, int, int]]) -> Iterator[tuple[int, int, list[int]]]:
    """(width, rows, positions in the lot) of every micro-batch of `shapes` (bucket_micro_batches),
    the same micro-batches whatever the lot: its examples (`lengths`, by position) placed by `fit_lot`;
    one that fits no row left (the charged bad event) is in none."""
    placed, _ = fit_lot(lengths, tuple((width, count * each) for width, count, each in shapes))
    for (width, count, each), members in zip(shapes, placed, strict=True):
        for start in range(0, count * each, each):
            yield width, each, members[start : start + each]


def bucketed_lot_bound(
    released: Sequence[float], noise_std: float, dataset_size: int, sample_rate: float, steps: int, target_epsilon: float, delta: float, max_buckets: int
) -> tuple[Buckets, float]:
    """(buckets, p) of a constant-time run bucketed by width, from the released length histogram:
    p is the per-step bad-event probability charged, the confidence bounds' β spread over T steps."""
    allowed = allowed_log_tail(steps, target_epsilon, delta)
    bounds = count_bounds(released, noise_std, dataset_size, allowed + math.log(steps * COUNTS_PART))
    buckets, p = width_buckets(bounds, sample_rate, allowed + math.log(ROWS_PART), allowed + math.log(WIDTHS_PART), max_buckets)
    return buckets, p + math.exp(allowed + math.log(COUNTS_PART))
