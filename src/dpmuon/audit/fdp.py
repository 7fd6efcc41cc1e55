"""f-DP and Gaussian-DP one-run bounds (Mahloujifar, Melis & Chaudhuri, "Auditing f-differential
privacy in one run", ICML 2025).

Setting as for the (ε, δ) bound (`bound`): m canaries each in with probability 1/2, one run, r
guesses of which v are right. If the run is f-DP with respect to each canary, the paper's
recursion bounds how likely v or more right guesses are, using the whole trade-off curve f
through its "blow-up" function — the most true-positive rate a test at false-positive rate x
can have, 1 − f(x) — rather than one (ε, δ) point. Starting from the mass the event would need
(τ·v/m right, τ·(r − v)/m wrong, for an event of probability τ), it walks down the number of
right guesses, each step charging the least mass f allows for the guesses still to be placed;
if the total exceeds the guessed fraction r/m, no f-DP run produces the event with probability
τ, and the observation refutes f at level τ.

Two hypotheses are tested:
- the claim: the accountant's own privacy profile δ(ε) for (σ, q, T) (a PLD, `dp_accounting`,
  pessimistic), plus its (ε, δ) point. A mechanism satisfying every point of a profile has
  blow-up at most the lower envelope of the lines each point allows (`profile_blow_up_inverse`),
  so that envelope is a hypothesis the claim implies, and refuting it refutes the claim;
- μ-Gaussian DP, blow-up Φ(Φ⁻¹(x) + μ): μ̂ is the largest μ refuted, reported with ε_μ̂(δ), the
  ε a Gaussian mechanism that leaky would have. μ_claim, beside it, is the smallest μ whose GDP
  profile covers the claimed one at every grid point: the claim in GDP terms, on the grid. It is
  loose — the subsampled Gaussian's profile has a heavier tail than any Gaussian's — so the
  verdict is the claim test, and μ̂ against μ_claim is for reading, not deciding.

The recursion is implemented here from the paper's description; `PrivacyProfile` and the
claim envelope are this package's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np
from scipy import stats

from .bound import _check_counts, count_correct, guess_counts, membership_guesses, per_test_confidence

NORMAL = NormalDist()

# The profile's ε grid: fine enough that the envelope is not loosened by much, wide enough for
# guesses up to ~99.99% accurate.
EPSILON_GRID = tuple(np.round(np.arange(0.0, 10.0001, 0.05), 4).tolist())
MU_MAX = 30.0  # above any μ a one-run audit of ≤ 10⁷ canaries can refute


@dataclass(frozen=True)
class PrivacyProfile:
    """Points (ε, δ(ε)) a mechanism is claimed to satisfy, all at once."""

    epsilons: tuple[float, ...]
    deltas: tuple[float, ...]

    def __post_init__(self):
        if len(self.epsilons) != len(self.deltas) or not self.epsilons:
            raise ValueError(f"a profile needs one δ per ε, got {len(self.epsilons)} ε and {len(self.deltas)} δ")
        if any(not 0 <= d <= 1 for d in self.deltas) or any(e < 0 for e in self.epsilons):
            raise ValueError("a profile needs ε ≥ 0 and δ ∈ [0, 1] at every point")

    def with_point(self, epsilon: float, delta: float) -> PrivacyProfile:
        return PrivacyProfile((*self.epsilons, epsilon), (*self.deltas, delta))


def gdp_delta(mu: float, epsilon: np.ndarray | float) -> np.ndarray:
    """δ_μ(ε) of μ-Gaussian DP (Dong, Roth & Su 2022, Cor. 2.13); 0 for μ = 0."""
    epsilon = np.asarray(epsilon, dtype=np.float64)
    if mu <= 0:
        return np.zeros_like(epsilon)
    # e^ε Φ(−ε/μ − μ/2) in log space: e^ε overflows long before the product is negligible.
    second = np.exp(epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2))
    return np.clip(stats.norm.cdf(-epsilon / mu + mu / 2) - second, 0.0, 1.0)


def gdp_profile(mu: float, epsilons: tuple[float, ...] = EPSILON_GRID) -> PrivacyProfile:
    return PrivacyProfile(tuple(epsilons), tuple(gdp_delta(mu, np.array(epsilons)).tolist()))


def gdp_epsilon(mu: float, delta: float, tolerance: float = 1e-6) -> float:
    """The smallest ε with δ_μ(ε) ≤ δ: μ-GDP's ε at δ."""
    if mu <= 0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_delta(mu, hi) > delta:
        lo, hi = hi, 2 * hi
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gdp_delta(mu, mid) > delta else (lo, mid)
    return hi


