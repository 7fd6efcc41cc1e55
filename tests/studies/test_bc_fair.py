"""The fair comparison's stages: tuning extends a grid whose edge wins, and finals, variants and
the horizon start only from the best rates of a complete tuning stage, publishing their
diagnostics; the report pairs by seed and reads the finals' oracle."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import pytest
from helpers_runs import table_rows, write_run

from studies.bc_fair import (
    CONTENDERS,
    HORIZON_RATES_PREREGISTRATION,
    PUBLISH_DIAGNOSTICS,
    RATES,
    SEEDS,
    SEEDS_TUNE,
    jobs,
    slower_muon_rates,
    tune_name,
    tuning_grid,
)
from studies.bc_fair_report import (
    LATE_FROM,
    comparisons_markdown,
    gap_changes_markdown,
    h3,
    h4,
    horizon_markdown,
    horizon_rates_figure,
    horizon_rates_markdown,
    load,
    mean_ci,
    oracle_markdown,
    paired,
    tuning_markdown,
    write_report,
)


def publish(results: Path, contender: str, lr: float, nll: float, seeds=SEEDS_TUNE) -> None:
    for seed in seeds:
        write_run(results / "tune", tune_name(contender, lr, seed), val_nll=nll + 0.001 * seed, learning_rates={"lr": float(f"{lr:.6g}")})


def test_tuning_waits_for_every_run_then_extends_a_winning_edge(tmp_path):
    rates, best = tuning_grid(tmp_path, "dp_muon")
    assert rates == list(RATES) and best is None
    for lr in RATES:  # the largest rate wins: the grid grows past it
        publish(tmp_path, "dp_muon", lr, nll=1.0 - lr)
    rates, best = tuning_grid(tmp_path, "dp_muon")
    assert best is None and math.isclose(rates[-1], RATES[-1] * math.sqrt(2))
    publish(tmp_path, "dp_muon", rates[-1], nll=5.0)  # worse past the edge: the old edge is best
    assert tuning_grid(tmp_path, "dp_muon")[1] == RATES[-1]


def test_later_stages_start_from_the_best_rates_paired_by_seed(tmp_path):
    assert {job.stage for job in jobs(tmp_path, lambda seed: seed)} == {"tune"}
    best = {contender: RATES[1] if contender == "dp_muonbc" else RATES[2] for contender in CONTENDERS}
    for contender in CONTENDERS:
        for lr in RATES:
            publish(tmp_path, contender, lr, nll=abs(lr - best[contender]))
    todo = jobs(tmp_path, lambda seed: 100 + seed)
    finals = [job for job in todo if job.stage == "finals"]
    assert len(finals) == (len(CONTENDERS) + 1) * len(SEEDS)  # the contenders, then DP-MuonBC with split rates
    for job in finals:  # each part at its contender's best rate; the split run's AdamW part at DP-Muon's
        contender = "dp_muonbc" if job.name.startswith("dp_muonbc_split") else job.name.rsplit("_seed", 1)[0]
        adam = best["dp_muon"] if job.name.startswith("dp_muonbc_split") else best[contender]
        assert f"optimizer.lr={best[contender]:.6g}" in job.overrides and f"optimizer.adam.lr={adam:.6g}" in job.overrides
    # s = one step's noise std at both optimizers' best rates: the weak correction's fair rate is DP-Muon's.
    for rate, name in ((best["dp_muonbc"], "dp_muonbc_stepstd"), (best["dp_muon"], "dp_muonbc_stepstd_muonrate")):
        runs = [job for job in todo if job.name.rsplit("_seed", 1)[0] == name]
        assert len(runs) == len(SEEDS)
        expected = {f"optimizer.lr={rate:.6g}", f"optimizer.adam.lr={rate:.6g}", "optimizer=dp_muonbc", "optimizer.bias_correction.noise_std=step"}
        assert all(expected <= set(job.overrides) for job in runs)
    horizon = [job.name for job in todo if job.stage == "horizon"]
    assert horizon == [f"{contender}_seed{seed}" for seed in SEEDS for contender in CONTENDERS]
    assert all(job.mechanism_seed == 100 + int(job.name[-1]) for job in todo if job.stage != "tune")
    # Fresh draws after tuning: a final on a tuning seed would repeat the run that picked its rate.
    assert not {int(job.name[-1]) for job in todo if job.stage != "tune"} & set(SEEDS_TUNE)
    # Stage by stage: every seed of the finals before any variant.
    assert [stage for stage, _ in itertools.groupby(job.stage for job in todo)] == ["tune", "finals", "variants", "horizon", "horizon_rates"]
    # Only what comes after tuning publishes its diagnostics (the finals' oracle among them).
    assert all((PUBLISH_DIAGNOSTICS in job.overrides) == (job.stage != "tune") for job in todo)
    assert all(("logging.oracle_alignment=true" in job.overrides) == (job.stage == "finals" and "split" not in job.name) for job in todo)
    assert all("privacy.constant_time=false" in job.overrides for job in todo)


def test_the_tuning_table_marks_only_the_runners_selection(tmp_path):
    for lr in RATES:  # complete, the middle rate wins: selected
        publish(tmp_path, "dp_muon", lr, nll=abs(lr - RATES[2]))
    for lr in RATES:  # the smallest rate wins, so the grid grows: nothing is selected yet
        publish(tmp_path, "dp_muonbc", lr, nll=lr)
    publish(tmp_path, "dp_muonbc_matched", RATES[0], nll=0.1, seeds=(0,))  # one seed of one rate
    rows = {row[0]: row[1:] for row in table_rows(tuning_markdown(tmp_path))}
    assert [cell.endswith("* (2)") for cell in rows[f"{RATES[2]:.4g}"]] == [True, False, False]
    assert not any("*" in cell for row in rows.values() for cell in row[1:])
    assert rows[f"{RATES[0]:.4g}"][2] == "0.1000 (1)"
    assert "Not selected yet (dp_muonbc, dp_muonbc_matched)" in tuning_markdown(tmp_path)


def test_report_pairs_by_seed_with_a_t_interval(tmp_path):
    for seed, (bc, muon) in zip(SEEDS, [(0.50, 0.52), (0.61, 0.60), (0.44, 0.47)]):
        write_run(tmp_path / "finals", f"dp_muonbc_seed{seed}", test_nll=bc)
        write_run(tmp_path / "finals", f"dp_muon_seed{seed}", test_nll=muon)
    write_run(tmp_path / "finals", f"dp_muonbc_matched_seed{SEEDS[0]}", test_nll=0.4)  # one pair: n = 1
    write_run(tmp_path / "finals", f"dp_muonbc_seed{SEEDS_TUNE[0]}", test_nll=9.0)  # a tuning seed: not a final
    write_run(tmp_path / "finals", f"dp_muon_seed{SEEDS_TUNE[0]}", test_nll=0.0)
    runs = load(tmp_path, "finals")
    deltas = paired(runs, "dp_muonbc", "dp_muon")
    assert deltas == pytest.approx([-0.02, 0.01, -0.03])
    half = 4.302653 * statistics.stdev(deltas) / math.sqrt(3)  # t(0.975, 2)
    assert mean_ci(deltas) == f"{-0.04 / 3:+.4f} [{-0.04 / 3 - half:+.4f}, {-0.04 / 3 + half:+.4f}] (n = 3)"
    assert mean_ci(paired(runs, "dp_muonbc_matched", "dp_muon")) == "-0.1200 (n = 1)"
    assert mean_ci([]) == "not run yet"
    rows = {tuple(row[:2]): row[2:] for row in table_rows(comparisons_markdown(tmp_path))}
    # NLL, BLEU and ROUGE-L of the same pairs (write_run's BLEU is 20.0 for every run, ROUGE-L none)
    assert rows[("each at its best rate", "DP-MuonBC − DP-Muon")] == [mean_ci(deltas), "+0.0000 [+0.0000, +0.0000] (n = 3)", "not run yet"]
    assert rows[("horizon (3 epochs)", "DP-MuonBC − DP-Muon")] == ["not run yet"] * 3


def test_the_runner_restores_the_kept_public_model_and_refuses_another(tmp_path, monkeypatch):
    """A new working session has no models/: the runner restores the public model kept beside the
    runs, and refuses one whose weights differ from those the committed runs started from."""
    from conftest import tiny_gpt2

    from dpmuon.models import weights_fingerprint
    from dpmuon.run_folder import WEIGHTS_FINGERPRINT
    from studies import bc_fair

    results, restored = tmp_path / "fair", tmp_path / "models" / "public-for-e2e"
    model = tiny_gpt2()
    model.save_pretrained(results / "public_pretraining" / "model")
    (results / "public_pretraining" / WEIGHTS_FINGERPRINT).write_text(weights_fingerprint(model) + "\n")
    monkeypatch.setattr(bc_fair, "PUBLIC_MODEL", restored)
    bc_fair.public_model(results)
    assert (restored / "config.json").exists()

    tiny_gpt2(seed=1).save_pretrained(restored)  # a rebuild: other weights
    with pytest.raises(SystemExit, match="models/public-for-e2e has fingerprint"):
        bc_fair.public_model(results)


def test_run_stage_runs_only_that_stage_once_its_inputs_are_in(tmp_path, monkeypatch):
    from studies import bc_fair

    ran = []

    def run_jobs(pending, work, results, threads, parallel):  # publishes each job as a finished run
        ran.extend(pending)
        for job in pending:
            write_run(results / job.stage, job.name)

    monkeypatch.setattr(bc_fair, "public_model", lambda results: None)
    monkeypatch.setattr(bc_fair, "run_jobs", run_jobs)
    args = ["run", "--results", str(tmp_path), "--work", str(tmp_path / "work")]
    with pytest.raises(SystemExit, match="--stage horizon: the stages before it are not all published"):
        bc_fair.main([*args, "--stage", "horizon"])
    for contender in CONTENDERS:
        for lr in RATES:
            publish(tmp_path, contender, lr, nll=abs(lr - RATES[2]))
    assert bc_fair.main([*args, "--stage", "horizon"]) == 0
    assert {job.stage for job in ran} == {"horizon"} and len(ran) == len(CONTENDERS) * len(SEEDS)
    assert not (tmp_path / "finals").exists()


def test_a_variants_change_in_the_gap_is_paired_by_seed_against_the_default(tmp_path):
    """Δ under the variant minus the finals' Δ of the same seed; a seed missing either is left out."""
    for seed, (bc, muon, bc_v, muon_v) in zip(SEEDS, [(0.56, 0.50, 0.53, 0.50), (0.66, 0.60, 0.61, 0.58), (0.50, 0.45, 0.49, 0.47)]):
        write_run(tmp_path / "finals", f"dp_muonbc_seed{seed}", test_nll=bc)
        write_run(tmp_path / "finals", f"dp_muon_seed{seed}", test_nll=muon)
        write_run(tmp_path / "variants", f"dp_muonbc_nesterov_seed{seed}", test_nll=bc_v)
        write_run(tmp_path / "variants", f"dp_muon_nesterov_seed{seed}", test_nll=muon_v)
        if seed != SEEDS[2]:
            write_run(tmp_path / "variants", f"dp_muonbc_stepstd_seed{seed}", test_nll=bc - 0.01 * (seed - 1))
    rows = {row[0]: row[1:] for row in table_rows(gap_changes_markdown(tmp_path))}
    assert rows["variant nesterov"][0] == mean_ci([0.03 - 0.06, 0.03 - 0.06, 0.02 - 0.05])
    assert rows["s = one step's noise std"][0] == mean_ci([-0.01, -0.02])  # against DP-Muon's final: bc_v − bc
    assert rows["variant series2"] == ["not run yet"] * 3


