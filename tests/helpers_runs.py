"""Synthetic run directories for the eval tests: one run's files (`write_run`), the rows a run
logs (`training_rows`), the tree the `runs_root` fixture of conftest.py holds, and reading a
markdown table back."""

from __future__ import annotations

import json
from pathlib import Path

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


def write_runs_tree(root: Path) -> Path:
    """The `runs_root` fixture's runs: E2E with DP-Adam (two seeds), DP-MuonBC (two seeds, one
    crashed), non-private Adam and a DP-SGD run that measured nothing; DART with one DP-MuonBC run."""
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
