"""Empirical privacy audit: canaries, one training run each, a lower bound on ε.

Trains with canaries through the real mechanism (the training loop's Poisson lot sampler, the
Privatizer's clipping + calibrated noise + accountant, SGD on the release), scores every
canary by the likelihood ratio of all its releases, and turns a membership test on the
canaries into a lower bound on ε at confidence 1 − β (Steinke, Nasr & Jagielski 2023, one-run
auditing; see dpmuon.audit). The correct mechanism must stay below the accountant's ε;
the deliberately broken ones (noise ÷ 10, noise ÷ 2, noise calibrated per block, clipping off)
must be caught with a bound above it.

    python scripts/audit_privacy.py                        # quick mode, for CI (~10 s)
    python scripts/audit_privacy.py --mode full --json results/audit/audit.json --markdown results/audit/table.md
    python scripts/audit_privacy.py --scenario dirac-fast --break half_noise --seed-offset 10

Exit status 1 when a verdict is not the expected one (the correct mechanism flagged, or a
break missed although the design could refute its claim).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from . import (
    BREAKS,
    METHOD,
    MODES,
    AuditResult,
    AuditSetup,
    describe,
    expected_verdict,
    format_markdown,
    format_table,
    run_audits,
    table_rows,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick", help="quick: CI-sized; full: more canaries and seeds, opacus, ε = 8, GPT-2")
    parser.add_argument("--scenario", default=None, help="run only the scenario(s) of this name")
    parser.add_argument(
        "--break", dest="breakage", choices=BREAKS, default=None,
        help="audit only this mechanism (none = the correct one), in the scenarios that audit it; default: each scenario's list",
    )
    parser.add_argument("--seed-offset", type=int, default=0, help="shift every scenario's seed: fresh canaries, lots and noise")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: the audit's tensors are small, extra threads mostly contend)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every scenario's setup and results here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the results table here")
    return parser.parse_args(argv)


def selected_setups(args: argparse.Namespace) -> list[AuditSetup]:
    setups = [
        replace(setup, seed=setup.seed + args.seed_offset, confidence=args.confidence)
        for setup in MODES[args.mode]
        if (args.scenario is None or setup.name == args.scenario) and (args.breakage is None or args.breakage in setup.breaks)
    ]
    if not setups:
        names = sorted({setup.name for setup in MODES[args.mode]})
        raise SystemExit(f"error: no {args.mode}-mode scenario matches (scenarios: {', '.join(names)})")
    return setups


def markdown_report(command: str, results: list[AuditResult], setups: list[AuditSetup], seconds: float) -> str:
    return "\n".join(
        [
            "# Empirical privacy audit",
            "",
            f"Method: {METHOD}. `lb > ε` means the run is refuted as (ε, δ)-DP at the stated confidence.",
            "",
            f"Command: `{command}` — wall time {seconds / 60:.1f} min.",
            "",
            format_markdown(table_rows(results)),
            "",
            "Scenarios:",
            "",
            *(f"- {describe(setup)}" for setup in setups),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    command = shlex.join(["python", "scripts/audit_privacy.py", *(sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()
    print(f"method: {METHOD}")
    setups = selected_setups(args)
    report, results = [], []
    for setup in setups:
        scenario_start = time.perf_counter()
        outcome = run_audits(setup, None if args.breakage is None else (args.breakage,))
        print(f"\nscenario: {describe(setup)}")
        print(format_table(table_rows(outcome)))
        ceiling = outcome[0].ceiling
        if ceiling <= setup.epsilon:
            print(f"note: this design cannot refute ε = {setup.epsilon:g} (its ceiling is {ceiling:.2f}); no verdict above is evidence of correctness")
        print(f"wall time: {time.perf_counter() - scenario_start:.1f} s")
        results += outcome
        report.append({"setup": asdict(setup), "description": describe(setup), "results": [r.to_dict() for r in outcome]})
    seconds = time.perf_counter() - start
    print(f"\ntotal wall time: {seconds:.1f} s")
    if args.json is not None:
        summary = {"method": METHOD, "mode": args.mode, "command": command, "wall_seconds": seconds, "scenarios": report}
        args.json.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(markdown_report(command, results, setups, seconds))
    surprises = [r for r in results if not expected_verdict(r)]
    for r in surprises:
        print(f"UNEXPECTED: {r.scenario} (seed {r.seed}), {r.mechanism} at claimed ε = {r.claimed_epsilon:.3f}: {r.verdict}", file=sys.stderr)
    return 1 if surprises else 0

