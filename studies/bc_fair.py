"""DP-MuonBC compared fairly: each optimizer at its own best rate, the method's variants, and a
horizon long enough for late gains (results/bc_regime/fair/, issue 25).

    python -m studies.bc_fair run [--jobs 2]   # every stage whose inputs exist (resumable)
    python -m studies.bc_fair run --stage horizon   # one stage only (long runs first in a session)
    python -m studies.bc_fair list             # every run known so far: done or to do

The setting of the regime map (experiment=pretrained_tiny_e2e: the public tiny model, lot 256,
ε = 8, 100 steps; lots as drawn, not padded to constant time), in stages that each need the
previous one's published results:

1. tune: DP-Muon, DP-MuonBC, and DP-MuonBC with `match_norm` (its steps as long as DP-Muon's)
   on a √2-spaced grid of RATES at the final horizon, SEEDS_TUNE seeds per point; a best rate on
   the grid's edge extends the grid by one rate past it.
2. finals: each at its best rate (lowest mean validation NLL), on seeds 2–4 (fresh draws: not
   the runs that selected the rate), oracle diagnostics on
   (published in metrics.jsonl, as every later stage's diagnostics are). Tuning shares one rate
   between the Muon part and the AdamW part (embeddings, biases, norms), so DP-MuonBC's lower
   best rate also slows its AdamW part: `dp_muonbc_split` runs its Muon part at its own best rate
   and its AdamW part at DP-Muon's, which separates the two.
3. variants: at the best rates, DP-MuonBC against DP-Muon under the same variant
   (classical Newton–Schulz with Frobenius and max(1, ‖M‖_F) scaling, Nesterov), and
   DP-MuonBC with s = one step's noise std, seeds 2–4. That correction is far weaker (its steps
   are ~1.07× F(M)'s, not 1.39×), so at DP-MuonBC's best rate it is nearly DP-Muon at a √2
   lower rate; `dp_muonbc_stepstd_muonrate` runs it at DP-Muon's best rate as well, where its
   steps and AdamW part are as fast as DP-Muon's.
4. horizon: the best DP-Muon, DP-MuonBC and DP-MuonBC with `match_norm` for HORIZON_EPOCHS
   epochs (σ recalibrated for ε = 8 over that plan), seeds 2–4. The norm-matched arm has
   DP-Muon's step lengths and AdamW rate, so against DP-Muon it isolates the correction's
   direction, and against DP-MuonBC the rates.
5. horizon_rates (issue 39's add-on, judged by the rule in HORIZON_RATES_PREREGISTRATION, which
   the runner needs before it starts one): the horizon's rates were tuned at 100 steps, and the
   norm-matched arm's late lead over DP-Muon may be what a slower rate gives DP-Muon too. So
   DP-Muon over the horizon at its best rate × 2^(−k/4), k in SLOWER_STEPS (both parts, as
   tuning shares them), and DP-MuonBC with split rates over the horizon (its AdamW part's slower
   rate, alone), seeds 2–4. Paired with the horizon's runs of the same seed.

Runs of one seed index share one mechanism seed (the same lots and noise for every optimizer: a
paired comparison), drawn once from OS entropy. The study spans many working sessions, and a
session keeps nothing but the repository, so the seeds are committed beside the runs
(results/bc_regime/fair/mechanism_seeds.json): a pair begun in one session is completed in the
next on the same lots and noise. A run reproduces bit for bit on the same machine; another CPU
rounds differently (the public model's step-0 validation NLL is 6.70724056 on one session's
machine and 6.70724043 on another's), which moves a 100-step run's NLL by ~5e-5, far below the
differences compared. A run whose seed is published is a measurement of
the optimizers, not a private release of E2E (its ε is the mechanism's calibration, not a
guarantee about these files); see bc_regime.py.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
from pathlib import Path

from dpmuon.eval import SUMMARY_FILE, read_summary
from dpmuon.run_folder import WEIGHTS_FINGERPRINT

from .bc_regime import MechanismSeeds, publish_public_model
from .jobs import REPO, Job, run_jobs

RATES = tuple(0.005 * 2 ** (k / 2) for k in range(5))  # 0.005 … 0.02: √2 apart around the committed 0.01
STAGES = ("tune", "finals", "variants", "horizon", "horizon_rates")
SEEDS_TUNE = (0, 1)
# The finals, variants and horizon run on seed indices that tuning did not use: the same mechanism
# seed is the same lots and noise, so on seeds 0–1 the finals would repeat the runs that picked
# their rate and judge that pick on its own draws.
SEEDS = (2, 3, 4)
PUBLIC_MODEL = REPO / "models" / "public-for-e2e"
SEEDS_FILE = "mechanism_seeds.json"  # published: see the module's docstring
HORIZON_EPOCHS = 3  # ≈ 493 steps at lot 256 on E2E's 42,061 examples
SLOWER_STEPS = (1, 2)  # horizon_rates: DP-Muon at its best rate × 2^(−k/4) (0.0042 and 0.0035 for 0.005)
HORIZON_RATES_PREREGISTRATION = "horizon_rates_preregistration.md"
# name → the optimizer's overrides; the tuned contenders
CONTENDERS = {
    "dp_muon": ("optimizer=dp_muon",),
    "dp_muonbc": ("optimizer=dp_muonbc",),
    "dp_muonbc_matched": ("optimizer=dp_muonbc", "optimizer.bias_correction.match_norm=true"),
}
# name → overrides applied to both DP-Muon and DP-MuonBC (paired under the same variant)
VARIANTS = {
    "series2": ("optimizer.ns_coefficients=series:2", "optimizer.ns_steps=10"),
    "series2_max1": ("optimizer.ns_coefficients=series:2", "optimizer.ns_steps=10", "optimizer.ns_normalize=max1"),
    "nesterov": ("optimizer.nesterov=true",),
}
STEP_STD = ("optimizer.bias_correction.noise_std=step",)  # DP-MuonBC only: against plain DP-Muon
# After tuning, runs publish their non-private diagnostics in metrics.jsonl (train loss, the
# finals' oracle alignment): they are a measurement with published seeds, and a published run
# keeps only metrics.jsonl, not the owner-only diagnostics.jsonl.
PUBLISH_DIAGNOSTICS = "logging.nonprivate_diagnostics=publish"


def overrides(contender: str, lr: float, seed: int, *extra: str, adam_lr: float | None = None) -> tuple[str, ...]:
    """A run's overrides: the AdamW part at `lr` too, unless `adam_lr` says otherwise."""
    return (
        "experiment=pretrained_tiny_e2e",
        *CONTENDERS[contender],
        f"optimizer.lr={lr:.6g}",
        f"optimizer.adam.lr={lr if adam_lr is None else adam_lr:.6g}",
        "privacy.target_epsilon=8",
        # Constant-time lots hide the lot sizes from step times; these runs publish their
        # mechanism seeds (the lots themselves), so there is nothing left to hide, and padding
        # costs ~5× here (386-row lots of full-width rows, every position computed: 26 s a step
        # on one thread against ~5 s). The regime map ran without them too (before they existed).
        "privacy.constant_time=false",
        "privacy.published_seed=true",  # SEEDS_FILE publishes them: each summary says its ε is no guarantee
        f"seed={seed}",
        *extra,
    )


