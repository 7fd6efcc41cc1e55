"""`python -m dpmuon.privacy`: calibrate σ for (ε, δ, q, steps), or report ε for a given σ."""

from __future__ import annotations

import argparse
import sys

from ..jsontext import to_json
from .accountant import ACCOUNTANTS, calibrate_noise_multiplier, epsilon_after, plan_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpmuon.privacy",
        description="Noise multiplier for a target (ε, δ) under Poisson subsampling, as one JSON object.",
    )
    parser.add_argument("--epsilon", type=float, help="target ε (omit when --noise-multiplier is given)")
    parser.add_argument("--delta", type=float, required=True)
    parser.add_argument("--sample-rate", type=float, required=True, help="q = expected lot size / N")
    steps = parser.add_mutually_exclusive_group(required=True)
    steps.add_argument("--steps", type=int)
    steps.add_argument("--epochs", type=float, help="plan steps as ceil(epochs / q)")
    parser.add_argument("--noise-multiplier", type=float, help="report the ε this σ reaches instead of calibrating")
    parser.add_argument("--accountant", choices=ACCOUNTANTS, default="prv")
    args = parser.parse_args(argv)

    try:
        n_steps = args.steps if args.steps is not None else plan_steps(args.epochs, args.sample_rate)
        if args.noise_multiplier is None:
            if args.epsilon is None:
                parser.error("give --epsilon (to calibrate σ) or --noise-multiplier (to report ε)")
            sigma = calibrate_noise_multiplier(args.epsilon, args.delta, args.sample_rate, n_steps, args.accountant)
        else:
            sigma = args.noise_multiplier
        eps = epsilon_after(sigma, args.sample_rate, n_steps, args.delta, args.accountant)
    except ValueError as err:
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
