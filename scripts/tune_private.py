"""Private hyper-parameter tuning by random stopping: see `python scripts/tune_private.py --help`."""

from dpmuon.experiments.tune_private import main

if __name__ == "__main__":
    raise SystemExit(main())
