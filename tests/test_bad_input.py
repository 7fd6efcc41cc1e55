"""Bad input and impossible settings: one clear message, non-zero exit, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dpmuon.data import DataError
from dpmuon.errors import UserError
from dpmuon.training.loop import run
from helpers_train import compose_config, require_real_data

SMALL = ["experiment=smoke", "logging.progress=false", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.max_train_examples=100", "privacy.expected_lot_size=10"]


def e2e_prefix_root(tmp_path, train_lines: list[str]):
    folder = tmp_path / "e2e" / "prefix_tuning_format"
    folder.mkdir(parents=True)
    good = "name : A | Type : pub||A is a pub . \n"
    (folder / "src1_train.txt").write_text("".join(train_lines))
    (folder / "src1_valid.txt").write_text(good * 3)
    (folder / "src1_test.txt").write_text(good * 3)
    return tmp_path


def cli(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpmuon.train", *overrides], capture_output=True, text=True, timeout=300)


def test_malformed_prefix_line_names_file_and_line(tmp_path):
    require_real_data()
    root = e2e_prefix_root(tmp_path, ["name : A||fine . \n"] * 4 + ["no separator here\n"])
    with pytest.raises(DataError, match=r"src1_train\.txt, line 5"):
        run(compose_config(*SMALL, f"data.root={root}"), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing half-written


def test_malformed_csv_row_names_file_and_line(tmp_path):
    require_real_data()
    (tmp_path / "e2e").mkdir()
    (tmp_path / "e2e" / "trainset.csv").write_text('mr,ref\n"name[A]","ok"\n"name[B]","x","extra"\n')
    with pytest.raises(DataError, match=r"trainset\.csv, line 3"):
        run(compose_config(*SMALL, f"data.root={tmp_path}", "dataset.format=csv"), tmp_path / "run")


def test_malformed_dart_json_names_the_file(tmp_path):
    require_real_data()
    (tmp_path / "dart").mkdir()
    (tmp_path / "dart" / "dart-v1.1.1-full-train.json").write_text('[{"tripleset": [["a", "b", "c"]], "annotations": [{"text": "x"}]},\n{"tripleset": ')
    with pytest.raises(DataError, match=r"dart-v1\.1\.1-full-train\.json.*line 2"):
        run(compose_config(*SMALL, f"data.root={tmp_path}", "dataset=dart"), tmp_path / "run")


def test_missing_split_says_what_to_run(tmp_path):
    require_real_data()
    with pytest.raises(DataError, match="make data"):
        run(compose_config(*SMALL, f"data.root={tmp_path}"), tmp_path / "run")


@pytest.mark.parametrize(
    "override,message",
    [
        ("privacy.target_epsilon=0", "target_epsilon must be > 0"),
        ("privacy.delta=0.02", r"delta=0.02 must be in \(0, 1/N\)"),
        ("privacy.expected_lot_size=500", r"expected lot size 500 must be in \[1, N=100\]"),
        ("privacy.noise_multiplier=0.3", "over by"),
        ("trainer.device=tpu", "unknown trainer.device"),
    ],
)
def test_impossible_settings_are_refused_before_training(tmp_path, override, message):
    require_real_data()
    with pytest.raises(UserError, match=message):
        run(compose_config(*SMALL, override), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_prints_one_line_and_exits_2(tmp_path):
    require_real_data()
    out = cli(*SMALL, "privacy.target_epsilon=-1", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: privacy.target_epsilon must be > 0")
    assert "Traceback" not in out.stderr


def test_cli_unknown_optimizer_lists_the_valid_ones(tmp_path):
    out = cli("optimizer=dp_lion", f"hydra.run.dir={tmp_path}")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    for name in ("dp_sgd", "dp_adam", "dp_muon", "dp_muonbc"):
        assert name in out.stderr
