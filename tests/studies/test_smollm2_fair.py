"""The SmolLM2 + LoRA study: tuning grids that grow past a winning edge, DP-MuonBC's grid from
DP-Muon's pick, finals on fresh seeds only once every arm has a pick, and the pre-registered
decision rule (results/smollm2_fair/preregistration.md) read off paired finals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers_runs import write_run

from studies.smollm2_fair import ADAM_RATES, ARMS, EXTRA_SEEDS, MUON_RATES, SEED_TUNE, SEEDS, jobs, picks, tune_name
from studies.smollm2_fair_report import h1, h2, load, write_report


def tune(results: Path, arm: str, lr: float, nll: float) -> None:
    write_run(results / "tune", tune_name(arm, lr), val_nll=nll)


def tune_all(results: Path, arms=("dp_muon", "dp_adam", "dp_muonbc"), muon_pick: float = MUON_RATES[1], adam_pick: float = ADAM_RATES[2]) -> None:
    """Tuning runs whose picks are DP-Muon's `muon_pick`, DP-Adam's `adam_pick` and DP-MuonBC's muon_pick/√2."""
    if "dp_muon" in arms:
        for lr in MUON_RATES:
            tune(results, "dp_muon", lr, 1.0 + abs(math.log(lr / muon_pick)))
    if "dp_adam" in arms:
        for lr in ADAM_RATES:
            tune(results, "dp_adam", lr, 1.0 + abs(math.log(lr / adam_pick)))
    if "dp_muonbc" in arms:
        tune(results, "dp_muonbc", muon_pick / math.sqrt(2), 1.1)
        tune(results, "dp_muonbc", muon_pick, 1.2)


def final(results: Path, arm: str, seed: int, **values) -> None:
    write_run(results / "finals", f"{arm}_seed{seed}", **values)


def test_tuning_runs_on_seed_0_without_the_test_set_and_muon_first():
    todo = jobs(Path("/nonexistent"), lambda seed: 100 + seed)
    assert [job.name for job in todo] == [tune_name("dp_muon", lr) for lr in MUON_RATES] + [tune_name("dp_adam", lr) for lr in ADAM_RATES]
    assert all(job.stage == "tune" and job.mechanism_seed == 100 + SEED_TUNE for job in todo)
    assert all({"eval.test=false", "trainer.steps=100", "model.lora.alpha=16", "privacy.published_seed=true"} <= set(job.overrides) for job in todo)
    adam = next(job for job in todo if "optimizer=dp_adam" in job.overrides)
    assert not any(o.startswith("optimizer.adam.") for o in adam.overrides)  # DP-Adam has no AdamW part to set


def test_a_winning_edge_grows_the_grid_by_doubling_and_muonbc_tunes_around_muons_pick(tmp_path):
    for lr in MUON_RATES:  # the largest rate wins: the grid doubles past it
        tune(tmp_path, "dp_muon", lr, 2.0 - lr)
    rates, pick = picks(tmp_path)["dp_muon"]
    assert pick is None and rates[-1] == pytest.approx(2 * MUON_RATES[-1])
    assert "dp_muonbc" not in picks(tmp_path)  # nothing to tune around yet
    tune(tmp_path, "dp_muon", rates[-1], 5.0)  # worse past the edge: the old edge is the pick
    grids = picks(tmp_path)
    assert grids["dp_muon"][1] == MUON_RATES[-1]
    assert grids["dp_muonbc"][0] == pytest.approx([MUON_RATES[-1] / math.sqrt(2), MUON_RATES[-1]])
    assert grids["dp_muonbc_matched"] == ([MUON_RATES[-1]], MUON_RATES[-1])
    # A tie goes to the smaller rate.
    for lr in ADAM_RATES:
        tune(tmp_path, "dp_adam", lr, 1.0 if lr in ADAM_RATES[1:3] else 2.0)
    assert picks(tmp_path)["dp_adam"][1] == ADAM_RATES[1]


def test_finals_start_once_every_arm_has_a_pick_on_fresh_seeds_at_the_picks(tmp_path):
    tune_all(tmp_path, arms=("dp_muon",))
    assert not [job for job in jobs(tmp_path, lambda seed: seed) if job.stage == "finals"]  # DP-Adam and DP-MuonBC have no pick
    tune_all(tmp_path, arms=("dp_adam", "dp_muonbc"))  # DP-MuonBC's pick: μ*/√2. match_norm's tuning run selects nothing, so the finals need not wait for it.
    todo = jobs(tmp_path, lambda seed: 100 + seed)
    assert todo.index(next(job for job in todo if job.name == tune_name("dp_muonbc_matched", MUON_RATES[1]))) < len(todo) - 12  # yet it runs first
    finals = [job for job in todo if job.stage == "finals"]
    assert [job.name for job in finals] == [f"{arm}_seed{seed}" for seed in SEEDS for arm in ARMS]
    rate = {"dp_adam": ADAM_RATES[2], "dp_muon": MUON_RATES[1], "dp_muonbc": MUON_RATES[1] / math.sqrt(2), "dp_muonbc_matched": MUON_RATES[1]}
    for job in finals:
        arm, seed = job.name.rsplit("_seed", 1)
        assert f"optimizer.lr={rate[arm]:.6g}" in job.overrides and job.mechanism_seed == 100 + int(seed)
        assert "trainer.eval_every=25" in job.overrides and "eval.test=false" not in job.overrides
    assert SEED_TUNE not in {int(job.name[-1]) for job in finals}  # fresh draws: not the run that picked the rate


