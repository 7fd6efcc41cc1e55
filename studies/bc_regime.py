"""When does DP-MuonBC help? The regime map of results/bc_regime/.

    python -m studies.bc_regime run [--jobs 2]   # every run (resumable; skips what is done)
    python -m studies.bc_regime list             # the runs, in the order they are run

The committed CPU study's setting (experiment=pretrained_tiny_e2e: the publicly pretrained tiny model, lot
256, 100 steps, per-matrix C = 0.1) with oracle alignment diagnostics on, at the learning rate
each optimizer's committed finals use:

- the map: DP-Muon and DP-MuonBC at ε ∈ EPSILONS (σ shrinks, the buffers' SNR rises), seeds 0-2;
- a learning-rate check at the largest ε (LR_CHECK × the committed rate, seed 0);
- ablations of DP-MuonBC at ε = 8: probe scale ρ/s, K probe pairs, the min_snr gate;
- the candidate rule (RULE, a gate) at the other ε (seed 0).

Pairing: the runs of one seed index share a mechanism seed (the same lots and the same noise
draws for both optimizers), drawn once from OS entropy and kept in the working directory
(mode 0600, never published). Runs that share noise are a measurement, not a private release:
publishing two of them reveals the difference of their noise-free sums, so the study-level ε of
results/bc_regime composes nothing — each run's own ε holds for that run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

from dpmuon.eval import Run, read_summary
from dpmuon.jsontext import to_json
from dpmuon.privacy import PRV_MAX_EPSILON
from dpmuon.run_folder import SUMMARY, WEIGHTS_FINGERPRINT, is_finished

from .jobs import REPO, Job, publish, run_jobs

EPSILONS = (8, 32, 128, 1024)
SEEDS = (0, 1, 2)
OPTIMIZERS = ("dp_muon", "dp_muonbc")
LR_CHECK = (0.3, 3.0)  # × the committed rate, at the largest ε (1× is the map's own run)
ABLATIONS = {  # DP-MuonBC at ε = 8: name → overrides
    "probe2": ("optimizer.bias_correction.probe_scale=2.0",),
    "probe4": ("optimizer.bias_correction.probe_scale=4.0",),
    "k4": ("optimizer.bias_correction.num_probes=4",),
    "gate0.01": ("optimizer.bias_correction.min_snr=0.01",),
    "gate0.1": ("optimizer.bias_correction.min_snr=0.1",),
}
# The candidate rule, checked across the map (seed 0): the gate that matched DP-Muon
# at ε = 8 (its ablation), at every other ε, where it opens more often.
RULE = "gate0.1"
# The pretrained regime: DP-Muon at the paper's noise multiplier (σ for ε = 8 over 10 epochs at
# lot 1024 on E2E's N = 42,061, δ = 8e-6: `python -m dpmuon.privacy --epsilon 8 --delta 8e-6
# --sample-rate 0.0243456 --epochs 10`) for 20 steps at two lots the CPU allows, for the local
# SmolLM2-135M and for the tiny public model; two lots separate the signal's energy from its
# sampling variance (see bc_regime_report.extrapolate_snr).
PAPER_SIGMA = 0.68329
PRETRAINED_LOTS = (8, 16)
PRETRAINED_MODELS = {
    "smollm2": ("dataset=e2e", "model=smollm2_135m", "model.name_or_path=models/smollm2"),
    "tiny": ("experiment=pretrained_tiny_e2e",),
}
STUDY_RUNS = REPO / "results" / "e2e" / "runs"  # the committed study, whose rates are reused


def committed_rate(optimizer: str, study_runs: Path = STUDY_RUNS) -> float:
    """The learning rate the committed study's finals of `optimizer` used (selected by its tuning)."""
    final = study_runs / f"{optimizer}_seed0"
    return Run(final, read_summary(final / SUMMARY)).learning_rates["lr"]


def run_overrides(optimizer: str, lr: float, epsilon: float, seed: int) -> tuple[str, ...]:
    # PRV cannot calibrate ε = 1024 in memory (privacy/plan.py: PRV_MAX_EPSILON): RDP there.
    accountant = ("privacy.accountant=rdp",) if epsilon > PRV_MAX_EPSILON else ()
    return (
        "experiment=pretrained_tiny_e2e",
        f"optimizer={optimizer}",
        f"optimizer.lr={lr:g}",
        f"optimizer.adam.lr={lr:g}",
        f"privacy.target_epsilon={epsilon:g}",
        *accountant,
        f"seed={seed}",
        "logging.oracle_alignment=true",
    )


