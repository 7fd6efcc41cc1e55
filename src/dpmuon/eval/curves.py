"""Training curves per dataset: validation NLL, train loss and ε spent against step, and each
DP method's validation NLL above the best DP method's (the gap panel).

One line per run group (see grouping.py): the mean over the group's seeds, with a band from
the minimum to the maximum over seeds where a group has more than one. The DP optimizers differ
by 0.01–0.15 in validation NLL, which an axis spanning the whole descent (and the non-private
reference) cannot show: the gap panel subtracts, at each step, the lowest DP mean and fits its
axis to the second half of training. Each optimizer has its
color and marker (DP methods share one ε curve, which would otherwise hide three of them), the
ε panel marks the target ε, and a run whose values went non-finite is labelled diverged. Every
panel labels its y axis; a panel with nothing logged is left out. The train loss of a private run
is a non-private diagnostic (outside its guarantee): its panel is drawn only when asked for
(`train_loss=True`, make_curves.py --train-loss) and says so in its title. Figures are built on
matplotlib's Agg canvas directly, without pyplot, so no global backend state is touched.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dpmuon.config.roster import optimizer_roster
from dpmuon.eval.grouping import RunGroup, group_runs, runs_by_dataset
from dpmuon.eval.runs import Run

# Fixed so that a method has the same color in every figure of every dataset (its YAML's `display.color`).
OPTIMIZER_COLORS = {entry.name: entry.color for entry in optimizer_roster()}
_OTHER_COLORS = ("#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
# Groups of one optimizer that differ in model or target ε share its color, not its line style.
_LINE_STYLES = ("-", "--", ":", "-.")
# A marker per optimizer, in roster order, on a few points each, offset so that equal curves
# (every DP method's ε) still show every method's markers.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
OPTIMIZER_MARKERS = {name: _MARKERS[i % len(_MARKERS)] for i, name in enumerate(OPTIMIZER_COLORS)}
MARKED_POINTS = 8
BAND_NOTE = "line: mean over seeds; band: min–max over seeds"
ONE_RUN_NOTE = "one run per line"
# Matplotlib otherwise stamps its version into the PNG; leaving it out keeps files reproducible.
_PNG_METADATA = {"Software": None}


@dataclass(frozen=True)
class Panel:
    key: str  # metrics.jsonl key
    title: str
    file_name: str
    ylabel: str
    gap: bool = False  # DP groups only, minus the lowest DP mean at each step


TRAIN_LOSS = Panel("train_loss", "train loss", "train_loss.png", "train loss (nats/token)")
PANELS = (
    Panel("val_nll", "validation NLL", "val_nll.png", "validation NLL (nats/token)"),
    Panel("val_nll", "validation NLL above the best DP method's", "val_nll_gap.png", "Δ validation NLL (nats/token)", gap=True),
    TRAIN_LOSS,
    Panel("epsilon", "ε spent", "epsilon.png", "ε spent"),
)
# The train-loss panel's title where a private run contributes to it.
PRIVATE_TRAIN_LOSS_TITLE = "train loss (non-private diagnostic: outside ε)"


@dataclass(frozen=True)
class CurveBand:
    """One group's curve: at each step, statistics over the runs that logged that step."""

    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    n_runs: np.ndarray


def run_series(rows: Sequence[dict], key: str) -> dict[int, float]:
    """step -> value of `key`; rows without it (or with null) are skipped, a repeated step keeps the last."""
    return {row["step"]: float(row[key]) for row in rows if row.get(key) is not None}


def aggregate_curves(runs: Sequence[Run], key: str, diagnostics: bool = True, pool: bool = False) -> list[tuple[RunGroup, CurveBand]]:
    """The curve of `key` for each group of one dataset's runs that logged it, in table order
    (diagnostics=False: from metrics.jsonl alone, leaving out the runs' diagnostics.jsonl; pool:
    see grouping.group_runs)."""
    curves = []
    for group in group_runs(runs, pool):
        series = [run_series(run.load_metrics(diagnostics), key) for run in group.runs]
        steps = sorted({step for per_run in series for step in per_run})
        if not steps:
            continue
        # Seeds may stop at different steps; each point averages the seeds that reached it.
        at_step = [[per_run[step] for per_run in series if step in per_run] for step in steps]
        curves.append((group, CurveBand(
            steps=np.array(steps),
            mean=np.array([np.mean(values) for values in at_step]),
            low=np.array([np.min(values) for values in at_step]),
            high=np.array([np.max(values) for values in at_step]),
            n_runs=np.array([len(values) for values in at_step]),
        )))  # fmt: skip
    return curves


def gaps_to_best_private(curves: list[tuple[RunGroup, CurveBand]]) -> list[tuple[RunGroup, CurveBand]]:
    """The DP groups' curves minus, at each step all of them logged, the lowest DP mean there
    (bands: each group's seed minimum and maximum minus that same mean); none for fewer than two
    DP groups."""
    private = [(group, band) for group, band in curves if group.key.private]
    if len(private) < 2:
        return []
    steps = np.array(sorted(set.intersection(*(set(band.steps.tolist()) for _, band in private))))
    if not len(steps):
        return []
    picked = [np.searchsorted(band.steps, steps) for _, band in private]
    best = np.min([band.mean[at] for (_, band), at in zip(private, picked)], axis=0)
    return [
        (group, CurveBand(steps, band.mean[at] - best, band.low[at] - best, band.high[at] - best, band.n_runs[at]))
        for (group, band), at in zip(private, picked)
    ]


