"""The regime sweep's job list: paired mechanism seeds, kept secret, and a complete map."""

from __future__ import annotations

import json
import os
import stat

import pytest

from dpmuon.privacy.randomness import OS_ENTROPY, USER_SEED
from studies import bc_regime
from studies import jobs as jobs_module
from studies.jobs import Job, run_job

RATES = {"dp_muon": 0.01, "dp_muonbc": 0.003}


def test_runs_of_one_seed_index_share_a_secret_mechanism_seed_that_differs_across_indices(tmp_path):
    seeds = bc_regime.MechanismSeeds(tmp_path / "mechanism_seeds.json")
    jobs = bc_regime.jobs(RATES, seeds)
    by_index = {}
    for job in jobs:
        index = next(o for o in job.overrides if o.startswith("seed=")).split("=")[1]
        by_index.setdefault(index, set()).add(job.mechanism_seed)
    assert set(by_index) == {"0", "1", "2"}
    assert all(len(s) == 1 for s in by_index.values())  # DP-Muon and DP-MuonBC (and ablations) paired
    assert len({s for v in by_index.values() for s in v}) == 3
    assert not any("mechanism_seed" in o for job in jobs for o in job.overrides)  # printed overrides hold no secret
    assert stat.S_IMODE(os.stat(tmp_path / "mechanism_seeds.json").st_mode) == 0o600
    again = bc_regime.jobs(RATES, bc_regime.MechanismSeeds(tmp_path / "mechanism_seeds.json"))
    assert [j.mechanism_seed for j in again] == [j.mechanism_seed for j in jobs]  # resumed sweeps pair up
    assert all(64 < job.mechanism_seed.bit_length() <= 128 for job in jobs)  # 128 random bits: no search finds one


def test_a_stored_mechanism_seed_is_kept_and_only_new_ones_are_drawn(tmp_path):
    (tmp_path / "mechanism_seeds.json").write_text('{"0": 12345}')  # drawn with fewer bits by an older runner
    seeds = bc_regime.MechanismSeeds(tmp_path / "mechanism_seeds.json")
    assert seeds(0) == 12345 and seeds(1).bit_length() > 64


def test_the_map_covers_every_epsilon_optimizer_and_seed_at_the_committed_rates():
    jobs = bc_regime.jobs(RATES, lambda seed: 7)
    runs = {j.name: j for j in jobs if j.stage == "runs"}
    assert len(runs) == len(bc_regime.EPSILONS) * len(bc_regime.OPTIMIZERS) * len(bc_regime.SEEDS)
    job = runs["dp_muonbc_eps128_seed2"]
    assert {"optimizer=dp_muonbc", "optimizer.lr=0.003", "privacy.target_epsilon=128", "seed=2", "logging.oracle_alignment=true"} <= set(job.overrides)
    checks = [j for j in jobs if j.stage == "lr_check"]
    assert {o for j in checks for o in j.overrides if o.startswith("optimizer.lr=")} == {
        "optimizer.lr=0.003",
        "optimizer.lr=0.03",
        "optimizer.lr=0.0009",
        "optimizer.lr=0.009",
    }
    assert len([j for j in jobs if j.stage == "ablations"]) == len(bc_regime.ABLATIONS) * len(bc_regime.SEEDS)
    rules = [j for j in jobs if j.stage == "rule_check"]  # the candidate gate at every ε but the ablations' 8
    assert sorted(j.name for j in rules) == [f"dp_muonbc_{bc_regime.RULE}_eps{e}_seed0" for e in (1024, 128, 32)]
    assert all(set(bc_regime.ABLATIONS[bc_regime.RULE]) <= set(j.overrides) for j in rules)
    # seed-major: everything of seed 0 (map, checks, ablations) comes before anything of seed 1
    order = [j.name for j in jobs]
    assert max(i for i, n in enumerate(order) if n.endswith("seed0")) < min(i for i, n in enumerate(order) if n.endswith("seed1"))


def test_the_committed_rates_are_read_from_the_study_finals():
    assert bc_regime.committed_rate("dp_muon") > 0 and bc_regime.committed_rate("dp_muonbc") > 0


