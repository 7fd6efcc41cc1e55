"""Command-line entry points behind scripts/make_tables.py and scripts/make_curves.py."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from dpmuon.eval.compare import write_comparisons
from dpmuon.eval.curves import write_curves
from dpmuon.eval.runs import RunFormatError, find_runs
from dpmuon.eval.snr import write_snr_plot
from dpmuon.eval.sweeps import write_sweep_plots
from dpmuon.eval.tables import write_tables
from dpmuon.paths import REPO_ROOT

# argparse's own convention for usage errors; also used for unusable input.
USAGE_ERROR = 2
# The default output folder, inside the first RUNS_DIR: never the committed results/.
DEFAULT_OUT = "report"
# Options only some reports take (their write function's keyword of the same name).
FLAGS = {
    "pool": "average runs of one row/line that differ in a setting (steps, ε, lot size, optimizer settings…) or "
    "repeat a seed; without it they are refused, naming the setting and the runs",
    "train_loss": "also plot the train loss: for private runs a non-private diagnostic (owner-only, outside the guarantee), so it is off by default",
}


def tables_main(argv: Sequence[str] | None = None) -> int:
    return _main(
        argv,
        prog="make_tables.py",
        description="Aggregate every run's summary.json into <out>/<dataset>/table.{md,csv,tex}: one row "
        "per (optimizer, model, target ε) with mean ± std over seeds, beside the paper's numbers.",
        write=write_tables,
        what="tables",
        flags=("pool",),
    )


def curves_main(argv: Sequence[str] | None = None) -> int:
    return _main(
        argv,
        prog="make_curves.py",
        description="Plot validation NLL (also each DP method's above the best DP method's), ε spent and, with "
        "--train-loss, the train loss against step from every run's "
        "metrics.jsonl into <out>/<dataset>/curves.png (plus one PNG per panel): mean over seeds "
        "with a min–max band, one line per (optimizer, model, target ε).",
        write=write_curves,
        what="figures",
        flags=("pool", "train_loss"),
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
        flags=("pool",),
    )


def _main(
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    write: Callable[..., list[Path]],
    what: str,
    flags: Sequence[str] = (),
) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("runs_dirs", nargs="+", type=Path, metavar="RUNS_DIR",
                        help="run directories, or folders searched recursively for summary.json")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output folder (default: RUNS_DIR/{DEFAULT_OUT}, beside the runs it reads)")  # fmt: skip
    parser.add_argument("--force", action="store_true",
                        help="replace committed files (tracked by git, or under the repository's results/)")  # fmt: skip
    for flag in flags:
        parser.add_argument(f"--{flag.replace('_', '-')}", action="store_true", help=FLAGS[flag])
    args = parser.parse_args(argv)
    chosen = {flag: getattr(args, flag) for flag in flags}
    out = args.out if args.out is not None else args.runs_dirs[0] / DEFAULT_OUT
    try:
        if out.exists() and not out.is_dir():
            raise RunFormatError(f"--out {out} is a file, not a folder")
        runs = find_runs(args.runs_dirs)
        if not runs:
            raise RunFormatError(f"no runs (summary.json) found under {', '.join(map(str, args.runs_dirs))}")
        written = _write_without_clobbering(lambda folder: write(runs, folder, **chosen), out, args.force)
    except RunFormatError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as error:  # a read-only or otherwise unusable output folder
        print(f"{prog}: error: cannot write to {out}: {error.strerror or error}"
              + (f" ({error.filename})" if error.filename else ""), file=sys.stderr)  # fmt: skip
        return USAGE_ERROR
    print(f"Wrote {what} for {len(runs)} runs:")
    for path in written:
        print(f"  {path}")
    return 0


def _write_without_clobbering(write: Callable[[Path], list[Path]], out: Path, force: bool) -> list[Path]:
    """Write into a scratch folder, then move each file to `out`: a committed file there that
    would change is replaced only with `force`, and then nothing is written at all."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".scratch-") as scratch:
        made = write(Path(scratch))
        targets = {path: out / path.relative_to(scratch) for path in made}
        changed = [t for p, t in targets.items() if t.exists() and t.read_bytes() != p.read_bytes()]
        protected = [t for t in changed if _committed(t)]
        if protected and not force:
            shown = ", ".join(map(str, protected[:3])) + (f" and {len(protected) - 3} more" if len(protected) > 3 else "")
            raise RunFormatError(f"would overwrite committed file(s) {shown}; pass --force to replace them, or --out to write elsewhere")
        for path, target in targets.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
    return list(targets.values())


def _committed(path: Path) -> bool:
    """Under the repository's results/, or tracked by git: a committed result, not scratch output."""
    resolved = path.resolve()
    if resolved.is_relative_to(REPO_ROOT / "results"):
        return True
    try:
        done = subprocess.run(["git", "ls-files", "--error-unmatch", str(resolved)], cwd=resolved.parent,
                              capture_output=True, check=False)  # fmt: skip
    except OSError:  # no git: nothing is tracked
        return False
    return done.returncode == 0