@lru_cache(maxsize=64)
def subsampled_gaussian_profile(noise_multiplier: float, sample_rate: float, steps: int, epsilons: tuple[float, ...] = EPSILON_GRID) -> PrivacyProfile:
    """The accountant's claim as a profile: T compositions of the Poisson-subsampled Gaussian
    (σ, q), through dp_accounting's PLD accountant (pessimistic discretization: δ(ε) upper bounds)."""
    try:
        from dp_accounting import dp_event, pld
    except ImportError:
        raise SystemExit("error: the f-DP audit needs dp-accounting: pip install -e '.[audit]'") from None

    accountant = pld.PLDAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(noise_multiplier)), steps)
    return PrivacyProfile(tuple(epsilons), tuple(min(1.0, float(accountant.get_delta(e))) for e in epsilons))


BlowUpInverse = Callable[[float], float]


def gdp_blow_up_inverse(mu: float) -> BlowUpInverse:
    """x ↦ Φ(Φ⁻¹(x) − μ): the least false-positive rate at which μ-GDP allows true-positive rate x."""

    def inverse(x: float) -> float:
        if x <= 0.0:
            return 0.0
        if x >= 1.0:
            return 1.0
        return NORMAL.cdf(NORMAL.inv_cdf(x) - mu)

    return inverse


def profile_blow_up_inverse(profile: PrivacyProfile) -> BlowUpInverse:
    """The inverse of the blow-up a profile implies, x ↦ max_ε max((x − δ(ε)) e^{−ε}, 1 − δ(ε) − e^ε (1 − x)).

    (ε, δ)-DP for both orders of a neighbouring pair (the profiles here are) bounds a test's
    true-positive rate at false-positive rate α by e^ε α + δ and by 1 − e^{−ε}(1 − δ − α);
    inverting each line gives the least α that allows true-positive rate x.
    """
    epsilons, deltas = np.array(profile.epsilons), np.array(profile.deltas)
    shrink, grow = np.exp(-epsilons), np.exp(epsilons)

    def inverse(x: float) -> float:
        return max(0.0, float(np.max((x - deltas) * shrink)), float(np.max(1 - deltas - grow * (1 - x))))

    return inverse


def fdp_refutes(canaries: int, guesses: int, correct: int, inverse: BlowUpInverse, level: float) -> bool:
    """Whether `correct` of `guesses` right refutes the f-DP hypothesis (given as its blow-up
    inverse) at level `level` (= β): the mass the event needs exceeds the guessed fraction."""
    _check_counts(canaries, guesses, correct)
    if guesses == 0:
        return False
    tau = level * guesses / canaries
    right, wrong = tau * correct / guesses, tau * (guesses - correct) / guesses
    budget = guesses / canaries
    for i in range(correct - 1, -1, -1):
        if right + wrong > budget:  # both only grow from here: refuted already
            return True
        needed = max(wrong, inverse(right))
        right += i / (guesses - i) * (needed - wrong)
        wrong = needed
    return right + wrong > budget


