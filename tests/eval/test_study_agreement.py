"""The study counts what the runs' summaries say: a ledger cut short or re-chained is refused,
runs with published seeds have no guarantee, and runs planned for different ε compose to a
finite ε (issues 37 and 42)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dpmuon.eval.study import main, read_run
from dpmuon.privacy import PrivacyLedger
from dpmuon.privacy.accountant import ReleaseSlack, epsilon_after
from dpmuon.privacy.composition import RunRecord, composed_epsilon
from dpmuon.privacy.ledger import line_hash
from dpmuon.privacy.randomness import OS_ENTROPY, USER_SEED

PROG = "python -m dpmuon.eval.study"
HEADER = {"dataset": "e2e", "dataset_size": 1000, "delta": 1e-5, "accountant": "prv"}


def finished_run(run_dir: Path, steps: int = 6, **summary_fields) -> Path:
    """A private run as the trainer leaves it: a chained ledger and the summary written from it."""
    run_dir.mkdir(parents=True)
    ledger = PrivacyLedger(run_dir / "privacy_ledger.jsonl", HEADER)
    for step in range(1, steps + 1):
        ledger.record(step, 1.0, 0.01, f"{step:064x}")
    summary = {**HEADER, "optimizer": "dp_adam", "private": True, "seed": 0, "noise_multiplier": 1.0, "sample_rate": 0.01,
               "steps": steps, "releases_charged": steps, "ledger_head": ledger.head, "ledger_length": ledger.length,
               "mechanism_randomness": OS_ENTROPY, **summary_fields}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def refused(capsys, *args) -> str:
    assert main([str(arg) for arg in args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def rechain(run_dir: Path, keep: int) -> None:
    """The first `keep` releases under a fresh, self-consistent chain (a new run ID, every prev recomputed)."""
    path = run_dir / "privacy_ledger.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()[: keep + 1]]
    path.unlink()
    ledger = PrivacyLedger(path, {key: value for key, value in records[0].items() if key not in ("kind", "format", "run_id")})
    for release in records[1:]:
        ledger.record(release["step"], release["noise_multiplier"], release["sample_rate"], release["release_sha256"])


def test_a_finished_run_is_read_from_its_ledger(tmp_path: Path):
    assert read_run(finished_run(tmp_path / "run")).charged == 6


@pytest.mark.parametrize("summary_fields", [{}, {"ledger_head": None, "ledger_length": None}], ids=["with-head", "older-summary"])
def test_a_truncated_ledger_is_refused(tmp_path: Path, capsys, summary_fields):
    run = finished_run(tmp_path / "run", **summary_fields)
    ledger = run / "privacy_ledger.jsonl"
    ledger.write_text("".join(ledger.read_text().splitlines(keepends=True)[:3]))  # head -n 3
    err = refused(capsys, run)
    assert err.startswith(f"{PROG}: error: {run}: privacy_ledger.jsonl does not match summary.json")
    assert ("ledger_head" if summary_fields == {} else "releases_charged") in err


@pytest.mark.parametrize("summary_fields", [{}, {"ledger_head": None, "ledger_length": None}], ids=["with-head", "older-summary"])
def test_a_rechained_ledger_is_refused(tmp_path: Path, capsys, summary_fields):
    run = finished_run(tmp_path / "run", **summary_fields)
    rechain(run, keep=3)
    assert "does not match summary.json" in refused(capsys, run)


def test_a_ledger_rechained_with_as_many_releases_is_refused_by_its_head(tmp_path: Path, capsys):
    run = finished_run(tmp_path / "run")
    rechain(run, keep=6)  # same count, another chain: not the ledger the summary was written from
    assert "ledger_head" in refused(capsys, run)


def test_a_ledger_that_stops_before_the_summarys_last_step_is_refused(tmp_path: Path, capsys):
    run = finished_run(tmp_path / "run", steps=6, releases_charged=None, ledger_head=None, ledger_length=None)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "steps": 9}))
    assert "(steps 9, the ledger has 'releases up to step 6')" in refused(capsys, run)


def study(capsys, *args) -> dict:
    assert main([str(arg) for arg in args]) == 0
    captured = capsys.readouterr()
    return {**json.loads(captured.out), "stderr": captured.err}


def test_runs_under_published_mechanism_seeds_have_no_guarantee(tmp_path: Path, capsys):
    (tmp_path / "mechanism_seeds.json").write_text(json.dumps({"0": 12345}))
    run = finished_run(tmp_path / "finals" / "dp_muon_seed0", mechanism_randomness=USER_SEED)
    report = study(capsys, run)
    assert report["epsilon_total"] == "no guarantee" and report["epsilon_per_run"][str(run)] == "no guarantee"
    assert report["published_seed_runs"] == [str(run)]
    assert "published mechanism seed" in report["stderr"]


def test_a_summary_that_says_its_seed_was_published_has_no_guarantee(tmp_path: Path, capsys):
    run = finished_run(tmp_path / "run", mechanism_randomness="published seed — no guarantee")
    assert study(capsys, run)["epsilon_total"] == "no guarantee"
    (run / "privacy_ledger.jsonl").unlink()  # from the summary alone: the same
    assert study(capsys, run)["epsilon_total"] == "no guarantee"


def test_an_os_entropy_run_beside_published_seeds_keeps_its_epsilon(tmp_path: Path, capsys):
    (tmp_path / "mechanism_seeds.json").write_text("{}")
    run = finished_run(tmp_path / "run")
    assert isinstance(study(capsys, run)["epsilon_total"], float)


# Two constant-time runs on one dataset (N = 1000, q = 0.05, 30 steps, δ = 1e-5), planned as the
# driver plans them (lot_bound, calibrate_noise_multiplier): ε = 8 and ε = 1. Each run's lot bound
# fits its truncation probability p to its own e^ε.
PLANNED = {8.0: (0.58624267578125, 2.4628031393311506e-14), 1.0: (1.494140625, 3.908208723019162e-11)}
Q, STEPS, DELTA = 0.05, 30, 1e-5


def planned_run(epsilon: float) -> RunRecord:
    sigma, truncation = PLANNED[epsilon]
    return RunRecord(Path(f"eps{epsilon:g}"), "e2e", 1000, None, True, DELTA, ((sigma, Q, STEPS),), 0, "privacy_ledger.jsonl",
                     slack=ReleaseSlack(bad_event=truncation))  # fmt: skip


@pytest.mark.slow  # about 7 s: six PRV evaluations
def test_runs_planned_for_different_epsilon_compose_to_a_finite_epsilon():
    runs = [planned_run(8.0), planned_run(1.0)]
    own = [epsilon_after(run.history[0][0], Q, STEPS, DELTA / 2, "prv", run.slack) for run in runs]
    ideal = composed_epsilon([RunRecord(**{**vars(run), "slack": ReleaseSlack()}) for run in runs], DELTA)
    total = composed_epsilon(runs, DELTA)
    assert math.isfinite(total)
    assert ideal < total <= sum(own) + 1e-9  # never below the ideal mechanisms, never above basic composition
    assert total < 1.2 * ideal


@pytest.mark.slow  # a 3-step training run (about 40 s on 2 cores)
def test_a_trained_runs_summary_records_its_ledger_and_the_study_checks_it(tmp_path: Path, capsys):
    from helpers_train import compose_config, require_real_data

    from dpmuon.training.loop import run

    require_real_data()
    tiny = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128", "data.max_train_examples=300",
            "data.max_valid_examples=16", "privacy.expected_lot_size=16", "trainer.steps=3", "trainer.micro_batch_size=8",
            "trainer.eval_every=0", "eval.validation=false", "eval.test=false", "logging.progress=false", "logger=none",
            "privacy.noise_multiplier=1.0"]  # fmt: skip
    summary = run(compose_config("experiment=smoke", "optimizer=dp_sgd", *tiny), tmp_path / "run")
    lines = (tmp_path / "run" / "privacy_ledger.jsonl").read_text().splitlines(keepends=True)
    assert (summary["ledger_head"], summary["ledger_length"]) == (line_hash(lines[-1].rstrip("\n").encode()), 4)
    assert study(capsys, tmp_path / "run")["epsilon_total"] == pytest.approx(summary["epsilon"])
    (tmp_path / "run" / "privacy_ledger.jsonl").write_text("".join(lines[:3]))
    assert "does not match summary.json" in refused(capsys, tmp_path / "run")
