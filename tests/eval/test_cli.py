"""The eval commands: no runs found is one line and exit 2; scripts/make_tables.py and make_curves.py run as commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpmuon.eval.cli import curves_main, tables_main
from dpmuon.paths import REPO_ROOT


@pytest.mark.parametrize("main", [tables_main, curves_main])
def test_no_runs_found_exits_2_with_one_line(main, tmp_path: Path, capsys):
    assert main([str(tmp_path), "--out", str(tmp_path / "results")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no runs (summary.json) found" in error


def test_scripts_run_as_commands(runs_root: Path, tmp_path: Path):
    for script in ("make_tables.py", "make_curves.py"):
        done = subprocess.run(
            [sys.executable, str(REPO_ROOT / "scripts" / script), str(runs_root), "--out", str(tmp_path / "results")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert str(tmp_path / "results" / "e2e") in done.stdout
    assert (tmp_path / "results" / "e2e" / "table.md").exists()
    assert (tmp_path / "results" / "e2e" / "curves.png").exists()

    missing = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "make_tables.py"), str(tmp_path / "nowhere")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"make_tables.py: error: {tmp_path / 'nowhere'}: no such directory (nor a summary.json file)"]

