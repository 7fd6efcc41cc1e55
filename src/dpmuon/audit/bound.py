"""The one-run bound (Steinke, Nasr & Jagielski 2023) and the auditor's likelihood-ratio score:
statistics only, no training."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats
from scipy.special import expit


def randomized_response_accuracy(epsilon: float) -> float:
    """e^ε / (1 + e^ε): the highest probability that a membership guess against an ε-DP
    mechanism is right — the accuracy of ε-randomized response."""
    return float(expit(epsilon))


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[≥ `correct` of `guesses` guesses are right] for an (ε, δ)-DP run.

    Steinke et al.'s theorem for (ε, δ)-DP, in the form the paper evaluates it:
    P[Binomial(r, p_ε) ≥ v] + 2mδ · max_{1≤i≤v} P[v − i ≤ Binomial(r, p_ε) < v] / i,
    with p_ε = e^ε/(1 + e^ε), m canaries, r guesses, v correct. δ = 0 leaves the pure-DP
    statement: the correct count is stochastically dominated by Binomial(r, p_ε).
    """
    _check_counts(canaries, guesses, correct)
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise ValueError(f"need ε ≥ 0 and δ ∈ [0, 1], got ε={epsilon}, δ={delta}")
    accuracy = randomized_response_accuracy(epsilon)
    tail = float(stats.binom.sf(correct - 1, guesses, accuracy))
    if delta == 0 or correct == 0:
        return min(1.0, tail)
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, accuracy)  # P[v−1], P[v−2], …, P[0]
    alpha = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(1.0, tail + 2 * canaries * delta * alpha)


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got {correct}, {guesses}, {canaries}")


def one_run_epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95, tolerance: float = 1e-6) -> float:
    """An ε the observation refutes at level 1 − confidence: the run is not (ε, δ)-DP.

    Bisection keeps p(lo) < β ≤ p(hi) and returns lo. Reporting any ℓ with p(ℓ) < β is valid
    whether or not p is monotone in ε: if the run is (ε*, δ)-DP it is (ε', δ)-DP for every
    ε' ≥ ε*, so ℓ > ε* can only happen when the observed count is one that the (ε*, δ) bound
    already declares less likely than β.
    """
    _check_counts(canaries, guesses, correct)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    beta = 1 - confidence

    def refuted(epsilon: float) -> bool:
        return one_run_p_value(canaries, guesses, correct, epsilon, delta) < beta

    if not refuted(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while refuted(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if refuted(mid) else (lo, mid)
    return lo


def membership_guesses(scores: np.ndarray, guesses: int, tails: str = "both") -> np.ndarray:
    """+1 ("in") for the highest scores, −1 ("out") for the lowest, 0 (abstain) elsewhere.

    both: ⌈r/2⌉ "in", ⌊r/2⌋ "out" — for scores whose low tail is evidence of absence (a canary
    in every lot: its absence shows as pure noise). upper: all r guesses "in" — for Poisson-
    subsampled canaries, whose low scores mean "never sampled", which an included canary also
    is with probability (1 − q)^T: "out" guesses there are barely better than chance.
    """
    if not 0 <= guesses <= len(scores):
        raise ValueError(f"cannot make {guesses} guesses about {len(scores)} canaries")
    if tails not in ("both", "upper"):
        raise ValueError(f"tails must be 'both' or 'upper', got {tails!r}")
    order = np.argsort(scores, kind="stable")
    n_in = guesses if tails == "upper" else (guesses + 1) // 2
    n_out = guesses - n_in
    verdicts = np.zeros(len(scores), dtype=np.int8)
    verdicts[order[len(scores) - n_in :]] = 1
    verdicts[order[:n_out]] = -1
    return verdicts


def count_correct(verdicts: np.ndarray, included: np.ndarray) -> tuple[int, int]:
    """(correct guesses, guesses made); abstentions count as neither."""
    truth = np.where(included, 1, -1)
    made = verdicts != 0
    return int((verdicts[made] == truth[made]).sum()), int(made.sum())


@dataclass(frozen=True)
class OneRunBound:
    """The audit's verdict: the best of several pre-declared guess counts, Bonferroni-corrected."""

    epsilon: float  # the empirical lower bound
    confidence: float  # overall, after the correction
    canaries: int
    guesses: int  # of the guess count that gave the bound
    correct: int
    tests: int  # guess counts tried; each was tested at level (1 − confidence) / tests


def guess_counts(canaries: int, fractions: tuple[float, ...]) -> list[int]:
    """The pre-declared guess counts r = fraction · m (distinct, at least one guess each)."""
    return sorted({max(1, min(canaries, round(f * canaries))) for f in fractions})


def per_test_confidence(confidence: float, tests: int) -> float:
    """Bonferroni: K tests at level β/K each hold jointly at level β."""
    return 1 - (1 - confidence) / tests


def one_run_audit(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float, fractions: tuple[float, ...], tails: str = "both") -> OneRunBound:
    """Guess at every pre-declared count, bound each at level β/K, report the largest.

    The maximum over K bounds is valid at level β by the union bound; a plain maximum over
    guess counts chosen after looking would not be.
    """
    canaries = len(scores)
    counts = guess_counts(canaries, fractions)
    level = per_test_confidence(confidence, len(counts))
    bounds = []
    for r in counts:
        correct, made = count_correct(membership_guesses(scores, r, tails), included)
        epsilon = one_run_epsilon_lower_bound(canaries, made, correct, delta, level)
        bounds.append(OneRunBound(epsilon, confidence, canaries, made, correct, len(counts)))
    return max(bounds, key=lambda bound: bound.epsilon)


def audit_ceiling(canaries: int, delta: float, confidence: float, fractions: tuple[float, ...]) -> float:
    """The largest lower bound this design can ever report (every guess right): no claimed ε
    above it can be refuted, however broken the mechanism."""
    counts = guess_counts(canaries, fractions)
    level = per_test_confidence(confidence, len(counts))
    return max(one_run_epsilon_lower_bound(canaries, r, r, delta, level) for r in counts)


# --- the auditor's score ---------------------------------------------------------------------


def sampled_release_log_likelihood_ratio(projection: np.ndarray, snr: np.ndarray | float, sample_rate: float) -> np.ndarray:
    """log P[release | canary in] − log P[release | canary out], for one release, per canary.

    projection = ⟨x, c⟩ / ‖c‖², the released sum x along the canary's clipped gradient c: it is
    s + N(0, 1/snr²) with snr = ‖c‖ / (noise std), where s = 1 if the canary was in the lot —
    with probability q when it is in the data set, never when it is not. So the ratio is
    (1 − q) + q · exp(snr² · (projection − 1/2)).
    """
    log_absent = math.log1p(-sample_rate) if sample_rate < 1 else -math.inf
    return np.logaddexp(log_absent, math.log(sample_rate) + np.square(snr) * (projection - 0.5))