def optimizer_color(optimizer: str) -> str:
    if optimizer in OPTIMIZER_COLORS:
        return OPTIMIZER_COLORS[optimizer]
    # A stable hash (unlike hash()) keeps unknown optimizers' colors fixed across runs too.
    return _OTHER_COLORS[zlib.crc32(optimizer.encode()) % len(_OTHER_COLORS)]


def write_curves(runs: Sequence[Run], out_dir: Path, diagnostics: bool = True, pool: bool = False, train_loss: bool = False) -> list[Path]:
    """Write curves.png and one PNG per panel for every dataset under `out_dir/<dataset>/`.

    diagnostics: whether the train-loss panel may show private runs' owner-only diagnostics
    (not covered by their guarantee); False draws only what metrics.jsonl publishes.
    train_loss: draw the train-loss panel at all. pool: see grouping.group_runs.
    A dataset whose runs logged nothing gets no figure.
    """
    written = []
    panels = [panel for panel in PANELS if train_loss or panel is not TRAIN_LOSS]
    for dataset, dataset_runs in runs_by_dataset(runs).items():
        curves = {panel: aggregate_curves(dataset_runs, panel.key, diagnostics, pool) for panel in panels}
        curves.update({panel: gaps_to_best_private(curves[panel]) for panel in panels if panel.gap})
        several = any(len(group.runs) > 1 for panel in curves.values() for group, _ in panel)
        note = BAND_NOTE if several else ONE_RUN_NOTE
        shown = [panel for panel in panels if curves[panel]]  # nothing logged (or one DP method: no gap): no panel
        if not shown:
            continue
        folder = Path(out_dir) / dataset
        folder.mkdir(parents=True, exist_ok=True)

        combined = new_figure(width=5.2 * len(shown))
        for axes, panel in zip(combined.subplots(1, len(shown), squeeze=False)[0], shown):
            draw_panel(axes, panel, curves[panel])
        combined.suptitle(f"{dataset} ({note})")
        written.append(save_figure(combined, folder / "curves.png"))

        for panel in shown:
            single = new_figure(width=6.0)
            draw_panel(single.subplots(), panel, curves[panel])
            single.suptitle(f"{dataset} ({note})", fontsize="medium")
            written.append(save_figure(single, folder / panel.file_name))
    return written


def diverged(run: Run) -> bool:
    """The run's loss or metrics went non-finite: its stop reason says so (newer runs), or its
    summary holds a NaN (older runs wrote them as bare NaN)."""
    if str(run.summary.get("stop_reason") or "").startswith("non-finite"):
        return True
    return any(isinstance(run.summary.get(key), float) and not math.isfinite(run.summary[key]) for key in ("test_nll", "val_nll"))


def draw_panel(axes: Axes, panel: Panel, curves: list[tuple[RunGroup, CurveBand]]) -> None:
    private_train_loss = panel is TRAIN_LOSS and any(group.key.private for group, _ in curves)
    axes.set_title(PRIVATE_TRAIN_LOSS_TITLE if private_train_loss else panel.title)
    axes.set_ylabel(panel.ylabel)
    variants_seen: dict[str, int] = {}
    for index, (group, band) in enumerate(curves):
        optimizer = group.key.optimizer
        variant = variants_seen.get(optimizer, 0)
        variants_seen[optimizer] = variant + 1
        color = optimizer_color(optimizer)
        every = max(len(curves), len(band.steps) // MARKED_POINTS)  # each curve's markers on its own steps
        pooled = f", pooled: {', '.join(group.pooled)} differ" if group.pooled else ""
        label = f"{group.label} (n={len(group.runs)}{pooled}{', diverged' if any(map(diverged, group.runs)) else ''})"
        axes.plot(
            band.steps, band.mean, color=color, linestyle=_LINE_STYLES[variant % len(_LINE_STYLES)],
            marker=OPTIMIZER_MARKERS.get(optimizer, "o"), markersize=4, markevery=(index % every, every), label=label,
        )  # fmt: skip
        if len(group.runs) > 1:
            axes.fill_between(band.steps, band.low, band.high, color=color, alpha=0.2, linewidth=0)
    if panel.gap:
        fit_to_second_half(axes, [band for _, band in curves])
    if panel.key == "epsilon":
        targets = sorted({group.key.target_epsilon for group, _ in curves if group.key.target_epsilon is not None})
        for i, target in enumerate(targets):
            axes.axhline(target, color="black", linestyle=":", linewidth=1, label="target ε" if i == 0 else None)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")


def fit_to_second_half(axes: Axes, bands: list[CurveBand]) -> None:
    """Limit the y axis to the means over the second half of the steps (early steps, where the
    methods differ by whole nats, run off the top) and mark zero, the best DP method."""
    late = np.concatenate([band.mean[band.steps >= band.steps[len(band.steps) // 2]] for band in bands])
    low, high = min(0.0, float(late.min())), float(late.max())
    pad = 0.1 * max(high - low, 0.01)
    axes.set_ylim(low - pad, high + pad)
    axes.axhline(0.0, color="black", linewidth=0.8)


def new_figure(width: float) -> Figure:
    figure = Figure(figsize=(width, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Figure, path: Path) -> Path:
    figure.savefig(path, format="png", dpi=120, metadata=_PNG_METADATA)
    return path
