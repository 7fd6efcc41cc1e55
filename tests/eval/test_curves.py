"""Training curves built from synthetic run directories: mean and min–max bands, reproducible
PNGs, empty panels, and the optimizers' colors."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_runs import PNG_SIGNATURE
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from dpmuon.eval.cli import curves_main
from dpmuon.eval.curves import NOT_LOGGED, PANELS, aggregate_curves, draw_panel, optimizer_color
from dpmuon.eval.runs import find_runs


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
    assert curves_main([str(runs_root), "--out", str(first)]) == 0
    assert str(first / "e2e" / "curves.png") in capsys.readouterr().out
    curves_main([str(runs_root), "--out", str(second)])
    names = ["curves.png"] + [panel.file_name for panel in PANELS]
    for dataset in ("e2e", "dart"):
        for name in names:
            data = (first / dataset / name).read_bytes()
            assert data.startswith(PNG_SIGNATURE)
            assert data == (second / dataset / name).read_bytes()


def test_empty_panel_says_not_logged():
    axes: Axes = Figure().subplots()
    draw_panel(axes, PANELS[0], [])
    assert [text.get_text() for text in axes.texts] == [NOT_LOGGED]


def test_paper_optimizers_have_fixed_distinct_colors():
    names = ["dp_sgd", "dp_adam", "dp_muon", "dp_muonbc", "adam", "muon"]
    assert len({optimizer_color(name) for name in names}) == len(names)
    assert optimizer_color("my_new_optimizer") == optimizer_color("my_new_optimizer")