def paired_finals(results: Path, bleu_delta: list[float], nll_delta: list[float], seeds=SEEDS) -> None:
    for seed, db, dn in zip(seeds, bleu_delta, nll_delta, strict=True):
        final(results, "dp_adam", seed, bleu=30.0, test_nll=2.0)
        final(results, "dp_muon", seed, bleu=30.0 + db, test_nll=2.0 + dn)


@pytest.mark.parametrize(
    "bleu_delta, nll_delta, verdict",
    [
        ([8.0, 9.0, 10.0], [-0.05, -0.04, -0.06], "supported"),
        ([6.0, 9.0, 12.0], [0.01, 0.02, 0.015], "reversed"),  # BLEU up, but the NLL interval above 0
        ([-3.0, -2.0, -4.0], [0.0, 0.01, -0.01], "reversed"),
        ([0.5, -0.5, 0.2], [0.005, -0.004, 0.001], "level"),
        ([3.0, 9.0, -1.0], [-0.02, 0.03, 0.0], "inconclusive"),
        ([3.0, 4.0, 5.0], [-0.05, -0.04, -0.06], "inconclusive"),  # above 0, but a mean below +5
    ],
)
def test_h1_reads_the_pre_registered_rule(tmp_path, bleu_delta, nll_delta, verdict):
    paired_finals(tmp_path, bleu_delta, nll_delta)
    assert h1(load(tmp_path, "finals"))[0] == verdict


def test_an_inconclusive_h1_adds_seeds_4_and_5_for_dp_adam_and_dp_muon_only(tmp_path):
    tune_all(tmp_path)
    tune(tmp_path, "dp_muonbc_matched", MUON_RATES[1], 1.15)
    paired_finals(tmp_path, [3.0, 9.0, -1.0], [-0.02, 0.03, 0.0])
    extra = [job.name for job in jobs(tmp_path, lambda seed: seed) if job.stage == "finals" and int(job.name[-1]) in EXTRA_SEEDS]
    assert extra == [f"{arm}_seed{seed}" for seed in EXTRA_SEEDS for arm in ("dp_adam", "dp_muon")]
    paired_finals(tmp_path, [8.0, 9.0], [-0.05, -0.04], seeds=EXTRA_SEEDS)  # the final reading is on all five
    verdict, bleu, _ = h1(load(tmp_path, "finals"))
    assert bleu.n == 5 and verdict == "supported"
    # Seeds 4–5 are not read as a second chance beyond the rule: the runner adds nothing more.
    assert {int(job.name[-1]) for job in jobs(tmp_path, lambda seed: seed) if job.stage == "finals"} == {*SEEDS, *EXTRA_SEEDS}


def test_a_supported_h1_adds_no_seeds(tmp_path):
    tune_all(tmp_path)
    paired_finals(tmp_path, [8.0, 9.0, 10.0], [-0.05, -0.04, -0.06])
    assert not [job for job in jobs(tmp_path, lambda seed: seed) if int(job.name[-1]) in EXTRA_SEEDS]


@pytest.mark.parametrize(
    "own, matched, verdict",
    [
        ([-0.03, -0.02, -0.025], [-0.02, -0.015, -0.018], "supported, by its direction"),
        ([-0.03, -0.02, -0.025], [-0.01, 0.01, 0.0], "supported: step length, not bias correction"),
        ([-0.03, 0.02, -0.025], [-0.02, -0.015, -0.018], "not supported"),
    ],
)
def test_h2_reads_the_pre_registered_rule(tmp_path, own, matched, verdict):
    for seed, a, b in zip(SEEDS, own, matched, strict=True):
        final(tmp_path, "dp_muon", seed, test_nll=2.0)
        final(tmp_path, "dp_muonbc", seed, test_nll=2.0 + a)
        final(tmp_path, "dp_muonbc_matched", seed, test_nll=2.0 + b)
    assert h2(load(tmp_path, "finals"))[0] == verdict


def test_the_report_says_what_was_not_measured_and_reads_validation_at_fixed_steps(tmp_path):
    write_report(tmp_path)
    text = (tmp_path / "fair.md").read_text()
    assert 'H1 "DP-Muon ≫ DP-Adam": waiting for the finals' in text and "not run yet" in text
    curve = [{"step": 0, "val_nll": 3.5}, {"step": 75, "val_nll": 2.2}, {"step": 100, "val_nll": 2.0}, {"step": 50, "val_nll": 1.0}]
    for seed in SEEDS:
        final(tmp_path, "dp_muon", seed, metrics=sorted(curve, key=lambda r: r["step"]))
    write_report(tmp_path)
    row = next(line for line in (tmp_path / "fair.md").read_text().splitlines() if line.startswith("| val NLL, mean of steps 75–100"))
    assert "2.1000 [2.1000, 2.1000] (3)" in row  # the last two evaluations, never the best (step 50)
