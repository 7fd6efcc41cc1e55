"""The job runner of the multi-run experiments: one failed job does not stop the others."""

from __future__ import annotations

import pytest

from studies import jobs
from studies.jobs import Job


def test_every_job_runs_past_a_failure_and_the_failures_are_named(tmp_path, monkeypatch):
    ran = []

    def run_job(job, work, results, threads):
        ran.append(job.name)
        if job.name == "a":
            raise SystemExit(f"{job.name} failed (exit 2); see its log")
        return results / job.name

    monkeypatch.setattr(jobs, "run_job", run_job)
    todo = [Job(name, "runs", ()) for name in ("a", "b", "c")]
    with pytest.raises(SystemExit, match=r"1 of 3 jobs failed:\n  runs/a: a failed \(exit 2\)"):
        jobs.run_jobs(todo, tmp_path, tmp_path / "results", threads=1, parallel=1)
    assert ran == ["a", "b", "c"]
    monkeypatch.setattr(jobs, "run_job", lambda job, work, results, threads: results / job.name)
    assert jobs.run_jobs(todo[1:], tmp_path, tmp_path / "results", threads=1, parallel=2) == [tmp_path / "results" / "b", tmp_path / "results" / "c"]
