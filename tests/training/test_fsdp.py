"""`trainer.strategy=fsdp` in the driver (training/fsdp.py): two gloo processes under torchrun train
exactly the run DDP trains (the same releases, weights, metrics and ε), a run SIGKILLed mid-way
resumes to the uninterrupted run's end with every release charged once, and the runs FSDP2 would
hang are refused before any model is built."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from helpers_resume import ledger, rows, wait_for_step
from helpers_train import require_real_data, seed_file_override

from dpmuon.errors import UserError
from dpmuon.privacy.distributed import DataParallel
from dpmuon.training.fsdp import check_can_shard

TINY = [
    "experiment=smoke", "optimizer=dp_muonbc", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2", "privacy.expected_lot_size=16",
    "privacy.noise_multiplier=1.0", "trainer.steps=6", "trainer.micro_batch_size=8", "trainer.num_threads=1",
    "trainer.eval_every=3", "trainer.checkpoint_every=2", seed_file_override(5 << 100),  # every run: the same lots and noise
    "eval.num_beams=1", "eval.max_new_tokens=4", "logging.progress=false", "logger=none",
]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dpmuon.train", *args]


def completed(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run under DDP and under FSDP, uninterrupted."""
    require_real_data()
    root = tmp_path_factory.mktemp("strategies")
    for strategy in ("ddp", "fsdp"):
        completed(torchrun(*TINY, f"trainer.strategy={strategy}", f"hydra.run.dir={root / strategy}"))
    return root


def final_weights(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]


def charged(run_dir) -> list[tuple]:
    """The ledger's releases as charged: (step, σ, q), without the digests (a sharded release's
    digest is of its shards')."""
    return [(r["step"], r["noise_multiplier"], r["sample_rate"]) for r in ledger(run_dir) if r.get("charged")]


def descendants(pid: int) -> list[int]:
    children = [int(child) for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return children + [grandchild for child in children for grandchild in descendants(child)]


def test_fsdp_trains_the_run_ddp_trains_bit_for_bit(runs):
    """Two ranks' float64 sums add the same way under both (S0 + S1), so the grid releases are
    equal, and DP-MuonBC's Newton–Schulz on the owner rank gives the same steps: equal weights."""
    ddp, fsdp = (json.loads((runs / s / "summary.json").read_text()) for s in ("ddp", "fsdp"))
    assert fsdp["world_size"] == ddp["world_size"] == 2 and (ddp["strategy"], fsdp["strategy"]) == ("ddp", "fsdp")
    for key in ("epsilon", "steps", "test_nll", "final_weights_sha256", "initial_weights_sha256"):
        assert fsdp[key] == ddp[key], key
    assert rows(runs / "fsdp") == rows(runs / "ddp")  # val NLL, ε, update ratios, lot sizes, train loss
    assert charged(runs / "fsdp") == charged(runs / "ddp") and len(charged(runs / "ddp")) == 6
    a, b = final_weights(runs / "ddp"), final_weights(runs / "fsdp")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)  # whole tensors, as one process saves them


def test_a_killed_fsdp_run_resumes_to_the_uninterrupted_end(runs, tmp_path):
    """SIGKILL to every process after step 3 (one past a checkpoint): the resume replays step 3 from
    the checkpoint of step 2 and charges no release twice."""
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        torchrun(*TINY, "trainer.strategy=fsdp", f"hydra.run.dir={run_dir}"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    wait_for_step(run_dir, proc, 3)
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun's workers run in sessions of their own
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists()
    completed(torchrun(f"resume={run_dir}"))
    reference = runs / "fsdp"
    assert charged(run_dir) == charged(reference)  # each step charged once
    # Step 3 ran twice, from the same weights, lot and noise: its replay matched the first release
    # shard for shard (else it would have been redrawn fresh and charged), and is not charged.
    assert [r["step"] for r in ledger(run_dir) if r.get("kind") == "release" and not r["charged"]] == [3]
    assert rows(run_dir) == rows(reference)
    ours, theirs = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference))
    for key in ("epsilon", "steps", "test_nll", "final_weights_sha256"):
        assert ours[key] == theirs[key], key
    a, b = final_weights(run_dir), final_weights(reference)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_two_slurm_tasks_train_as_two_ranks(runs, tmp_path):
    """hydra/launcher=slurm with tasks_per_node=2: each task (here, as SLURM and submitit start it
    on one node) is a rank, and together they train the torchrun run."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
             "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(port)}  # fmt: skip
    # A task runs the Hydra job itself (submitit calls it), not the command line that submitted it.
    cmd = [sys.executable, "-c", "from dpmuon.train import main; main()", *TINY, "trainer.strategy=fsdp", f"hydra.run.dir={tmp_path / 'slurm'}"]
    logs = [tmp_path / f"task{rank}.log" for rank in range(2)]  # files: a full pipe would stall its rank, and the other with it
    tasks = [
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), env={**ENV, **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)})
        for rank, log in enumerate(logs)
    ]
    for task, log in zip(tasks, logs):
        assert task.wait(timeout=600) == 0, log.read_text()[-3000:]
    summary = json.loads((tmp_path / "slurm" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_weights_sha256"] == json.loads((runs / "fsdp" / "summary.json").read_text())["final_weights_sha256"]


def test_runs_fsdp_would_hang_or_cannot_shard_are_refused():
    with pytest.raises(UserError, match="torchrun --nproc_per_node"):
        check_can_shard(DataParallel(0, 1), private=True, constant_time=True)
    for private, constant_time in ((True, False), (False, False)):
        with pytest.raises(UserError, match="privacy.constant_time=true"):
            check_can_shard(DataParallel(0, 2), private=private, constant_time=constant_time)
    check_can_shard(DataParallel(1, 2), private=True, constant_time=True)
