"""Paired differences between optimizers: see `python scripts/compare_optimizers.py --help`."""

from dpmuon.eval.cli import compare_main

if __name__ == "__main__":
    raise SystemExit(compare_main())
