"""Training curves built from synthetic run directories: mean and min–max bands, reproducible
PNGs, empty panels, the optimizers' colors and markers, the target ε, captions that match the
number of seeds, diverged runs, and the gap panel that shows how far apart the DP methods are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers_runs import PNG_SIGNATURE, training_rows, write_run
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from dpmuon.eval import curves
from dpmuon.eval.cli import curves_main
from dpmuon.eval.curves import PANELS, CurveBand, aggregate_curves, draw_panel, gaps_to_best_private, optimizer_color
from dpmuon.eval.grouping import group_runs
from dpmuon.eval.runs import find_runs

GAP = next(panel for panel in PANELS if panel.gap)


def test_curve_aggregation_means_and_min_max_band(runs_root: Path):
    e2e_runs = [run for run in find_runs([runs_root]) if run.dataset == "e2e"]
    val_nll = {group.label: band for group, band in aggregate_curves(e2e_runs, "val_nll")}
    assert list(val_nll) == ["dp_adam", "dp_muonbc", "adam"]  # dp_sgd logged nothing

    dp_adam = val_nll["dp_adam"]  # separate validation rows; seeds offset by 0.2
    assert dp_adam.steps.tolist() == [20, 30]
    assert dp_adam.mean.tolist() == pytest.approx([2.08, 2.07])
    assert dp_adam.low.tolist() == pytest.approx([1.98, 1.97])
    assert dp_adam.high.tolist() == pytest.approx([2.18, 2.17])

    dp_muonbc = val_nll["dp_muonbc"]  # merged rows; seed 1 stopped at step 20
    assert dp_muonbc.n_runs.tolist() == [2, 1]
    assert dp_muonbc.mean.tolist() == pytest.approx([2.08, 1.97])

    train_loss = {group.label: band for group, band in aggregate_curves(e2e_runs, "train_loss")}
    assert "adam" not in train_loss  # non-private run logged no train loss
    assert train_loss["dp_adam"].mean.tolist() == pytest.approx([2.95, 2.85, 2.75])
    epsilon = {group.label: band for group, band in aggregate_curves(e2e_runs, "epsilon")}
    assert list(epsilon) == ["dp_adam", "dp_muonbc"]
    assert epsilon["dp_adam"].high[-1] == pytest.approx(8.0)


def test_curves_are_written_as_reproducible_pngs(runs_root: Path, tmp_path: Path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    assert curves_main([str(runs_root), "--out", str(first), "--train-loss"]) == 0
    assert str(first / "e2e" / "curves.png") in capsys.readouterr().out
    curves_main([str(runs_root), "--out", str(second), "--train-loss"])
    for name in ["curves.png"] + [panel.file_name for panel in PANELS]:
        data = (first / "e2e" / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        assert data == (second / "e2e" / name).read_bytes()
    assert not (first / "dart").exists()  # its one run logged nothing: no figure of empty panels


def test_paper_optimizers_have_fixed_distinct_colors():
    names = ["dp_sgd", "dp_adam", "dp_muon", "dp_muonbc", "adam", "muon"]
    assert len({optimizer_color(name) for name in names}) == len(names)
    assert optimizer_color("my_new_optimizer") == optimizer_color("my_new_optimizer")


def test_the_epsilon_panel_marks_the_target_and_every_optimizer_stays_visible(runs_root: Path):
    e2e_runs = [run for run in find_runs([runs_root]) if run.dataset == "e2e"]
    axes: Axes = Figure().subplots()
    (epsilon,) = [panel for panel in PANELS if panel.key == "epsilon"]
    draw_panel(axes, epsilon, aggregate_curves(e2e_runs, "epsilon"))
    target = [line for line in axes.get_lines() if line.get_label() == "target ε"]
    assert len(target) == 1 and list(target[0].get_ydata()) == [8.0, 8.0]
    curves = [line for line in axes.get_lines() if line.get_label() != "target ε"]
    assert len({line.get_marker() for line in curves}) == len(curves) == 2  # equal ε curves, told apart by marker
    assert all(tick == int(tick) for tick in axes.get_xticks())  # steps: no fractional ticks


def test_captions_match_the_number_of_seeds_and_a_diverged_run_says_so(tmp_path: Path, monkeypatch):
    write_run(tmp_path, "ok", training_rows(0), seed=0)
    write_run(tmp_path, "nan", [{"step": 10, "lr": 1e-3, "epsilon": 1.0, "val_nll": None}], optimizer="dp_sgd", stop_reason="non-finite: …")
    titles, panels = [], {}

    def keep(figure, path):
        titles.append(figure._suptitle.get_text())
        panels[path.name] = figure.axes
        return path

    monkeypatch.setattr(curves, "save_figure", keep)
    curves.write_curves(find_runs([tmp_path]), tmp_path / "out", train_loss=True)
    assert titles and all(title == f"e2e ({curves.ONE_RUN_NOTE})" for title in titles)  # no "band: min–max" over one seed
    assert not any(axes.collections for figure_axes in panels.values() for axes in figure_axes)  # no band drawn
    (train_loss,) = panels["train_loss.png"]
    assert [line.get_label() for line in train_loss.get_lines()] == ["dp_adam (n=1)"]
    (epsilon,) = panels["epsilon.png"]
    assert "dp_sgd (n=1, diverged)" in [line.get_label() for line in epsilon.get_lines()]


def test_the_gap_panel_subtracts_the_best_dp_mean_at_each_step_and_leaves_out_non_private_runs(runs_root: Path):
    e2e_runs = [run for run in find_runs([runs_root]) if run.dataset == "e2e"]
    gaps = {group.label: band for group, band in gaps_to_best_private(aggregate_curves(e2e_runs, "val_nll"))}
    assert list(gaps) == ["dp_adam", "dp_muonbc"]  # adam (non-private, lower) is no reference
    # means: dp_adam 2.08, 2.07; dp_muonbc 2.08, 1.97 at steps 20, 30
    assert gaps["dp_adam"].mean.tolist() == pytest.approx([0.0, 0.1])
    assert gaps["dp_muonbc"].mean.tolist() == pytest.approx([0.0, 0.0])
    assert gaps["dp_adam"].high.tolist() == pytest.approx([0.1, 0.2])  # the seed band moves with the mean
    one_dp = [run for run in e2e_runs if run.optimizer != "dp_adam"]
    assert gaps_to_best_private(aggregate_curves(one_dp, "val_nll")) == []


def test_the_gap_axis_shows_late_differences_of_hundredths_not_the_early_descent(runs_root: Path):
    steps = np.arange(10, 110, 10)
    early_then_close = np.array([1.2, 0.6, 0.3, 0.1, 0.05, 0.03, 0.03, 0.02, 0.02, 0.02])
    bands = [CurveBand(steps, values, values, values, np.ones(10)) for values in (np.zeros(10), early_then_close)]
    e2e_runs = [run for run in find_runs([runs_root]) if run.dataset == "e2e"]  # group_runs takes one dataset's runs
    groups = [group for group in group_runs(e2e_runs) if group.key.private][:2]
    axes: Axes = Figure().subplots()
    draw_panel(axes, GAP, list(zip(groups, bands)))
    low, high = axes.get_ylim()
    assert low < 0.0 < 0.03 < high < 0.05  # the 0.02-0.03 gaps fill the axis; step 10's 1.2 runs off the top
