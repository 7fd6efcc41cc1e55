"""scripts/gpu_check.sh: its syntax and usage (default suite) and its CPU dry run (slow)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import xml.etree.ElementTree as ET

import pytest
import torch
from helpers_train import require_real_data

from dpmuon.config.roster import optimizer_names
from dpmuon.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
DP_OPTIMIZERS = set(optimizer_names(private=True))


def test_script_parses_and_refuses_bad_usage(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)
    for args in ([], ["--frobnicate", str(tmp_path)], [str(tmp_path), str(tmp_path / "second")]):
        done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, check=False)
        assert done.returncode == 2 and "usage: scripts/gpu_check.sh" in done.stderr, args
    assert not any(tmp_path.iterdir())  # refused before writing anything


def test_without_a_gpu_the_real_check_stops_and_points_to_the_dry_run(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the real check would run")
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 1 and "run with --cpu for the dry run" in done.stderr
    stages = [row["stage"] for row in csv.DictReader(open(tmp_path / "out" / "status.tsv"), delimiter="\t")]
    assert stages == ["environment"]  # nothing else was attempted
    assert json.loads((tmp_path / "out" / "environment.json").read_text())["cuda_available"] is False


@pytest.mark.slow
def test_cpu_dry_run_runs_every_stage_and_writes_every_result(tmp_path):
    require_real_data()
    out = tmp_path / "gpu_check"
    done = subprocess.run(["bash", str(SCRIPT), "--cpu", str(out)], capture_output=True, text=True, check=False, timeout=1800)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else done.stderr
    assert done.returncode == 0, log[-4000:]

    status = {row["stage"]: row for row in csv.DictReader(open(out / "status.tsv"), delimiter="\t")}
    assert list(status) == ["environment", "install", "gpu_tests", "smoke", "bench", "fsdp"]
    assert all(row["exit_code"] == "0" for row in status.values()), status

    environment = json.loads((out / "environment.json").read_text())
    assert environment["mode"] == "cpu dry run" and environment["torch"]

    suite = ET.parse(out / "pytest_gpu.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 8 and int(suite.get("failures")) == int(suite.get("errors")) == int(suite.get("skipped")) == 0

    smoke = json.loads((out / "smoke.json").read_text())
    assert {row["optimizer"] for row in smoke} == DP_OPTIMIZERS
    assert all(row["steps"] == 3 and 0 < row["epsilon"] <= 8 and row["test_sources"] == 4 for row in smoke)
    assert all((out / "smoke").glob(f"*_{name}_*/generations.txt") for name in DP_OPTIMIZERS)
    table = (out / "tables" / "e2e" / "table.md").read_text()
    assert all(f"| {name} |" in table for name in DP_OPTIMIZERS) and "BLEU (lowercase)" in table

    for micro_batch in (4, 8):
        bench = json.loads((out / f"bench_mb{micro_batch}.json").read_text())
        assert bench["settings"]["micro_batch"] == micro_batch and bench["settings"]["device"] == "cpu"
        labels = {row["config"] for row in bench["rows"]}
        assert {f"fast/per_matrix/dp_muonbc/{variant}" for variant in ("default", "as-drawn", "no-noise")} <= labels
        assert set(bench["phases"]) == {label for label in labels if not label.startswith("non-private")}
        assert all(row["examples_per_s"] > 0 and row["peak_mib"] > 0 for row in bench["rows"])

    fsdp = json.loads((out / "fsdp.json").read_text())  # two gloo processes stand in for two GPUs
    assert fsdp["same_final_weights"] and fsdp["ddp"]["epsilon"] == fsdp["fsdp"]["epsilon"] > 0
