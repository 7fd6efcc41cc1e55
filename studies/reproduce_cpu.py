"""The committed CPU-scale reproduction (results/<dataset>/): tune, train, publish, report.

    python -m studies.reproduce_cpu --dataset e2e             # everything (resumable)
    python -m studies.reproduce_cpu --dataset dart --jobs 2   # two runs at a time, 1 thread each
    python -m studies.reproduce_cpu --dataset e2e --dry-run   # list the runs

(studies/reproduce_cpu.py runs the same.)

Stages (each skips what is already done — a run whose working directory or published copy
under results/ has a summary.json — and resumes killed runs):
1. public model: models/public-for-<dataset> (scripts/pretrain_public.py) must exist;
2. tuning: every DP optimizer at each learning rate of its grid (same number of trials each),
   one seed, half the training horizon, scored by validation NLL — the test set is not used;
3. finals: each DP optimizer at its selected rate, and non-private Adam, for every seed;
4. publish (as each run ends): its summary.json, metrics.jsonl, resolved config and generations
   are copied to results/<dataset>/{tuning,runs}/<run>/ (no checkpoints); the public
   pretraining run's go to results/<dataset>/public_pretraining/ (a rebuild with other
   weights: public_pretraining-<fingerprint>/);
5. report: tables, curves, the momentum-SNR figure and the paired comparison, all by the
   project's scripts, and tuning.md.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

from dpmuon.config.roster import optimizer_names
from dpmuon.eval import Run, read_metrics, read_summary
from dpmuon.run_folder import METRICS, SUMMARY, WEIGHTS_FINGERPRINT, is_finished

from .jobs import REPO, Job, publish, run_jobs

DP_OPTIMIZERS = optimizer_names(private=True)  # conf/optimizer/*.yaml with private: true
# Five rates per optimizer, half a decade apart: one tuning budget for all. DP-SGD's rates are
# larger because its update is the raw released gradient (norm ≲ C = 0.1), not a normalized one.
# (A 3-point grid, then a 4-point one, peaked at their upper edge for the adaptive methods.)
LR_GRID = {
    "dp_sgd": (3.0, 10.0, 30.0, 100.0, 300.0),
    "dp_adam": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
    "dp_muon": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
    "dp_muonbc": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
}
NON_PRIVATE = ("adam", 1e-3)


def lr_overrides(optimizer: str, lr: float) -> list[str]:
    """One knob per optimizer: for DP-Muon(BC) the Adam part (non-matrix tensors) shares it."""
    out = [f"optimizer={optimizer}", f"optimizer.lr={lr:g}"]
    if "muon" in optimizer:
        out.append(f"optimizer.adam.lr={lr:g}")
    return out


def tuning_jobs(dataset: str, steps: int) -> list[Job]:
    return [
        Job(
            f"{opt}_lr{lr:g}",
            "tuning",
            (f"experiment=pretrained_tiny_{dataset}", *lr_overrides(opt, lr), f"trainer.steps={steps}", "eval.test=false", "seed=0"),
        )  # fmt: skip
        for opt in DP_OPTIMIZERS
        for lr in LR_GRID[opt]
    ]


def select_learning_rates(summaries: list[dict]) -> dict[str, float]:
    """Per optimizer, the rate with the lowest final validation NLL (ties: the smaller rate).

    A diverged trial (no finite validation NLL) never wins; an optimizer with no usable trial
    is an error, not a silent default.
    """
    best: dict[str, tuple[float, float]] = {}
    for s in summaries:
        nll = s.get("val_nll")
        if nll is None or not math.isfinite(nll):
            continue
        lr = float(s["learning_rate"])
        key = (nll, lr)
        if s["optimizer"] not in best or key < best[s["optimizer"]]:
            best[s["optimizer"]] = key
    missing = [opt for opt in DP_OPTIMIZERS if opt not in best]
    if missing:
        raise SystemExit(f"no usable tuning run for {missing}; check results/*/tuning")
    return {opt: lr for opt, (_, lr) in best.items()}


def final_jobs(dataset: str, rates: dict[str, float], seeds: list[int]) -> list[Job]:
    """Seed-major order: whenever the runs are cut short, the finished seeds compare every optimizer."""
    settings = [(opt, rates[opt]) for opt in DP_OPTIMIZERS] + [NON_PRIVATE]
    return [
        Job(f"{opt}_seed{seed}", "runs", (f"experiment=pretrained_tiny_{dataset}", *lr_overrides(opt, lr), f"seed={seed}"))
        for seed in seeds
        for opt, lr in settings
    ]


def run_all(jobs: list[Job], work: Path, results: Path, parallel: int) -> list[dict]:
    threads = 1 if parallel > 1 else 2
    published_dirs = run_jobs(jobs, work, results, threads, parallel)
    summaries = []
    for published in published_dirs:
        run = Run(published, read_summary(published / SUMMARY))
        summaries.append({**run.summary, "learning_rate": run.learning_rates["lr"]})
    return summaries


def public_record(results: Path, public_run: Path, fingerprint: str) -> Path:
    """Where the public pretraining run that built the current public model is published.

    `public_pretraining/` holds the first build. A rebuild (e.g. on another machine, where
    floating-point differences make the same command produce slightly different weights) is
    another model, so it goes beside it as `public_pretraining-<fingerprint>/` rather than
    over the record of the model that earlier runs started from.
    """
    first = results / "public_pretraining"
    if not is_finished(first):
        return first
    recorded = first / WEIGHTS_FINGERPRINT
    if recorded.exists():
        same = recorded.read_text().strip() == fingerprint
    else:  # a record from before fingerprints: compare the training trajectories
        same = _losses(first / METRICS) == _losses(public_run / METRICS)
    return first if same else results / f"public_pretraining-{fingerprint[:12]}"


def _losses(metrics: Path) -> list:
    return [row.get("train_loss") for row in read_metrics(metrics)]


def publish_public_model(dataset: str, results: Path) -> None:
    """Publish the provenance of models/public-for-<dataset>: its run files and weights fingerprint."""
    from dpmuon.models import load_pretrained, weights_fingerprint

    public_run = REPO / "outputs" / f"public_for_{dataset}" / "seed0"
    if not is_finished(public_run):
        return
    fingerprint = weights_fingerprint(load_pretrained(str(REPO / "models" / f"public-for-{dataset}")))
    record = public_record(results, public_run, fingerprint)
    publish(public_run, record)
    (record / WEIGHTS_FINGERPRINT).write_text(fingerprint + "\n")
    print(f"[{dataset}] public model {fingerprint[:12]}: provenance in {record}", flush=True)


def write_tuning_table(summaries: list[dict], rates: dict[str, float], path: Path, steps: int) -> None:
    lines = [
        f"# Learning-rate tuning ({steps} steps, seed 0, validation NLL on {summaries[0]['dataset']}'s validation split)",
        "",
        "Every DP optimizer gets the same budget: one run per rate of its grid. The selected rate "
        "(lowest final validation NLL) is used for the final runs. The test set is not touched.",
        "",
        "| optimizer | learning rate | final validation NLL | ε spent | selected |",
        "|---|---|---|---|---|",
    ]
    for s in sorted(summaries, key=lambda s: (DP_OPTIMIZERS.index(s["optimizer"]), s["learning_rate"])):
        nll = "diverged" if s.get("val_nll") is None else f"{s['val_nll']:.4f}"
        chosen = "✓" if rates[s["optimizer"]] == s["learning_rate"] else ""
        lines.append(f"| {s['optimizer']} | {s['learning_rate']:g} | {nll} | {s['epsilon']:.3f} | {chosen} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("e2e", "dart"), required=True)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tune-steps", type=int, default=40, help="tuning horizon (finals: the experiment's trainer.steps)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each then uses one thread)")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "cpu_repro", help="working run directories (checkpoints live here)")
    parser.add_argument("--results", type=Path, default=REPO / "results")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    work, results = args.work / args.dataset, args.results / args.dataset
    tuning = tuning_jobs(args.dataset, args.tune_steps)
    if args.dry_run:
        for job in tuning + final_jobs(args.dataset, {o: LR_GRID[o][1] for o in DP_OPTIMIZERS}, list(range(args.seeds))):
            print(job.stage, job.name, " ".join(job.overrides))
        return 0
    if not (REPO / "models" / f"public-for-{args.dataset}").exists():
        raise SystemExit(f"models/public-for-{args.dataset} is missing: run python scripts/pretrain_public.py --private {args.dataset}")
    os.environ.setdefault("WANDB_MODE", "disabled")
    publish_public_model(args.dataset, results)

    print(f"[{args.dataset}] tuning: {len(tuning)} runs", flush=True)
    tuned = run_all(tuning, work, results, args.jobs)
    rates = select_learning_rates(tuned)
    write_tuning_table(tuned, rates, results / "tuning.md", args.tune_steps)
    print(f"[{args.dataset}] selected rates: {rates}", flush=True)

    finals = final_jobs(args.dataset, rates, list(range(args.seeds)))
    print(f"[{args.dataset}] final runs: {len(finals)}", flush=True)
    run_all(finals, work, results, args.jobs)

    for script in ("make_tables.py", "make_curves.py", "make_snr_plot.py", "compare_optimizers.py"):
        subprocess.run([sys.executable, str(REPO / "scripts" / script), str(results / "runs"), "--out", str(args.results), "--force"], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
