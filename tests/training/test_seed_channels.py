"""The mechanism seed reaches no channel a run writes to: no argument names or reads it in any
case or form, no config value resolves to it (checked before Hydra writes anything), a seed
file that is no regular file is refused at once, and a run whose seed is published says so."""

from __future__ import annotations

import os
import signal
import socket
import sys

import pytest
from helpers_train import compose_config
from omegaconf import OmegaConf

from dpmuon.errors import UserError
from dpmuon.privacy.randomness import PUBLISHED_SEED, USER_SEED
from dpmuon.privacy.seed import read_seed_file, user_seed
from dpmuon.train import cli
from dpmuon.training.secret import MECHANISM_SEED_ENV, refuse_seed_in_config, seed_on_command_line, user_mechanism_secret
from dpmuon.training.summary import mechanism_fields

SECRET = 0x5EC2E7_9A1B_3C4D_5E6F_7A8B_9C0D  # 111 bits


def run_cli(monkeypatch, capsys, args: list[str]) -> str:
    monkeypatch.setattr(sys, "argv", ["dpmuon.train", *args])
    with pytest.raises(SystemExit) as stopped:
        cli()
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    return err


# ---- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override",
    [
        "++hydra.job.env_set.DPMUON_MECHANISM_SEED=55555", "hydra.job.env_set.dpmuon_mechanism_seed=55555",
        "+hydra.job.env_set.DpMuon_Mechanism_Seed=55555", "hydra.job.env_set={DPMUON_MECHANISM_SEED: 55555}",
        "experiment_name=${oc.env:DPMUON_MECHANISM_SEED}", "experiment_name=${oc.env:DPMUON_MECHANISM_SEED,55555}",
        "experiment_name='${oc.decode:${oc.env:DPMUON_MECHANISM_SEED}}'", "experiment_name='run_${env:dpmuon_mechanism_seed}'",
        "experiment_name='${oc.env:DPMUON_${oc.select:seed}}'",  # a name built from parts
        "privacy.MECHANISM_SEED=55555", "+privacy.Mechanism_Seed=55555", "privacy={MECHANISM_SEED: 55555}",
    ],
)  # fmt: skip
def test_an_argument_that_names_or_reads_the_seed_is_refused_before_hydra_writes_anything(tmp_path, monkeypatch, capsys, override):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SECRET))
    err = run_cli(monkeypatch, capsys, ["experiment=smoke", override, "data.max_train_examples=0", f"hydra.run.dir={tmp_path}/run"])
    assert "names or reads the mechanism seed" in err and MECHANISM_SEED_ENV in err and "55555" not in err and str(SECRET) not in err
    assert list(tmp_path.iterdir()) == []


def test_arguments_that_only_name_a_path_or_read_another_variable_are_no_seed():
    assert seed_on_command_line(["privacy.mechanism_seed_file=/keys/mechanism_seed.txt", "model.tokenizer=${oc.env:HOME}", "seed=3"]) is None
    assert seed_on_command_line(["hydra.job.env_set.OMP_NUM_THREADS=1", "hydra.run.dir=/runs/mechanism_seed_study"]) is None


# ---- the resolved config ------------------------------------------------------------------------


def test_a_config_value_resolving_to_the_seed_is_refused_before_hydra_writes_anything(tmp_path, monkeypatch, capsys):
    """No argument names the seed: an environment variable holds an interpolation of it, which
    `oc.decode` resolves. The folder's name, .hydra/hydra.yaml, W&B's group would all hold it."""
    monkeypatch.setenv(MECHANISM_SEED_ENV, "5")  # weak: found by the canary, not by its digits
    monkeypatch.setenv("DPMUON_TEST_NAME", "${oc.env:DPMUON_MECHANISM_SEED}")
    args = ["experiment=smoke", "experiment_name='${oc.decode:${oc.env:DPMUON_TEST_NAME}}'"]
    err = run_cli(monkeypatch, capsys, [*args, "data.max_train_examples=0", f"hydra.run.dir={tmp_path}/run"])
    assert err.startswith("error: experiment_name: its value is read from DPMUON_MECHANISM_SEED")
    err = run_cli(monkeypatch, capsys, ["-m", *args, "optimizer=dp_sgd,dp_adam", f"hydra.sweep.dir={tmp_path}/sweep"])
    assert err.startswith("error: experiment_name: its value is read from DPMUON_MECHANISM_SEED")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv(MECHANISM_SEED_ENV)  # the same config with the seed in a file: refused all the same
    with pytest.raises(UserError, match="^experiment_name: its value is read from"):
        user_mechanism_secret(compose_config(args[1]))


