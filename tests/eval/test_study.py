"""Study-level privacy: composing the ledgers of every run on one private training set."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpmuon.eval.study import main
from dpmuon.privacy import PrivacyAccountant, PrivacyLedger, epsilon_after
from dpmuon.privacy.randomness import OS_ENTROPY

torch.set_num_threads(1)

FINGERPRINT_A = "a" * 64
FINGERPRINT_B = "b" * 64
PROG = "python -m dpmuon.eval.study"


def write_ledger(run_dir: Path, releases, dataset="e2e", size=1000, fingerprint=FINGERPRINT_A, delta=1e-5) -> Path:
    """A run directory with a ledger: header, then one line per (σ, q, charged) release."""
    run_dir.mkdir(parents=True)
    header = {"kind": "header", "format": 1, "dataset": dataset, "dataset_size": size,
              "data_fingerprint": fingerprint, "delta": delta, "accountant": "prv"}  # fmt: skip
    lines = [header] + [
        {"kind": "release", "step": step, "noise_multiplier": sigma, "sample_rate": q, "release_sha256": f"{step:064x}", "charged": charged}
        for step, (sigma, q, charged) in enumerate(releases, start=1)
    ]
    (run_dir / "privacy_ledger.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


def releases(sigma: float, q: float, n: int, charged: bool = True) -> list[tuple[float, float, bool]]:
    return [(sigma, q, charged)] * n


def write_summary(run_dir: Path, **overrides) -> Path:
    """A run without a ledger: only summary.json (with secret randomness unless overridden)."""
    summary = {"dataset": "e2e", "dataset_size": 1000, "optimizer": "dp_adam", "private": True, "seed": 0,
               "noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 20, "delta": 1e-5, "accountant": "prv",
               "mechanism_randomness": OS_ENTROPY}  # fmt: skip
    summary.update(overrides)
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def study(capsys, *args) -> dict:
    assert main([str(arg) for arg in args]) == 0
    return json.loads(capsys.readouterr().out)


def accountant_epsilon(steps: list[tuple[float, float]], delta: float) -> float:
    """The reference: one accountant stepped through every charged release in turn."""
    accountant = PrivacyAccountant(delta, "prv")
    for sigma, q in steps:
        accountant.step(sigma, q)
    return accountant.epsilon()


def test_total_equals_one_accountant_over_the_concatenated_releases(tmp_path: Path, capsys):
    a = write_ledger(tmp_path / "a", releases(1.0, 0.01, 5) + releases(0.8, 0.02, 3))
    b = write_ledger(tmp_path / "b", releases(1.0, 0.01, 4) + releases(1.2, 0.01, 2))
    report = study(capsys, a, b)
    concatenated = [(1.0, 0.01)] * 5 + [(0.8, 0.02)] * 3 + [(1.0, 0.01)] * 4 + [(1.2, 0.01)] * 2
    assert report["epsilon_total"] == pytest.approx(accountant_epsilon(concatenated, 1e-5), rel=1e-9)
    assert report["epsilon_per_run"][str(a)] == pytest.approx(accountant_epsilon(concatenated[:8], 1e-5), rel=1e-9)
    assert report["epsilon_per_run"][str(b)] == pytest.approx(accountant_epsilon(concatenated[8:], 1e-5), rel=1e-9)
    assert report["delta"] == 1e-5 and report["accountant"] == "prv"
    assert [run["ledger"] for run in report["runs"]] == ["privacy_ledger.jsonl"] * 2
    assert report["epsilon_total"] > max(report["epsilon_per_run"].values())


def test_uncharged_replays_cost_nothing(tmp_path: Path, capsys):
    replayed = write_ledger(tmp_path / "replayed", releases(1.0, 0.01, 10) + releases(1.0, 0.01, 5, charged=False))
    (run,) = study(capsys, replayed)["runs"]
    assert (run["charged_releases"], run["uncharged_releases"]) == (10, 5)
    assert study(capsys, replayed)["epsilon_total"] == pytest.approx(epsilon_after(1.0, 0.01, 10, 1e-5))


def test_runs_on_different_datasets_are_reported_as_separate_groups(tmp_path: Path, capsys):
    write_ledger(tmp_path / "e2e_a", releases(1.0, 0.01, 10))
    write_ledger(tmp_path / "e2e_a2", releases(1.0, 0.01, 10))
    write_ledger(tmp_path / "dart", releases(0.9, 0.02, 10), dataset="dart", size=2000)
    report = study(capsys, tmp_path)
    assert "epsilon_total" not in report and "different datasets" in report["warnings"][0]
    groups = {g["dataset"]: g for g in report["groups"]}
    assert set(groups) == {"e2e", "dart"}
    assert groups["e2e"]["epsilon_total"] == pytest.approx(epsilon_after(1.0, 0.01, 20, 1e-5))
    assert [run["run"] for run in groups["dart"]["runs"]] == [str(tmp_path / "dart")]


def test_overlapping_subsets_of_a_dataset_are_composed_together(tmp_path: Path, capsys):
    """Runs on 1000 and on 400 examples of e2e, or on the same N with other examples (another
    fingerprint), or with none recorded, may all have touched one person: one total."""
    write_ledger(tmp_path / "all", releases(1.0, 0.01, 10))
    write_ledger(tmp_path / "subset", releases(1.0, 0.01, 10), size=400, fingerprint=FINGERPRINT_B)
    write_summary(tmp_path / "unrecorded", steps=10)
    report = study(capsys, tmp_path)
    assert report["dataset"] == "e2e" and report["dataset_sizes"] == [400, 1000]
    assert report["data_fingerprints"] == [FINGERPRINT_A, FINGERPRINT_B] and len(report["runs"]) == 3
    assert report["epsilon_total"] == pytest.approx(epsilon_after(1.0, 0.01, 30, 1e-5))


@pytest.mark.parametrize("moved", ["another data root", "a subset of the same examples"])
def test_the_data_fingerprint_is_the_examples_content_not_their_path(tmp_path: Path, moved: str):
    from helpers_train import require_real_data

    from dpmuon.data import load_tokenizer
    from dpmuon.training.data import prepare_data

    require_real_data()
    root = Path(os.environ["DPMUON_DATA_DIR"])
    copy = tmp_path / "elsewhere"
    shutil.copytree(root / "e2e", copy / "e2e")  # the same files under another path
    tokenizer = load_tokenizer()  # $DPMUON_TOKENIZER
    dataset = {"_target_": "dpmuon.data.e2e.E2ESettings"}

    def fingerprint(data_root: Path, examples: int) -> str:
        limits = {"max_train_examples": examples, "max_valid_examples": 1, "max_test_sources": 1}
        return prepare_data(dataset, {"root": str(data_root), **limits}, tokenizer, 128, lambda _: None).train_source

    if moved == "another data root":
        assert fingerprint(root, 30) == fingerprint(copy, 30)
    else:
        assert fingerprint(root, 30) != fingerprint(root, 29)  # other examples: another fingerprint


def test_a_run_without_a_ledger_counts_every_charged_release_not_its_steps(tmp_path: Path, capsys):
    """A resume re-ran steps 5 and 6 with fresh noise: 8 charged releases for 6 steps."""
    resumed = write_summary(tmp_path / "resumed", steps=6, releases_charged=8)
    report = study(capsys, resumed)
    assert report["runs"][0]["charged_releases"] == 8
    assert report["epsilon_total"] == pytest.approx(epsilon_after(1.0, 0.01, 8, 1e-5))


@pytest.mark.parametrize("randomness", [{}, {"mechanism_randomness": None}], ids=["absent", "null"])
def test_a_private_run_without_secret_randomness_has_no_guarantee(tmp_path: Path, capsys, randomness):
    """Runs before secret randomness drew lots and noise from the published seed: no ε covers them."""
    old = write_summary(tmp_path / "old", **randomness)
    if not randomness:
        (old / "summary.json").write_text(json.dumps({k: v for k, v in json.loads((old / "summary.json").read_text()).items()
                                                      if k != "mechanism_randomness"}))  # fmt: skip
    secret = write_ledger(tmp_path / "secret", releases(1.0, 0.01, 10))
    assert main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["epsilon_per_run"][str(old)] == "no guarantee"
    assert report["epsilon_per_run"][str(secret)] == pytest.approx(epsilon_after(1.0, 0.01, 10, 1e-5))
    assert report["epsilon_total"] == "no guarantee" and report["epsilon_total_private_runs"] == "no guarantee"
    assert report["runs_without_secret_randomness"] == [str(old)]
    assert "WARNING" in captured.err and "no secret mechanism randomness" in captured.err


def test_runs_before_ledgers_are_reconstructed_from_their_summary(tmp_path: Path, capsys):
    old = write_summary(tmp_path / "old", noise_multiplier=0.9, sample_rate=0.02, steps=25, delta=2e-5)
    report = study(capsys, old)
    assert report["runs"][0]["ledger"] == "reconstructed from summary.json"
    assert report["runs"][0]["charged_releases"] == 25
    assert report["data_fingerprints"] == [] and report["delta"] == 2e-5
    assert report["epsilon_total"] == pytest.approx(epsilon_after(0.9, 0.02, 25, 2e-5))


def test_a_resume_folder_inside_a_run_is_not_a_second_run(tmp_path: Path, capsys):
    run = write_summary(tmp_path / "runs" / "dp_adam_seed0")
    write_summary(run / "resume")
    assert [r["run"] for r in study(capsys, tmp_path / "runs")["runs"]] == [str(run)]


def test_a_non_private_run_voids_the_study_and_says_so(tmp_path: Path, capsys):
    write_ledger(tmp_path / "dp", releases(1.0, 0.01, 10))
    public = write_summary(tmp_path / "adam", optimizer="adam", private=False, noise_multiplier=0.0, delta=None, data_fingerprint=FINGERPRINT_A)
    assert main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["epsilon_total"] == "inf" and report["epsilon_per_run"][str(public)] == "inf"
    assert report["epsilon_total_private_runs"] == pytest.approx(epsilon_after(1.0, 0.01, 10, 1e-5))
    assert report["non_private_runs"] == [str(public)]
    assert "WARNING" in captured.err and "no differential-privacy guarantee" in captured.err


def test_a_noiseless_ledger_line_makes_the_run_non_private(tmp_path: Path, capsys):
    run = write_ledger(tmp_path / "broken", releases(1.0, 0.01, 3) + releases(0.0, 0.01, 1))
    assert study(capsys, run)["epsilon_total"] == "inf"


def test_user_seeded_runs_are_listed_and_two_of_them_are_warned_about(tmp_path: Path, capsys):
    from dpmuon.privacy.randomness import OS_ENTROPY, USER_SEED

    paired = [write_summary(tmp_path / name, mechanism_randomness=USER_SEED) for name in ("muon", "muonbc")]
    write_summary(tmp_path / "own_noise", mechanism_randomness=OS_ENTROPY)
    assert main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["user_seeded_runs"] == [str(run) for run in paired]
    assert any("2 private runs" in w and "no finite ε" in w for w in report["warnings"])
    assert "WARNING" in captured.err and "mechanism_seed" in captured.err
    # one user-seeded run cannot share its noise with another run of the study: no warning
    report = study(capsys, paired[0], tmp_path / "own_noise")
    assert report["user_seeded_runs"] == [str(paired[0])] and report["warnings"] == []


def test_delta_override_and_disagreeing_deltas(tmp_path: Path, capsys):
    a = write_ledger(tmp_path / "a", releases(1.0, 0.01, 10), delta=1e-5)
    b = write_ledger(tmp_path / "b", releases(1.0, 0.01, 10), delta=1e-6)
    assert main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{PROG}: error:") and "--delta" in err
    report = study(capsys, a, b, "--delta", "1e-6")
    assert report["delta"] == 1e-6
    assert report["epsilon_total"] == pytest.approx(epsilon_after(1.0, 0.01, 20, 1e-6))
    assert report["epsilon_total"] > epsilon_after(1.0, 0.01, 20, 1e-5)  # smaller δ, larger ε


def _bad_ledger_header(root: Path) -> list[Path]:
    run = root / "run"
    run.mkdir()
    (run / "privacy_ledger.jsonl").write_text(json.dumps({"kind": "release"}) + "\n")
    return [run]


def _bad_charged_flag(root: Path) -> list[Path]:
    run = write_ledger(root / "run", releases(1.0, 0.01, 2))
    lines = (run / "privacy_ledger.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('"charged": true', '"charged": "yes"')
    (run / "privacy_ledger.jsonl").write_text("\n".join(lines) + "\n")
    return [run]


def _garbage_mid_ledger(root: Path) -> list[Path]:
    run = write_ledger(root / "run", releases(1.0, 0.01, 2))
    lines = (run / "privacy_ledger.jsonl").read_text().splitlines()
    (run / "privacy_ledger.jsonl").write_text("\n".join([lines[0], "{not json", lines[2]]) + "\n")
    return [run]


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda root: [root / "missing"], "no such directory"),
        (lambda root: [root], "no run"),
        (_bad_ledger_header, "first line must be the ledger header"),
        (_bad_charged_flag, "'charged' must be true or false"),
        (_garbage_mid_ledger, "privacy_ledger.jsonl:2: not valid JSON"),
        (lambda root: [write_summary(root / "run", steps=None)], "'steps'"),
        (lambda root: [write_summary(root / "run", delta=None)], "needs 'delta'"),
        (lambda root: [write_summary(root / "run"), "--delta", "2"], "--delta must be in (0, 1)"),
    ],
    ids=["missing-dir", "no-runs", "header", "charged-flag", "bad-line", "no-steps", "no-delta", "delta-range"],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys, make_args, message):
    assert main([str(arg) for arg in make_args(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{PROG}: error:") and message in err


def test_a_torn_last_line_is_a_release_that_never_happened(tmp_path: Path, capsys):
    run = write_ledger(tmp_path / "crashed", releases(1.0, 0.01, 6))
    text = (run / "privacy_ledger.jsonl").read_text()
    (run / "privacy_ledger.jsonl").write_text(text[: len(text) - 20])  # the crash cut the last line
    assert study(capsys, run)["runs"][0]["charged_releases"] == 5


def test_runs_as_a_module(tmp_path: Path):
    run = write_ledger(tmp_path / "a", releases(1.0, 0.01, 4))
    done = subprocess.run([sys.executable, "-m", "dpmuon.eval.study", str(run)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {"runs", "epsilon_per_run", "epsilon_total", "delta"} <= set(report)
    assert math.isfinite(report["epsilon_total"])


def _table_run(run_dir: Path, **overrides) -> Path:
    """A run that also follows the table's artifact contract."""
    contract = {"model": "tiny", "target_epsilon": 8.0, "epsilon": 8.0, "clip_mode": "per_matrix", "test_nll": 2.0,
                "bleu": 20.0, "bleu_single_ref": 10.0, "rouge_l": 40.0, "train_seconds": 1.0,
                "metric_implementations": {}, "git_commit": "abc", "command": "python -m dpmuon.train"}  # fmt: skip
    return write_summary(run_dir, **{**contract, **overrides})


