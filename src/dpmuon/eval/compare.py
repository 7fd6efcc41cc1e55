"""Paired comparisons between optimizers: differences per seed, relative to the seed spread.

Runs of different optimizers with the same seed start from the same initial weights (`seed`
drives the public randomness), so per-seed differences remove that part of the between-seed
variation. Their lots and noise are shared too only where the mechanism's randomness came
from the seed (runs from before secret mechanism randomness, or given one user mechanism
seed); by default each run draws its own from OS entropy. For each pair (A, B) and metric this reports the mean
difference A − B over the seeds both ran, its sample standard deviation, and on how many
seeds A was better — the evidence behind statements like "DP-MuonBC > DP-Muon".
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from itertools import combinations
from pathlib import Path

from dpmuon.eval.grouping import group_runs, runs_by_dataset
from dpmuon.eval.runs import Run

# metric → (header, decimals, True when larger is better)
METRICS = {"test_nll": ("test NLL", 4, False), "bleu": ("BLEU", 2, True), "rouge_l": ("ROUGE-L", 2, True)}


def paired_differences(a: Sequence[Run], b: Sequence[Run], metric: str) -> list[float]:
    """A − B for every seed that both groups ran and measured."""
    by_seed = {run.seed: run.summary[metric] for run in b if run.summary.get(metric) is not None}
    return [run.summary[metric] - by_seed[run.seed] for run in a if run.summary.get(metric) is not None and run.seed in by_seed]


def comparison_markdown(dataset: str, runs: Sequence[Run], pool: bool = False) -> str:
    groups = group_runs(runs, pool)
    lines = [
        f"# {dataset}: paired differences between optimizers",
        "",
        "Per seed, A − B: runs of one seed start from the same initial weights; they share lots and noise only "
        "where the mechanism's randomness came from that seed (not by default: each run draws its own). Mean ± "
        "sample std over seeds, and the number of seeds on which A was better. Lower NLL is better; higher "
        "BLEU / ROUGE-L are.",
        "",
        "| A | B | " + " | ".join(f"Δ {header}" for header, _, _ in METRICS.values()) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for first, second in combinations(groups, 2):
        cells = []
        for metric, (_, decimals, larger_better) in METRICS.items():
            diffs = paired_differences(first.runs, second.runs, metric)
            if not diffs:
                cells.append("not measured")
                continue
            spread = f" ± {statistics.stdev(diffs):.{decimals}f}" if len(diffs) > 1 else ""
            wins = sum((d > 0) == larger_better and d != 0 for d in diffs)
            cells.append(f"{statistics.fmean(diffs):+.{decimals}f}{spread} (A better on {wins}/{len(diffs)})")
        lines.append(f"| {first.label} | {second.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_comparisons(runs: Sequence[Run], out_dir: Path, pool: bool = False) -> list[Path]:
    written = []
    for dataset, dataset_runs in runs_by_dataset(runs).items():
        folder = Path(out_dir) / dataset
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "comparison.md"
        path.write_text(comparison_markdown(dataset, dataset_runs, pool))
        written.append(path)
    return written
