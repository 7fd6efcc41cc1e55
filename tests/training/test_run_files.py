"""Run records name no machine's folders (paths inside the checkout are recorded relative to it),
lose no metrics row on resume, and are readable by whoever the umask shares them with."""

from __future__ import annotations

import json
import os
import stat
import sys

from dpmuon.durable import atomic_write
from dpmuon.paths import REPO_ROOT
from dpmuon.training.run_files import MetricsLog, atomic_write_json, command_line, repo_relative


def test_paths_inside_the_checkout_are_recorded_relative_and_others_unchanged(monkeypatch):
    assert repo_relative(f"hydra.run.dir={REPO_ROOT}/outputs/a") == "hydra.run.dir=outputs/a"
    assert repo_relative(f"{REPO_ROOT}/models/public-for-e2e") == "models/public-for-e2e"
    assert repo_relative("hydra.run.dir=/elsewhere/outputs/a") == "hydra.run.dir=/elsewhere/outputs/a"
    assert repo_relative(f"{REPO_ROOT}-other/x") == f"{REPO_ROOT}-other/x"  # a sibling folder is not inside
    monkeypatch.setattr(sys, "orig_argv", ["/usr/bin/python3", "-m", "dpmuon.train", f"resume={REPO_ROOT}/outputs/r", "seed=1"])
    assert command_line() == "python3 -m dpmuon.train resume=outputs/r seed=1"


def test_a_damaged_middle_line_is_moved_aside_and_the_valid_rows_after_it_are_kept(tmp_path):
    """A resume rewrites metrics.jsonl: nothing valid is lost, nothing is deleted unmarked."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "val_n\n{"step": 3}\n{"step": 4}\n{"step": 5}\n{"step": 6, "lr"')
    metrics = MetricsLog(path)
    assert metrics.set_aside_after(4) == 2  # the damaged line 2 and the re-run step 5; the torn tail is dropped
    assert [r["step"] for r in metrics.rows()] == [1, 3, 4]
    aside = [json.loads(line) for line in metrics.superseded_path.read_text().splitlines()]
    assert aside == [{"damaged": True, "line": 2, "text": '{"step": 2, "val_n'}, {"step": 5, "superseded": True}]


def test_published_files_follow_the_umask_and_secrets_stay_owner_only(tmp_path):
    """mkstemp creates 0600: a shared cluster's group could not read a run's summary."""
    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "summary.json", {"a": 1})
        atomic_write(tmp_path / "mechanism_state.pt", lambda f: f.write(b"x"), secret=True)
        metrics = MetricsLog(tmp_path / "metrics.jsonl")
        metrics.append({"step": 1})
        metrics.set_aside_after(0)  # a resume rewrites the file
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "summary.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "metrics.jsonl").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "mechanism_state.pt").stat().st_mode) == 0o600
