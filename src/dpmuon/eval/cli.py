"""Command-line entry points behind scripts/make_tables.py and scripts/make_curves.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from dpmuon.eval.compare import write_comparisons
from dpmuon.eval.curves import write_curves
from dpmuon.eval.runs import Run, RunFormatError, find_runs
from dpmuon.eval.snr import write_snr_plot
from dpmuon.eval.sweeps import write_sweep_plots
from dpmuon.eval.tables import write_tables

# argparse's own convention for usage errors; also used for unusable input.
USAGE_ERROR = 2


def tables_main(argv: Sequence[str] | None = None) -> int:
    return _main(
        argv,
        prog="make_tables.py",
        description="Aggregate every run's summary.json into <out>/<dataset>/table.{md,csv,tex}: one row "
        "per (optimizer, model, target ε) with mean ± std over seeds, beside the paper's numbers.",
        write=write_tables,
        what="tables",
    )


def curves_main(argv: Sequence[str] | None = None) -> int:
    return _main(
        argv,
        prog="make_curves.py",
        description="Plot validation NLL, train loss and ε spent against step from every run's "
        "metrics.jsonl into <out>/<dataset>/curves.png (plus one PNG per panel): mean over seeds "
        "with a min–max band, one line per (optimizer, model, target ε).",
        write=write_curves,
        what="figures",
    )


def sweep_plots_main(argv: Sequence[str] | None = None) -> int:
    return _main(
        argv,
        prog="make_sweep_plots.py",
        description="Plot final BLEU and test NLL against target ε and against the clipping threshold "
        "from every run's summary.json into <out>/<dataset>/utility_vs_{epsilon,clip}.png: one line "
        "per optimizer (and clipping mode where it varies), mean over seeds with a min–max band.",
        write=write_sweep_plots,
        what="sweep plots",
    )


def snr_plot_main(argv: Sequence[str] | None = None) -> int:
    return _main(
        argv,
        prog="make_snr_plot.py",
        description="Plot the public SNR estimate of DP-Muon's momentum buffers (median over matrices) "
        "against step from every run's metrics.jsonl into <out>/<dataset>/snr.png and snr.csv.",
        write=write_snr_plot,
        what="SNR figures",
    )


def compare_main(argv: Sequence[str] | None = None) -> int:
    return _main(
        argv,
        prog="compare_optimizers.py",
        description="Paired (same-seed) differences between every two optimizer groups in test NLL, "
        "BLEU and ROUGE-L, from every run's summary.json, into <out>/<dataset>/comparison.md.",
        write=write_comparisons,
        what="comparisons",
    )


def _main(
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    write: Callable[[Sequence[Run], Path], list[Path]],
    what: str,
) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("runs_dirs", nargs="+", type=Path, metavar="RUNS_DIR",
                        help="run directories, or folders searched recursively for summary.json")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("results"), help="output folder (default: results)")
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.runs_dirs)
        if not runs:
            raise RunFormatError(f"no runs (summary.json) found under {', '.join(map(str, args.runs_dirs))}")
        written = write(runs, args.out)
    except RunFormatError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    print(f"Wrote {what} for {len(runs)} runs:")
    for path in written:
        print(f"  {path}")
    return 0