def tune_name(contender: str, lr: float, seed: int) -> str:
    return f"{contender}_lr{lr:.4g}_seed{seed}"


def val_nll(results: Path, stage: str, name: str) -> float | None:
    path = results / stage / name / SUMMARY_FILE
    value = read_summary(path).get("val_nll") if path.exists() else None
    return value if value is not None and math.isfinite(value) else None


def tuning_grid(results: Path, contender: str) -> tuple[list[float], float | None]:
    """The rates to tune (RATES, extended past an edge that wins) and the best, once all are in."""
    rates = list(RATES)
    while True:
        means = {}
        for lr in rates:
            nlls = [val_nll(results, "tune", tune_name(contender, lr, s)) for s in SEEDS_TUNE]
            if None in nlls:
                return rates, None
            means[lr] = statistics.mean(nlls)
        best = min(means, key=means.get)
        if best == rates[0]:
            rates.insert(0, rates[0] / math.sqrt(2))
        elif best == rates[-1]:
            rates.append(rates[-1] * math.sqrt(2))
        else:
            return rates, best


def slower_muon_rates(best_muon: float) -> list[float]:
    """horizon_rates' DP-Muon rates below its best (see the docstring)."""
    return [best_muon * 2 ** (-k / 4) for k in SLOWER_STEPS]


