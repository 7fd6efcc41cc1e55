"""A user mechanism seed comes only from the environment or an owner-only file and appears in
nothing a run writes or prints; the secret mechanism state does not outlive training; the
summary names the non-private values it holds; bf16 without fixed shapes and a resume under
another lot sampling are caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_train import compose_config, require_real_data

from dpmuon.errors import UserError
from dpmuon.privacy.mechanism import mechanism_randomness
from dpmuon.privacy.randomness import USER_SEED
from dpmuon.privacy.state import save_mechanism_state
from dpmuon.train import check_resume_seed, cli
from dpmuon.training import loop
from dpmuon.training.batching import fixed_batch_shape
from dpmuon.training.secret import (
    MECHANISM_SEED_ENV,
    WEAK_SEED_WARNING,
    record_seed_use,
    seed_on_command_line,
    user_mechanism_secret,
)

SECRET = 0x5EC2E7_9A1B_3C4D_5E6F_7A8B_9C0D  # a 111-bit seed, distinctive in decimal and hex
TINY = [
    "experiment=smoke", "optimizer=dp_muon", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2",
    "privacy.expected_lot_size=16", "privacy.noise_multiplier=1.0", "trainer.steps=2", "trainer.micro_batch_size=16",
    "trainer.eval_every=1", "trainer.checkpoint_every=1", "eval.num_beams=1", "eval.max_new_tokens=4",
    "logging.progress=false", "logger=none", "trainer.num_threads=1",
]  # fmt: skip


def seed_file(directory: Path, seed: int = SECRET, mode: int = 0o600) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "mechanism_seed"
    path.write_text(f"{seed}\n")
    path.chmod(mode)
    return path


def seed_hits(root: Path, seed: int = SECRET) -> list[str]:
    """Files under `root` holding the seed in decimal or hex."""
    forms = [str(seed).encode(), f"{seed:x}".encode(), f"{seed:X}".encode()]
    return [str(p) for p in root.rglob("*") if p.is_file() and any(form in p.read_bytes() for form in forms)]


# ---- the command line --------------------------------------------------------------------------


SWEEPS = {"choice(11111111,22222222)", "range(11111111,11111113)", "11111111,11111111"}


@pytest.mark.parametrize(
    "override",
    [
        "privacy.mechanism_seed=11111111", "+privacy.mechanism_seed=11111111", "++privacy.mechanism_seed=11111111",
        "~privacy.mechanism_seed", "privacy.mechanism_seed=int(11111111)", "privacy.mechanism_seed=11_111_111",
        "privacy={mechanism_seed: 11111111}", *(f"privacy.mechanism_seed={sweep}" for sweep in sorted(SWEEPS)),
    ],
)  # fmt: skip
def test_a_seed_on_the_command_line_is_refused_before_hydra_writes_anything(tmp_path, monkeypatch, capsys, override):
    multirun = ["-m"] if override.split("=", 1)[-1] in SWEEPS else []
    # A config that fails validation: on code without the check, Hydra writes its records first.
    args = [*multirun, "experiment=smoke", override, "data.max_train_examples=0", f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"]
    monkeypatch.setattr(sys, "argv", ["dpmuon.train", *args])
    with pytest.raises(SystemExit) as stopped:
        cli()
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and MECHANISM_SEED_ENV in err and "privacy.mechanism_seed_file=" in err
    assert "11111111" not in err and "11_111_111" not in err
    assert list(tmp_path.iterdir()) == []  # no .hydra/*.yaml, no multirun.yaml, no run directory


def test_a_path_that_names_the_seed_is_no_seed_on_the_command_line():
    assert not seed_on_command_line(["privacy.mechanism_seed_file=/keys/mechanism_seed.txt", "privacy.mechanism_seed_file=a,b", "seed=3"])
    assert not seed_on_command_line(["hydra.run.dir=/runs/mechanism_seed_study", "privacy={mechanism_seed_file: /k}"])
    assert seed_on_command_line(["hydra.sweeper.params.privacy.mechanism_seed=1,2"])
    assert seed_on_command_line(["privacy=choice({mechanism_seed: 1},{'mechanism_seed': 2})"])
    assert seed_on_command_line(["privacy.mechanism_seed=("])  # unreadable, still refused


# ---- reading the seed --------------------------------------------------------------------------


def test_the_seed_comes_from_the_environment_or_an_owner_only_file(tmp_path, monkeypatch):
    monkeypatch.delenv(MECHANISM_SEED_ENV, raising=False)
    assert user_mechanism_secret(compose_config()) is None  # default: OS entropy
    monkeypatch.setenv(MECHANISM_SEED_ENV, f" {SECRET}\n")
    assert user_mechanism_secret(compose_config()) == SECRET
    owner_only = seed_file(tmp_path / "a")
    with pytest.raises(UserError, match="keep one"):
        user_mechanism_secret(compose_config(f"privacy.mechanism_seed_file={owner_only}"))
    monkeypatch.delenv(MECHANISM_SEED_ENV)
    assert user_mechanism_secret(compose_config(f"privacy.mechanism_seed_file={owner_only}")) == SECRET
    read_only = seed_file(tmp_path / "b", mode=0o400)
    assert user_mechanism_secret(compose_config(f"privacy.mechanism_seed_file={read_only}")) == SECRET
    for mode in (0o640, 0o604, 0o660):
        shared = seed_file(tmp_path / f"m{mode:o}", mode=mode)
        with pytest.raises(UserError) as caught:
            user_mechanism_secret(compose_config(f"privacy.mechanism_seed_file={shared}"))
        message = str(caught.value)
        assert message.endswith(f"chmod 600 {shared}") and "\n" not in message and str(SECRET) not in message
    with pytest.raises(UserError, match="cannot open"):
        user_mechanism_secret(compose_config(f"privacy.mechanism_seed_file={tmp_path}/missing"))


def test_a_seed_below_2_to_the_64_is_warned_once_per_run(monkeypatch, capsys):
    cfg = compose_config()
    for seed, warned in ((2**64 - 1, True), (2**64, False)):
        monkeypatch.setenv(MECHANISM_SEED_ENV, str(seed))
        mechanism_randomness(user_mechanism_secret(cfg), loop.privacy_settings(cfg), log=loop.log)
        err = capsys.readouterr().err
        assert err.count(WEAK_SEED_WARNING) == (1 if warned else 0) and str(seed) not in err


def test_a_resume_draws_from_the_kind_of_randomness_the_run_started_with(tmp_path, monkeypatch):
    cfg = compose_config()
    monkeypatch.delenv(MECHANISM_SEED_ENV, raising=False)
    record_seed_use(tmp_path, True)
    with pytest.raises(UserError, match=f"resume it with {MECHANISM_SEED_ENV} set"):
        check_resume_seed(cfg, tmp_path)  # nothing carries the seed on: it would draw OS entropy
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SECRET))
    check_resume_seed(cfg, tmp_path)  # the seed given again
    monkeypatch.delenv(MECHANISM_SEED_ENV)
    (tmp_path / "mechanism_state.pt").write_bytes(b"")
    check_resume_seed(cfg, tmp_path)  # the saved state carries the draws on
    record_seed_use(tmp_path, False)
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SECRET))
    with pytest.raises(UserError, match=f"unset {MECHANISM_SEED_ENV}"):
        check_resume_seed(cfg, tmp_path)


# ---- end to end: no file, log or W&B record holds the seed --------------------------------------


def test_a_seeded_run_leaves_its_seed_in_no_file_log_or_wandb_record(tmp_path):
    """Seed from the environment, diagnostics published, W&B offline, the run directory named
    by Hydra's override_dirname: the seed's decimal and hex forms appear nowhere."""
    require_real_data()
    runs, wandb_home = tmp_path / "runs", tmp_path / "wandb-home"
    env = {**os.environ, MECHANISM_SEED_ENV: str(SECRET), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.update({f"WANDB_{kind}_DIR": str(wandb_home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}, WANDB_DIR=str(wandb_home))
    overrides = [*TINY, "logger=wandb", "logging.nonprivate_diagnostics=publish"]
    named_by = f"hydra.job.config.override_dirname.exclude_keys=[{','.join(o.split('=')[0] for o in overrides)}]"  # a short name: seed=3
    cmd = [sys.executable, "-m", "dpmuon.train", *overrides, "seed=3", named_by, f"hydra.run.dir={runs}/${{hydra:job.override_dirname}}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = [p.parent for p in runs.glob("*/summary.json")]
    assert run_dir.name == "seed=3"
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B's own record was written
    assert seed_hits(tmp_path) == []
    assert str(SECRET) not in done.stdout + done.stderr and f"{SECRET:x}" not in (done.stdout + done.stderr).lower()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mechanism_randomness"] == USER_SEED and "mechanism_seed" not in summary["command"]
    assert not (run_dir / "mechanism_state.pt").exists()


def test_a_multirun_sharing_a_seed_file_warns_once_and_records_no_seed(tmp_path):
    require_real_data()
    sweep, secret = tmp_path / "sweep", seed_file(tmp_path / "secret")
    cmd = [sys.executable, "-m", "dpmuon.train", "-m", *TINY, "trainer.steps=1", "eval.test=false", "optimizer=dp_sgd,dp_adam",
           f"privacy.mechanism_seed_file={secret}", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={k: v for k, v in os.environ.items() if k != MECHANISM_SEED_ENV})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("jobs of this multirun share each mechanism seed") == 1
    assert (sweep / "multirun.yaml").exists() and len(list(sweep.glob("*/summary.json"))) == 2
    assert seed_hits(sweep) == [] and str(SECRET) not in done.stdout + done.stderr


# ---- the secret state does not outlive training --------------------------------------------------


def test_a_write_of_the_mechanism_state_that_is_interrupted_leaves_no_temp_file(tmp_path, monkeypatch):
    modes = []

    def interrupted(obj, f):
        modes.append(os.fstat(f.fileno()).st_mode & 0o777)  # before any byte is written
        f.write(b"partial secret")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_mechanism_state(tmp_path / "mechanism_state.pt", 1, {"randomness": {}})
    assert modes == [0o600] and list(tmp_path.iterdir()) == []


def test_a_failure_after_training_still_removes_the_mechanism_state_and_left_temp_files(tmp_path, monkeypatch):
    """Stopped mid-training, the run keeps its secret state to resume from; a temp file a kill -9
    left mid-write goes at the resume; once training is over the state goes even if the curves
    (or W&B's finish, or the evaluation) fail after summary.json."""
    require_real_data()
    train_step, left = loop.train_step, tmp_path / ".mechanism_state.pt.k1ll3d.tmp"

    def stopped_at_2(t, step):
        if step == 2:
            raise RuntimeError("stopped")
        return train_step(t, step)

    monkeypatch.setattr(loop, "train_step", stopped_at_2)
    with pytest.raises(RuntimeError, match="stopped"):
        loop.run(compose_config(*TINY, "logging.nonprivate_diagnostics=file"), tmp_path)
    assert (tmp_path / "mechanism_state.pt").exists()  # step 2 is still to run: the state stays
    monkeypatch.setattr(loop, "train_step", train_step)
    left.write_bytes(b"generator states")

    def broken(*args, **kwargs):
        assert not left.exists()  # removed when the resume started
        left.write_bytes(b"generator states")  # as if a kill -9 had left one during training
        raise RuntimeError("curves failed")

    monkeypatch.setattr("dpmuon.training.summary.write_curves", broken)
    with pytest.raises(RuntimeError, match="curves failed"):
        loop.run(compose_config(*TINY, "logging.nonprivate_diagnostics=file", f"resume={tmp_path}"), tmp_path)
    assert (tmp_path / "summary.json").exists() and (tmp_path / "checkpoint.pt").exists()
    assert not (tmp_path / "mechanism_state.pt").exists() and not left.exists()
    assert json.loads((tmp_path / "summary.json").read_text())["nonprivate_values_logged"] == []  # kept in the owner-only file


def test_the_summary_lists_the_nonprivate_values_the_record_holds(tmp_path):
    """Published diagnostics are listed by name: exactly those a run keeping them to itself writes
    to its owner-only diagnostics file, and the train time."""
    require_real_data()
    both = [*TINY, "eval.test=false", "logging.oracle_alignment=true"]
    kept = loop.run(compose_config(*both, "logging.nonprivate_diagnostics=file"), tmp_path / "file")
    published = loop.run(compose_config(*both, "logging.nonprivate_diagnostics=publish"), tmp_path / "publish")
    diagnostics = {key for line in (tmp_path / "file" / "diagnostics.jsonl").read_text().splitlines() for key in json.loads(line)} - {"step"}
    listed = published["nonprivate_values_logged"]

    def covered(key: str) -> bool:
        return key in listed or (key.startswith("oracle_") and "oracle_*" in listed)

    assert kept["nonprivate_values_logged"] == [] and all(map(covered, diagnostics))
    assert {"train_loss", "lot_size", "clip_fraction", "oracle_*"} <= set(listed)
    assert set(listed) - diagnostics - {"oracle_*"} == {"train_seconds"}  # nothing listed that is not logged


# ---- bf16 without fixed shapes --------------------------------------------------------------------


def test_bf16_without_fixed_batch_shapes_is_warned_and_refused_in_secure_mode(capsys):
    assert fixed_batch_shape(compose_config("trainer.fixed_batch_shape=false"), "bf16") is False
    assert capsys.readouterr().err.count("sensitivity bound is not exact") == 1
    assert fixed_batch_shape(compose_config("trainer.fixed_batch_shape=false"), "fp32") is False
    assert "not exact" not in capsys.readouterr().err
    with pytest.raises(UserError, match="trainer.fixed_batch_shape=false: .*not exact.*privacy.secure_noise=true"):
        fixed_batch_shape(compose_config("trainer.fixed_batch_shape=false", "privacy.secure_noise=true"), "bf16")


# ---- a resume under another lot sampling ---------------------------------------------------------


def test_a_resume_under_another_lot_sampling_is_refused_in_one_line(tmp_path, monkeypatch):
    """A stored config edited to privacy.sampling=shuffle met a Poisson sampler's saved state (a
    KeyError before); the other way round, the shuffle order would have been silently dropped."""
    require_real_data()
    train_step = loop.train_step

    def stopped_at_1(t, step):
        if step == 1:
            raise RuntimeError("stopped")
        return train_step(t, step)

    monkeypatch.setattr(loop, "train_step", stopped_at_1)
    with pytest.raises(RuntimeError, match="stopped"):
        loop.run(compose_config(*TINY, "eval.test=false"), tmp_path)  # the state at step 0 is saved
    monkeypatch.setattr(loop, "train_step", train_step)
    with pytest.raises(UserError) as caught:
        loop.run(compose_config(*TINY, "eval.test=false", "privacy.sampling=shuffle", f"resume={tmp_path}"), tmp_path)
    assert "privacy.sampling" in str(caught.value) and "\n" not in str(caught.value)