def fdp_p_value(canaries: int, guesses: int, correct: int, inverse: BlowUpInverse, floor: float = 1e-12) -> float:
    """The smallest level (≥ `floor`, to 1%) at which the hypothesis is refuted; 1 if it never is.

    Refutation is monotone in the level: a larger τ starts the recursion with more mass.
    """
    if not fdp_refutes(canaries, guesses, correct, inverse, 1.0):
        return 1.0
    if fdp_refutes(canaries, guesses, correct, inverse, floor):
        return floor
    lo, hi = math.log(floor), 0.0  # refuted at e^hi, not at e^lo
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fdp_refutes(canaries, guesses, correct, inverse, math.exp(mid)) else (mid, hi)
    return math.exp(hi)


def gdp_covering_mu(profile: PrivacyProfile, tolerance: float = 1e-4) -> float:
    """The smallest μ with δ_μ(ε) ≥ δ(ε) at every point of the profile: what the profile implies in GDP terms there."""
    epsilons, deltas = np.array(profile.epsilons), np.array(profile.deltas)

    def covers(mu: float) -> bool:
        return bool(np.all(gdp_delta(mu, epsilons) >= deltas))

    lo, hi = 0.0, 1.0
    while not covers(hi):
        lo, hi = hi, 2 * hi
        if hi > MU_MAX:
            return math.inf
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if covers(mid) else (mid, hi)
    return hi


def gdp_mu_lower_bound(canaries: int, guesses: int, correct: int, confidence: float, tolerance: float = 1e-3) -> float:
    """The largest μ (to `tolerance`, rounded down) whose GDP the guesses refute at `confidence`.

    A larger μ allows more at every false-positive rate, so refutation is monotone in μ:
    bisection keeps refuted(lo) and not refuted(hi).
    """
    beta = 1 - confidence

    def refuted(mu: float) -> bool:
        return fdp_refutes(canaries, guesses, correct, gdp_blow_up_inverse(mu), beta)

    if not refuted(tolerance):
        return 0.0
    lo, hi = tolerance, 1.0
    while refuted(hi):
        lo, hi = hi, 2 * hi
        if hi > MU_MAX:
            return MU_MAX
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if refuted(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class FdpBound:
    """The f-DP view of one audit: the claim test and the Gaussian-DP lower bound, each the best
    over pre-declared guess counts (Bonferroni)."""

    mu: float  # GDP lower bound μ̂ (the run is not μ-GDP for any μ below it)
    epsilon: float  # ε of μ̂-GDP at the audit's δ
    mu_claim: float  # the GDP μ the claimed profile implies on the grid
    claim_p_value: float  # Bonferroni-adjusted p-value of "the run satisfies the claimed profile" (floored at 1e-12)
    confidence: float
    guesses: int  # of the guess count that gave μ̂
    correct: int
    tests: int

    @property
    def refutes_claim(self) -> bool:
        return self.claim_p_value < 1 - self.confidence


def one_run_fdp_audit(
    scores: np.ndarray,
    included: np.ndarray,
    claimed: PrivacyProfile,
    delta: float,
    confidence: float,
    fractions: tuple[float, ...],
    tails: str = "upper",
) -> FdpBound:
    """The claim test and μ̂ at every pre-declared guess count, each at level β/K (K counts)."""
    canaries = len(scores)
    counts = guess_counts(canaries, fractions)
    level = per_test_confidence(confidence, len(counts))
    claim = profile_blow_up_inverse(claimed)
    best, p_values = None, []
    for r in counts:
        correct, made = count_correct(membership_guesses(scores, r, tails), included)
        p_values.append(fdp_p_value(canaries, made, correct, claim))
        mu = gdp_mu_lower_bound(canaries, made, correct, level)
        if best is None or mu > best[0]:
            best = (mu, made, correct)
    mu, made, correct = best
    return FdpBound(
        mu=mu,
        epsilon=gdp_epsilon(mu, delta),
        mu_claim=gdp_covering_mu(claimed),
        claim_p_value=min(1.0, len(counts) * min(p_values)),
        confidence=confidence,
        guesses=made,
        correct=correct,
        tests=len(counts),
    )
