"""Reports never average unlike runs silently (issue 42): runs of one row/line that differ in a
setting or repeat a seed are refused in one line, or pooled with --pool and said so; figures
label every y axis, draw no empty panel and leave the train loss out unless asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_runs import training_rows, write_run

from dpmuon.eval import curves
from dpmuon.eval.cli import compare_main, curves_main, tables_main


def refused(capsys, main, *args) -> str:
    assert main([str(arg) for arg in args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.mark.parametrize(
    "setting, first, second",
    [("steps", 30, 16), ("planned_steps", 30, 16), ("expected_lot_size", 256, 512), ("sample_rate", 0.024, 0.05),
     ("delta", 8e-6, 1e-5), ("clip_norm", 0.1, 1.0), ("learning_rates", {"lr": 1e-3}, {"lr": 2e-3}),
     ("dataset_size", 1000, 500), ("max_lot_size", 300, None)],
)  # fmt: skip
@pytest.mark.parametrize("main", [tables_main, curves_main, compare_main], ids=["tables", "curves", "compare"])
def test_runs_that_differ_in_a_setting_are_refused_naming_it(tmp_path: Path, capsys, main, setting, first, second):
    a = write_run(tmp_path, "a", training_rows(0), seed=0, **{setting: first})
    b = write_run(tmp_path, "b", training_rows(1), seed=1, **{setting: second})
    err = refused(capsys, main, tmp_path, "--out", tmp_path / "out")
    assert f"the runs averaged as dp_adam differ in {setting!r}: {first!r} ({a}) vs {second!r} ({b})" in err
    assert "--pool" in err


def test_the_issue_case_a_30_and_a_16_step_run_of_seed_0(tmp_path: Path, capsys):
    write_run(tmp_path, "outputs/long", training_rows(0, 30), steps=30, planned_steps=30)
    write_run(tmp_path, "outputs/short", training_rows(0, 10), steps=16, planned_steps=16)
    assert "differ in 'steps'" in refused(capsys, tables_main, tmp_path / "outputs", "--out", tmp_path / "t")
    assert "differ in 'steps'" in refused(capsys, curves_main, tmp_path / "outputs", "--out", tmp_path / "c")


def test_two_runs_of_one_seed_are_refused(tmp_path: Path, capsys):
    a, b = write_run(tmp_path, "a", seed=0), write_run(tmp_path, "b", seed=0)
    err = refused(capsys, tables_main, tmp_path, "--out", tmp_path / "out")
    assert f"repeat seed 0 ({a}, {b})" in err and "n=2" in err


def test_differing_optimizer_settings_in_the_config_are_refused(tmp_path: Path, capsys):
    for seed, momentum in enumerate((0.9, 0.95)):
        run = write_run(tmp_path, f"s{seed}", seed=seed)
        (run / "config.yaml").write_text(f"optimizer:\n  name: dp_adam\n  lr: 0.001\n  momentum: {momentum}\n")
    assert "differ in their config's optimizer section" in refused(capsys, tables_main, tmp_path, "--out", tmp_path / "out")


def test_a_run_stopped_early_still_averages_with_its_seeds(tmp_path: Path, capsys):
    write_run(tmp_path, "a", seed=0, steps=30, planned_steps=30)
    write_run(tmp_path, "b", seed=1, steps=12, planned_steps=30, stop_reason="privacy budget exhausted")
    assert tables_main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0


def test_pool_averages_them_and_says_what_differs(tmp_path: Path, capsys):
    write_run(tmp_path, "a", seed=0, steps=30)
    write_run(tmp_path, "b", seed=0, steps=16)
    assert tables_main([str(tmp_path), "--out", str(tmp_path / "out"), "--pool"]) == 0
    table = (tmp_path / "out" / "e2e" / "table.md").read_text()
    assert "2 (seeds 0, 0; repeated: seed 0 ×2)" in table
    assert "**Pooled (--pool): dp_adam averages runs that differ in steps, seed.**" in table


def figures(tmp_path: Path, monkeypatch, *args) -> dict:
    """{file name: figure} of a make_curves run, kept instead of saved."""
    made = {}

    def keep(figure, path):
        made[path.name] = figure
        path.write_bytes(b"")
        return path

    monkeypatch.setattr(curves, "save_figure", keep)
    assert curves_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *args]) == 0
    return made


def test_every_panel_has_a_y_label_and_none_is_empty(tmp_path: Path, monkeypatch):
    write_run(tmp_path, "runs/a", training_rows(0), seed=0)
    write_run(tmp_path, "runs/b", [{"step": 10, "epsilon": 1.0}], optimizer="dp_sgd")  # only ε logged
    made = figures(tmp_path, monkeypatch, "--train-loss")
    for name, figure in made.items():
        for axes in figure.axes:
            assert axes.get_ylabel(), f"{name}: {axes.get_title()} has no y label"
            assert axes.get_lines(), f"{name}: {axes.get_title()} is empty"
            assert not axes.texts  # no "not logged" placeholder
    assert len(made["curves.png"].axes) == 3  # val NLL, train loss, ε: dp_sgd logged no val NLL, so no gap


def test_a_panel_nothing_logged_is_left_out(tmp_path: Path, monkeypatch):
    write_run(tmp_path, "runs/a", [{"step": 10, "epsilon": 1.0}, {"step": 20, "epsilon": 2.0}])
    made = figures(tmp_path, monkeypatch, "--train-loss")
    assert [axes.get_title() for axes in made["curves.png"].axes] == ["ε spent"]
    assert sorted(made) == ["curves.png", "epsilon.png"]


def test_the_train_loss_is_left_out_by_default_and_captioned_when_asked(tmp_path: Path, monkeypatch):
    write_run(tmp_path, "runs/a", training_rows(0))
    default = figures(tmp_path, monkeypatch)
    assert "train_loss.png" not in default
    assert "train loss" not in " ".join(axes.get_title() for axes in default["curves.png"].axes)
    asked = figures(tmp_path, monkeypatch, "--train-loss")
    (axes,) = asked["train_loss.png"].axes
    assert axes.get_title() == curves.PRIVATE_TRAIN_LOSS_TITLE and "non-private" in axes.get_title()


def test_a_summary_records_ledger_head_and_length_fields():
    from dpmuon.eval.runs import RunSummary

    fields = RunSummary.__dataclass_fields__
    assert fields["ledger_head"].default is None and fields["ledger_length"].default is None
    assert json.dumps({"ledger_head": "x"})  # (the study compares them with the ledger: test_study_agreement.py)


def test_sweep_lines_split_runs_of_other_lengths_and_label_their_y_axes(tmp_path: Path, monkeypatch):
    from dpmuon.eval import sweeps
    from dpmuon.eval.runs import find_runs

    for seed, (epsilon, steps) in enumerate([(1.0, 30), (8.0, 30), (1.0, 16), (8.0, 16)]):
        write_run(tmp_path, f"r{seed}", seed=seed, target_epsilon=epsilon, planned_steps=steps)
    lines = sweeps.sweep_lines(find_runs([tmp_path]), "target_epsilon", "bleu")
    assert [line.label for line in lines] == ["dp_adam (planned_steps=16)", "dp_adam (planned_steps=30)"]
    made = {}
    monkeypatch.setattr(sweeps, "save_figure", lambda figure, path: made.setdefault(path.name, figure) and path)
    sweeps.write_sweep_plots(find_runs([tmp_path]), tmp_path / "out")
    assert all(axes.get_ylabel() for axes in made["utility_vs_epsilon.png"].axes)