def jobs(results: Path, mechanism_seed) -> list[Job]:
    """The runs of every stage whose inputs are published; seed-major within a stage."""
    grids = {contender: tuning_grid(results, contender) for contender in CONTENDERS}
    best = {contender: grid[1] for contender, grid in grids.items()}
    # Seed 0 of every contender and rate first: a stage cut short still compares them all.
    out = [
        Job(tune_name(contender, lr, s), "tune", overrides(contender, lr, s), mechanism_seed(s))
        for s in SEEDS_TUNE
        for contender, (rates, _) in grids.items()
        for lr in rates
    ]
    if None in best.values():
        return out

    def after_tuning(contender: str, seed: int, *extra: str) -> tuple[str, ...]:
        return overrides(contender, best[contender], seed, *extra, PUBLISH_DIAGNOSTICS)

    # Stage by stage: every seed of the finals (the headline comparison) before any variant.
    for seed in SEEDS:
        for contender in CONTENDERS:
            out.append(Job(f"{contender}_seed{seed}", "finals", after_tuning(contender, seed, "logging.oracle_alignment=true"), mechanism_seed(seed)))
    for seed in SEEDS:  # the split rates (see the docstring), after the contenders' finals
        split = overrides("dp_muonbc", best["dp_muonbc"], seed, PUBLISH_DIAGNOSTICS, adam_lr=best["dp_muon"])
        out.append(Job(f"dp_muonbc_split_seed{seed}", "finals", split, mechanism_seed(seed)))
    for seed in SEEDS:
        secret = mechanism_seed(seed)
        for variant, extra in VARIANTS.items():
            for contender in ("dp_muon", "dp_muonbc"):
                out.append(Job(f"{contender}_{variant}_seed{seed}", "variants", after_tuning(contender, seed, *extra), secret))
        out.append(Job(f"dp_muonbc_stepstd_seed{seed}", "variants", after_tuning("dp_muonbc", seed, *STEP_STD), secret))
        at_muon_rate = overrides("dp_muonbc", best["dp_muon"], seed, *STEP_STD, PUBLISH_DIAGNOSTICS)
        out.append(Job(f"dp_muonbc_stepstd_muonrate_seed{seed}", "variants", at_muon_rate, secret))
    horizon = ("trainer.steps=null", f"trainer.epochs={HORIZON_EPOCHS}", "trainer.eval_every=25", "trainer.checkpoint_every=25")
    for seed in SEEDS:
        for contender in CONTENDERS:
            out.append(Job(f"{contender}_seed{seed}", "horizon", after_tuning(contender, seed, *horizon), mechanism_seed(seed)))
    for seed in SEEDS:
        secret = mechanism_seed(seed)
        for lr in slower_muon_rates(best["dp_muon"]):
            out.append(Job(tune_name("dp_muon", lr, seed), "horizon_rates", overrides("dp_muon", lr, seed, *horizon, PUBLISH_DIAGNOSTICS), secret))
        split = overrides("dp_muonbc", best["dp_muonbc"], seed, *horizon, PUBLISH_DIAGNOSTICS, adam_lr=best["dp_muon"])
        out.append(Job(f"dp_muonbc_split_seed{seed}", "horizon_rates", split, secret))
    return out


