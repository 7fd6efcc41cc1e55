"""Result tables and training curves built from synthetic run directories."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from dpmuon.eval.cli import curves_main, tables_main
from dpmuon.eval.curves import NOT_LOGGED, PANELS, aggregate_curves, draw_panel, optimizer_color
from dpmuon.eval.runs import RunFormatError, find_runs

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(root: Path, name: str, metrics: list[dict] | None = None, **overrides) -> Path:
    """A run directory following the artifact contract; `overrides` replace summary values."""
    summary = {
        "dataset": "e2e", "optimizer": "dp_adam", "model": "gpt2", "seed": 0,
        "target_epsilon": 8.0, "epsilon": 8.0, "delta": 8e-6, "noise_multiplier": 0.7,
        "sample_rate": 0.024, "steps": 30, "accountant": "prv", "clip_mode": "per_matrix",
        "test_nll": 0.5, "bleu": 20.0, "bleu_single_ref": 15.0, "rouge_l": None, "train_seconds": 12.5,
        "metric_implementations": {"bleu": "sacrebleu X", "bleu_single_ref": "sacrebleu Y", "rouge_l": "rouge Z"},
        "git_commit": "abc1234", "command": "python -m dpmuon.train optimizer=dp_adam",
    }  # fmt: skip
    summary.update(overrides)
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    if metrics is not None:
        (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics))
    return folder


def training_rows(seed: int, last_step: int = 30, private: bool = True, merged_validation: bool = False) -> list[dict]:
    """Rows logged every 10 steps; validation at steps 20 and 30, separate or merged into the training row."""
    rows = []
    for step in range(10, last_step + 1, 10):
        row = {"step": step, "lr": 1e-3, "epsilon": step / 30 * 8 if private else None}
        if private:  # the non-private fixture run has its train-loss diagnostics off
            row["train_loss"] = 3.0 - step / 100 + seed / 10
        validation = {"step": step, "val_nll": 2.0 + seed / 5 - step / 1000}
        if step >= 20 and merged_validation:
            row.update(validation)
        rows.append(row)
        if step >= 20 and not merged_validation:
            rows.append(validation)
    return rows


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    root = tmp_path / "outputs"
    for seed, (nll, bleu, eps) in enumerate([(0.50, 20.0, 7.99), (0.52, 22.0, 8.01)]):
        write_run(root, f"e2e/dp_adam/seed{seed}", training_rows(seed), seed=seed, test_nll=nll, bleu=bleu, epsilon=eps)
    # Seed 1 of DP-MuonBC crashed after step 20 and never measured BLEU.
    for seed, (bleu, last_step) in enumerate([(30.0, 30), (None, 20)]):
        write_run(
            root, f"e2e/dp_muonbc/seed{seed}", training_rows(seed, last_step, merged_validation=True),
            optimizer="dp_muonbc", seed=seed, test_nll=0.45 + seed / 100, bleu=bleu, rouge_l=40.0 + 2 * seed,
        )  # fmt: skip
    write_run(
        root, "e2e/adam/seed0", training_rows(0, private=False), optimizer="adam",
        noise_multiplier=0, epsilon=None, test_nll=0.4, bleu=40.0, bleu_single_ref=None,
    )  # fmt: skip
    write_run(root, "e2e/dp_sgd/seed0", optimizer="dp_sgd", bleu=None, bleu_single_ref=None, test_nll=None)
    write_run(root, "dart/dp_muonbc/seed0", dataset="dart", optimizer="dp_muonbc", rouge_l=30.0)
    return root


def table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def test_markdown_table_aggregates_seeds_and_marks_missing_values(runs_root: Path, tmp_path: Path):
    out = tmp_path / "results"
    assert tables_main([str(runs_root), "--out", str(out)]) == 0
    header, _, *rows = table_rows((out / "e2e" / "table.md").read_text())
    assert header[:9] == ["optimizer", "model", "target ε", "ε spent (mean)", "seeds (n)",
                          "test NLL", "BLEU", "BLEU (single ref)", "ROUGE-L"]  # fmt: skip
    assert header[9:] == ["paper: test NLL", "paper: BLEU", "paper: ROUGE-L"]
    by_optimizer = {row[0]: dict(zip(header, row)) for row in rows}
    assert [row[0] for row in rows] == ["dp_sgd", "dp_adam", "dp_muonbc", "adam"]

    dp_adam = by_optimizer["dp_adam"]
    assert dp_adam["seeds (n)"] == "2 (0, 1)"
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


def test_curve_aggregation_means_and_min_max_band(runs_root: Path):
    e2e_runs = [run for run in find_runs([runs_root]) if run.dataset == "e2e"]
    val_nll = {group.label: band for group, band in aggregate_curves(e2e_runs, "val_nll")}
    assert list(val_nll) == ["dp_adam", "dp_muonbc", "adam"]  # dp_sgd logged nothing

    dp_adam = val_nll["dp_adam"]  # separate validation rows; seeds offset by 0.2
    assert dp_adam.steps.tolist() == [20, 30]
    assert dp_adam.mean.tolist() == pytest.approx([2.08, 2.07])
    assert dp_adam.low.tolist() == pytest.approx([1.98, 1.97])
    assert dp_adam.high.tolist() == pytest.approx([2.18, 2.17])

    dp_muonbc = val_nll["dp_muonbc"]  # merged rows; seed 1 stopped at step 20
    assert dp_muonbc.n_runs.tolist() == [2, 1]
    assert dp_muonbc.mean.tolist() == pytest.approx([2.08, 1.97])

    train_loss = {group.label: band for group, band in aggregate_curves(e2e_runs, "train_loss")}
    assert "adam" not in train_loss  # non-private run logged no train loss
    assert train_loss["dp_adam"].mean.tolist() == pytest.approx([2.95, 2.85, 2.75])
    epsilon = {group.label: band for group, band in aggregate_curves(e2e_runs, "epsilon")}
    assert list(epsilon) == ["dp_adam", "dp_muonbc"]
    assert epsilon["dp_adam"].high[-1] == pytest.approx(8.0)


def test_curves_are_written_as_reproducible_pngs(runs_root: Path, tmp_path: Path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    assert curves_main([str(runs_root), "--out", str(first)]) == 0
    assert str(first / "e2e" / "curves.png") in capsys.readouterr().out
    curves_main([str(runs_root), "--out", str(second)])
    names = ["curves.png"] + [panel.file_name for panel in PANELS]
    for dataset in ("e2e", "dart"):
        for name in names:
            data = (first / dataset / name).read_bytes()
            assert data.startswith(PNG_SIGNATURE)
            assert data == (second / dataset / name).read_bytes()


def test_empty_panel_says_not_logged():
    axes: Axes = Figure().subplots()
    draw_panel(axes, PANELS[0], [])
    assert [text.get_text() for text in axes.texts] == [NOT_LOGGED]


def test_paper_optimizers_have_fixed_distinct_colors():
    names = ["dp_sgd", "dp_adam", "dp_muon", "dp_muonbc", "adam", "muon"]
    assert len({optimizer_color(name) for name in names}) == len(names)
    assert optimizer_color("my_new_optimizer") == optimizer_color("my_new_optimizer")


@pytest.mark.parametrize("main", [tables_main, curves_main])
def test_no_runs_found_exits_2_with_one_line(main, tmp_path: Path, capsys):
    assert main([str(tmp_path), "--out", str(tmp_path / "results")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no runs (summary.json) found" in error


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


def test_scripts_run_as_commands(runs_root: Path, tmp_path: Path):
    for script in ("make_tables.py", "make_curves.py"):
        done = subprocess.run(
            [sys.executable, str(REPO / "scripts" / script), str(runs_root), "--out", str(tmp_path / "results")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert str(tmp_path / "results" / "e2e") in done.stdout
    assert (tmp_path / "results" / "e2e" / "table.md").exists()
    assert (tmp_path / "results" / "e2e" / "curves.png").exists()

    missing = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tables.py"), str(tmp_path / "nowhere")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"make_tables.py: error: {tmp_path / 'nowhere'}: no such directory (nor a summary.json file)"]


def test_paired_comparison_uses_same_seed_differences(tmp_path):
    from dpmuon.eval.cli import compare_main

    for seed, (nll_a, nll_b) in enumerate(((1.0, 1.5), (2.0, 2.25), (3.0, 2.9))):
        write_run(tmp_path / "runs", f"a{seed}", optimizer="dp_muon", seed=seed, test_nll=nll_a, bleu=10.0 + seed)
        write_run(tmp_path / "runs", f"b{seed}", optimizer="dp_adam", seed=seed, test_nll=nll_b, bleu=10.0)
    assert compare_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "e2e" / "comparison.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| dp_adam | dp_muon"))
    # A = dp_adam (table order), differences +0.5, +0.25, -0.1: mean +0.2167, A better (lower NLL) on 1 of 3.
    assert "+0.2167 ± 0.3014 (A better on 1/3)" in row
    assert "-1.00 ± 1.00 (A better on 0/3)" in row  # BLEU: 0, -1, -2
    assert "not measured" in row  # rouge_l is null in the fixture
