"""The paper's headline tested fairly on a real pretrained LM (results/smollm2_fair/, issue 39):
DP-Adam, DP-Muon, DP-MuonBC and DP-MuonBC with `match_norm` on SmolLM2-135M + LoRA, each at its
own tuned rate, paired by mechanism seed, judged by the rule pre-registered in
results/smollm2_fair/preregistration.md before any final run.

    python -m studies.smollm2_fair run [--jobs 1]   # every run whose inputs exist (resumable)
    python -m studies.smollm2_fair list             # every run known so far: done or to do

The setting (conf/experiment/smollm2_lora_e2e.yaml plus SETTING): LoRA r = 8, α = 16 on all seven
projections, nothing else trained (checked before the first run: every trained tensor a matrix,
so DP-Muon has no AdamW part); E2E, ε = 8, δ = 8e-6, Poisson expected lot 64, 100 steps,
C = 0.1 split over the matrices (C/√K each, the default rule). Stages, each unlocked by the
previous one's published results:

1. tune, seed 0, validation NLL at step 100: DP-Adam on ADAM_RATES, DP-Muon on MUON_RATES, each
   grid extended ×2 past an edge that wins; then DP-MuonBC at {μ*/√2, μ*} and the match_norm arm
   at μ*, μ* DP-Muon's pick (no extension: the 2-point grid brackets the step-length change).
2. finals, seeds 1–3 (fresh draws), all four arms at their picks: validation every 25 steps,
   test NLL, BLEU and ROUGE-L of beam-5 decoding of the first 200 test sources.
3. extra: if H1 reads "inconclusive" on seeds 1–3, DP-Adam and DP-Muon on seeds 4–5.

Constant-time lots are off: the mechanism seeds are published (`mechanism_seeds.json`, as in
results/bc_regime/fair/), so step times hide nothing the seeds do not already reveal, and the
padding would double a step. Each run is a measurement of the optimizers; its ε is the
noise's calibration, not a guarantee about E2E.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from dpmuon.eval import SUMMARY_FILE, read_summary

from .bc_regime import MechanismSeeds
from .jobs import REPO, Job, run_jobs

RESULTS = REPO / "results" / "smollm2_fair"
MODEL = REPO / "models" / "smollm2"
SEEDS_FILE = "mechanism_seeds.json"
SEED_TUNE = 0
SEEDS = (1, 2, 3)
EXTRA_SEEDS = (4, 5)  # H1 inconclusive on SEEDS: DP-Adam and DP-Muon only
ADAM_RATES = (1e-3, 2e-3, 4e-3, 8e-3)
MUON_RATES = (2e-3, 4e-3, 8e-3, 16e-3)
ARMS = {
    "dp_adam": ("optimizer=dp_adam",),
    "dp_muon": ("optimizer=dp_muon",),
    "dp_muonbc": ("optimizer=dp_muonbc",),
    "dp_muonbc_matched": ("optimizer=dp_muonbc", "optimizer.bias_correction.match_norm=true"),
}
SETTING = (
    "experiment=smollm2_lora_e2e",
    "model.lora.alpha=16",
    "trainer.steps=100",
    "trainer.checkpoint_every=5",
    "privacy.target_epsilon=8",
    "privacy.constant_time=false",
    "privacy.published_seed=true",  # SEEDS_FILE publishes them: each summary says its ε is no guarantee
    "logging.per_matrix_every=25",  # 420 matrices: a per-matrix dict every step would be 4 MB of metrics a run
)
TUNING = ("trainer.eval_every=0", "eval.test=false")  # validation at step 100 only; the test set unseen
FINAL = ("trainer.eval_every=25",)


def overrides(arm: str, lr: float, seed: int, *stage: str) -> tuple[str, ...]:
    # The Muon arms' AdamW part has no tensor here (every trained tensor is a matrix); its rate is
    # set to the Muon rate all the same, so that no recipe rate enters a run's record.
    adam_part = () if arm == "dp_adam" else (f"optimizer.adam.lr={lr:.6g}",)
    return (*SETTING, *ARMS[arm], f"optimizer.lr={lr:.6g}", *adam_part, f"seed={seed}", *stage)


def tune_name(arm: str, lr: float) -> str:
    return f"{arm}_lr{lr:.4g}_seed{SEED_TUNE}"


def summary_value(results: Path, stage: str, name: str, key: str) -> float | None:
    path = results / stage / name / SUMMARY_FILE
    value = read_summary(path).get(key) if path.exists() else None
    return value if value is not None and math.isfinite(value) else None


def doubling_grid(results: Path, arm: str, rates: tuple[float, ...]) -> tuple[list[float], float | None]:
    """The rates to tune (extended ×2 past an edge that wins, until one does not) and the pick,
    once every rate of the grid is published."""
    rates = list(rates)
    while True:
        nll = {lr: summary_value(results, "tune", tune_name(arm, lr), "val_nll") for lr in rates}
        if None in nll.values():
            return rates, None
        best = min(rates, key=nll.get)
        if best == rates[0]:
            rates.insert(0, rates[0] / 2)
        elif best == rates[-1]:
            rates.append(rates[-1] * 2)
        else:
            return rates, best


def muonbc_grid(results: Path, muon_pick: float) -> tuple[list[float], float | None]:
    rates = [muon_pick / math.sqrt(2), muon_pick]
    nll = {lr: summary_value(results, "tune", tune_name("dp_muonbc", lr), "val_nll") for lr in rates}
    return rates, None if None in nll.values() else min(rates, key=nll.get)


def picks(results: Path) -> dict[str, tuple[list[float], float | None]]:
    """arm → (its tuning rates so far, its pick or None)."""
    # DP-Muon first: its pick unlocks DP-MuonBC's tuning runs.
    grids = {"dp_muon": doubling_grid(results, "dp_muon", MUON_RATES), "dp_adam": doubling_grid(results, "dp_adam", ADAM_RATES)}
    muon_pick = grids["dp_muon"][1]
    if muon_pick is not None:
        grids["dp_muonbc"] = muonbc_grid(results, muon_pick)
        grids["dp_muonbc_matched"] = ([muon_pick], muon_pick)
    return grids


def jobs(results: Path, mechanism_seed) -> list[Job]:
    """Every run whose inputs are published, in the order they should run."""
    grids = picks(results)
    secret = mechanism_seed(SEED_TUNE)
    out = [Job(tune_name(arm, lr), "tune", overrides(arm, lr, SEED_TUNE, *TUNING), secret) for arm, (rates, _) in grids.items() for lr in rates]
    best = {arm: grid[1] for arm, grid in grids.items()}
    if len(best) < len(ARMS) or None in best.values():
        return out
    # Seed-major: a stage cut short still holds complete pairs.
    out += [Job(f"{arm}_seed{seed}", "finals", overrides(arm, best[arm], seed, *FINAL), mechanism_seed(seed)) for seed in SEEDS for arm in ARMS]
    from .smollm2_fair_report import h1_needs_more_seeds  # the pre-registered rule, read from the finals

    if h1_needs_more_seeds(results):
        out += [
            Job(f"{arm}_seed{seed}", "finals", overrides(arm, best[arm], seed, *FINAL), mechanism_seed(seed))
            for seed in EXTRA_SEEDS
            for arm in ("dp_adam", "dp_muon")
        ]
    return out


def is_published(results: Path, job: Job) -> bool:
    return (results / job.stage / job.name / SUMMARY_FILE).exists()


def check_only_matrices_train() -> None:
    """Refuse to start unless every tensor the study's runs train is a matrix (the setting's
    premise: DP-Adam and DP-Muon then update exactly the same tensors)."""
    from dpmuon.config import compose_config
    from dpmuon.data import load_tokenizer
    from dpmuon.models import build_model

    cfg = compose_config(*overrides("dp_muon", MUON_RATES[0], SEED_TUNE))
    model = build_model(cfg.model, load_tokenizer(cfg.model.tokenizer, cfg.model.get("bpe_merges")))
    trained = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    not_matrices = {name: shape for name, shape in trained.items() if len(shape) != 2}
    if not trained or not_matrices:
        raise SystemExit(f"smollm2_fair: the setting trains {len(not_matrices)} tensors that are not matrices ({not_matrices}); only LoRA matrices may train")
    print(f"smollm2_fair: {len(trained)} trained tensors, all matrices, {sum(math.prod(s) for s in trained.values()):,} parameters", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "list"))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "smollm2_fair", help="working run directories")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.command == "list":
        todo = jobs(args.results, lambda seed: None)
        for job in todo:
            print("done " if is_published(args.results, job) else "to do", job.stage, job.name, " ".join(job.overrides))
        return 0
    if not MODEL.exists():
        raise SystemExit("models/smollm2 is missing: make models/smollm2")
    if not (args.results / "preregistration.md").exists():
        raise SystemExit(f"{args.results / 'preregistration.md'} is missing: the decision rule is committed before any run")
    os.environ.setdefault("WANDB_MODE", "disabled")
    check_only_matrices_train()
    seeds = MechanismSeeds(args.results / SEEDS_FILE)
    while True:  # a stage's results unlock the next one's jobs
        pending = [job for job in jobs(args.results, seeds) if not is_published(args.results, job)]
        if not pending:
            return 0
        print(f"smollm2_fair: {len(pending)} runs to do, {args.jobs} at a time", flush=True)
        run_jobs(pending, args.work, args.results, threads=args.threads, parallel=args.jobs)
        if not any(is_published(args.results, job) for job in pending):
            print("smollm2_fair: the runs left are held by another runner", flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(main())