def is_published(results: Path, job: Job) -> bool:
    return (results / job.stage / job.name / SUMMARY_FILE).exists()


def public_model(results: Path) -> None:
    """The public model every run starts from, kept beside the runs: a rebuild can be another
    model (later code changes its weights), and a working session keeps nothing but the
    repository. The first runner publishes models/public-for-e2e there; later ones restore it."""
    kept = results / "public_pretraining" / "model"
    if not PUBLIC_MODEL.exists() and kept.exists():
        shutil.copytree(kept, PUBLIC_MODEL)
    if not PUBLIC_MODEL.exists():
        raise SystemExit("models/public-for-e2e is missing: make models/public-for-e2e")
    publish_public_model(results / "public_pretraining")
    if not kept.exists():
        shutil.copytree(PUBLIC_MODEL, kept)
    check_public_model(results)


def check_public_model(results: Path) -> None:
    """Refuse to add runs that start from another public model than the committed ones did, or
    whose seeds were not kept."""
    from dpmuon.models import load_pretrained, weights_fingerprint

    committed = (results / "public_pretraining" / WEIGHTS_FINGERPRINT).read_text().strip()
    here = weights_fingerprint(load_pretrained(str(PUBLIC_MODEL)))
    if here != committed:
        raise SystemExit(
            f"models/public-for-e2e has fingerprint {here[:12]}…, the committed runs started from {committed[:12]}…: "
            "restore that model, or move results/bc_regime/fair/ aside and start over"
        )
    runs = [p for p in results.glob("*/*") if (p / SUMMARY_FILE).exists()]
    if runs and not (results / SEEDS_FILE).exists():
        raise SystemExit(f"{len(runs)} committed runs but no {SEEDS_FILE}: their pairs cannot be completed; move them aside and start over")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "list"))
    parser.add_argument("--stage", choices=("all", *STAGES), default="all", help="run only this stage's runs (once its inputs are published)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "bc_fair", help="working run directories")
    parser.add_argument("--results", type=Path, default=REPO / "results" / "bc_regime" / "fair")
    args = parser.parse_args(argv)
    if args.command == "list":
        todo = jobs(args.results, lambda seed: None)
        published = {job for job in todo if is_published(args.results, job)}
        for job in todo:
            print("done " if job in published else "to do", job.stage, job.name, " ".join(job.overrides))
        for stage in dict.fromkeys(job.stage for job in todo):
            in_stage = [job for job in todo if job.stage == stage]
            print(f"{stage}: {sum(job in published for job in in_stage)} of {len(in_stage)} published")
        if "finals" not in {job.stage for job in todo}:
            print("finals, variants, horizon: listed once every tuning run is published")
        return 0
    os.environ.setdefault("WANDB_MODE", "disabled")
    public_model(args.results)
    seeds = MechanismSeeds(args.results / SEEDS_FILE)
    while True:  # a stage's results unlock the next one's jobs
        todo = jobs(args.results, seeds)
        pending = [job for job in todo if not is_published(args.results, job) and args.stage in ("all", job.stage)]
        if not pending:
            if args.stage not in ("all", *(job.stage for job in todo)):
                raise SystemExit(f"--stage {args.stage}: the stages before it are not all published yet (see: python -m studies.bc_fair list)")
            return 0
        if any(job.stage == "horizon_rates" for job in pending) and not (args.results / HORIZON_RATES_PREREGISTRATION).exists():
            raise SystemExit(f"{args.results / HORIZON_RATES_PREREGISTRATION} is missing: horizon_rates' decision rule is committed before its first run")
        print(f"bc_fair: {len(pending)} runs to do, {args.jobs} at a time", flush=True)
        run_jobs(pending, args.work, args.results, threads=1, parallel=args.jobs)
        # A job another runner holds is skipped, not published: without this check a runner
        # whose only pending jobs are held by another would loop on them at full speed.
        if not any(is_published(args.results, job) for job in pending):
            print("bc_fair: the runs left are held by another runner", flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(main())
