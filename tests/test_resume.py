"""Kill a run (SIGKILL mid-training, or SIGTERM) and resume: same result as never stopping."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dpmuon.errors import UserError
from dpmuon.training.loop import run
from dpmuon.training.plan import check_resume_compatible, make_plan
from helpers_train import compose_config, require_real_data

OVERRIDES = [
    "experiment=smoke", "optimizer=dp_muonbc", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
    "model.n_positions=128", "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2",
    "privacy.expected_lot_size=16", "privacy.noise_multiplier=1.0", "trainer.steps=8", "trainer.micro_batch_size=8",
    "trainer.eval_every=3", "trainer.checkpoint_every=2", "eval.num_beams=1", "eval.max_new_tokens=4",
    "logging.progress=false", "logger=none", "trainer.num_threads=1",
]  # fmt: skip
TIMING = {"step_seconds"}


def launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dpmuon.train", *OVERRIDES, f"hydra.run.dir={run_dir}", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 240) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines() if line.strip()):
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended before step {step}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"step {step} not reached within {timeout}s")


def rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def resume(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpmuon.train", f"resume={run_dir}", f"hydra.run.dir={run_dir}/resume-launch"], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    require_real_data()
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    summary = run(compose_config(*OVERRIDES), run_dir)
    return run_dir, summary


def assert_same_run(resumed: Path, reference: tuple[Path, dict]) -> None:
    ref_dir, ref_summary = reference
    assert rows(resumed) == rows(ref_dir)  # no row lost, none duplicated, same numbers
    summary = json.loads((resumed / "summary.json").read_text())
    for key in ("epsilon", "steps", "test_nll", "bleu", "noise_multiplier", "initial_weights_sha256", "final_weights_sha256"):
        assert summary[key] == ref_summary[key], key
    ours = torch.load(resumed / "checkpoint.pt", weights_only=False)["model"]
    theirs = torch.load(ref_dir / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert (resumed / "generations.txt").read_text() == (ref_dir / "generations.txt").read_text()


@pytest.mark.parametrize("kill_after", [3, 6])
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, reference, kill_after):
    run_dir = tmp_path / "run"
    proc = launch(run_dir)
    wait_for_step(run_dir, proc, kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = resume(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from step" in done.stderr
    assert_same_run(run_dir, reference)


def test_sigterm_checkpoints_and_says_how_to_resume(tmp_path, reference):
    run_dir = tmp_path / "run"
    proc = launch(run_dir)
    wait_for_step(run_dir, proc, 1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM
    assert f"resume={run_dir}" in stderr and "Traceback" not in stderr
    stopped_at = torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"]
    assert stopped_at == rows(run_dir)[-1]["step"]  # checkpoint and log agree
    done = resume(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(run_dir, reference)


def test_finished_run_cannot_be_resumed(reference):
    done = resume(reference[0])
    assert done.returncode == 2 and "already finished" in done.stderr


def test_resume_refuses_a_changed_mechanism():
    kwargs = dict(private=True, dataset_size=1000, expected_lot_size=50, epochs=None, steps=20, target_epsilon=8.0, delta=1e-5, accountant="prv")
    stored = make_plan(**kwargs, noise_multiplier=1.0).as_dict()
    check_resume_compatible(stored, make_plan(**kwargs, noise_multiplier=1.0))
    with pytest.raises(UserError, match="noise_multiplier"):
        check_resume_compatible(stored, make_plan(**kwargs, noise_multiplier=1.5))
    with pytest.raises(UserError, match="dataset_size"):
        check_resume_compatible(stored, make_plan(**(kwargs | {"dataset_size": 999}), noise_multiplier=1.0))
