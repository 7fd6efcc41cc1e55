"""Result tables (markdown, CSV, LaTeX) built from synthetic run directories: seeds aggregated,
missing values marked, the paper's rows, the notes, and byte-identical reruns."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from helpers_runs import table_rows, write_run

from dpmuon.eval.cli import tables_main


def test_markdown_table_aggregates_seeds_and_marks_missing_values(runs_root: Path, tmp_path: Path):
    out = tmp_path / "results"
    assert tables_main([str(runs_root), "--out", str(out)]) == 0
    header, _, *rows = table_rows((out / "e2e" / "table.md").read_text())
    assert header[:9] == ["optimizer", "model", "target ε", "ε spent (mean)", "n (seeds)",
                          "test NLL", "BLEU", "BLEU (single ref)", "ROUGE-L"]  # fmt: skip
    assert header[9:] == ["paper: test NLL", "paper: BLEU", "paper: ROUGE-L"]
    by_optimizer = {row[0]: dict(zip(header, row)) for row in rows}
    assert [row[0] for row in rows] == ["dp_sgd", "dp_adam", "dp_muonbc", "adam"]

    dp_adam = by_optimizer["dp_adam"]
    assert dp_adam["n (seeds)"] == "2 (seeds 0, 1)"
    assert dp_adam["ε spent (mean)"] == "8.00 ± 0.01"
    assert dp_adam["test NLL"] == "0.5100 ± 0.0141"  # sample std of (0.50, 0.52) = 0.02 / sqrt(2)
    assert dp_adam["BLEU"] == "21.00 ± 1.41"
    assert dp_adam["ROUGE-L"] == "not measured"
    assert (dp_adam["paper: test NLL"], dp_adam["paper: BLEU"], dp_adam["paper: ROUGE-L"]) == ("0.4961", "18.49", "not reported")

    dp_muonbc = by_optimizer["dp_muonbc"]
    assert dp_muonbc["BLEU"] == "30.00 (n=1 of 2)"
    assert dp_muonbc["ROUGE-L"] == "41.00 ± 1.41"
    assert dp_muonbc["paper: BLEU"] == "34.92"

    adam = by_optimizer["adam"]
    assert adam["target ε"] == "— (non-private)" and adam["ε spent (mean)"] == "—"
    assert adam["test NLL"] == "0.4000 (n=1)"
    assert adam["BLEU (single ref)"] == "not measured"
    assert adam["paper: BLEU"] == ""  # the paper has no non-private row

    dp_sgd = by_optimizer["dp_sgd"]
    assert dp_sgd["test NLL"] == dp_sgd["BLEU"] == "not measured"
    assert dp_sgd["paper: BLEU"] == ""  # DP-SGD's numbers were not available


def test_markdown_notes_name_scorers_commits_commands_and_paper_source(runs_root: Path, tmp_path: Path):
    write_run(
        runs_root, "e2e/dp_adam/seed2", seed=2, git_commit="def5678", command=["python", "train.py", "seed=2"],
        metric_implementations={"bleu": "sacrebleu OTHER", "bleu_single_ref": "sacrebleu Y", "rouge_l": "rouge Z"},
    )  # fmt: skip
    tables_main([str(runs_root), "--out", str(tmp_path / "results")])
    notes = (tmp_path / "results" / "e2e" / "table.md").read_text().split("## Notes")[1]
    assert "BLEU: runs disagree: `sacrebleu OTHER` (1 run); `sacrebleu X` (4 runs)" in notes
    assert "BLEU (single ref): `sacrebleu Y` (5 runs)" in notes  # two runs did not measure it
    assert "ROUGE-L: `rouge Z` (2 runs)" in notes
    assert "`abc1234` (6 runs), `def5678` (1 run)" in notes
    assert notes.count("python -m dpmuon.train optimizer=dp_adam") == 1
    assert "python train.py seed=2" in notes
    assert "Kim & Fan 2026 (arXiv 2605.12994)" in notes and "not reproduced" in notes
    assert "pretrained GPT-2" in notes


def test_notes_say_which_starting_weights_the_runs_share_once_any_run_records_them(runs_root: Path, tmp_path: Path):
    tables_main([str(runs_root), "--out", str(tmp_path / "before")])
    assert "Initial weights" not in (tmp_path / "before" / "e2e" / "table.md").read_text()  # older runs: no claim
    write_run(runs_root, "e2e/dp_adam/seed3", seed=3, initial_weights_sha256="ae3e8c4f760b" + "0" * 52)
    tables_main([str(runs_root), "--out", str(tmp_path / "after")])
    notes = (tmp_path / "after" / "e2e" / "table.md").read_text().split("## Notes")[1]
    assert "Initial weights (`initial_weights_sha256`, first 12 hex digits): `ae3e8c4f760b` (1 run), `not recorded` (6 runs)." in notes


def test_dart_table_has_its_own_paper_row(runs_root: Path, tmp_path: Path):
    tables_main([str(runs_root), "--out", str(tmp_path / "results")])
    header, _, row = table_rows((tmp_path / "results" / "dart" / "table.md").read_text())
    cells = dict(zip(header, row))
    assert (cells["paper: test NLL"], cells["paper: BLEU"], cells["paper: ROUGE-L"]) == ("0.4460", "7.50", "34.42")


def test_csv_and_latex_carry_the_same_rows(runs_root: Path, tmp_path: Path):
    tables_main([str(runs_root), "--out", str(tmp_path / "results")])
    folder = tmp_path / "results" / "e2e"
    rows = list(csv.DictReader((folder / "table.csv").open()))
    assert [row["optimizer"] for row in rows] == ["dp_sgd", "dp_adam", "dp_muonbc", "adam"]
    dp_muonbc = rows[2]
    assert (dp_muonbc["bleu_mean"], dp_muonbc["bleu_std"], dp_muonbc["bleu_n"]) == ("30.0", "", "1")
    assert float(dp_muonbc["rouge_l_mean"]) == pytest.approx(41.0) and dp_muonbc["n_runs"] == "2"
    assert rows[0]["test_nll_mean"] == "" and rows[0]["test_nll_n"] == "0"
    assert rows[3]["private"] == "false" and rows[3]["epsilon_spent_mean"] == ""
    assert rows[1]["paper_bleu"] == "18.49" and rows[1]["paper_rouge_l"] == ""

    latex = (folder / "table.tex").read_text()
    assert r"\begin{tabular}" in latex and r"\bottomrule" in latex
    assert r"dp\_muonbc & gpt2 & 8 &" in latex
    assert r"0.5100 $\pm$ 0.0141" in latex and "not measured" in latex


def test_tables_are_byte_identical_on_rerun(runs_root: Path, tmp_path: Path):
    first, second = tmp_path / "first", tmp_path / "second"
    tables_main([str(runs_root), "--out", str(first)])
    tables_main([str(runs_root), "--out", str(second)])
    files = sorted(path.relative_to(first) for path in first.rglob("*") if path.is_file())
    assert len(files) == 6  # md, csv, tex for e2e and dart
    assert all((first / name).read_bytes() == (second / name).read_bytes() for name in files)


def test_one_seed_reads_as_one_seed_and_a_non_private_run_reconstructs_no_releases(tmp_path: Path):
    write_run(tmp_path / "runs", "adam", optimizer="adam", noise_multiplier=0, epsilon=None, private=False)
    assert tables_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "e2e" / "table.md").read_text()
    header, _, row = table_rows(text)[:3]
    assert dict(zip(header, row))["n (seeds)"] == "1 (seed 0)"
    assert "Releases are reconstructed" not in text  # a run without noise released nothing
