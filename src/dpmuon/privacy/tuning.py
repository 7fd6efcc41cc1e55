"""Privacy of random-stopping hyperparameter tuning (Papernot & Steinke, ICLR 2022).

Run a DP training Q a random number K of times — each run drawing its hyperparameters afresh
— and release only the best run (by a score that is part of Q's output). With K from a
truncated negative binomial TNB(η, γ) (η = 1: geometric, η = 0: logarithmic, −1 < η < 0:
heavier-tailed), their Theorem 2 says: if Q is (λ, ε)-RDP and (λ̂, ε̂)-RDP, the whole tuning
procedure is (λ, ε′)-RDP with

    ε′ = ε + (1 + η)(1 − 1/λ̂) ε̂ + (1 + η) log(1/γ) / λ̂ + log E[K] / (λ − 1),

for every λ > 1 and λ̂ ≥ 1. Here Q's RDP curve comes from Opacus' RDP accountant for its
(σ, q, steps), the bound is minimised over λ̂ and converted to (ε, δ) at each λ. For pure
ε-DP Q (RDP ε at every order) λ, λ̂ → ∞ gives their corollary: (2 + η)ε-DP.

The bound holds only if K stays secret and nothing but the best run is released: publishing
K, or the other runs, leaves only the composition of the K runs (`python -m dpmuon.eval.study`).
"""

from __future__ import annotations

import argparse
import math
import secrets
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from ..jsontext import to_json
from .accountant import RDP_ORDERS, PrivacyAccountant

History = Sequence[tuple[float, float, int]]  # (σ, q, steps), as in PrivacyAccountant.history
# γ for a requested E[K]: 200 halvings of [log SMALLEST_GAMMA, 0] resolve log γ to float precision.
SMALLEST_GAMMA = 1e-300
BISECTION_STEPS = 200


@dataclass(frozen=True)
class TruncatedNegativeBinomial:
    """K on {1, 2, …} with P[K = k] ∝ C(k + η − 1, k) (1 − γ)^k (Papernot & Steinke, Definition 1)."""

    eta: float  # shape η > −1: 1 = geometric, 0 = logarithmic
    gamma: float  # γ ∈ (0, 1): smaller γ, more trials

    def __post_init__(self):
        if not self.eta > -1:
            raise ValueError(f"the shape η must be > -1, got {self.eta}")
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"γ must be in (0, 1), got {self.gamma}")

    @classmethod
    def with_mean(cls, mean: float, eta: float) -> TruncatedNegativeBinomial:
        """The distribution of shape η with E[K] = mean (> 1), by bisection on log γ."""
        if not mean > 1:
            raise ValueError(f"the mean number of trials must be > 1, got {mean}")
        low, high = math.log(SMALLEST_GAMMA), 0.0  # E[K] falls from huge to 1 as γ rises to 1
        if _mean_at(eta, low) < mean:
            raise ValueError(f"a mean of {mean} trials is out of reach for η = {eta}")
        for _ in range(BISECTION_STEPS):
            mid = (low + high) / 2
            low, high = (mid, high) if _mean_at(eta, mid) > mean else (low, mid)
        return cls(eta, math.exp(low))

    @property
    def mean(self) -> float:
        log_gamma = math.log(self.gamma)
        if self.eta == 0:
            return (1 - self.gamma) / (self.gamma * -log_gamma)
        # η(1 − γ) / (γ(1 − γ^η)), with 1 − γ^η = −expm1(η log γ) accurate for η near 0.
        return self.eta * (1 - self.gamma) / (self.gamma * -math.expm1(self.eta * log_gamma))

    def probabilities(self) -> Iterator[float]:
        """P[K = 1], P[K = 2], …: the binomial coefficient as a running product, O(1) per term."""
        log_inv_gamma = -math.log(self.gamma)
        # Normaliser: Σ_{k≥1} C(k + η − 1, k)(1 − γ)^k = γ^−η − 1, or log(1/γ) in the η → 0 limit.
        norm = log_inv_gamma if self.eta == 0 else math.expm1(self.eta * log_inv_gamma)
        running, k = 1.0, 0
        while True:
            k += 1
            if self.eta == 0:  # logarithmic: (1 − γ)^k / k
                running *= 1 - self.gamma
                yield running / k / norm
            else:
                running *= (k - 1 + self.eta) / k * (1 - self.gamma)
                yield running / norm

    def sample(self) -> int:
        """K by inversion of one uniform from the OS CSPRNG: K must stay as secret as the noise."""
        u = secrets.SystemRandom().random()
        cumulative = 0.0
        for k, p in enumerate(self.probabilities(), start=1):
            cumulative += p
            # Round-off can leave the total a hair below 1: stop where no mass is left.
            if u < cumulative or p < 1e-300:
                return k
        return k


def _mean_at(eta: float, log_gamma: float) -> float:
    gamma = math.exp(log_gamma)
    return 1.0 if gamma >= 1.0 else TruncatedNegativeBinomial(eta, gamma).mean


