"""Plot training curves of runs: see `python scripts/make_curves.py --help`."""

from dpmuon.eval.cli import curves_main

if __name__ == "__main__":
    raise SystemExit(curves_main())