def test_the_seeds_value_or_name_anywhere_in_the_config_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SECRET))
    for override, key in ((f"experiment_name=run{SECRET}", "experiment_name"), (f"seed={SECRET}", "seed"), (f"experiment_name=x{SECRET:x}", "experiment_name")):
        with pytest.raises(UserError, match=f"^{key}: holds the mechanism seed's value") as caught:
            user_mechanism_secret(compose_config(override))
        assert str(SECRET) not in str(caught.value) and "\n" not in str(caught.value)
    hydra_section = OmegaConf.create({"seed": 0, "hydra": {"job": {"env_set": {"DPMUON_MECHANISM_SEED": "1"}}}})
    with pytest.raises(UserError, match=r"^hydra\.job\.env_set\.DPMUON_MECHANISM_SEED: the config names the mechanism seed"):
        refuse_seed_in_config(hydra_section, None)
    run_folder = OmegaConf.create({"experiment_name": "${oc.env:DPMUON_MECHANISM_SEED}", "hydra": {"run": {"dir": "out/${experiment_name}"}}})
    with pytest.raises(UserError, match="^experiment_name: its value is read"):  # the user's key, not Hydra's
        refuse_seed_in_config(run_folder, None)
    assert user_mechanism_secret(compose_config("experiment_name=run5")) == SECRET  # no seed in it
    refuse_seed_in_config(OmegaConf.create({"privacy": {"mechanism_seed": None}}), SECRET)  # an older run's stored config


# ---- the seed file --------------------------------------------------------------------------------


@pytest.fixture
def no_hang():
    """A read that blocks fails the test in 5 s instead of hanging it."""

    def hung(signum, frame):
        raise TimeoutError("reading the seed file blocked")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


def test_a_seed_file_that_is_no_regular_file_is_refused_at_once(tmp_path, monkeypatch, no_hang):
    monkeypatch.delenv(MECHANISM_SEED_ENV, raising=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "sock"))
    directory = tmp_path / "dir"
    directory.mkdir(mode=0o700)
    try:
        for path, kind in ((fifo, "FIFO"), (tmp_path / "sock", "socket"), (directory, "directory"), ("/dev/null", "character device")):
            with pytest.raises(UserError) as caught:
                user_seed(path)
            assert str(caught.value) == f"privacy.mechanism_seed_file={path}: not a regular file (a {kind}); valid: a file holding one integer"
    finally:
        server.close()
    good = tmp_path / "seed"
    good.write_text(f"{SECRET}\n")
    good.chmod(0o600)
    assert read_seed_file(good).strip() == str(SECRET)


# ---- a published seed -----------------------------------------------------------------------------


def test_a_run_whose_seed_is_published_says_its_epsilon_is_no_guarantee(monkeypatch):
    class Randomness:
        source = USER_SEED

    cfg = compose_config("privacy.published_seed=true")
    assert mechanism_fields(cfg, True, Randomness())["mechanism_randomness"] == PUBLISHED_SEED == "published seed — no guarantee"
    assert mechanism_fields(compose_config(), True, Randomness())["mechanism_randomness"] == USER_SEED
    monkeypatch.delenv(MECHANISM_SEED_ENV, raising=False)
    with pytest.raises(UserError, match="^privacy.published_seed=true: this run draws OS entropy"):
        user_mechanism_secret(cfg)
