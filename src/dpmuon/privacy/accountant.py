"""Privacy accounting for the Poisson-subsampled Gaussian mechanism (through Opacus).

PRV (Gopi et al.) is the default: numerically tight, reported as an upper bound. RDP is the
classic, looser alternative. One step = one Poisson-subsampled Gaussian release with rate q and
noise multiplier σ (noise std σ·Δ for joint L2 sensitivity Δ).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from .settings import ACCOUNTANTS, default

# Binary-search precision of σ calibration, in units of ε (Opacus' epsilon_tolerance).
CALIBRATION_TOLERANCE = 0.01
# RDP orders: Opacus' default stops at 63, too low for ε ≈ 8 at small q (the optimum sits at the
# edge and the bound loosens); extending the grid only tightens the bound.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 256)))


# Shares of δ the releases' bad events (ReleaseSlack.bad_event) may take, smallest first. A run is
# planned (σ calibrated, constant-time lots bounded: lot_bound.py) to fit the first; runs composed
# in a study multiply the charge (more releases at a larger ε), and rather than report ε = inf
# the accountant takes the next share they fit in. Each share is a valid split of δ for the same
# mechanism, so the smallest ε among them is a guarantee.
BAD_EVENT_SHARES = (1e-3, 1e-2, 1e-1)
BAD_EVENT_SHARE = BAD_EVENT_SHARES[0]


@dataclass(frozen=True)
class ReleaseSlack:
    """What one release costs beyond the ideal subsampled Gaussian the accountant analyses.

    epsilon: the release's output probabilities are within a factor e^{±epsilon/2} of the ideal
      mechanism's (the float64 grid noise: privacy/grid.py), outside the bad event.
    bad_event: a bound, per release and under the computed mechanism as under the ideal, on the
      probability of an event the analysis does not cover (a grid cell reaching past the
      analysed tail or more coordinates in a |z| band than its count bound: privacy/grid.py; a
      Poisson lot truncated to its constant-time bound).

    T such releases are within e^{±a}, a = T·epsilon/2, of the ideal on the good events, so with
    the ideal (ε_I, δ_I) they are (ε_I + 2a, e^a·δ_I + (1 + e^{ε_I + a})·T·bad_event)-DP. The
    accountant spends δ_I = (1 − s)·δ·e^{−a} on the ideal mechanism, with s the smallest of
    BAD_EVENT_SHARES whose s·δ the bad events fit in, and reports an infinite ε if none fits.
    """

    epsilon: float = 0.0
    bad_event: float = 0.0

    def __add__(self, other: ReleaseSlack) -> ReleaseSlack:
        return ReleaseSlack(self.epsilon + other.epsilon, self.bad_event + other.bad_event)

    def __bool__(self) -> bool:
        return bool(self.epsilon or self.bad_event)

    def ideal_delta(self, steps: int, delta: float, share: float = BAD_EVENT_SHARE) -> float:
        """δ_I: what the ideal mechanism may spend of δ after `steps` releases, when the bad
        events take `share` of it."""
        if not self:
            return delta
        return (1 - share) * delta * math.exp(-steps * self.epsilon / 2)

    def epsilon_of(self, steps: int, delta: float, ideal_epsilon: Callable[[float], float]) -> float:
        """ε after `steps` releases, given the ideal mechanism's ε as a function of its δ."""
        if not self:
            return ideal_epsilon(delta)
        a = steps * self.epsilon / 2
        for share in BAD_EVENT_SHARES if self.bad_event else BAD_EVENT_SHARES[:1]:
            # A larger share leaves the ideal mechanism less δ, so a larger ε: the first that fits is the least.
            eps = ideal_epsilon(self.ideal_delta(steps, delta, share))
            if not (self.bad_event and math.isfinite(eps)):
                return eps + 2 * a
            x = eps + a  # log(1 + e^x), without overflow at large ε
            log_charge = max(x, 0.0) + math.log1p(math.exp(-abs(x))) + math.log(steps * self.bad_event)
            if log_charge <= math.log(share * delta):
                return eps + 2 * a
        return math.inf


def _epsilon_kwargs(accountant: str) -> dict:
    return {"alphas": list(RDP_ORDERS)} if accountant == "rdp" else {}


def _opacus_epsilon(accountant: str, history: list[tuple[float, float, int]], delta: float) -> float:
    # Opacus is imported where it computes: it loads torch, which reading recorded histories
    # (the study, the tables, this module's importers) does not need.
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = history
    with warnings.catch_warnings():
        # PRV sizes its domain with an internal RDP bound that warns about its order grid.
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        # A release of every example (q = 1: the length histogram) takes log(1 − q) = −inf in
        # PRV's domain mask, which numpy warns about; the mask it gives is the right one.
        warnings.filterwarnings("ignore", message="divide by zero encountered in log", category=RuntimeWarning)
        eps = float(acc.get_epsilon(delta=delta, **_epsilon_kwargs(accountant)))
    # Numerical breakdown (tiny σ) may give NaN; never let it pass as a small ε.
    return math.inf if math.isnan(eps) else eps


def _check_accountant(name: str) -> None:
    if name not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {name!r}; valid: {', '.join(ACCOUNTANTS)}")


def plan_steps(epochs: float, sample_rate: float) -> int:
    """Steps that cover `epochs` passes in expectation: ceil(epochs / q)."""
    if epochs <= 0:
        raise ValueError(f"epochs must be > 0, got {epochs}")
    check_sample_rate(sample_rate)
    # Round away float noise (10 / (1024/42061) is 410.75…, but 2 / 0.5 must stay 4).
    return max(1, math.ceil(round(epochs / sample_rate, 9)))