def test_a_runner_stops_when_another_holds_every_run_left(tmp_path, monkeypatch):
    """Two runners share one job list; the one left with only the other's runs must stop, not
    loop on them (a skipped job is not published, so it stays pending)."""
    from studies import bc_fair

    passes = []
    monkeypatch.setattr(bc_fair, "public_model", lambda results: None)
    monkeypatch.setattr(bc_fair, "run_jobs", lambda pending, *a, **k: passes.append(len(pending)))
    for contender in CONTENDERS:
        for lr in RATES:
            publish(tmp_path, contender, lr, nll=abs(lr - RATES[2]))
    assert bc_fair.main(["run", "--stage", "horizon", "--results", str(tmp_path), "--work", str(tmp_path / "work")]) == 0
    assert passes == [len(CONTENDERS) * len(SEEDS)]


def oracle_row(step: int, snr: float, single: float, averaged: float, ratio: float) -> dict:
    matrices = ("a", "b")
    return {
        "step": step,
        "oracle_snr": dict.fromkeys(matrices, snr),
        "oracle_cos_plain": dict.fromkeys(matrices, 0.05),
        "oracle_cos_bc": dict.fromkeys(matrices, 0.05 + single),
        "oracle_cos_bc_mean": dict.fromkeys(matrices, 0.05 + averaged),
        "oracle_signal_plain": dict.fromkeys(matrices, 0.02),
        "oracle_signal_bc": dict.fromkeys(matrices, 0.02 * ratio),
    }


