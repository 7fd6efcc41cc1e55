"""Idealized power of the one-run f-DP audit against subtle mutations, without training.

Simulates exactly what the Dirac-canary auditor sees — per step, each canary's release along its
clipped gradient is s + N(0, (scale·σ)²) in units of its sensitivity, s = 1 if the slot was drawn
(rate q × lot factor, never for an excluded canary) — scores it with the audit's likelihood
ratio, and runs the audit's claim test (the accountant's profile for σ, q, T) at the audit's
guess counts. It answers "how many canaries would a one-run audit need?" for mutations that the
real audit (results/audit/) cannot catch at 10⁴ canaries.

    python scripts/audit_power.py --canaries 100000 --sample-rate 0.005 --steps 200
"""

from __future__ import annotations

import argparse

import numpy as np

from dpmuon.audit import (
    count_correct,
    fdp_p_value,
    guess_counts,
    membership_guesses,
    profile_blow_up_inverse,
    sampled_release_log_likelihood_ratio,
    subsampled_gaussian_profile,
)
from dpmuon.privacy import calibrate_noise_multiplier, epsilon_after

# name → (noise scale, lot factor)
MUTATIONS = {"correct": (1.0, 1.0), "noise × 0.8": (0.8, 1.0), "noise × 0.9": (0.9, 1.0), "lots at 2q": (1.0, 2.0)}


def simulated_scores(canaries: int, q: float, steps: int, sigma: float, scale: float, lot_factor: float, divisor: float, rng) -> tuple:
    included = rng.random(canaries) < 0.5
    scores = np.zeros(canaries)
    for _ in range(steps):
        drawn = included & (rng.random(canaries) < q * lot_factor)
        scores += sampled_release_log_likelihood_ratio(drawn + rng.normal(0.0, scale * sigma, canaries), divisor / sigma, q)
    return scores, included


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canaries", type=int, default=100_000)
    parser.add_argument("--sample-rate", type=float, default=0.005)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--score-noise-divisor", type=float, default=1.0, help="the score's assumed noise σ/divisor (1: the claim's own)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.001, 0.003, 0.01, 0.03, 0.1])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    q, steps = args.sample_rate, args.steps
    sigma = calibrate_noise_multiplier(args.epsilon, args.delta, q, steps)
    claim = profile_blow_up_inverse(subsampled_gaussian_profile(sigma, q, steps).with_point(args.epsilon, args.delta))
    counts = guess_counts(args.canaries, tuple(args.fractions))
    print(f"m = {args.canaries}, q = {q}, T = {steps}, σ = {sigma:.4f} (ε = {args.epsilon} at δ = {args.delta}); guess counts {counts}")
    for name, (scale, lot_factor) in MUTATIONS.items():
        true = epsilon_after(sigma * scale, min(1.0, q * lot_factor), steps, args.delta)
        scores, included = simulated_scores(args.canaries, q, steps, sigma, scale, lot_factor, args.score_noise_divisor, np.random.default_rng(args.seed))
        cells = []
        for r in counts:
            correct, made = count_correct(membership_guesses(scores, r, "upper"), included)
            cells.append(f"{correct}/{made}: p {min(1.0, len(counts) * fdp_p_value(args.canaries, made, correct, claim)):.2g}")
        print(f"{name:12s} true ε {true:5.2f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
