"""The mechanism's randomness is secret: fresh per run by default, never derived from the
published `seed`, never written where a run's artifacts go, replayable only from the
owner-only mechanism state; secure mode draws lots and noise from the OS CSPRNG."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers_train import compose_config, require_real_data

from dpmuon.eval.runs import read_run_rows
from dpmuon.privacy import GaussianNoise, MechanismRandomness, PoissonLotSampler, SecretStream, build_lot_sampler
from dpmuon.privacy.randomness import OS_ENTROPY, SECURE, USER_SEED
from dpmuon.train import jobs_per_mechanism_seed
from dpmuon.training.loop import run
from dpmuon.training.secret import MECHANISM_SEED_ENV

TINY = [
    "experiment=smoke", "optimizer=dp_muon", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2",
    "privacy.expected_lot_size=16", "privacy.noise_multiplier=1.0", "trainer.steps=6", "trainer.micro_batch_size=16",
    "trainer.eval_every=3", "trainer.checkpoint_every=3", "eval.num_beams=1", "eval.max_new_tokens=4",
    "logging.progress=false", "logger=none", "trainer.num_threads=1",
]  # fmt: skip
SECRET = 987654321  # distinctive enough to grep for


def lots(randomness: MechanismRandomness, n: int = 500, steps: int = 5) -> list[list[int]]:
    sampler = PoissonLotSampler(n, 0.1, randomness.sampler, secure=randomness.secure)
    return [sampler.next_lot() for _ in range(steps)]


def test_default_randomness_is_fresh_for_every_run():
    a, b = MechanismRandomness(None), MechanismRandomness(None)
    assert a.source == b.source == OS_ENTROPY
    assert lots(a) != lots(b)
    assert not np.array_equal(GaussianNoise(a.noise).standard_normal(8), GaussianNoise(b.noise).standard_normal(8))


def test_user_seed_replays_lots_and_noise_and_is_independent_of_the_public_seed():
    torch.manual_seed(0)
    a = MechanismRandomness(7)
    torch.manual_seed(1)  # the public seed drives model init and data, never the mechanism
    b = MechanismRandomness(7)
    assert a.source == USER_SEED
    assert lots(a) == lots(b)
    assert np.array_equal(GaussianNoise(a.noise).standard_normal(8), GaussianNoise(b.noise).standard_normal(8))
    assert lots(MechanismRandomness(8)) != lots(MechanismRandomness(7))


def test_saved_state_replays_and_a_reseed_does_not():
    a = MechanismRandomness(3)
    lots(a, steps=2)
    state = a.state_dict()
    upcoming = lots(a)
    b = MechanismRandomness(None)
    b.load_state_dict(state)
    assert lots(b) == upcoming and b.source == USER_SEED
    b.load_state_dict(state)
    b.reseed_from_os_entropy()
    assert lots(b) != upcoming


def test_secure_lots_come_from_the_csprng_at_rate_q():
    seeded_twice = [MechanismRandomness(5, secure=True) for _ in range(2)]
    assert lots(seeded_twice[0]) != lots(seeded_twice[1])  # a seed does not reach secure draws
    sampler = PoissonLotSampler(400, 0.05, SecretStream(0), secure=True)
    sizes = [len(sampler.next_lot()) for _ in range(400)]
    mean, var = 20, 400 * 0.05 * 0.95
    assert sum(sizes) / len(sizes) == pytest.approx(mean, abs=5 * math.sqrt(var / 400))
    with pytest.raises(ValueError, match="poisson"):
        build_lot_sampler("shuffle", 100, 10, SecretStream(0), secure=True)


@pytest.mark.parametrize("mode", [[], ["privacy.secure_noise=true"]], ids=["default", "secure"])
def test_two_runs_with_identical_config_draw_different_lots(tmp_path, mode):
    require_real_data()
    sizes, digests = [], []
    for name in ("a", "b"):
        run(compose_config(*TINY, *mode), tmp_path / name)
        sizes.append([row["lot_size"] for row in read_run_rows(tmp_path / name, diagnostics=True) if row["step"] > 0])
        digests.append([json.loads(line).get("release_sha256") for line in (tmp_path / name / "privacy_ledger.jsonl").read_text().splitlines()[1:]])
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["mechanism_randomness"] == (SECURE if mode else OS_ENTROPY)
    assert sizes[0] != sizes[1]  # six Binomial(200, 0.08) lot sizes agree by chance ~1e-6
    assert not set(digests[0]) & set(digests[1])


def test_a_non_private_run_draws_its_lots_from_the_public_seed_and_rebuilds_bit_for_bit(tmp_path):
    """Its lots protect nothing, so a public model (scripts/pretrain_public.py) made by one is
    reproducible in a fresh checkout; another seed draws other lots."""
    require_real_data()
    public = [*TINY, "optimizer=adam"]
    weights = [run(compose_config(*public, f"seed={seed}"), tmp_path / name)["final_weights_sha256"] for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    assert weights[0] == weights[1] != weights[2]


def test_a_user_seed_never_reaches_the_artifacts_or_the_console(tmp_path):
    require_real_data()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dpmuon.train", *TINY, "privacy.keep_mechanism_state=true", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, MECHANISM_SEED_ENV: str(SECRET)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(SECRET) not in done.stdout + done.stderr
    mechanism_state = run_dir / "mechanism_state.pt"
    for path in run_dir.rglob("*"):
        if path.is_file() and path != mechanism_state:
            assert str(SECRET).encode() not in path.read_bytes(), path
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mechanism_randomness"] == USER_SEED
    # The generator states live only in the owner-only mechanism state, not in the checkpoint.
    assert stat.S_IMODE(mechanism_state.stat().st_mode) == 0o600
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert set(checkpoint["rng"]) <= {"probes", "torch_global", "cuda_global"}
    assert "sampler" not in checkpoint and "accountant" not in checkpoint
    assert sorted(torch.load(mechanism_state, weights_only=False)) == [3, 6]  # the last two checkpoints' states


def test_mechanism_state_is_deleted_when_the_run_completes(tmp_path):
    require_real_data()
    run(compose_config(*TINY), tmp_path)
    assert (tmp_path / "checkpoint.pt").exists() and not (tmp_path / "mechanism_state.pt").exists()


def test_jobs_per_mechanism_seed_counts_the_sweep(tmp_path):
    missing = tmp_path / "multirun.yaml"
    assert jobs_per_mechanism_seed(["optimizer=a,b", "seed=1,2"], missing, from_env=True) == 4  # the environment's seed: one for all
    assert jobs_per_mechanism_seed(["optimizer=a,b", "privacy.mechanism_seed_file=s"], missing, from_env=False) == 2
    assert jobs_per_mechanism_seed(["optimizer=a,b", "privacy.mechanism_seed_file=s,t"], missing, from_env=False) == 2  # paired by design
    assert jobs_per_mechanism_seed(["seed=0", "privacy.mechanism_seed_file=s,t,u"], missing, from_env=False) == 1
    assert jobs_per_mechanism_seed(["seed=0"], missing, from_env=True) == 1  # one job: nothing shared
