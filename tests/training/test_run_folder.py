"""One run per run directory (issue 24): a new run never takes over another run's folder, two
processes never share one, a resume continues exactly the stored run and writes only into its
folder, and a config error is refused before Hydra creates anything.

The run folders here are built by hand (stored config, a checkpoint's bytes, a summary): every
refusal comes before any data, tokenizer or model is read, so no test trains.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_resume import OVERRIDES
from helpers_train import compose_config
from omegaconf import OmegaConf

from dpmuon.config.schema import ConfigError
from dpmuon.errors import UserError
from dpmuon.launch import carry_adjustments
from dpmuon.training import loop
from dpmuon.training.run_identity import check_same_run, config_identity
from dpmuon.training.run_lock import LOCK_FILE, lock_run_dir, unlock_run_dir


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpmuon.train", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def stored_run(run_dir: Path, *overrides: str, finished: bool = False) -> Path:
    """A run folder as a run leaves it: its stored config, log, metrics, checkpoint (and summary)."""
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_config(*OVERRIDES, *overrides), run_dir / ".hydra" / "config.yaml")
    (run_dir / "train.log").write_text("the run's own log\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "checkpoint.pt").write_bytes(b"the run's weights")
    if finished:
        (run_dir / "summary.json").write_text('{"optimizer": "dp_sgd"}\n')
    return run_dir


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_line(out: subprocess.CompletedProcess) -> str:
    """The refusal: exit 2 and one line."""
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    return lines[0]


def failed_reading_no_data(out: subprocess.CompletedProcess) -> bool:
    """Past every check: the run started and failed at the empty data folder."""
    return out.returncode == 2 and out.stderr.startswith("error: no e2e train file")


@pytest.fixture
def no_data(tmp_path) -> Path:
    """An empty data.root: whatever gets past the checks fails at once, without training."""
    (tmp_path / "no-data").mkdir()
    return tmp_path / "no-data"


# ---- a new run never takes over another run's folder ----------------------------------------------


def test_a_new_run_with_another_optimizer_refuses_a_finished_runs_folder_and_leaves_it_untouched(tmp_path):
    run_dir = stored_run(tmp_path / "run", "optimizer=dp_sgd", finished=True)
    before = digests(run_dir)
    out = cli(*OVERRIDES, "optimizer=dp_adam", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert "holds a finished run (summary.json)" in error_line(out)
    assert digests(run_dir) == before  # not even Hydra's .hydra/config.yaml was rewritten


def test_a_new_run_with_a_changed_learning_rate_is_refused_and_the_same_config_is_told_to_resume(tmp_path):
    run_dir = stored_run(tmp_path / "run")
    before = digests(run_dir)
    changed = cli(*OVERRIDES, "optimizer.lr=0.5", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert "holds another run (its configuration differs at optimizer.lr)" in error_line(changed)
    same = cli(*OVERRIDES, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert f"continue it with `python -m dpmuon.train resume={run_dir}`" in error_line(same)
    assert digests(run_dir) == before
    # The same refusal where a script calls the loop itself, before anything is read
    with pytest.raises(UserError, match="differs at optimizer.lr"):
        loop.run(compose_config(*OVERRIDES, "optimizer.lr=0.5"), run_dir)
    assert digests(run_dir) == before


def test_a_checkpoint_continues_only_the_configuration_that_wrote_it(tmp_path):
    written = config_identity(compose_config(*OVERRIDES))
    check_same_run(written, compose_config(*OVERRIDES, "trainer.num_threads=2", "logging.progress=true"), tmp_path)
    with pytest.raises(UserError, match=r"differs at optimizer.lr\)"):
        check_same_run(written, compose_config(*OVERRIDES, "optimizer.lr=0.5"), tmp_path)
    with pytest.raises(UserError, match=r"differs at optimizer.name, optimizer._target_, optimizer.betas, "):
        check_same_run(written, compose_config(*OVERRIDES, "optimizer=dp_adam"), tmp_path)


# ---- one process per folder ------------------------------------------------------------------------


def test_a_second_process_in_a_busy_run_folder_is_refused_naming_the_holder(tmp_path, no_data):
    run_dir = tmp_path / "run"
    assert lock_run_dir(run_dir)  # this test process plays the run in progress
    try:
        out = cli(*OVERRIDES, f"data.root={no_data}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert f"is in use by another run (PID {os.getpid()}" in error_line(out)
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # Hydra wrote nothing there
    finally:
        unlock_run_dir(run_dir)
    assert not (run_dir / LOCK_FILE).exists()


# ---- a resume continues exactly the stored run, in its own folder -------------------------------------


def test_resume_refuses_overrides_it_cannot_honour(tmp_path, no_data):
    run_dir = stored_run(tmp_path / "run", f"data.root={no_data}")
    before = digests(run_dir)
    out = cli(f"resume={run_dir}", "trainer.steps=2", "privacy.expected_lot_size=32", cwd=tmp_path)
    assert "trainer.steps, privacy.expected_lot_size cannot be given with it" in error_line(out)
    assert digests(run_dir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-data", "run"]


def test_resume_takes_an_allowed_override_and_writes_only_into_its_own_folder(tmp_path, no_data):
    run_dir = stored_run(tmp_path / "run", f"data.root={no_data}")
    records = digests(run_dir / ".hydra")
    out = cli(f"resume={run_dir}", "trainer.num_threads=2", cwd=tmp_path)
    assert failed_reading_no_data(out), out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-data", "run"]  # no outputs/<…>/<time>/
    assert digests(run_dir / ".hydra") == records  # the stored config stays the original
    log = (run_dir / "train.log").read_text()
    assert log.startswith("the run's own log\n") and "no e2e train file" in log  # its log goes on in its folder


def test_a_resume_takes_only_the_adjustable_values_of_its_command():
    stored = compose_config(*OVERRIDES)
    composed = compose_config("trainer.num_threads=3", "logging.progress=true", "trainer.steps=2")
    carry_adjustments(stored, composed, ["resume=x", "trainer.num_threads=3", "logging.progress=true"])
    assert stored.trainer.num_threads == 3 and stored.logging.progress is True
    assert stored.trainer.steps == 8  # the stored run's, whatever the composed default


# ---- config errors: before anything is read, and no folder left behind ---------------------------------


@pytest.mark.parametrize("override", ["+optimizer.lrr=1", "optimizer.lrr=1"])
def test_an_unknown_key_is_refused_with_near_matches_before_any_folder_is_created(tmp_path, no_data, override):
    out = cli(*OVERRIDES, f"data.root={no_data}", override, cwd=tmp_path)
    line = error_line(out)
    assert line.startswith("error: optimizer.lrr=1: not an option; valid: ") and "did you mean optimizer.lr" in line
    assert not (tmp_path / "outputs").exists()


def test_a_command_that_fails_before_training_leaves_no_folder(tmp_path, no_data):
    out = cli(*OVERRIDES, f"data.root={no_data}", cwd=tmp_path)  # the default, timestamped run folder
    assert failed_reading_no_data(out), out.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (["privacy.secure_noise=true", "privacy.sampling=shuffle"], "privacy.sampling=shuffle: cannot be drawn from the OS CSPRNG"),
        (["optimizer=dp_muon", "optimizer.ns_coefficients=cubic"], "optimizer.ns_coefficients=cubic: not quintic or series:K"),
        (["optimizer=dp_muon", "optimizer.ns_coefficients=series:0"], "optimizer.ns_coefficients=series:0: "),
        (["data.max_train_examples=10", "privacy.expected_lot_size=20"], r"privacy.expected_lot_size=20: .*valid: an integer in \[1, 10\]"),
        (["+optimizer.lrr=1"], "optimizer.lrr=1: not an option"),
    ],
)
def test_cross_field_rules_are_refused_before_anything_is_read(tmp_path, monkeypatch, overrides, refused):
    def read(*args, **kwargs):
        raise AssertionError("read before the config was checked")

    monkeypatch.setattr(loop, "load_tokenizer_or_stand_in", read)
    monkeypatch.setattr(loop, "prepare_data", read)
    with pytest.raises(ConfigError, match=f"^{refused}"):
        loop.run(compose_config(*OVERRIDES, *overrides), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_sweep_refuses_a_sweep_folder_that_holds_earlier_runs(tmp_path, no_data):
    """`make reproduce-*-cpu` reruns into fixed sweep folders: Hydra would rewrite each earlier
    job's .hydra/ before the job could refuse its folder."""
    sweep = tmp_path / "sweep"
    stored_run(sweep / "0_e2e_dp_muonbc_eps8.0_seed0", finished=True)
    before = digests(sweep)
    out = cli("-m", *OVERRIDES, f"data.root={no_data}", "seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert f"hydra.sweep.dir={sweep} holds earlier runs (0_e2e_dp_muonbc_eps8.0_seed0)" in error_line(out)
    assert digests(sweep) == before


def test_the_run_state_files_are_the_ones_the_run_writes():
    from dpmuon.eval.runs import DIAGNOSTICS_FILE
    from dpmuon.privacy.ledger import LEDGER_FILE
    from dpmuon.privacy.state import MECHANISM_STATE_FILE
    from dpmuon.training.checkpoint import CHECKPOINT_FILE
    from dpmuon.training.run_identity import RUN_STATE

    assert {CHECKPOINT_FILE, MECHANISM_STATE_FILE, LEDGER_FILE, DIAGNOSTICS_FILE, "metrics.jsonl", "summary.json"} == set(RUN_STATE)
