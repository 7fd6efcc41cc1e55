"""The first pretrained model end to end (results/smollm2_lora, issue 27): SmolLM2-135M with
rank-8 LoRA adapters, DP fine-tuned on E2E at ε = 8 (conf/experiment/smollm2_lora_e2e.yaml),
DP-Adam and DP-Muon, one seed each, one CPU thread each.

    python -m studies.smollm2_lora run [--jobs 2]   # the runs (resumable; ~1 h each)
    python -m studies.smollm2_lora report           # results/smollm2_lora/e2e/table.*

Each run draws its own secret mechanism randomness (nothing is paired here).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dpmuon.eval import tables_main

from .jobs import REPO, Job, run_jobs

OPTIMIZERS = ("dp_adam", "dp_muon")
RESULTS = REPO / "results" / "smollm2_lora"


def jobs() -> list[Job]:
    return [Job(optimizer, "runs", ("experiment=smollm2_lora_e2e", f"optimizer={optimizer}")) for optimizer in OPTIMIZERS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "report"))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "smollm2_lora", help="working run directories")
    args = parser.parse_args(argv)
    if args.command == "report":
        return tables_main([str(RESULTS / "runs"), "--out", str(RESULTS), "--force"])
    if not (REPO / "models" / "smollm2").exists():
        raise SystemExit("models/smollm2 is missing: make models/smollm2")
    os.environ.setdefault("WANDB_MODE", "disabled")
    run_jobs(jobs(), args.work, RESULTS, threads=1, parallel=args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
