"""The case-insensitive BLEU column: shown where runs recorded it, absent for older runs."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from dpmuon.eval.cli import tables_main

SUMMARY = {
    "dataset": "e2e", "optimizer": "dp_adam", "model": "gpt2", "seed": 0, "target_epsilon": 8.0,
    "epsilon": 8.0, "delta": 8e-6, "noise_multiplier": 0.7, "sample_rate": 0.024, "steps": 30,
    "accountant": "prv", "clip_mode": "per_matrix", "test_nll": 0.5, "bleu": 20.0, "bleu_single_ref": 15.0,
    "rouge_l": 40.0, "train_seconds": 1.0, "git_commit": "abc1234", "command": "python -m dpmuon.train",
    "metric_implementations": {"bleu": "sacrebleu X", "bleu_single_ref": "sacrebleu Y", "rouge_l": "rouge Z"},
}  # fmt: skip


def write_run(root: Path, name: str, **overrides) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({**SUMMARY, **overrides}))


def tables(tmp_path: Path, runs: Path) -> tuple[str, list[dict]]:
    assert tables_main([str(runs), "--out", str(tmp_path / "out")]) == 0
    folder = tmp_path / "out" / "e2e"
    return (folder / "table.md").read_text(), list(csv.DictReader(io.StringIO((folder / "table.csv").read_text())))


def test_runs_without_the_metric_keep_the_old_columns(tmp_path):
    write_run(tmp_path / "runs", "a")
    markdown, rows = tables(tmp_path, tmp_path / "runs")
    assert "BLEU (lowercase)" not in markdown
    assert not any(key.startswith("bleu_lowercase") for key in rows[0])


def test_lowercase_bleu_column_sits_beside_bleu_and_counts_the_runs_that_measured_it(tmp_path):
    runs = tmp_path / "runs"
    implementations = {**SUMMARY["metric_implementations"], "bleu_lowercase": "sacrebleu lowercase"}
    write_run(runs, "new0", seed=0, bleu=20.0, bleu_lowercase=20.5, metric_implementations=implementations)
    write_run(runs, "new1", seed=1, bleu=22.0, bleu_lowercase=23.5, metric_implementations=implementations)
    write_run(runs, "old2", seed=2, bleu=24.0)  # made before the metric existed
    markdown, rows = tables(tmp_path, runs)

    header = next(line for line in markdown.splitlines() if line.startswith("| optimizer"))
    headers = [cell.strip() for cell in header.strip("|").split(" | ")]
    assert headers[headers.index("BLEU") + 1] == "BLEU (lowercase)"
    row = next(line for line in markdown.splitlines() if line.startswith("| dp_adam"))
    cells = [cell.strip() for cell in row.strip("|").split(" | ")]
    assert cells[headers.index("BLEU (lowercase)")] == "22.00 ± 2.12 (n=2 of 3)"
    assert cells[headers.index("BLEU")] == "22.00 ± 2.00"
    assert "BLEU (lowercase): `sacrebleu lowercase` (2 runs)" in markdown

    (only,) = rows
    assert (only["bleu_lowercase_mean"], only["bleu_lowercase_n"]) == ("22.0", "2")
    tex = (tmp_path / "out" / "e2e" / "table.tex").read_text()
    assert "BLEU (lowercase)" in tex