def jobs(rates: dict[str, float], mechanism_seed) -> list[Job]:
    """Seed-major (seed 0's map, the learning-rate check, seed 0's ablations, then seed 1's ...):
    a sweep cut short still holds complete, paired seed indices.

    mechanism_seed: seed index → its secret mechanism seed (one per pair).
    """
    out = []
    for seed in SEEDS:
        secret = mechanism_seed(seed)
        for epsilon in EPSILONS:
            for opt in OPTIMIZERS:
                out.append(Job(f"{opt}_eps{epsilon}_seed{seed}", "runs", run_overrides(opt, rates[opt], epsilon, seed), secret))
        if seed == 0:
            top = max(EPSILONS)
            for factor in LR_CHECK:
                for opt in OPTIMIZERS:
                    lr = rates[opt] * factor
                    out.append(Job(f"{opt}_eps{top}_lr{lr:g}_seed0", "lr_check", run_overrides(opt, lr, top, 0), secret))
        for name, extra in ABLATIONS.items():
            out.append(Job(f"dp_muonbc_{name}_eps8_seed{seed}", "ablations", run_overrides("dp_muonbc", rates["dp_muonbc"], 8, seed) + extra, secret))
        if seed == 0:
            for epsilon in reversed(EPSILONS[1:]):  # where the gate opens most first
                overrides = run_overrides("dp_muonbc", rates["dp_muonbc"], epsilon, 0) + ABLATIONS[RULE]
                out.append(Job(f"dp_muonbc_{RULE}_eps{epsilon}_seed0", "rule_check", overrides, secret))
    return out


def pretrained_jobs() -> list[Job]:
    return [
        Job(
            f"{model}_lot{lot}",
            "pretrained",
            (
                *overrides,
                "optimizer=dp_muon",
                f"privacy.noise_multiplier={PAPER_SIGMA}",
                f"privacy.expected_lot_size={lot}",
                "trainer.steps=20",
                "trainer.micro_batch_size=8",
                "trainer.eval_every=0",
                "trainer.checkpoint_every=5",
                "eval.test=false",
                "eval.validation=false",
                "logging.oracle_alignment=true",
                "seed=0",
            ),
        )
        for model, overrides in PRETRAINED_MODELS.items()
        for lot in PRETRAINED_LOTS
    ]


class MechanismSeeds:
    """The sweep's secret mechanism seeds, one per seed index, drawn from OS entropy on first use
    and kept (mode 0600) in the working directory so that resumed and later runs pair up."""

    def __init__(self, path: Path):
        self.path = path
        self.seeds: dict[str, int] = json.loads(path.read_text()) if path.exists() else {}

    def __call__(self, seed: int) -> int:
        if str(seed) not in self.seeds:
            self.seeds[str(seed)] = secrets.randbits(128)  # seeds already stored stay: runs pair up
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(to_json(self.seeds))
        return self.seeds[str(seed)]


def publish_public_model(dest: Path) -> None:
    """The provenance of the public model every run starts from: its pretraining run's files
    and the weights' fingerprint (a rebuild draws other lots, so it is another model)."""
    from dpmuon.models import load_pretrained, weights_fingerprint

    public_run = REPO / "outputs" / "public_for_e2e" / "seed0"
    if (dest / WEIGHTS_FINGERPRINT).exists() or not is_finished(public_run):
        return
    publish(public_run, dest)
    (dest / WEIGHTS_FINGERPRINT).write_text(weights_fingerprint(load_pretrained(str(REPO / "models" / "public-for-e2e"))) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "list"))
    parser.add_argument("--stage", choices=("all", "map", "pretrained"), default="all", help="map: the ε sweep, its checks and ablations")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "bc_regime", help="working run directories")
    parser.add_argument("--results", type=Path, default=REPO / "results" / "bc_regime")
    args = parser.parse_args(argv)

    rates = {opt: committed_rate(opt) for opt in OPTIMIZERS}

    def selected(mechanism_seed) -> list[Job]:
        return (jobs(rates, mechanism_seed) if args.stage != "pretrained" else []) + (pretrained_jobs() if args.stage != "map" else [])

    if args.command == "list":
        for job in selected(lambda seed: "<secret>"):
            print(job.stage, job.name, " ".join(job.overrides))
        return 0
    for needed in ("public-for-e2e", "smollm2") if args.stage != "map" else ("public-for-e2e",):
        if not (REPO / "models" / needed).exists():
            raise SystemExit(f"models/{needed} is missing: make models/{needed}")
    os.environ.setdefault("WANDB_MODE", "disabled")
    publish_public_model(args.results / "public_pretraining")
    todo = selected(MechanismSeeds(args.work / "mechanism_seeds.json"))
    print(f"bc_regime: {len(todo)} runs, {args.jobs} at a time; rates {rates}", flush=True)
    run_jobs(todo, args.work, args.results, threads=1, parallel=args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
