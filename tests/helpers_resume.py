"""Killing and resuming driver runs in a subprocess: a tiny private E2E run (`OVERRIDES`), launched,
SIGKILLed once a step is logged, resumed, and compared with an uninterrupted run."""

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
from helpers_train import seed_file_override

from dpmuon.eval.runs import read_run_rows

OVERRIDES = [
    "experiment=smoke", "optimizer=dp_muonbc", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
    "model.n_positions=128", "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2",
    "privacy.expected_lot_size=16", "privacy.noise_multiplier=1.0", "trainer.steps=8", "trainer.micro_batch_size=8",
    "trainer.eval_every=3", "trainer.checkpoint_every=4", "eval.num_beams=1", "eval.max_new_tokens=4",
    "logging.progress=false", "logger=none", "trainer.num_threads=1",
    "data.fallback=none",  # an empty data root must stop a run here, not switch it to the synthetic set
]  # fmt: skip
SEEDED = [seed_file_override(11 << 100)]  # the resumed run reads the file its stored config names
TIMING = {"step_seconds"}
BEFORE_FIRST_CHECKPOINT, BETWEEN_CHECKPOINTS = 1, 5


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


def kill_after(run_dir: Path, step: int, *extra: str) -> list[dict]:
    """SIGKILL the run once `step` is logged; returns the ledger as it was left."""
    proc = launch(run_dir, *extra)
    wait_for_step(run_dir, proc, step)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return ledger(run_dir)


def rows(run_dir: Path) -> list[dict]:
    """The training steps' rows (not step 0's: the validation NLL of the initial weights), each
    with its step's owner-only diagnostics (train loss, lot size, ...)."""
    logged = read_run_rows(run_dir, diagnostics=True)
    return [{k: v for k, v in row.items() if k not in TIMING} for row in logged if row["step"] > 0]


def ledger(run_dir: Path) -> list[dict]:
    lines = (run_dir / "privacy_ledger.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def resume(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpmuon.train", f"resume={run_dir}"], capture_output=True, text=True, timeout=600)


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
