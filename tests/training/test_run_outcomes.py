"""How `python -m dpmuon.train` ends when a run does not simply succeed: a diverged run says so
(non-zero exit, strict JSON), a signal anywhere ends in one line with the resume command, an
unusable output folder is one line, a multirun runs every job and names the failed ones,
train.log holds the driver's [dpmuon] lines, and a finished torchrun worker exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers_train import require_real_data

from dpmuon import outcomes

TINY = [
    "experiment=smoke", "optimizer=dp_adam", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2", "privacy.expected_lot_size=16",
    "privacy.noise_multiplier=1.0", "trainer.steps=4", "trainer.micro_batch_size=8", "trainer.eval_every=2",
    "eval.num_beams=1", "eval.max_new_tokens=4", "logging.progress=false", "logger=none", "trainer.num_threads=1",
]  # fmt: skip

# Runs the driver's command line with `module.function` patched to signal the process itself
# first: an interrupt at a chosen point of the run, as Ctrl-C or a scheduler's SIGTERM would be.
SIGNAL_AT = textwrap.dedent(
    """
    import importlib, os, signal, sys
    module, name, signame = sys.argv[1:4]
    target = importlib.import_module(module)
    original = getattr(target, name)
    def signalled(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, signame))
        return original(*args, **kwargs)
    setattr(target, name, signalled)
    sys.argv = ["dpmuon.train", *sys.argv[4:]]
    from dpmuon.train import cli
    cli()
    """
)


def train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpmuon.train", *args], capture_output=True, text=True, timeout=300)


def strict_loads(text: str):
    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_a_diverged_run_ends_non_zero_with_one_clear_line_and_strict_json(tmp_path):
    require_real_data()
    done = train(*TINY, "optimizer.lr=1e30", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: non-finite: the validation NLL is nan")
    summary = strict_loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"].startswith("non-finite") and not summary["stopped_by_budget_guard"]
    assert summary["val_nll"] is None and summary["test_nll"] is None  # not the finite NLL of an earlier step
    for name in ("metrics.jsonl", "privacy_ledger.jsonl"):
        for line in (tmp_path / name).read_text().splitlines():
            strict_loads(line)
    assert "error: non-finite: the validation NLL is nan" in (tmp_path / "train.log").read_text()  # a failed run's log says why


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_diverging_under_torchrun_stops_every_rank_at_that_step(tmp_path, strategy):
    """Under DDP rank 0 alone validates: the other rank must stop with it, not go on to a release
    whose collectives rank 0 no longer joins."""
    require_real_data()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dpmuon.train", *TINY]
    command += ["optimizer.lr=1e30", f"trainer.strategy={strategy}", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "error: non-finite: the validation NLL is nan at step 2" in done.stderr
    assert not re.search(r"rank\s*:\s*1\b", done.stderr), done.stderr[-3000:]  # torchrun names rank 0 alone as failed
    summary = strict_loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["stop_reason"].startswith("non-finite") and summary["world_size"] == 2


RERUN = "it stopped before it trained: run the same command again"
RESUME = "resume with: python -m dpmuon.train resume={run_dir}"


@pytest.mark.parametrize(
    "where, signame, advice",
    [
        ("dpmuon.training.loop:hidden_matrices", "SIGINT", RERUN),  # right after the model is built
        pytest.param("dpmuon.training.evaluation:decode", "SIGTERM", RESUME, marks=pytest.mark.slow),  # trains first
    ],
    ids=["setup", "decoding"],
)
def test_a_signal_anywhere_ends_in_one_line_with_the_resume_command(tmp_path, where, signame, advice):
    require_real_data()
    module, name = where.split(":")
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_AT, module, name, signame, *TINY, f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 128 + getattr(signal, signame)
    assert "Traceback" not in done.stderr
    last = f"interrupted by {signame}; {advice.format(run_dir=tmp_path)}"
    assert done.stderr.strip().splitlines()[-1] == f"[dpmuon] {last}"
    log = (tmp_path / "train.log").read_text()  # every [dpmuon] line, the resume command included
    assert "e2e train: 200 examples" in log and last in log


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "multirun"])
def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path, multirun):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    done = train(*(["-m"] if multirun else []), "experiment=smoke", f"{key}={blocker}/run")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {key}={blocker}/run: {blocker} is a file, not a folder; pass {key}=<a writable folder>"]


def test_a_multirun_runs_every_job_and_names_the_failed_ones(tmp_path):
    """Both jobs fail validation in a second: the second still runs, and the summary names both."""
    done = train("-m", "experiment=smoke", "privacy.target_epsilon=0,-1", f"hydra.sweep.dir={tmp_path}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    summary = done.stderr[done.stderr.index("error: 2 job(s) of the multirun failed:") :].splitlines()
    assert summary[1].startswith("  job 0 (experiment=smoke privacy.target_epsilon=0): privacy.target_epsilon=0: must be > 0")
    assert summary[2].startswith("  job 1 (experiment=smoke privacy.target_epsilon=-1): privacy.target_epsilon=-1: must be > 0")
    recorded = [json.loads(line) for line in (Path(tmp_path) / "failed_jobs.jsonl").read_text().splitlines()]
    assert [job["number"] for job in recorded] == [0, 1]


def test_a_read_only_output_folder_is_named_before_hydra_starts(tmp_path, monkeypatch):
    """(Root writes anywhere, so the read-only folder is simulated.)"""
    monkeypatch.setattr(outcomes.os, "access", lambda path, mode: Path(path) != tmp_path)
    assert outcomes.output_folder_problem([f"hydra.run.dir={tmp_path}/new/run"]) == (
        f"hydra.run.dir={tmp_path}/new/run: {tmp_path} is not writable; pass hydra.run.dir=<a writable folder>"
    )
    assert outcomes.output_folder_problem([f"hydra.run.dir={tmp_path.parent}/x"]) is None


# The command line with the job stubbed out, beside an object whose finalization aborts the
# process: what a gloo thread left running does at a finished worker's exit (outcomes.end_distributed_process).
ABORTS_AT_FINALIZATION = textwrap.dedent(
    """
    import atexit, os, sys
    from dpmuon import train
    class Aborts:
        def __del__(self, abort=os.abort):  # (module globals are gone by then)
            abort()
    aborts = Aborts()
    atexit.register(print, "atexit handlers ran")
    train.main = lambda: print("the job ran", end=" ")  # unflushed: the end must flush it
    sys.argv = ["dpmuon.train"]
    train.cli()
    """
)


def test_a_finished_torchrun_worker_exits_zero_whatever_finalization_would_do(tmp_path):
    def finish(env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", ABORTS_AT_FINALIZATION], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)

    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    alone = finish(env)
    assert alone.returncode == -signal.SIGABRT  # the stand-in does abort a process that is finalized
    worker = finish({**env, "WORLD_SIZE": "2"})
    assert worker.returncode == 0, worker.stderr[-2000:]
    assert worker.stdout == "the job ran atexit handlers ran\n"