def test_the_oracle_table_and_figure_come_from_the_finals_published_rows(tmp_path):
    for seed, averaged in zip(SEEDS, [0.010, 0.012, 0.014]):  # seed s: probe-averaged gain 0.010 + 0.002 s at every step
        rows = [oracle_row(step, 0.02, single=-0.004, averaged=averaged, ratio=1.25) for step in (1, 2, 3)]
        write_run(tmp_path / "finals", f"dp_muon_seed{seed}", rows + [{"step": 3, "val_nll": 2.0}])
    table = oracle_markdown(load(tmp_path, "finals"))
    half = 4.302653 * 0.002 / math.sqrt(3)
    (muon,) = [line for line in table.splitlines() if line.startswith("| dp_muon |")]
    cells = [cell.strip() for cell in muon.strip("|").split("|")]
    assert cells[1] == "0.0200 [0.0200, 0.0200] (n = 3)"  # true SNR
    assert cells[2] == "-0.0040 [-0.0040, -0.0040] (n = 3)"  # one draw: negative
    assert cells[3] == f"0.0120 [{0.012 - half:.4f}, {0.012 + half:.4f}] (n = 3)"  # the average: positive
    assert cells[4] == "1.2500 [1.2500, 1.2500] (n = 3)"
    assert "| dp_muonbc | not run yet |" in table
    written = write_report(tmp_path)
    assert [path.name for path in written] == ["fair.md", "paired_delta.png", "alignment_vs_snr.png", "horizon_rates.png"]
    assert all(path.stat().st_size > 0 for path in written)


