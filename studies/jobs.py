"""Jobs of a multi-run experiment: run (or resume, or skip) one training run in a subprocess
and publish its small files under results/ the moment it ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dpmuon.privacy import MECHANISM_SEED_ENV, has_saved_state
from dpmuon.run_folder import PUBLISHED, RUNNER_LOCK, is_finished

REPO = Path(__file__).resolve().parents[1]  # the repository the studies run in


@dataclass(frozen=True)
class Job:
    name: str
    stage: str  # the folder it is published in: "tuning", "runs", ...
    overrides: tuple[str, ...]
    mechanism_seed: int | None = None  # secret: reaches the run through its environment, never argv


def run_job(job: Job, work: Path, results: Path, threads: int) -> Path:
    """Run (or resume, or skip) one job and return its published copy under `results`.

    Its working directory (with checkpoints) lives under `work`. A run already published under
    `results` is not run again, even when its working directory is gone (the committed record
    is the result; re-running would replace it with another draw). A job another runner holds
    (its lock file names a live process) is skipped: two runners may share one job list.
    """
    run_dir = work / job.stage / job.name
    published = results / job.stage / job.name
    if is_finished(run_dir):
        publish(run_dir, published)
        return published
    if is_finished(published):
        return published
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / RUNNER_LOCK
    if not _take(lock):
        print(f"  {job.stage}/{job.name}: held by another runner, skipped", flush=True)
        return published
    try:
        # Argv is world-readable (`ps`, /proc/<pid>/cmdline); a process's environment only to its
        # owner. A job without a seed must not inherit one from the runner's environment.
        env = {k: v for k, v in os.environ.items() if k != MECHANISM_SEED_ENV}
        if job.mechanism_seed is not None:
            env[MECHANISM_SEED_ENV] = str(job.mechanism_seed)
        # A run stopped before saving state has nothing to resume from: it starts again.
        if has_saved_state(run_dir):
            cmd = [sys.executable, "-m", "dpmuon.train", f"resume={run_dir}"]  # it writes into run_dir itself
        else:
            cmd = [
                sys.executable,
                "-m",
                "dpmuon.train",
                *job.overrides,
                f"hydra.run.dir={run_dir}",
                f"trainer.num_threads={threads}",
                "logging.progress=false",
            ]
        start = time.time()
        with open(work / job.stage / f"{job.name}.log", "a") as log:
            done = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"{job.name} failed (exit {done.returncode}); see {work / job.stage / (job.name + '.log')}")
        print(f"  {job.stage}/{job.name}: {time.time() - start:.0f} s", flush=True)
        publish(run_dir, published)  # at once: a run is on record (and committable) as soon as it ends
    finally:
        lock.unlink(missing_ok=True)
    return published


def run_jobs(jobs: Sequence[Job], work: Path, results: Path, threads: int, parallel: int) -> list[Path]:
    """`run_job` for every job, `parallel` at a time; returns their published copies in order.

    A failed job does not stop the others (`ThreadPoolExecutor.map` would cancel every job not
    yet started at the first failure): all run, then the failures are named together and the
    runner exits non-zero.
    """
    with ThreadPoolExecutor(parallel) as pool:
        futures = [pool.submit(run_job, job, work, results, threads) for job in jobs]
    failures = [f"{job.stage}/{job.name}: {error}" for job, error in ((j, f.exception()) for j, f in zip(jobs, futures)) if error is not None]
    if failures:
        raise SystemExit(f"{len(failures)} of {len(jobs)} jobs failed:\n  " + "\n  ".join(failures))
    return [future.result() for future in futures]


def _take(lock: Path) -> bool:
    """Create the lock with this process's id; a lock left by a dead process is taken over."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(lock.read_text() or 0), 0)
            return False
        except (ProcessLookupError, ValueError):
            lock.unlink(missing_ok=True)
            return _take(lock)
        except PermissionError:  # alive, another user's
            return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def publish(run_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for source, target in PUBLISHED.items():  # the record, without checkpoints or mechanism state
        if (run_dir / source).exists():
            shutil.copyfile(run_dir / source, dest / target)
