"""Reading run directories: a malformed summary, a missing key or a bad metrics line is named with its file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_runs import training_rows, write_run

from dpmuon.eval.cli import curves_main, tables_main
from dpmuon.eval.runs import Run, RunFormatError, find_runs


@pytest.mark.parametrize("main", [tables_main, curves_main])
def test_malformed_summary_names_the_file(main, tmp_path: Path, capsys):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text("{not json")
    assert main([str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert str(tmp_path / "broken" / "summary.json") in error and "not valid JSON" in error


def test_missing_summary_key_is_named(tmp_path: Path):
    folder = write_run(tmp_path, "run")
    summary = json.loads((folder / "summary.json").read_text())
    del summary["test_nll"]
    (folder / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(RunFormatError, match="missing required key.*test_nll"):
        find_runs([tmp_path])


def test_malformed_metrics_line_names_file_and_line(tmp_path: Path, capsys):
    folder = write_run(tmp_path, "run", training_rows(0))
    with (folder / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 40, "train_loss": "high"}\n')
    assert curves_main([str(tmp_path), "--out", str(tmp_path / "results")]) == 2
    assert f"{folder / 'metrics.jsonl'}:6: 'train_loss' must be a number" in capsys.readouterr().err


def test_learning_rates_come_from_the_summary_or_an_older_records_config(tmp_path: Path):
    summary = {"learning_rates": {"lr": 0.01, "adam.lr": 0.001}}
    assert Run(tmp_path / "new", summary).learning_rates == {"lr": 0.01, "adam.lr": 0.001}
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.yaml").write_text("optimizer:\n  lr: 0.03\n  adam:\n    lr: 0.002\n")
    assert Run(old, {}).learning_rates == {"lr": 0.03, "adam.lr": 0.002}
    with pytest.raises(RunFormatError, match="no 'learning_rates'"):
        _ = Run(tmp_path / "neither", {}).learning_rates


def test_a_run_that_scored_nothing_reads_with_no_scorers_and_tables_say_so(tmp_path: Path, capsys):
    """eval.test=false (a tuning run) scores nothing: such runs wrote metric_implementations null
    before the driver wrote {}; both read as no scorers, and a table of them still builds."""
    write_run(tmp_path / "runs", "old", test_nll=None, bleu=None, bleu_single_ref=None, metric_implementations=None)
    write_run(tmp_path / "runs", "new", seed=1, test_nll=None, bleu=None, bleu_single_ref=None, metric_implementations={})
    assert [run.summary["metric_implementations"] for run in find_runs([tmp_path / "runs"])] == [{}, {}]
    assert tables_main([str(tmp_path / "runs"), "--out", str(tmp_path / "tables")]) == 0
