"""Grouping runs into table rows: split and labelled by model and target ε, never averaged across settings."""

from __future__ import annotations

from pathlib import Path

from helpers_runs import table_rows, write_run

from dpmuon.eval.cli import tables_main


def test_rows_are_split_and_labelled_by_model_and_target_epsilon(tmp_path: Path):
    write_run(tmp_path, "a", model="gpt2", target_epsilon=8.0)
    write_run(tmp_path, "b", model="distilgpt2", target_epsilon=8.0)
    write_run(tmp_path, "c", model="gpt2", target_epsilon=3.0)
    tables_main([str(tmp_path), "--out", str(tmp_path / "results")])
    header, _, *rows = table_rows((tmp_path / "results" / "e2e" / "table.md").read_text())
    assert [row[0] for row in rows] == ["dp_adam (distilgpt2, ε=8)", "dp_adam (gpt2, ε=3)", "dp_adam (gpt2, ε=8)"]
    assert all(row[4].startswith("1 ") for row in rows)  # nothing averaged across settings
    paper_bleu = {row[0]: row[header.index("paper: BLEU")] for row in rows}
    assert paper_bleu == {"dp_adam (distilgpt2, ε=8)": "18.49", "dp_adam (gpt2, ε=3)": "", "dp_adam (gpt2, ε=8)": "18.49"}