def test_the_horizon_table_reads_the_paired_curve_every_hundred_steps_and_at_the_end(tmp_path):
    assert horizon_markdown(tmp_path).endswith("not run yet\n")
    last = {SEEDS[0]: 493, SEEDS[1]: 493, SEEDS[2]: 475}  # one pair stopped early: its last step is not the others'
    for seed in SEEDS:
        for contender, shift in (("dp_muon", 0.0), ("dp_muonbc", 0.01 * seed)):
            steps = [*range(0, last[seed], 25), last[seed]]
            write_run(tmp_path / "horizon", f"{contender}_seed{seed}", [{"step": s, "val_nll": 3.0 - s / 1000 + shift * s / 100} for s in steps])
    rows = {row[0]: row[1:] for row in table_rows(horizon_markdown(tmp_path))}
    assert rows["step"][:2] == ["DP-MuonBC − DP-Muon", "DP-MuonBC (match_norm) − DP-Muon"]
    assert [step for step in rows if step.isdigit()] == ["100", "200", "300", "400", "493"]
    assert rows["100"][1] == "not run yet"  # no norm-matched run
    rows = {step: cells[0] for step, cells in rows.items()}
    assert rows["200"] == mean_ci([0.02 * seed for seed in SEEDS])  # Δ = 0.01 · seed · step / 100
    assert rows["493"] == mean_ci([0.01 * seed * 4.93 for seed in SEEDS[:2]])  # n = 2: the third pair ended at 475


def test_the_split_rates_row_and_each_arms_step_length_ratio(tmp_path):
    for seed, (bc, split, muon) in zip(SEEDS, [(0.56, 0.50, 0.51), (0.66, 0.61, 0.60), (0.50, 0.45, 0.47)]):
        ratios = [{"step": step, "update_norm_ratio_median": 1.3 + 0.1 * (seed - SEEDS[0]) + 0.01 * step} for step in (1, 2, 3)]
        write_run(tmp_path / "finals", f"dp_muonbc_seed{seed}", ratios, test_nll=bc)
        write_run(tmp_path / "finals", f"dp_muonbc_split_seed{seed}", test_nll=split)
        write_run(tmp_path / "finals", f"dp_muon_seed{seed}", test_nll=muon)
    table = comparisons_markdown(tmp_path)
    rows = {tuple(row[:2]): row[2] for row in table_rows(table)}
    assert rows[("AdamW part at DP-Muon's rate", "DP-MuonBC (split rates) − DP-Muon")] == mean_ci([-0.01, 0.01, -0.02])
    assert rows[("AdamW part at DP-Muon's rate", "DP-MuonBC − DP-MuonBC (split rates)")] == mean_ci([0.06, 0.05, 0.05])
    # Per seed the median over steps (1.32, 1.42, 1.52), then over seeds; an arm without runs says so.
    assert f"- each at its best rate: {mean_ci([1.32, 1.42, 1.52]).replace('+', '')}" in table
    assert "- horizon (3 epochs): not run yet" in table


