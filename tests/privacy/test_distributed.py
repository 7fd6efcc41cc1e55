"""Two processes (gloo, CPU) release exactly what one process releases from the same lots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_gpt2, token_batch
from helpers_train import require_real_data, seed_file_override

from dpmuon.errors import UserError
from dpmuon.eval.runs import read_run_rows
from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.optim import MuonBCSettings, OptimizerInputs
from dpmuon.privacy import DataParallel, GaussianNoise, PrivacyAccountant, PrivacyLedger, Privatizer, SecretStream, build_partition
from dpmuon.privacy.ledger import LEDGER_FILE
from dpmuon.privacy.mechanism import length_release, open_ledger
from dpmuon.privacy.plan import make_plan
from dpmuon.privacy.randomness import MechanismRandomness

DATA = token_batch(40, seed=11)
# The last lot of one example leaves rank 1 nothing to add: its totals must still line up with rank 0's.
LOTS = [[0, 3, 4, 9, 12, 15, 21, 30, 33], [1, 2, 8, 17, 25, 39], [5, 6, 7, 10, 11, 13, 14, 16, 18, 19, 20], [22]]
MUONBC = {"lr": 0.02, "momentum": 0.9, "adam": {"lr": 1e-3}, "bias_correction": {"probe_scale": 1.0, "num_probes": 1}}


def train_steps(parallel: DataParallel, secure: bool = False) -> dict:
    """A few DP-MuonBC steps on the fixed lots; this rank processes its shard of each lot."""
    torch.manual_seed(0)
    model = tiny_gpt2(tie=True)
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.5, matrix_names=hidden_matrices(model))
    privatizer = Privatizer(
        model, partition, noise_multiplier=0.8, expected_lot_size=8, sample_rate=0.2, accountant=PrivacyAccountant(1e-5),
        noise=GaussianNoise(secure=True) if secure else GaussianNoise(SecretStream(5)), parallel=parallel,
    )  # fmt: skip
    optimizer = MuonBCSettings(**MUONBC).build(
        OptimizerInputs(dict(model.named_parameters()), hidden_matrices(model), privatizer.release_noise_std(), torch.Generator().manual_seed(6))
    )
    released, lot_sizes = [], []
    for lot in LOTS:
        shard = parallel.shard(lot)
        batches = [{k: v[shard[i : i + 2]] for k, v in DATA.items()} for i in range(0, len(shard), 2)]
        stats = privatizer.release(batches, per_example_lm_loss)
        released.append({n: p.grad.clone() for n, p in model.named_parameters()})
        lot_sizes.append(stats.lot_size)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "released": released,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "lot_sizes": lot_sizes,
        "steps": privatizer.accountant.steps,
    }


def _worker(rank: int, init_file: str, out: str, secure: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    parallel = DataParallel(rank, 2)
    result = train_steps(parallel, secure)
    parallel.leave()  # as the driver does after training
    result["left"] = not dist.is_initialized()
    torch.save(result, f"{out}.{rank}")


def test_two_gloo_processes_in_secure_mode_release_rank_zeros_noise_once(tmp_path):
    """CSPRNG draws differ per rank, so rank 0 alone noises and the others take its release."""
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path / "out"), True), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(2)]
    for step, grads in enumerate(ranks[0]["released"]):
        assert all(torch.equal(g, ranks[1]["released"][step][name]) for name, g in grads.items()), step
    assert all(torch.equal(p, ranks[1]["params"][name]) for name, p in ranks[0]["params"].items())


def test_two_gloo_processes_release_what_one_process_releases(tmp_path):
    torch.set_num_threads(1)
    single = train_steps(DataParallel(0, 1))
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(2)]
    assert all(result["left"] for result in ranks)
    for result in ranks:  # both ranks hold the single-process release and parameters
        assert result["lot_sizes"] == single["lot_sizes"] == [len(lot) for lot in LOTS]
        assert result["steps"] == single["steps"] == len(LOTS)
        for step, grads in enumerate(result["released"]):
            for name, g in grads.items():
                assert torch.allclose(g, single["released"][step][name], atol=1e-6, rtol=1e-5), (step, name)
        for name, p in result["params"].items():
            assert torch.allclose(p, single["params"][name], atol=1e-5, rtol=1e-5), name
    for name in ranks[0]["params"]:  # and the ranks agree bit for bit: one noise draw, broadcast by the sum
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])


def _refusing_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    parallel = DataParallel(rank, 2)

    def check() -> int:
        raise UserError("the ledger was deleted")

    outcomes = [parallel.on_main(lambda: 41 + 1)]
    try:
        parallel.on_main(check)
    except UserError as err:
        outcomes.append(str(err))
    parallel.leave()
    torch.save(outcomes, f"{out}.{rank}")


def test_a_refusal_on_rank_zero_is_raised_on_every_rank(tmp_path):
    """Rank 0 checks the ledger alone; had it raised alone, rank 1 would wait in its next collective."""
    context = mp.spawn(_refusing_worker, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "a rank is still waiting"
    for rank in range(2):
        assert torch.load(tmp_path / f"out.{rank}") == [42, "the ledger was deleted"]


def _ledger_refusing_worker(rank: int, init_file: str, run_dir: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    parallel = DataParallel(rank, 2)
    plan = make_plan(
        private=True, dataset_size=40, expected_lot_size=8, epochs=None, steps=3, target_epsilon=8.0, delta=1e-5,
        accountant="rdp", noise_multiplier=1.0,
    )  # fmt: skip
    refusals = []
    for refused in (
        lambda: length_release([3, 5, 8], 8, 2.0, MechanismRandomness(None), Path(run_dir), parallel),  # the ledger's rows were one width
        lambda: open_ledger(Path(run_dir), plan, "another data set", parallel),
    ):
        try:
            refused()
        except UserError as err:
            refusals.append(str(err).split(":")[0])
    parallel.leave()
    torch.save(refusals, f"{out}.{rank}")


def test_rank_zeros_ledger_refusals_are_raised_on_every_rank(tmp_path):
    """Rank 0 alone reads the ledger; a refusal there reaches every rank (before: rank 1 waited
    forever for the histogram's broadcast)."""
    PrivacyLedger(tmp_path / LEDGER_FILE, {"dataset": "d", "dataset_size": 40, "delta": 1e-5, "accountant": "rdp"})
    context = mp.spawn(_ledger_refusing_worker, args=(str(tmp_path / "init"), str(tmp_path), str(tmp_path / "out")), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "a rank is still waiting"
    for rank in range(2):
        assert torch.load(tmp_path / f"out.{rank}") == ["cannot continue this run directory"] * 2


def test_shards_partition_the_lot():
    lot = list(range(11))
    shards = [DataParallel(r, 3).shard(lot) for r in range(3)]
    assert sorted(sum(shards, [])) == lot and all(shards)


TORCHRUN_TINY = [
    "experiment=smoke", "optimizer=dp_muonbc", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2", "privacy.expected_lot_size=16",
    "privacy.noise_multiplier=1.0", "trainer.steps=4", "trainer.micro_batch_size=4", "trainer.num_threads=1",
    seed_file_override(3 << 100),  # one and two processes must draw the same lots and noise
    "eval.num_beams=1", "eval.max_new_tokens=4", "logging.progress=false", "logger=none",
]  # fmt: skip


def test_torchrun_two_processes_match_one_process(tmp_path):
    """The whole driver under torchrun (gloo): same ε, metrics and final weights as one process."""
    require_real_data()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run(
        [sys.executable, "-m", "dpmuon.train", *TORCHRUN_TINY, f"hydra.run.dir={tmp_path / 'one'}"], capture_output=True, text=True, env=env, timeout=600
    )
    assert single.returncode == 0, single.stderr[-3000:]
    double = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "dpmuon.train", *TORCHRUN_TINY, f"hydra.run.dir={tmp_path / 'two'}",
        ],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert double.returncode == 0, double.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["epsilon"] == one["epsilon"] and two["steps"] == one["steps"]
    rows = [read_run_rows(tmp_path / d, diagnostics=True)[1:] for d in ("one", "two")]  # [0]: step 0
    assert [r["lot_size"] for r in rows[0]] == [r["lot_size"] for r in rows[1]]  # same global lots
    assert [r["train_loss"] for r in rows[0]] == pytest.approx([r["train_loss"] for r in rows[1]], rel=1e-5)
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=False)["model"] for d in ("one", "two"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-5) for k in a)
