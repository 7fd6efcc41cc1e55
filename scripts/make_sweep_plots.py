"""Plot utility against ε and the clipping threshold from sweep runs: see `python scripts/make_sweep_plots.py --help`."""

from dpmuon.eval.cli import sweep_plots_main

if __name__ == "__main__":
    raise SystemExit(sweep_plots_main())
