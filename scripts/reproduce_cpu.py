"""The committed CPU-scale reproduction: see `python scripts/reproduce_cpu.py --help`."""

from dpmuon.experiments.reproduce_cpu import main

if __name__ == "__main__":
    raise SystemExit(main())