def test_tables_note_the_study_level_epsilon_of_their_runs_and_of_the_tuning_beside_them(tmp_path: Path):
    from dpmuon.eval.cli import tables_main

    results = tmp_path / "results" / "e2e"
    _table_run(results / "runs" / "dp_adam_seed0")
    _table_run(results / "runs" / "adam_seed0", optimizer="adam", private=False, noise_multiplier=0.0,
               delta=None, epsilon=None, target_epsilon=None)  # fmt: skip
    for lr in ("0.01", "0.1"):
        write_summary(results / "tuning" / f"dp_adam_lr{lr}", steps=15)
    assert tables_main([str(results / "runs"), "--out", str(tmp_path / "out")]) == 0
    notes = (tmp_path / "out" / "e2e" / "table.md").read_text().split("## Notes")[1]
    one, tuning, together = (epsilon_after(1.0, 0.01, steps, 1e-5) for steps in (20, 30, 50))
    assert (
        f"on e2e (N=1000), δ = 1e-05: the 1 DP run of this table: ε = {one:.2f}; "
        f"the 2 DP runs in `tuning/` beside `runs/` (the learning-rate search): ε = {tuning:.2f}; "
        f"all 3 together: ε = {together:.2f}."
    ) in notes
    assert "reconstructed from each run's summary.json" in notes
    assert "**1 run (adam) trained on these examples without noise" in notes and "ε = ∞" in notes


def test_a_chained_ledger_is_read_and_an_edited_one_is_refused(tmp_path: Path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    ledger = PrivacyLedger(run / "privacy_ledger.jsonl", {"dataset": "e2e", "dataset_size": 1000, "data_fingerprint": FINGERPRINT_A,
                                                          "delta": 1e-5, "accountant": "prv"})  # fmt: skip
    for step in range(1, 5):
        ledger.record(step, 1.0, 0.01, f"{step:064x}")
    assert study(capsys, run)["epsilon_total"] == pytest.approx(epsilon_after(1.0, 0.01, 4, 1e-5))
    lines = (run / "privacy_ledger.jsonl").read_text().splitlines()
    lines[2] = lines[2].replace('"charged": true', '"charged": false')  # a release made free by hand
    (run / "privacy_ledger.jsonl").write_text("\n".join(lines) + "\n")
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "privacy_ledger.jsonl:4: 'prev' is not the hash of line 3" in err
