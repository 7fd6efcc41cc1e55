"""The CPU reproduction's planning: equal tuning budgets, selection by validation NLL only."""

from __future__ import annotations

from pathlib import Path

import pytest

from studies import reproduce_cpu as reproduce


def test_every_dp_optimizer_gets_the_same_tuning_budget():
    jobs = reproduce.tuning_jobs("e2e", steps=40)
    per_optimizer = {opt: [j for j in jobs if f"optimizer={opt}" in j.overrides] for opt in reproduce.DP_OPTIMIZERS}
    assert {len(v) for v in per_optimizer.values()} == {5}
    for job in jobs:
        assert "eval.test=false" in job.overrides and "trainer.steps=40" in job.overrides  # the test set stays unseen
    # DP-Muon(BC) tune one knob: the Adam part of the model follows the Muon rate.
    muon = next(j for j in jobs if "optimizer=dp_muonbc" in j.overrides)
    lr = next(o for o in muon.overrides if o.startswith("optimizer.lr=")).split("=")[1]
    assert f"optimizer.adam.lr={lr}" in muon.overrides


def test_selection_takes_the_lowest_validation_nll_and_skips_diverged_runs():
    summaries = [
        {"optimizer": opt, "learning_rate": lr, "val_nll": nll} for opt in reproduce.DP_OPTIMIZERS for lr, nll in ((1e-3, 2.0), (3e-3, 1.5), (1e-2, None))
    ]
    summaries[0]["val_nll"] = float("nan")
    assert reproduce.select_learning_rates(summaries) == dict.fromkeys(reproduce.DP_OPTIMIZERS, 3e-3)


def test_an_optimizer_without_a_usable_trial_is_an_error():
    summaries = [{"optimizer": "dp_sgd", "learning_rate": 1.0, "val_nll": None}]
    with pytest.raises(SystemExit, match="no usable tuning run"):
        reproduce.select_learning_rates(summaries)


def test_finals_cover_every_optimizer_and_seed_plus_the_non_private_reference():
    jobs = reproduce.final_jobs("dart", dict.fromkeys(reproduce.DP_OPTIMIZERS, 1e-3), seeds=[0, 1, 2])
    assert len(jobs) == 3 * (len(reproduce.DP_OPTIMIZERS) + 1)
    assert all("experiment=pretrained_tiny_dart" in j.overrides for j in jobs)
    assert {j.name for j in jobs if "optimizer=adam" in j.overrides} == {"adam_seed0", "adam_seed1", "adam_seed2"}
    # seed-major: the first five jobs are one complete seed of every optimizer
    assert [j.name for j in jobs[:5]] == [f"{opt}_seed0" for opt in (*reproduce.DP_OPTIMIZERS, "adam")]


def test_a_published_run_is_not_run_again_when_its_working_directory_is_gone(tmp_path, monkeypatch):
    job = reproduce.final_jobs("dart", dict.fromkeys(reproduce.DP_OPTIMIZERS, 1e-3), seeds=[0])[0]
    published = tmp_path / "results" / job.stage / job.name
    published.mkdir(parents=True)
    (published / "summary.json").write_text("{}")
    monkeypatch.setattr(reproduce.subprocess, "run", lambda *a, **k: pytest.fail("a published run was re-run"))
    assert reproduce.run_jobs([job], tmp_path / "work", tmp_path / "results", threads=1, parallel=1) == [published]


def _pretraining_run(path, losses):
    path.mkdir(parents=True)
    (path / "summary.json").write_text("{}")
    (path / "metrics.jsonl").write_text("".join(f'{{"step": {i + 1}, "train_loss": {x}, "step_seconds": {i}}}\n' for i, x in enumerate(losses)))
    return path


def test_a_rebuilt_public_model_is_recorded_beside_the_first_build_not_over_it(tmp_path):
    results = tmp_path / "results"
    assert reproduce.public_record(results, tmp_path / "run", "ab" * 32) == results / "public_pretraining"
    _pretraining_run(results / "public_pretraining", [9.0, 8.5])
    # same trajectory (timings aside): the same build, even before fingerprints were recorded
    same = _pretraining_run(tmp_path / "same", [9.0, 8.5])
    assert reproduce.public_record(results, same, "ab" * 32) == results / "public_pretraining"
    # a floating-point-level difference is another model
    rebuilt = _pretraining_run(tmp_path / "rebuilt", [9.0, 8.500001])
    assert reproduce.public_record(results, rebuilt, "cd" * 32) == results / f"public_pretraining-{'cd' * 6}"
    # once a fingerprint is recorded, it decides
    (results / "public_pretraining" / "weights_sha256.txt").write_text("cd" * 32 + "\n")
    assert reproduce.public_record(results, rebuilt, "cd" * 32) == results / "public_pretraining"


def test_a_run_is_published_as_soon_as_it_finishes(tmp_path, monkeypatch):
    job = reproduce.tuning_jobs("e2e", steps=40)[0]

    def fake_training(cmd, **kwargs):
        run_dir = Path(next(arg for arg in cmd if arg.startswith("hydra.run.dir=")).split("=", 1)[1])
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / "config.yaml").write_text("optimizer: {lr: 0.001}\n")
        (run_dir / "summary.json").write_text('{"val_nll": 2.0}')
        (run_dir / "checkpoint.pt").write_text("not published")
        return reproduce.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(reproduce.subprocess, "run", fake_training)
    [published] = reproduce.run_jobs([job], tmp_path / "work", tmp_path / "results", threads=1, parallel=1)
    assert published == tmp_path / "results" / job.stage / job.name
    assert sorted(p.name for p in published.iterdir()) == ["config.yaml", "summary.json"]
