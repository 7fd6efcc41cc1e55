"""Sweep plots: final utility (BLEU, test NLL) against ε and against the clipping threshold.

Each point is the mean over seeds of one setting, with a min–max band; one line per optimizer
(and clipping mode, where the sweep varies it). Non-private references, when present, are
drawn as horizontal lines.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.ticker import NullFormatter

from dpmuon.eval.curves import OPTIMIZER_COLORS, new_figure, optimizer_color, save_figure
from dpmuon.eval.grouping import runs_by_dataset
from dpmuon.eval.runs import Run

METRICS = (("bleu", "BLEU (multi-ref)"), ("test_nll", "test NLL per token"))
AXES = (("target_epsilon", "ε (target)", "utility_vs_epsilon.png"), ("clip_norm", "clipping threshold C", "utility_vs_clip.png"))


@dataclass(frozen=True)
class SweepLine:
    label: str
    optimizer: str
    x: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    seeds: np.ndarray


def sweep_lines(runs: Sequence[Run], x_key: str, metric: str) -> list[SweepLine]:
    """Private runs grouped by optimizer (+ whatever else varies besides `x_key` and the seed)."""
    private = [r for r in runs if r.is_private and r.summary.get(x_key) is not None and r.summary.get(metric) is not None]
    # Any setting besides x and the seed that the runs differ in splits the lines, never averaged over.
    settings = ("clip_mode", "clip_norm", "target_epsilon", "model", "planned_steps", "expected_lot_size", "delta", "dataset_size")
    varying = [k for k in settings if k != x_key and len({repr(r.summary.get(k)) for r in private}) > 1]
    points: dict[tuple, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in private:
        key = (run.optimizer, *(run.summary.get(k) for k in varying))
        points[key][float(run.summary[x_key])].append(float(run.summary[metric]))
    lines = []
    order = list(OPTIMIZER_COLORS)
    for key in sorted(points, key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k)):
        xs = sorted(points[key])
        values = [points[key][x] for x in xs]
        details = ", ".join(f"{k}={v}" for k, v in zip(varying, key[1:]))
        lines.append(SweepLine(
            label=f"{key[0]} ({details})" if details else key[0], optimizer=key[0], x=np.array(xs),
            mean=np.array([np.mean(v) for v in values]), low=np.array([np.min(v) for v in values]),
            high=np.array([np.max(v) for v in values]), seeds=np.array([len(v) for v in values]),
        ))  # fmt: skip
    return lines


def write_sweep_plots(runs: Sequence[Run], out_dir: Path) -> list[Path]:
    """For each dataset and each swept axis with ≥ 2 values: one figure, BLEU and NLL panels."""
    written = []
    for dataset, dataset_runs in runs_by_dataset(runs).items():
        references = [r for r in dataset_runs if not r.is_private]
        for x_key, x_label, file_name in AXES:
            if len({r.summary.get(x_key) for r in dataset_runs if r.is_private} - {None}) < 2:
                continue
            figure = new_figure(width=11.0)
            for axes, (metric, title) in zip(figure.subplots(1, len(METRICS)), METRICS):
                for line_no, line in enumerate(sweep_lines(dataset_runs, x_key, metric)):
                    color = optimizer_color(line.optimizer)
                    style = ("-", "--", ":", "-.")[line_no % 4] if line.label != line.optimizer else "-"
                    seeds = f"n={line.seeds.max()}" if line.seeds.min() == line.seeds.max() else f"n={line.seeds.min()}–{line.seeds.max()}"
                    axes.plot(line.x, line.mean, marker="o", color=color, linestyle=style, label=f"{line.label} ({seeds})")
                    axes.fill_between(line.x, line.low, line.high, color=color, alpha=0.15, linewidth=0)
                for ref in references:
                    if ref.summary.get(metric) is not None:
                        axes.axhline(
                            ref.summary[metric], color=optimizer_color(ref.optimizer), linestyle=":", linewidth=1, label=f"{ref.optimizer} (non-private)"
                        )
                axes.set_xscale("log")
                xs = sorted({float(r.summary[x_key]) for r in dataset_runs if r.is_private and r.summary.get(x_key) is not None})
                axes.set_xticks(xs, [f"{x:g}" for x in xs])
                axes.xaxis.set_minor_formatter(NullFormatter())
                axes.set_xlabel(x_label)
                axes.set_title(title)
                axes.set_ylabel(title)
                axes.grid(alpha=0.3, which="both")
                axes.legend(fontsize="x-small")
            figure.suptitle(f"{dataset}: final utility vs {x_label} (mean over seeds, band min–max)")
            folder = Path(out_dir) / dataset
            folder.mkdir(parents=True, exist_ok=True)
            written.append(save_figure(figure, folder / file_name))
    return written
