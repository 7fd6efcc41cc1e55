"""Tune hyperparameters on private data by random stopping (Papernot & Steinke, ICLR 2022).

    python -m studies.tune_private --out outputs/tune_e2e --mean-trials 5 --lr-grid 3e-3,1e-2,3e-2 \\
        experiment=pretrained_tiny_e2e optimizer=dp_adam
    python -m studies.tune_private --out outputs/tune_e2e --mean-trials 10 --eta 0 \\
        --lr-range 1e-4:1e-1 --lr-key optimizer.lr --lr-key optimizer.adam.lr experiment=pretrained_tiny_e2e optimizer=dp_muon

Draws K from a truncated negative binomial with mean --mean-trials (shape --eta: 1 geometric,
0 logarithmic) using OS entropy, then runs K trainings (`python -m dpmuon.train OVERRIDES ...
eval.test=false`), each with a learning rate (and --param choices) drawn afresh and a fresh
seed, and selects the trial with the lowest final validation NLL. `<out>/tuning_summary.json`
holds the chosen trial, the ε of the whole procedure (Theorem 2; see dpmuon.privacy.tuning)
and one run's ε, and — secret — K and every candidate.

What the bound covers, and what it does not:
- Only the chosen trial may be published. K, the other candidates and their run directories
  must stay private: released, they leave only the composition of all K runs
  (`python -m dpmuon.eval.study <out>`), and K alone already undoes the random stopping.
- Each trial is Q = (draw hyperparameters, train with DP, score). The score (val_nll) is a
  function of the trained model and the validation split, so for neighbouring *training* sets
  (validation split fixed) Q's privacy is the training run's, and the theorem covers the
  selection. The validation examples themselves get no guarantee: the choice and the reported
  val_nll depend on them without noise. Score on public data to protect them too.
- Trials must be independent runs of one mechanism: the search may not touch σ, q, steps or
  the data (privacy.*, trainer.steps/epochs, dataset*, data.*), nor fix the mechanism's seed.

--fixed-trials N runs exactly N trials instead (e.g. for tests). That is NOT private selection:
its ε is the composition of the N runs, reported as such.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from dpmuon.eval.study import group_runs, is_run_dir, read_run
from dpmuon.jsontext import to_json
from dpmuon.privacy import MECHANISM_SEED_ENV, TruncatedNegativeBinomial, composed_epsilon, tuning_bound
from dpmuon.run_folder import SUMMARY as RUN_SUMMARY

SUMMARY = "tuning_summary.json"
DEFAULT_TRAIN = [sys.executable, "-m", "dpmuon.train"]
# Overrides the script sets itself on every trial.
CONTROLLED = ("hydra.run.dir", "seed", "eval.test")
# Keys that change the mechanism (σ, q, steps), the data, or tie trials' noise together.
MECHANISM_PREFIXES = ("privacy.", "trainer.steps", "trainer.epochs", "dataset", "data.", "experiment")
NOT_PRIVATE_SELECTION = "fixed trials: NOT private selection; ε is the composition of all trials"
RANDOM_STOPPING = "random stopping (Papernot & Steinke 2022, Theorem 2): K ~ truncated negative binomial, best trial released"
SECRET_NOTE = (
    "keep this object private: publishing the number of trials, the candidates, or any run but the chosen "
    "one voids the random-stopping bound; then only the composition of all trials holds "
    "(python -m dpmuon.eval.study)"
)


class TuningError(ValueError):
    """Arguments the tuner refuses: named, with the reason."""


@dataclass(frozen=True)
class SearchSpace:
    """Where each trial draws its hyperparameters: a learning rate and categorical choices."""

    lr_keys: tuple[str, ...]
    lr_grid: tuple[float, ...] | None
    lr_range: tuple[float, float] | None  # log-uniform
    choices: tuple[tuple[str, tuple[str, ...]], ...]

    def draw(self, rng: secrets.SystemRandom) -> dict[str, str]:
        if self.lr_grid is not None:
            lr = rng.choice(self.lr_grid)
        else:
            low, high = self.lr_range
            lr = math.exp(rng.uniform(math.log(low), math.log(high)))
        drawn = {key: f"{lr:.6g}" for key in self.lr_keys}
        drawn.update({key: rng.choice(values) for key, values in self.choices})
        return drawn


@dataclass
class Trial:
    index: int  # secret: the chosen trial's index would bound K from below
    run_dir: Path  # named by a random token, not by the index, for the same reason
    hyperparameters: dict[str, str]
    seed: int
    returncode: int | None = None
    val_nll: float | None = None  # None: no finite score (failed or diverged): never chosen

    def describe(self) -> dict:
        return {**asdict(self), "run_dir": str(self.run_dir)}

    def public(self) -> dict:
        return {"run_dir": str(self.run_dir), "hyperparameters": self.hyperparameters, "seed": self.seed, "val_nll": self.val_nll}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides passed to every trial (e.g. experiment=pretrained_tiny_e2e optimizer=dp_adam)")
    parser.add_argument("--out", type=Path, required=True, help="new folder for the trials and tuning_summary.json")
    trials = parser.add_mutually_exclusive_group(required=True)
    trials.add_argument("--mean-trials", type=float, help="E[K] of the random number of trials (> 1)")
    trials.add_argument("--fixed-trials", type=int, help="run exactly this many trials: NOT private selection")
    parser.add_argument("--eta", type=float, default=0.0, help="shape η > -1 of K's distribution (0: logarithmic, default; 1: geometric)")
    lr = parser.add_mutually_exclusive_group(required=True)
    lr.add_argument("--lr-grid", help="comma-separated learning rates, drawn uniformly")
    lr.add_argument("--lr-range", help="LOW:HIGH, drawn log-uniformly")
    parser.add_argument("--lr-key", action="append", help="config key(s) that get the drawn rate (default: optimizer.lr)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=V1,V2", help="another hyperparameter, drawn uniformly from its values")
    parser.add_argument("--delta", type=float, help="δ of the bound (default: the trials' own)")
    parser.add_argument("--train-command", default=shlex.join(DEFAULT_TRAIN), help="the trainer (default: python -m dpmuon.train)")
    return parser.parse_args(argv)


def search_space(args: argparse.Namespace) -> SearchSpace:
    lr_keys = tuple(args.lr_key or ["optimizer.lr"])
    choices = []
    for spec in args.param:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise TuningError(f"--param {spec!r}: expected KEY=V1,V2,...")
        choices.append((key, tuple(values.split(","))))
    for key in (*lr_keys, *(key for key, _ in choices)):
        if key.startswith(MECHANISM_PREFIXES) or key in CONTROLLED:
            raise TuningError(f"cannot search over {key!r}: it changes the mechanism or the data, or the tuner sets it")
    grid = _floats(args.lr_grid, ",") if args.lr_grid else None
    bounds = _floats(args.lr_range, ":") if args.lr_range else None
    if bounds is not None and (len(bounds) != 2 or not 0 < bounds[0] < bounds[1]):
        raise TuningError(f"--lr-range {args.lr_range!r}: expected LOW:HIGH with 0 < LOW < HIGH")
    if grid is not None and not all(value > 0 for value in grid):
        raise TuningError(f"--lr-grid {args.lr_grid!r}: learning rates must be > 0")
    return SearchSpace(lr_keys, grid, bounds, tuple(choices))


def _floats(text: str, separator: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(separator))
    except ValueError as error:
        raise TuningError(f"{text!r}: not numbers ({error})") from error


def check_overrides(overrides: list[str], space: SearchSpace) -> None:
    searched = {*CONTROLLED, *space.lr_keys, *(key for key, _ in space.choices)}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in searched:
            raise TuningError(f"override {override!r}: the tuner sets {key!r} on every trial")
        if key.startswith("privacy.mechanism_seed"):
            raise TuningError(f"override {override!r}: a fixed mechanism seed gives every trial the same noise")
    if MECHANISM_SEED_ENV in os.environ:  # every trial inherits this process's environment
        raise TuningError(f"{MECHANISM_SEED_ENV} is set: a fixed mechanism seed gives every trial the same noise; unset it")


def number_of_trials(args: argparse.Namespace) -> tuple[int, TruncatedNegativeBinomial | None]:
    if args.fixed_trials is not None:
        if args.fixed_trials < 1:
            raise TuningError(f"--fixed-trials must be >= 1, got {args.fixed_trials}")
        return args.fixed_trials, None
    distribution = TruncatedNegativeBinomial.with_mean(args.mean_trials, args.eta)
    return distribution.sample(), distribution


def run_trial(trial: Trial, train_command: list[str], overrides: list[str]) -> None:
    """One training on the private data; its log beside its files, its score from summary.json."""
    trial.run_dir.mkdir(parents=True)
    command = [
        *train_command, *overrides, *(f"{key}={value}" for key, value in trial.hyperparameters.items()),
        f"seed={trial.seed}", "eval.test=false", f"hydra.run.dir={trial.run_dir}",
    ]  # fmt: skip
    with open(trial.run_dir / "tune_private.log", "w") as log:
        trial.returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    summary = trial.run_dir / RUN_SUMMARY
    if trial.returncode == 0 and summary.is_file():
        score = json.loads(summary.read_text()).get("val_nll")
        trial.val_nll = float(score) if isinstance(score, (int, float)) and math.isfinite(score) else None


def choose(trials: list[Trial]) -> Trial | None:
    """The lowest validation NLL; ties go to the earlier trial. None when no trial scored."""
    scored = [trial for trial in trials if trial.val_nll is not None]
    return min(scored, key=lambda trial: (trial.val_nll, trial.index)) if scored else None


def privacy_of(trials: list[Trial], distribution: TruncatedNegativeBinomial | None, delta: float | None) -> dict:
    """ε of the whole procedure at δ: Theorem 2 for random stopping, composition for fixed trials."""
    records = [read_run(t.run_dir) for t in trials if is_run_dir(t.run_dir)]
    groups = group_runs(records) if records else []
    if len(groups) != 1:
        raise TuningError(f"the trials should share one private training set, found {len(groups)}")
    if any(not record.private for record in records):
        raise TuningError("a trial ran without noise: tuning on private data needs DP trials")
    delta = groups[0].delta(delta)
    base = max(composed_epsilon([record], delta) for record in records)
    if distribution is None:
        return {"epsilon": composed_epsilon(records, delta), "delta": delta, "base_epsilon": base, "private_selection": False}
    bound = tuning_bound([list(record.history) for record in records], delta, distribution)
    return {"epsilon": bound.epsilon, "delta": delta, "base_epsilon": bound.base_epsilon, "private_selection": True, "bound": bound.as_dict()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        space = search_space(args)
        check_overrides(args.overrides, space)
        if args.delta is not None and not 0 < args.delta < 1:
            raise TuningError(f"--delta must be in (0, 1), got {args.delta}")
        if args.out.exists() and any(args.out.iterdir()):
            raise TuningError(f"{args.out} is not empty: a new tuning (a new cost) needs a new folder")
        k, distribution = number_of_trials(args)
        rng = secrets.SystemRandom()
        trials = [Trial(i, args.out / f"trial_{secrets.token_hex(4)}", space.draw(rng), rng.randrange(2**31)) for i in range(k)]
        for trial in trials:
            run_trial(trial, shlex.split(args.train_command), args.overrides)
        privacy = privacy_of(trials, distribution, args.delta)
    except ValueError as error:  # TuningError, StudyError, impossible distribution parameters
        print(f"tune_private.py: error: {error}", file=sys.stderr)
        return 2
    chosen = choose(trials)
    record = {"trials": len(trials), "candidates": [trial.describe() for trial in trials]}
    summary = {
        "procedure": RANDOM_STOPPING if distribution else NOT_PRIVATE_SELECTION,
        **privacy,
        "chosen": chosen.public() if chosen else None,
        # Fixed trials are all accounted for; random stopping holds only while K stays secret.
        **({"secret": {"note": SECRET_NOTE, **record}} if distribution else record),
    }
    (args.out / SUMMARY).write_text(to_json(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if chosen is None:
        print(f"tune_private.py: no trial produced a finite val_nll; see {args.out}/trial_*/tune_private.log", file=sys.stderr)
        return 1
    print(f"chosen: {chosen.hyperparameters} (val_nll {chosen.val_nll:.4f}), {chosen.run_dir}; "
          f"ε = {privacy['epsilon']:.2f} at δ = {privacy['delta']:g} for the whole tuning; summary: {args.out / SUMMARY}")  # fmt: skip
    return 0