def test_every_run_declares_its_seed_published_and_the_report_says_its_epsilon_is_no_guarantee(tmp_path):
    """The seeds are committed (mechanism_seeds.json): each run's summary must say so, and the
    report says what the committed summaries, written before that, do not."""
    for contender in CONTENDERS:
        for lr in RATES:
            publish(tmp_path, contender, lr, nll=abs(lr - RATES[2]))
    assert all("privacy.published_seed=true" in job.overrides for job in jobs(tmp_path, lambda seed: seed))
    write_run(tmp_path / "finals", "dp_muon_seed2", mechanism_randomness="published seed — no guarantee")
    write_run(tmp_path / "finals", "dp_muonbc_seed2", mechanism_randomness="user seed (the guarantee assumes it stays secret)")
    (tmp_path / "public_pretraining").mkdir()
    write_report(tmp_path)
    text = (tmp_path / "fair.md").read_text()
    assert "**Published seeds — no guarantee.**" in text and "not a privacy guarantee" in text
    assert "1 of the 2 private runs' summaries, written before a run could declare its seed published, still say \"user seed" in text


def test_a_rate_outside_a_contenders_grid_is_not_in_the_grid_not_yet_to_run(tmp_path):
    for lr in RATES:  # DP-MuonBC's smallest rate wins: its grid, alone, grows below RATES[0]
        publish(tmp_path, "dp_muonbc", lr, nll=lr)
    below = RATES[0] / math.sqrt(2)
    publish(tmp_path, "dp_muonbc", below, nll=0.5)
    publish(tmp_path, "dp_muon", RATES[0], nll=0.1)
    rows = {row[0]: row[1:] for row in table_rows(tuning_markdown(tmp_path))}
    assert rows[f"{below:.4g}"] == ["not in the grid", "0.5005 (2)", "not in the grid"]
    assert rows[f"{RATES[0]:.4g}"][2] == "not run yet"  # in DP-MuonBC (match_norm)'s grid, not yet run


def tuned(results: Path, muon_rate: float, bc_rate: float) -> None:
    """A complete tuning stage whose picks are DP-Muon's `muon_rate` and the others' `bc_rate`."""
    for contender in CONTENDERS:
        for lr in RATES:
            publish(results, contender, lr, nll=abs(lr - (muon_rate if contender == "dp_muon" else bc_rate)))


def test_horizon_rates_runs_dp_muon_slower_and_dp_muonbc_split_over_the_horizon(tmp_path):
    tuned(tmp_path, RATES[2], RATES[1])
    todo = [job for job in jobs(tmp_path, lambda seed: 100 + seed) if job.stage == "horizon_rates"]
    slower = slower_muon_rates(RATES[2])
    assert [f"{lr:.4g}" for lr in slower] == [f"{RATES[2] * 2**-0.25:.4g}", f"{RATES[1]:.4g}"]  # 2^(−1/4), 2^(−1/2): a grid point
    # Seed-major: a stage cut short still holds every arm of its first seeds.
    rates = {**{tune_name("dp_muon", lr, 0).removesuffix("_seed0"): (lr, lr) for lr in slower}, "dp_muonbc_split": (RATES[1], RATES[2])}
    assert [job.name for job in todo] == [f"{name}_seed{seed}" for seed in SEEDS for name in rates]
    for job in todo:
        muon, adam = rates[job.name.rsplit("_seed", 1)[0]]
        assert {f"optimizer.lr={muon:.6g}", f"optimizer.adam.lr={adam:.6g}", "trainer.epochs=3", "trainer.steps=null"} <= set(job.overrides)
        assert {PUBLISH_DIAGNOSTICS, "privacy.constant_time=false"} <= set(job.overrides)
        assert job.mechanism_seed == 100 + int(job.name[-1])  # paired with the horizon's run of its seed


def test_horizon_rates_needs_its_preregistration(tmp_path, monkeypatch):
    from studies import bc_fair

    ran = []
    monkeypatch.setattr(bc_fair, "public_model", lambda results: None)
    monkeypatch.setattr(bc_fair, "run_jobs", lambda pending, *a, **k: ran.extend(pending))
    tuned(tmp_path, RATES[2], RATES[1])
    args = ["run", "--stage", "horizon_rates", "--results", str(tmp_path), "--work", str(tmp_path / "work")]
    with pytest.raises(SystemExit, match=f"{HORIZON_RATES_PREREGISTRATION} is missing"):
        bc_fair.main(args)
    assert not ran
    (tmp_path / HORIZON_RATES_PREREGISTRATION).write_text("the rule\n")
    assert bc_fair.main(args) == 0 and len(ran) == 3 * len(SEEDS)


