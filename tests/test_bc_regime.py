"""The regime sweep's job list: paired mechanism seeds, kept secret, and a complete map."""

from __future__ import annotations

import os
import stat

from dpmuon.experiments import bc_regime
from dpmuon.experiments import jobs as jobs_module
from dpmuon.experiments.jobs import Job, run_job

RATES = {"dp_muon": 0.01, "dp_muonbc": 0.003}


def _seed_of(job):
    (override,) = job.secret_overrides
    return int(override.split("=", 1)[1])


def test_runs_of_one_seed_index_share_a_secret_mechanism_seed_that_differs_across_indices(tmp_path):
    seeds = bc_regime.MechanismSeeds(tmp_path / "mechanism_seeds.json")
    jobs = bc_regime.jobs(RATES, seeds)
    by_index = {}
    for job in jobs:
        index = next(o for o in job.overrides if o.startswith("seed=")).split("=")[1]
        by_index.setdefault(index, set()).add(_seed_of(job))
    assert set(by_index) == {"0", "1", "2"}
    assert all(len(s) == 1 for s in by_index.values())  # DP-Muon and DP-MuonBC (and ablations) paired
    assert len({s for v in by_index.values() for s in v}) == 3
    assert not any("mechanism_seed" in o for job in jobs for o in job.overrides)  # printed overrides hold no secret
    assert stat.S_IMODE(os.stat(tmp_path / "mechanism_seeds.json").st_mode) == 0o600
    again = bc_regime.jobs(RATES, bc_regime.MechanismSeeds(tmp_path / "mechanism_seeds.json"))
    assert [j.secret_overrides for j in again] == [j.secret_overrides for j in jobs]  # resumed sweeps pair up


def test_the_map_covers_every_epsilon_optimizer_and_seed_at_the_committed_rates():
    jobs = bc_regime.jobs(RATES, lambda seed: 7)
    runs = {j.name: j for j in jobs if j.stage == "runs"}
    assert len(runs) == len(bc_regime.EPSILONS) * len(bc_regime.OPTIMIZERS) * len(bc_regime.SEEDS)
    job = runs["dp_muonbc_eps128_seed2"]
    assert {"optimizer=dp_muonbc", "optimizer.lr=0.003", "privacy.target_epsilon=128", "seed=2", "logging.oracle_alignment=true"} <= set(job.overrides)
    checks = [j for j in jobs if j.stage == "lr_check"]
    assert {o for j in checks for o in j.overrides if o.startswith("optimizer.lr=")} == {
        "optimizer.lr=0.003", "optimizer.lr=0.03", "optimizer.lr=0.0009", "optimizer.lr=0.009"
    }
    assert len([j for j in jobs if j.stage == "ablations"]) == len(bc_regime.ABLATIONS) * len(bc_regime.SEEDS)
    # seed-major: all of seed 0's map runs come before any of seed 1's
    order = [j.name for j in jobs if j.stage == "runs"]
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