def base_rdp(history: History, orders: Sequence[float] = RDP_ORDERS) -> np.ndarray:
    """RDP of one training run at each order: the sum over its (σ, q, steps) entries."""
    total = np.zeros(len(orders))
    for sigma, q, steps in history:
        if sigma <= 0:
            return np.full(len(orders), math.inf)
        total += np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=list(orders)), dtype=float)
    return total


def tuned_rdp(orders: Sequence[float], rdp: Sequence[float], distribution: TruncatedNegativeBinomial) -> np.ndarray:
    """Theorem 2 at every order λ > 1 of `orders`, with λ̂ ranging over 1 and the same orders.

    The λ̂ part does not depend on λ, so it is minimised once.
    """
    orders_arr, rdp_arr = np.asarray(orders, dtype=float), np.asarray(rdp, dtype=float)
    if orders_arr.shape != rdp_arr.shape or np.any(orders_arr <= 1):
        raise ValueError("orders must be > 1, one RDP value each")
    spread = 1 + distribution.eta
    log_inv_gamma = -math.log(distribution.gamma)
    # λ̂ = 1 needs no ε̂ (its coefficient 1 − 1/λ̂ vanishes): (1 + η) log(1/γ).
    hat_terms = spread * (1 - 1 / orders_arr) * rdp_arr + spread * log_inv_gamma / orders_arr
    selection = min(spread * log_inv_gamma, float(np.min(hat_terms)))
    return rdp_arr + selection + math.log(distribution.mean) / (orders_arr - 1)


def rdp_to_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> tuple[float, float]:
    """(ε, best order) at δ by Opacus' conversion (Balle et al. 2020, Theorem 21)."""
    with warnings.catch_warnings():
        # An optimum at an edge of the grid (1.1 … 255) only means a wider grid could tighten the bound.
        warnings.filterwarnings("ignore", message="Optimal order is the")
        eps, order = get_privacy_spent(orders=list(orders), rdp=list(rdp), delta=delta)
    return float(eps), float(order)


@dataclass(frozen=True)
class TuningBound:
    """ε of the whole random-stopping tuning, beside one run's ε."""

    epsilon: float  # the tuning procedure (RDP, Theorem 2), at delta
    order: float  # the RDP order λ that gives it
    base_epsilon: float  # one run alone, by the runs' own accountant (PRV)
    base_epsilon_rdp: float  # one run alone, by the same RDP conversion (like for like)
    delta: float
    distribution: TruncatedNegativeBinomial

    def as_dict(self) -> dict:
        return {
            "epsilon": self.epsilon,
            "rdp_order": self.order,
            "delta": self.delta,
            "base_epsilon": self.base_epsilon,
            "base_epsilon_rdp": self.base_epsilon_rdp,
            "mean_trials": self.distribution.mean,
            "eta": self.distribution.eta,
            "gamma": self.distribution.gamma,
            "theorem": "Papernot & Steinke (ICLR 2022), Theorem 2: truncated negative binomial number of trials, best one released",
        }


def tuning_bound(trials: Sequence[History], delta: float, distribution: TruncatedNegativeBinomial) -> TuningBound:
    """ε at δ of tuning by random stopping, each trial a run with one of these (σ, q, steps) histories.

    Trials should share one mechanism (search only hyperparameters that leave σ, q and the
    steps alone); where they differ (e.g. a crash cut one short) the largest RDP at each order
    covers them all, as Rényi divergence is jointly quasi-convex.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not trials:
        raise ValueError("no trial to bound")
    rdp = np.max([base_rdp(history) for history in trials], axis=0)
    eps, order = rdp_to_epsilon(RDP_ORDERS, tuned_rdp(RDP_ORDERS, rdp, distribution), delta)
    base_rdp_eps, _ = rdp_to_epsilon(RDP_ORDERS, rdp, delta)
    base_prv = max(_prv_epsilon(history, delta) for history in trials)
    return TuningBound(eps, order, base_prv, base_rdp_eps, delta, distribution)


def _prv_epsilon(history: History, delta: float) -> float:
    accountant = PrivacyAccountant(delta, "prv")
    accountant.history = [tuple(entry) for entry in history]
    return accountant.epsilon()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpmuon.privacy.tuning",
        description="ε of random-stopping tuning (Papernot & Steinke 2022): K ~ TNB(η, γ) runs of "
        "(σ, q, steps), only the best released. Prints one JSON object.",
    )
    parser.add_argument("--noise-multiplier", type=float, required=True)
    parser.add_argument("--sample-rate", type=float, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--delta", type=float, required=True)
    parser.add_argument("--mean-trials", type=float, required=True, help="E[K] (> 1)")
    parser.add_argument("--eta", type=float, default=1.0, help="shape η > -1 (1: geometric, 0: logarithmic; default 1)")
    args = parser.parse_args(argv)
    try:
        if args.steps < 1 or not 0 < args.sample_rate <= 1:
            raise ValueError("steps must be >= 1 and the sample rate in (0, 1]")
        distribution = TruncatedNegativeBinomial.with_mean(args.mean_trials, args.eta)
        bound = tuning_bound([[(args.noise_multiplier, args.sample_rate, args.steps)]], args.delta, distribution)
    except ValueError as error:
        print(f"python -m dpmuon.privacy.tuning: error: {error}", file=sys.stderr)
        return 2
    print(to_json(bound.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
