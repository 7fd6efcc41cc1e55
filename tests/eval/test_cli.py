"""The eval commands: no runs found is one line and exit 2; scripts/make_tables.py and make_curves.py run as
commands; they write beside the runs by default and never replace a committed file unless told to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpmuon.eval.cli import DEFAULT_OUT, curves_main, tables_main
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


def test_the_default_output_is_beside_the_runs_never_the_committed_results(runs_root: Path, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # once, results/ of the working directory: the repository's, run from its root
    assert tables_main([str(runs_root)]) == 0
    assert (runs_root / DEFAULT_OUT / "e2e" / "table.md").exists() and not (tmp_path / "results").exists()


def test_a_committed_file_is_replaced_only_with_force(runs_root: Path, tmp_path: Path, capsys):
    out = tmp_path / "repo"
    (out / "e2e").mkdir(parents=True)
    committed = out / "e2e" / "table.md"
    committed.write_text("the committed table\n")
    subprocess.run(["git", "init", "-q", str(out)], check=True)
    subprocess.run(["git", "add", "e2e/table.md"], cwd=out, check=True)  # tracked
    assert tables_main([str(runs_root), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"would overwrite committed file(s) {committed}" in error and "--force" in error
    assert committed.read_text() == "the committed table\n" and not (out / "e2e" / "table.csv").exists()  # nothing written
    assert tables_main([str(runs_root), "--out", str(out), "--force"]) == 0
    assert committed.read_text() != "the committed table\n"


def test_out_naming_a_file_is_one_line(runs_root: Path, tmp_path: Path, capsys):
    (tmp_path / "a-file").write_text("")
    assert curves_main([str(runs_root), "--out", str(tmp_path / "a-file")]) == 2
    assert capsys.readouterr().err == f"make_curves.py: error: --out {tmp_path / 'a-file'} is a file, not a folder\n"
