"""Empirical privacy audit: canaries, one training run each, a lower bound on ε.

Trains with canaries through the real mechanism (the training loop's Poisson lot sampler, the
Privatizer's clipping + calibrated noise + accountant, SGD on the release), scores every
canary by the likelihood ratio of all its releases, and turns a membership test on the
canaries into lower bounds at confidence 1 − β (see dpmuon.audit). The verdict is the f-DP
claim test (dpmuon.audit.fdp): the accountant's whole privacy profile for (σ, q, T), refuted or
not. The correct mechanism must pass it and every white-box check (noise std, lot rate, noise
and lots independent across steps); each
mutation (`--mutation`, MUTATIONS) must be caught — by the audit where one run can refute the
claim, else by the check named for it (canaries.ONE_RUN_BLIND).

    python -m dpmuon.audit.cli                             # quick mode, for CI
    python -m dpmuon.audit.cli --mode mutations --json results/audit/mutations.json --markdown results/audit/mutations.md
    python -m dpmuon.audit.cli --mode mutations --mutation noise_0.8 --seed-offset 10
    python -m dpmuon.audit.cli --mode quick --mutation noise_reused       # = make audit-quick MUTATION=noise_reused
    python -m dpmuon.audit.cli --from-json results/audit/mutations.json --markdown results/audit/mutations.md

Exit status 1 when a verdict is not the expected one (the correct mechanism flagged, or a
mutation missed by what should catch it).
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

from ..jsontext import to_json
from . import (
    BREAKS,
    METHOD,
    MODES,
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
        "--mutation",
        "--break",
        dest="breakage",
        choices=BREAKS,
        default=None,
        help="audit only this mechanism (none = the correct one), in the scenarios that audit it; default: each scenario's list",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="run nothing: rewrite --markdown from a saved --json (the committed table regenerates from the committed JSON)",
    )
    parser.add_argument("--seed-offset", type=int, default=0, help="shift every scenario's seed: fresh canaries, lots and noise")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the audit's tensors are small, extra threads mostly contend)")
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


def markdown_report(summary: dict) -> str:
    """The markdown table of a saved (or just made) --json summary: a function of it alone."""
    results = [result for scenario in summary["scenarios"] for result in scenario["results"]]
    return "\n".join(
        [
            "# Empirical privacy audit",
            "",
            f"Method: {summary['method']}. Verdict: the accountant's claim — its privacy profile for (σ, q, T) and its "
            "(ε, δ) — is refuted at the stated confidence (`claim p` < 0.05). `lot-rate p`: the white-box sampler "
            "check; `noise-reuse p`, `lot-reuse p`: the white-box checks that steps draw independent noise and lots "
            "(— where the summary predates them); none is a privacy bound.",
            "",
            f"Command: `{summary['command']}` — wall time {summary['wall_seconds'] / 60:.1f} min.",
            "",
            format_markdown(table_rows(results)),
            "",
            "Scenarios:",
            "",
            *(f"- {scenario['description']}" for scenario in summary["scenarios"]),
            "",
        ]
    )


def usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        if args.markdown is None:
            return usage_error("--from-json needs --markdown, the table to write")
        try:
            table = markdown_report(json.loads(args.from_json.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            return usage_error(
                f"--from-json {args.from_json}: not a readable audit summary of this version ({type(err).__name__}: {err}); write one with --json"
            )
        args.markdown.write_text(table)
        return 0
    torch.set_num_threads(args.threads)
    command = shlex.join(["python", "-m", "dpmuon.audit.cli", *(sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()
    print(f"method: {METHOD}")
    setups = selected_setups(args)
    report, results = [], []
    for setup in setups:
        scenario_start = time.perf_counter()
        outcome = run_audits(setup, None if args.breakage is None else (args.breakage,))
        print(f"\nscenario: {describe(setup)}")
        print(format_table(table_rows(outcome)))
        print(f"wall time: {time.perf_counter() - scenario_start:.1f} s")
        results += outcome
        report.append({"setup": asdict(setup), "description": describe(setup), "results": [r.to_dict() for r in outcome]})
    seconds = time.perf_counter() - start
    print(f"\ntotal wall time: {seconds:.1f} s")
    summary = {"method": METHOD, "mode": args.mode, "command": command, "wall_seconds": seconds, "scenarios": report}
    if args.json is not None:
        args.json.write_text(to_json(summary, indent=2, ensure_ascii=False) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(markdown_report(summary))
    surprises = [r for r in results if not expected_verdict(r)]
    for r in surprises:
        print(f"UNEXPECTED: {r.scenario} (seed {r.seed}), {r.mechanism} at claimed ε = {r.claimed_epsilon:.3f}: {r.verdict}", file=sys.stderr)
    return 1 if surprises else 0


if __name__ == "__main__":
    raise SystemExit(main())