def horizon_curve(results: Path, stage: str, name: str, endpoint: dict[int, float]) -> None:
    """Seeds' validation curves ending at `endpoint[seed]` (Δ between two such runs is constant from LATE_FROM on)."""
    for seed, end in endpoint.items():
        rows = [{"step": s, "val_nll": 3.0 - s / 1000 + (end if s >= LATE_FROM else 0.0)} for s in [*range(0, 493, 25), 493]]
        write_run(results / stage, f"{name}_seed{seed}", rows)


@pytest.mark.parametrize(
    "against_slower, verdict",  # Δ (matched − DP-Muon at 0.0042), Δ (matched − DP-Muon at 0.0035), per seed
    [
        (([-0.010, -0.008, -0.012], [-0.006, -0.009, -0.007]), "the correction's direction"),  # ahead of every slower run
        (([-0.010, -0.008, -0.012], [+0.002, -0.004, +0.005]), "a rate effect"),  # DP-Muon at 0.0035 as good on average
        (([-0.010, +0.006, -0.002], [-0.006, -0.009, -0.007]), "unresolved"),  # ahead on average, not on every seed
    ],
)
def test_h3_reads_the_matched_arm_against_dp_muon_at_every_rate(tmp_path, against_slower, verdict):
    tuned(tmp_path, RATES[2], RATES[1])
    matched = {2: -0.020, 3: -0.012, 4: -0.016}  # Δ (matched − DP-Muon at 0.005): an interval below 0
    horizon_curve(tmp_path, "horizon", "dp_muon", dict.fromkeys(SEEDS, 0.0))
    horizon_curve(tmp_path, "horizon", "dp_muonbc_matched", matched)
    assert h3(tmp_path) == "waiting for the runs"
    for lr, deltas in zip(slower_muon_rates(RATES[2]), against_slower):
        name = tune_name("dp_muon", lr, 0).removesuffix("_seed0")
        horizon_curve(tmp_path, "horizon_rates", name, {seed: matched[seed] - delta for seed, delta in zip(SEEDS, deltas)})
    assert h3(tmp_path).startswith(verdict)
    rows = {row[0]: row[1:] for row in table_rows(horizon_rates_markdown(tmp_path))}
    assert rows[f"DP-MuonBC (match_norm) − DP-Muon at {RATES[2]:.4g}"][:2] == [mean_ci(list(matched.values()))] * 2
    assert rows[f"DP-MuonBC (match_norm) − DP-Muon at {RATES[1]:.4g}"][0].startswith(f"{statistics.mean(against_slower[1]):+.4f} [")
    # The figure: each slower arm's and the matched arm's curve against DP-Muon at its best rate, ending where the rule reads.
    plotted = dict(horizon_rates_figure(tmp_path, tmp_path / "horizon_rates.png"))
    slower = zip(slower_muon_rates(RATES[2]), against_slower)
    expected = {f"DP-Muon at {lr:.4g} (n = 3)": statistics.mean(matched[s] - d for s, d in zip(SEEDS, deltas)) for lr, deltas in slower}
    assert plotted == pytest.approx({**expected, "DP-MuonBC (match_norm) (n = 3)": statistics.mean(matched.values())})


def test_h4_reads_dp_muonbc_against_its_split_rate_run(tmp_path):
    tuned(tmp_path, RATES[2], RATES[1])
    horizon_curve(tmp_path, "horizon", "dp_muonbc", dict.fromkeys(SEEDS, 0.0))
    assert h4(tmp_path) == "waiting for the runs"
    horizon_curve(tmp_path, "horizon_rates", "dp_muonbc_split", {2: 0.010, 3: 0.014, 4: 0.012})  # the split run is behind
    assert h4(tmp_path).startswith("supported")


def test_the_committed_horizon_rates_preregistration_names_the_runs_rates():
    """The rule's text and the runner's rates agree: DP-Muon's committed pick, slowed by SLOWER_STEPS."""
    root = Path(__file__).resolve().parents[2] / "results" / "bc_regime" / "fair"
    text = (root / HORIZON_RATES_PREREGISTRATION).read_text()
    best = tuning_grid(root, "dp_muon")[1]
    assert f"{best:.2g}" in text
    assert all(f"{lr:.2g}" in text for lr in slower_muon_rates(best))
    assert f"from step {LATE_FROM} on" in text
