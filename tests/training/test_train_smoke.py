"""The driver end to end on real E2E and DART subsets: the run-artifact contract (RunSummary, metrics.jsonl) and ε ≤ target."""

from __future__ import annotations

import dataclasses
import json
import stat

import pytest
from helpers_train import compose_config, require_real_data

from dpmuon.config.roster import optimizer_names
from dpmuon.eval.runs import RunSummary
from dpmuon.training.loop import run

TINY = [
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=300", "data.max_valid_examples=16", "data.max_test_sources=4",
    "privacy.expected_lot_size=16", "trainer.steps=4", "trainer.micro_batch_size=8",
    "trainer.eval_every=2", "trainer.checkpoint_every=2", "eval.num_beams=2", "eval.max_new_tokens=8",
    "logging.progress=false", "logger=none",
    "privacy.noise_multiplier=1.0",  # calibration (seconds of PRV) is exercised once, below
]  # fmt: skip
SUMMARY_KEYS = {
    "dataset",
    "optimizer",
    "model",
    "seed",
    "target_epsilon",
    "epsilon",
    "delta",
    "noise_multiplier",
    "sample_rate",
    "steps",
    "accountant",
    "clip_mode",
    "test_nll",
    "bleu",
    "rouge_l",
    "max_lot_size",
}  # fmt: skip  (train_seconds only with diagnostics published: it times the lots)


@pytest.mark.parametrize("dataset", ["e2e", "dart"])
@pytest.mark.parametrize("optimizer", optimizer_names(private=True))
def test_smoke_run_writes_the_artifact_contract(tmp_path, dataset, optimizer):
    require_real_data()
    cfg = compose_config("experiment=smoke", f"dataset={dataset}", f"optimizer={optimizer}", *TINY)
    summary = run(cfg, tmp_path)

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary and SUMMARY_KEYS <= set(on_disk)
    assert set(on_disk) == {f.name for f in dataclasses.fields(RunSummary)} - {"train_seconds"}  # the contract, exactly
    assert on_disk["learning_rates"] == ({"lr": cfg.optimizer.lr, "adam.lr": cfg.optimizer.adam.lr} if "muon" in optimizer else {"lr": cfg.optimizer.lr})
    assert on_disk["optimizer"] == optimizer and on_disk["dataset"] == dataset and on_disk["steps"] == 4
    assert 0 < on_disk["epsilon"] <= on_disk["target_epsilon"] == 8.0
    assert on_disk["noise_multiplier"] == 1.0 and on_disk["accountant"] == "prv"
    assert on_disk["test_nll"] > 0 and 0 <= on_disk["bleu"] <= 100 and 0 <= on_disk["rouge_l"] <= 100
    assert on_disk["initial_weights_sha256"] != on_disk["final_weights_sha256"]  # training moved the weights

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and set(rows[0]) == {"step", "val_nll"}  # before any release: the initial weights
    rows = rows[1:]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    released = {"epsilon", "lr", "noise_std", "noise_std_min", "noise_std_max"}
    of_the_lot = {"train_loss", "lot_size", "clip_fraction", "mean_grad_norm", "step_seconds"}
    assert all(released <= set(r) and not of_the_lot & set(r) for r in rows)
    # The raw lot's values: by default only in the owner-only diagnostics.jsonl, one row per step.
    diagnostics = tmp_path / "diagnostics.jsonl"
    assert stat.S_IMODE(diagnostics.stat().st_mode) == 0o600
    diagnostic_rows = [json.loads(line) for line in diagnostics.read_text().splitlines()]
    assert [r["step"] for r in diagnostic_rows] == [1, 2, 3, 4] and all(of_the_lot <= set(r) for r in diagnostic_rows)
    eps = [r["epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(on_disk["epsilon"])
    assert [r["step"] for r in rows if "val_nll" in r] == [2, 4]
    if optimizer.startswith("dp_muon"):
        assert len(rows[0]["snr"]) == 4  # one estimate per hidden matrix (1 layer × 4)

    generations = (tmp_path / "generations.txt").read_text().split("\n")[:-1]
    assert len(generations) == on_disk["test_sources"] == 4
    assert (tmp_path / "checkpoint.pt").exists()


def test_calibrated_run_spends_its_budget_and_no_more(tmp_path):
    require_real_data()
    cfg = compose_config("experiment=smoke", "optimizer=dp_adam", *TINY, "privacy.noise_multiplier=null", "privacy.target_epsilon=3")
    summary = run(cfg, tmp_path)
    assert summary["epsilon"] <= 3.0
    assert summary["epsilon"] == pytest.approx(3.0, abs=0.02)  # calibrated to the target, not far below


def test_disabling_nonprivate_diagnostics_leaves_only_released_quantities(tmp_path):
    require_real_data()
    cfg = compose_config("experiment=smoke", "optimizer=dp_muon", "logging.nonprivate_diagnostics=false", "logging.per_matrix_every=3", *TINY)
    run(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    allowed = {"step", "epsilon", "lr", "noise_std", "noise_std_min", "noise_std_max", "snr", "snr_median", "val_nll"}
    assert all(set(r) <= allowed for r in rows), [set(r) - allowed for r in rows]
    assert not (tmp_path / "diagnostics.jsonl").exists()
    # Per-matrix values every 3rd step and at the last; their median every step.
    assert [r["step"] for r in rows if "snr" in r] == [3, 4]
    assert [r["step"] for r in rows if "snr_median" in r] == [1, 2, 3, 4]


def test_non_private_reference_records_no_epsilon(tmp_path):
    require_real_data()
    summary = run(compose_config("experiment=smoke", "optimizer=adam", *TINY), tmp_path)
    assert summary["noise_multiplier"] == 0 and summary["epsilon"] is None and summary["private"] is False
    assert summary["releases_charged"] is None and summary["clip_mode"] is None and summary["sampling"] == "poisson"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not any(key in row for row in rows for key in ("epsilon", "noise_std"))  # no mechanism, nothing of one
    # No guarantee to keep: its diagnostics stay in metrics.jsonl, as its model reveals as much.
    assert all("train_loss" in row for row in rows[1:]) and not (tmp_path / "diagnostics.jsonl").exists()


def test_wandb_offline_run_is_written_beside_the_local_files(tmp_path, monkeypatch):
    require_real_data()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = run(compose_config("experiment=smoke", "optimizer=dp_muon", *TINY, "logger=wandb"), tmp_path)
    offline = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (tmp_path / "curves" / "e2e" / "curves.png").exists()


def test_end_to_end_run_feeds_the_table_and_curve_scripts(tmp_path):
    """Train → decode → score → table and curves, through the scripts' entry points."""
    require_real_data()
    from dpmuon.eval.cli import curves_main, tables_main

    summary = run(compose_config("experiment=smoke", "optimizer=dp_muonbc", *TINY), tmp_path / "runs" / "a")
    assert tables_main([str(tmp_path / "runs"), "--out", str(tmp_path / "results")]) == 0
    assert curves_main([str(tmp_path / "runs"), "--out", str(tmp_path / "results")]) == 0
    table = (tmp_path / "results" / "e2e" / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| dp_muonbc"))
    assert f"{summary['test_nll']:.4f}" in row and f"{summary['bleu']:.2f}" in row
    assert (tmp_path / "results" / "e2e" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
