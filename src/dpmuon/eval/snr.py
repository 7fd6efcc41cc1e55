"""The public signal-to-noise estimate of DP-Muon's momentum buffers over training.

Every DP-Muon(BC) step logs, per hidden matrix, SNR = (‖M‖² − s²mn) / (s²mn) of the matrix
handed to Newton–Schulz (computed from released quantities only), and `snr_median`, the median
over matrices. This plots `snr_median` per group: the mean over seeds, with a min–max band.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dpmuon.eval.curves import BAND_NOTE, ONE_RUN_NOTE, CurveBand, aggregate_curves, new_figure, optimizer_color, save_figure
from dpmuon.eval.grouping import runs_by_dataset
from dpmuon.eval.runs import Run

KEY = "snr_median"


def write_snr_plot(runs: Sequence[Run], out_dir: Path) -> list[Path]:
    written = []
    for dataset, dataset_runs in runs_by_dataset(runs).items():
        curves = [(g, b) for g, b in aggregate_curves(dataset_runs, KEY) if len(b.steps)]
        if not curves:
            continue
        folder = Path(out_dir) / dataset
        folder.mkdir(parents=True, exist_ok=True)
        figure = new_figure(width=6.5)
        axes = figure.subplots()
        for group, band in curves:
            color = optimizer_color(group.key.optimizer)
            axes.plot(band.steps, band.mean, color=color, label=f"{group.label} (n={len(group.runs)})")
            if len(group.runs) > 1:
                axes.fill_between(band.steps, band.low, band.high, color=color, alpha=0.2, linewidth=0)
        axes.axhline(1.0, color="gray", linestyle=":", linewidth=1, label="SNR = 1")
        axes.set_yscale("log")
        axes.set_xlabel("step")
        axes.set_ylabel("median over matrices of SNR(M)")
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize="small")
        note = BAND_NOTE if any(len(group.runs) > 1 for group, _ in curves) else ONE_RUN_NOTE
        figure.suptitle(f"{dataset}: momentum-buffer SNR from released quantities\n({note})", fontsize="medium")
        written.append(save_figure(figure, folder / "snr.png"))
        written.append(_write_csv(curves, folder / "snr.csv"))
    return written


def _write_csv(curves: list[tuple], path: Path) -> Path:
    lines = ["group,step,mean,min,max,runs"]
    for group, band in curves:
        band: CurveBand
        for i, step in enumerate(band.steps):
            lines.append(f"{group.label},{int(step)},{band.mean[i]:.6g},{band.low[i]:.6g},{band.high[i]:.6g},{int(band.n_runs[i])}")
    path.write_text("\n".join(lines) + "\n")
    return path
