"""Public pretraining for the CPU-scale reproduction: train the offline model non-privately on
public text disjoint from the private fine-tuning set, and save it as a model directory that
`model.name_or_path` accepts.

    python scripts/pretrain_public.py --private e2e   # public: DART's non-E2E annotations
    python scripts/pretrain_public.py --private dart  # public: E2E (private: DART minus E2E)
    python scripts/pretrain_public.py --private e2e --out models/public-for-e2e trainer.epochs=1

Extra arguments are Hydra overrides of the pretraining experiment
(`conf/experiment/public_for_<private>.yaml`). The run itself is a normal dpmuon run (metrics,
curves, checkpoints, resume) under outputs/; its final model is copied to --out.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from dpmuon import run_folder
from dpmuon.config import compose_config
from dpmuon.data import DataError
from dpmuon.errors import UserError
from dpmuon.training.loop import run

PUBLIC_CORPUS = {
    "e2e": "DART v1.1.1 annotations from WebNLG, WikiTableQuestions and WikiSQL (its E2E-derived part excluded)",
    "dart": "E2E (Prefix-Tuning format)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--private", choices=sorted(PUBLIC_CORPUS), required=True, help="the private set the model will be fine-tuned on")
    parser.add_argument("--out", type=Path, help="model directory to write (default: models/public-for-<private>)")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: outputs/public_for_<private>/seed<k>)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.epochs=1 seed=1")
    args = parser.parse_args(argv)

    out = args.out or Path("models") / f"public-for-{args.private}"
    cfg = compose_config(f"experiment=public_for_{args.private}", *args.overrides)
    run_dir = args.run_dir or Path("outputs") / f"public_for_{args.private}" / f"seed{cfg.seed}"
    print(f"public corpus for private={args.private}: {PUBLIC_CORPUS[args.private]}", file=sys.stderr)
    try:
        run(cfg, run_dir)
    except (UserError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(run_dir / run_folder.MODEL, out)
    print(f"wrote {out} (from {run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