def check_sample_rate(sample_rate: float) -> None:
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")


History = tuple[tuple[float, float, int], ...]  # (σ, q, releases)


@lru_cache(maxsize=4096)
def epsilon_after(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = default("accountant"),
    slack: ReleaseSlack = ReleaseSlack(),
    prior: History = (),
) -> float:
    """ε spent by `prior` releases and then `steps` releases with (σ, q) at δ; inf without noise,
    0 before any release. Each release, the prior's too, costs `slack`."""
    _check_accountant(accountant)
    history = [*prior, (noise_multiplier, sample_rate, steps)] if steps else list(prior)
    if not history:
        return 0.0
    if any(sigma <= 0 for sigma, _, _ in history):
        return math.inf
    releases = sum(n for _, _, n in history)
    return slack.epsilon_of(releases, delta, lambda d: _opacus_epsilon(accountant, history, d))


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = default("accountant"),
    slack: ReleaseSlack = ReleaseSlack(),
    prior: History = (),
) -> float:
    """Smallest σ (to the search tolerance) whose ε after `prior` and `steps` steps, slack included, is ≤ target_epsilon."""
    _check_accountant(accountant)
    if target_epsilon <= 0:
        raise ValueError(f"target epsilon must be > 0, got {target_epsilon}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    check_sample_rate(sample_rate)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    releases = steps + sum(n for _, _, n in prior)
    ideal_target = target_epsilon - releases * slack.epsilon
    if not ideal_target > 0:
        raise ValueError(f"the releases' float slack alone ({releases * slack.epsilon:.3g}) exceeds target epsilon {target_epsilon}")
    from opacus.accountants.utils import get_noise_multiplier  # as in _opacus_epsilon: it loads torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        sigma = get_noise_multiplier(
            target_epsilon=ideal_target,
            target_delta=slack.ideal_delta(steps, delta),
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
            epsilon_tolerance=CALIBRATION_TOLERANCE,
            **_epsilon_kwargs(accountant),
        )
    if prior:  # Opacus calibrates the steps alone; the prior releases only add to ε, so σ can only grow
        sigma = _raise_sigma(lambda s: epsilon_after(s, sample_rate, steps, delta, accountant, slack, prior), target_epsilon, sigma)
    spent = epsilon_after(sigma, sample_rate, steps, delta, accountant, slack, prior)
    if not spent <= target_epsilon:  # the search must never hand back a σ that overspends
        raise RuntimeError(f"calibration returned σ={sigma} with ε={spent} > target {target_epsilon}")
    return float(sigma)


def _raise_sigma(epsilon: Callable[[float], float], target: float, sigma: float) -> float:
    """The least σ' ≥ σ, to the calibration's tolerance, with epsilon(σ') ≤ target: σ itself if it
    fits, else the upper end of a bracket narrowed until its ε is within CALIBRATION_TOLERANCE."""
    if epsilon(sigma) <= target:
        return sigma
    low, high = sigma, sigma * 1.05
    while not epsilon(high) <= target:
        low, high = high, high + 2 * (high - low)
        if high > 1e6:
            raise ValueError(f"no noise multiplier up to {high:g} reaches ε ≤ {target}: the prior releases alone spend more")
    while target - epsilon(high) >= CALIBRATION_TOLERANCE and high - low > 1e-6 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if epsilon(middle) <= target else (middle, high)
    return high


class NullAccountant:
    """The accountant of a non-private run: it charges nothing and reports no ε (not 0: nothing
    about the run is private)."""

    steps = None

    def epsilon(self) -> None:
        return None


class PrivacyAccountant:
    """ε spent by one run's releases so far (rebuilt from the privacy ledger on resume)."""

    def __init__(self, delta: float, accountant: str = default("accountant"), slack: ReleaseSlack = ReleaseSlack()):
        _check_accountant(accountant)
        self.delta = delta
        self.mechanism = accountant
        self.slack = slack  # per release, beyond the ideal mechanism
        self.history: list[tuple[float, float, int]] = []  # (σ, q, consecutive steps)
        self.prior_releases = 0  # of the history, releases made before step 1 (the length histogram): not steps

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, q, n = self.history[-1]
            self.history[-1] = (sigma, q, n + 1)
        else:
            self.history.append((noise_multiplier, sample_rate, 1))

    @property
    def steps(self) -> int:
        """The charged step releases (the history's releases less the prior ones)."""
        return sum(n for _, _, n in self.history) - self.prior_releases

    def epsilon(self) -> float:
        return self.epsilon_with(extra_steps=0)

    def epsilon_with(self, extra_steps: int, noise_multiplier: float | None = None, sample_rate: float | None = None) -> float:
        """ε if `extra_steps` more releases with (σ, q) followed — the budget guard's look-ahead."""
        history = list(self.history)
        if extra_steps:
            if history and history[-1][:2] == (noise_multiplier, sample_rate):
                history[-1] = (noise_multiplier, sample_rate, history[-1][2] + extra_steps)
            else:
                history.append((noise_multiplier, sample_rate, extra_steps))
        if not history:
            return 0.0
        if any(sigma <= 0 for sigma, _, _ in history):
            return math.inf
        if len(history) == 1:
            return epsilon_after(*history[0], self.delta, self.mechanism, self.slack)
        steps = sum(n for _, _, n in history)
        return self.slack.epsilon_of(steps, self.delta, lambda d: _opacus_epsilon(self.mechanism, history, d))