def test_a_job_held_by_a_live_runner_is_skipped_and_a_dead_runners_lock_is_taken_over(tmp_path, monkeypatch):
    job = Job("a", "runs", ("seed=0",))
    run_dir = tmp_path / "work" / "runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "runner.lock").write_text(str(os.getppid()))  # a live process
    calls = []
    monkeypatch.setattr(jobs_module.subprocess, "run", lambda cmd, **k: calls.append(cmd))
    run_job(job, tmp_path / "work", tmp_path / "results", threads=1)
    assert calls == []

    (run_dir / "runner.lock").write_text("999999999")  # no such process

    def finish(cmd, **kwargs):
        calls.append(cmd)
        (run_dir / "summary.json").write_text("{}")
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(jobs_module.subprocess, "run", finish)
    published = run_job(job, tmp_path / "work", tmp_path / "results", threads=1)
    assert len(calls) == 1 and (published / "summary.json").exists() and not (run_dir / "runner.lock").exists()


def _fake_run(root, stage, name, optimizer, test_nll, snr=0.01, gain=0.02, lr=0.01, randomness=USER_SEED):
    run = root / stage / name
    run.mkdir(parents=True)
    summary = {"optimizer": optimizer, "test_nll": test_nll, "val_nll": test_nll - 0.1, "epsilon": 7.99, "mechanism_randomness": randomness}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "config.yaml").write_text(f"optimizer:\n  lr: {lr}\n")
    rows = [{"step": 1, "snr_median": snr / 2}]  # a row without oracle fields is skipped
    rows += [
        {
            "step": s,
            "snr_median": snr / 2,
            "snr": {"w": snr / 2, "v": snr / 2},
            "oracle_snr_median": snr,
            "oracle_snr": {"w": snr, "v": snr},
            "oracle_cos_plain": {"w": 0.5, "v": 0.5},
            "oracle_cos_bc": {"w": 0.5 + gain, "v": 0.5 + gain},
            "oracle_cos_plain_median": 0.5,
            "oracle_cos_bc_median": 0.5 + gain,
        }
        for s in (2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_pairs_runs_by_seed_and_says_what_was_not_run(tmp_path):
    from studies import bc_regime_report as report

    for seed, (muon, bc) in enumerate([(2.70, 2.80), (2.75, 2.80)]):
        _fake_run(tmp_path, "runs", f"dp_muon_eps8_seed{seed}", "dp_muon", muon, snr=0.02 * (seed + 1))
        _fake_run(tmp_path, "runs", f"dp_muonbc_eps8_seed{seed}", "dp_muonbc", bc)
    _fake_run(tmp_path, "runs", "dp_muon_eps32_seed0", "dp_muon", 2.5)  # its pair is missing
    _fake_run(tmp_path, "ablations", "dp_muonbc_probe2_eps8_seed0", "dp_muonbc", 2.60)
    _fake_run(tmp_path, "lr_check", "dp_muon_eps1024_lr0.003_seed0", "dp_muon", 2.4, lr=0.003)
    _fake_run(tmp_path, "rule_check", f"dp_muonbc_{bc_regime.RULE}_eps32_seed0", "dp_muonbc", 2.45)
    written = report.write_report(tmp_path)
    table = (tmp_path / "regime.md").read_text()
    row8 = next(line for line in table.splitlines() if line.startswith("| 8 |"))
    assert "+0.0750 ± 0.0354 (+0.1000, +0.0500)" in row8  # BC − Muon, per seed
    assert "| 0.03 |" in row8  # median true SNR over both DP-Muon runs' steps: median of 0.02, 0.02, 0.04, 0.04
    row32 = next(line for line in table.splitlines() if line.startswith("| 32 |"))
    assert "2.5000 (1 seed)" in row32 and report.NOT_RUN in row32  # no DP-MuonBC run: said, not filled
    assert next(line for line in table.splitlines() if line.startswith("| probe2 |")).count("-0.1000 (1 pair)") == 1
    assert "| dp_muon | 0.003 |" in table
    # gates: estimates 0.01 (seed 0) and 0.02 (seed 1) → half pass min_snr = 0.01; the rule's run at ε = 32 is paired
    assert "| 8 | 0.50 | 0.00 | " + report.NOT_RUN + " |" in table
    assert "| 32 | 0.00 | 0.00 | -0.0500 (1 pair) |" in table and f"| 128 | {report.NOT_RUN} | {report.NOT_RUN} | {report.NOT_RUN} |" in table
    # gain per (matrix, step) of the DP-Muon map runs: 3 runs × 2 steps × 2 matrices, all +0.02
    assert "| 0.0316–0.1 | 4 | +0.0200 |" in table and "positive gain: 12 of 12" in table
    csv_rows = (tmp_path / "regime.csv").read_text().splitlines()
    assert csv_rows[1].startswith("8,2,") and csv_rows[3].startswith("128,0,,,")
    before = [p.read_bytes() for p in written]
    report.write_report(tmp_path)
    assert [p.read_bytes() for p in written] == before  # tables and figures regenerate byte for byte


def test_the_report_refuses_a_run_that_did_not_draw_the_shared_seed(tmp_path):
    from studies import bc_regime_report as report

    _fake_run(tmp_path, "runs", "dp_muon_eps8_seed0", "dp_muon", 2.70)
    _fake_run(tmp_path, "runs", "dp_muonbc_eps8_seed0", "dp_muonbc", 2.80, randomness=OS_ENTROPY)  # e.g. resumed without its seed
    with pytest.raises(ValueError, match="dp_muonbc_eps8_seed0.*os entropy.*run it again"):
        report.write_report(tmp_path)


def test_snr_extrapolation_recovers_mean_and_variance_from_two_lots():
    """SNR_B ∝ E_B·B² with E_B = μ² + V/B: two lots give μ² and V, hence the SNR at lot 1024."""
    from studies.bc_regime_report import extrapolate_snr

    mean, variance = 2e-9, 3e-7
    snr = {b: (mean + variance / b) * b**2 for b in (8, 16)}
    constant, fitted = extrapolate_snr(snr)
    assert fitted == pytest.approx((mean + variance / 1024) * 1024**2, rel=1e-9)
    assert constant == pytest.approx(snr[16] * 64**2) and constant > fitted  # (1) is the upper bound
    assert extrapolate_snr({16: snr[16]}) == (constant, None)
    assert extrapolate_snr({8: 1.0, 16: 1.0})[1] is None  # energy falling faster than 1/B: not resolved


def test_a_jobs_mechanism_seed_reaches_the_run_through_its_environment_not_its_command_line(tmp_path, monkeypatch):
    seen = []

    def capture(cmd, env, **kwargs):
        seen.append((cmd, env))
        return type("Done", (), {"returncode": 1})()

    monkeypatch.setattr(jobs_module.subprocess, "run", capture)
    monkeypatch.setenv(jobs_module.MECHANISM_SEED_ENV, "5550123")  # the runner's own: no job may inherit it
    for job in (Job("a", "runs", ("seed=0",), mechanism_seed=918273645), Job("b", "runs", ("seed=0",))):
        with pytest.raises(SystemExit):
            run_job(job, tmp_path / "work", tmp_path / "results", threads=1)
    (seeded, seeded_env), (unseeded, unseeded_env) = seen
    assert not any("privacy.mechanism_seed" in arg or "918273645" in arg for arg in seeded + unseeded)  # argv: readable by every user (ps)
    assert seeded_env[jobs_module.MECHANISM_SEED_ENV] == "918273645" and jobs_module.MECHANISM_SEED_ENV not in unseeded_env


def test_a_run_that_stopped_before_saving_state_starts_again_with_its_seed_and_a_started_one_resumes(tmp_path, monkeypatch):
    """A run that failed in setup saved no mechanism state to resume from: it is started again
    from its command, its seed in the environment (pairing kept)."""
    seen = []

    def capture(cmd, env, **kwargs):
        seen.append((cmd, env))
        return type("Done", (), {"returncode": 1})()

    monkeypatch.setattr(jobs_module.subprocess, "run", capture)
    job = Job("a", "runs", ("seed=0",), mechanism_seed=918273645)
    run_dir = tmp_path / "work" / "runs" / "a"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("privacy:\n  mechanism_seed_file: null\n")
    for saved in (None, "mechanism_state.pt", "checkpoint.pt"):
        if saved:
            (run_dir / saved).write_bytes(b"")
        with pytest.raises(SystemExit):
            run_job(job, tmp_path / "work", tmp_path / "results", threads=1)
    (fresh, fresh_env), (after_state, _), (after_checkpoint, _) = seen
    assert "seed=0" in fresh and fresh_env[jobs_module.MECHANISM_SEED_ENV] == "918273645"
    assert any(arg.startswith("resume=") for arg in after_state) and any(arg.startswith("resume=") for arg in after_checkpoint)
