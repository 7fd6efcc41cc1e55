"""Plot the momentum-buffer SNR of DP-Muon runs: see `python scripts/make_snr_plot.py --help`."""

from dpmuon.eval.cli import snr_plot_main

if __name__ == "__main__":
    raise SystemExit(snr_plot_main())
