"""`python -m dpmuon.privacy`: calibrate σ for (ε, δ, q, steps), or report ε for a given σ.

Every number is checked before the accountant runs, and a bad one is refused in one line naming
the flag and its valid range: argparse takes "nan" and "inf" as floats, and the PRV accountant
given one (or a σ so small that its privacy-loss grid has billions of points) hangs or dies
allocating memory instead of answering.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings

from ..errors import UserError
from ..jsontext import to_json
from .accountant import calibrate_noise_multiplier, epsilon_after, plan_steps
from .plan import PRV_MAX_EPSILON
from .settings import ACCOUNTANTS

# The most points of PRV's discretized privacy-loss grid this command lets Opacus build: 7·10⁶
# points took 12 s and 1.5 GB (σ = 0.1, q = 0.01, 100 steps); 4·10⁷ ran past two minutes and
# 10⁸ past 6 GB. The grid widens as σ falls (ε grows) and refines with the steps, so the limit
# is a floor on σ that depends on q and the steps; RDP has none (any σ > 0).
PRV_GRID_LIMIT = 10**7


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dpmuon.privacy",
        description="Noise multiplier for a target (ε, δ) under Poisson subsampling, as one JSON object.",
    )
    parser.add_argument("--epsilon", type=float, help=f"target ε > 0 (≤ {PRV_MAX_EPSILON:g} with prv; omit when --noise-multiplier is given)")
    parser.add_argument("--delta", type=float, required=True, help="0 < δ < 1")
    parser.add_argument("--sample-rate", type=float, required=True, help="q = expected lot size / N, 0 < q ≤ 1")
    steps = parser.add_mutually_exclusive_group(required=True)
    steps.add_argument("--steps", type=int, help="an integer ≥ 1")
    steps.add_argument("--epochs", type=float, help="plan steps as ceil(epochs / q); a finite number > 0")
    parser.add_argument(
        "--noise-multiplier",
        type=float,
        help=f"report the ε this σ reaches instead of calibrating: a finite σ > 0 (with prv, large enough that PRV's grid "
        f"has at most {PRV_GRID_LIMIT:.0e} points: about σ ≥ 0.1 at q = 0.01 and 100 steps; rdp takes any σ > 0)",
    )
    parser.add_argument("--accountant", choices=ACCOUNTANTS, default="prv")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> int:
    """The steps the arguments plan, once every number is in range; else a one-line UserError."""
    if not (math.isfinite(args.delta) and 0 < args.delta < 1):
        raise UserError(f"--delta {args.delta:g}: out of range; valid: 0 < δ < 1")
    if not (math.isfinite(args.sample_rate) and 0 < args.sample_rate <= 1):
        raise UserError(f"--sample-rate {args.sample_rate:g}: out of range; valid: 0 < q ≤ 1")
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps}: out of range; valid: an integer ≥ 1")
    if args.epochs is not None and not (math.isfinite(args.epochs) and args.epochs > 0):
        raise UserError(f"--epochs {args.epochs:g}: not a finite number > 0; valid: a finite number > 0")
    if args.epsilon is not None and not (math.isfinite(args.epsilon) and args.epsilon > 0):
        raise UserError(f"--epsilon {args.epsilon:g}: not a finite number > 0; valid: a finite ε > 0")
    n_steps = args.steps if args.steps is not None else plan_steps(args.epochs, args.sample_rate)
    if args.noise_multiplier is None:
        if args.epsilon is None:
            raise UserError("give --epsilon (to calibrate σ) or --noise-multiplier (to report ε)")
        if args.accountant == "prv" and args.epsilon > PRV_MAX_EPSILON:
            raise UserError(
                f"--epsilon {args.epsilon:g}: beyond what the PRV accountant calibrates; valid with prv: ε ≤ {PRV_MAX_EPSILON:g} (use --accountant rdp above)"
            )
        return n_steps
    sigma = args.noise_multiplier
    if sigma == 0:
        raise UserError("--noise-multiplier 0: no noise, so ε = ∞ (no guarantee at all); valid: a finite σ > 0")
    if not (math.isfinite(sigma) and sigma > 0):
        raise UserError(f"--noise-multiplier {sigma:g}: not a finite number > 0; valid: a finite σ > 0")
    if args.accountant == "prv":
        points = prv_grid_points(sigma, args.sample_rate, n_steps, args.delta)
        if points > PRV_GRID_LIMIT:
            raise UserError(
                f"--noise-multiplier {sigma:g}: too small for the PRV accountant at q = {args.sample_rate:g} and {n_steps} steps "
                f"(its privacy-loss grid would have {points:.1e} points, more than the {PRV_GRID_LIMIT:.0e} it can build in memory and time); "
                "valid: a larger σ (or fewer steps), or --accountant rdp, which takes any σ > 0"
            )
    return n_steps


def prv_grid_points(sigma: float, sample_rate: float, steps: int, delta: float) -> int:
    """The points of the grid Opacus' PRV accountant would discretize the privacy loss on for
    (σ, q, steps) at δ — its own domain rule (width from a tail bound, mesh from the steps and the
    default errors of `get_epsilon`), which costs milliseconds while the grid itself may not fit in memory."""
    from opacus.accountants import PRVAccountant  # it loads torch: only where PRV is asked for
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

    with warnings.catch_warnings():
        # The domain's tail bound is an RDP bound, which warns about its order grid at small σ.
        warnings.filterwarnings("ignore", message="Optimal order is the")
        domain = PRVAccountant()._get_domain([PoissonSubsampledGaussianPRV(sample_rate, sigma)], [steps], eps_error=0.01, delta_error=delta / 1000)
    return domain.size


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        n_steps = check_args(args)
        sigma = args.noise_multiplier
        if sigma is None:
            sigma = calibrate_noise_multiplier(args.epsilon, args.delta, args.sample_rate, n_steps, args.accountant)
        eps = epsilon_after(sigma, args.sample_rate, n_steps, args.delta, args.accountant)
        if not math.isfinite(eps):  # the accountant broke down (its NaN becomes ∞): never print it as null
            raise UserError(
                f"the {args.accountant} accountant gives no finite ε for σ={sigma:g}, q={args.sample_rate:g}, {n_steps} steps; "
                "valid: a larger σ or --accountant rdp"
            )
    except (UserError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        to_json(
            {
                "noise_multiplier": sigma,
                "epsilon": eps,
                "target_epsilon": args.epsilon,
                "delta": args.delta,
                "sample_rate": args.sample_rate,
                "steps": n_steps,
                "accountant": args.accountant,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
