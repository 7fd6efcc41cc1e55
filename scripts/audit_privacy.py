"""Empirical privacy audit: canaries, one training run each, a lower bound on ε.

Trains a linear model with Dirac canaries through the real mechanism (Poisson lots, the
Privatizer's clipping + calibrated noise + accountant, SGD on the release), then turns a
membership test on the canaries into a lower bound on ε at confidence 1 − β (Steinke, Nasr &
Jagielski 2023, one-run auditing; see dpmuon.privacy.audit). The correct mechanism must stay
below the accountant's ε; the deliberately broken ones (noise 10× too small, canaries not
clipped) must be caught with a bound above it.

    python scripts/audit_privacy.py                       # fast mode: correct + both breaks (~15 s)
    python scripts/audit_privacy.py --mode full --json audit.json
    python scripts/audit_privacy.py --break noise --engine fast

Exit status 1 when a verdict is not the expected one (the correct mechanism flagged, or a
break missed although the design could refute its claim).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from dpmuon.privacy import ENGINES
from dpmuon.privacy.audit import BREAKS, METHOD, MODES, AuditResult, describe, expected_verdict, format_table, run_audits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="fast", help="fast: CI-sized; full: more canaries, and a claim of ε = 8")
    parser.add_argument(
        "--break", dest="breakage", choices=BREAKS, default=None,
        help="audit only this mechanism (none = the correct one); default: the correct one, then both breaks",
    )
    parser.add_argument("--engine", choices=sorted(ENGINES), default="opacus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--json", type=Path, default=None, help="write every scenario's setup and results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    breakages = BREAKS if args.breakage is None else (args.breakage,)
    print(f"method: {METHOD}")
    report, surprises = [], []
    for setup in MODES[args.mode]:
        setup = replace(setup, engine=args.engine, seed=args.seed, confidence=args.confidence)
        start = time.perf_counter()
        results: list[AuditResult] = run_audits(setup, breakages)
        print(f"\nscenario: {describe(setup)}")
        print(format_table(results))
        ceiling = results[0].ceiling
        if ceiling <= setup.epsilon:
            print(f"note: this design cannot refute ε = {setup.epsilon:g} (its ceiling is {ceiling:.2f}); no verdict above is evidence of correctness")
        print(f"wall time: {time.perf_counter() - start:.1f} s")
        surprises += [r for r in results if not expected_verdict(r)]
        report.append({"setup": asdict(setup), "results": [r.to_dict() for r in results]})
    if args.json is not None:
        args.json.write_text(json.dumps({"method": METHOD, "mode": args.mode, "scenarios": report}, indent=2))
    for r in surprises:
        print(f"UNEXPECTED: {r.mechanism} at claimed ε = {r.claimed_epsilon:.3f}: {r.verdict}", file=sys.stderr)
    return 1 if surprises else 0


if __name__ == "__main__":
    sys.exit(main())
