"""What a study costs: the composed privacy of every run that touched one private training set.

    python -m dpmuon.privacy.study RUN_DIR... [--delta D]

Each run's ε holds for that run alone. A study that tunes, repeats seeds and compares
optimizers on the same private examples releases all of those runs, so its privacy is the
composition of every charged release of every run: this module merges the runs' (σ, q)
histories and composes them with the PRV accountant at one δ.

Where a run's releases come from:
- `privacy_ledger.jsonl` (one line per release; only `"charged": true` lines cost anything);
- else `summary.json` (runs from before ledgers): `steps` releases at its (σ, q), marked
  "reconstructed from summary.json".

Runs are grouped by their private training set (dataset, N, data fingerprint) and each group is
composed on its own — runs on other data (e.g. a public pretraining run) neither add to nor
hide a group's cost. A run that records no fingerprint might be any set of its (dataset, N):
it is composed into every such group (or forms one of its own), never left out.

A non-private run (no noise) on a group's data gives the group no guarantee at all: its
`epsilon_total` is "inf" (a string: strict JSON has no infinity, and null could pass for
"unknown"), the run is listed under `non_private_runs` with a warning on stderr, and
`epsilon_total_private_runs` still reports what the DP runs alone compose to.

Composition assumes the runs' noise was independent. A run seeded by the user
(`privacy.mechanism_seed`, `"mechanism_randomness"` in its summary) shares its lots and noise
with every run given the same seed: subtracting two such releases cancels the noise, and no
finite ε covers those runs together. Summaries never record the seed, so the study cannot tell
which runs shared one: it lists them under `user_seeded_runs` and warns when two or more
private runs of a group were user-seeded.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .accountant import PrivacyAccountant
from .ledger import FORMAT as LEDGER_FORMAT
from .ledger import LEDGER_FILE
from .randomness import USER_SEED

SUMMARY_FILE = "summary.json"
FROM_LEDGER = LEDGER_FILE
RECONSTRUCTED = "reconstructed from summary.json"
INFINITE = "inf"
ACCOUNTANT = "prv"
USAGE_ERROR = 2

History = list[tuple[float, float, int]]  # (σ, q, releases), as in PrivacyAccountant.history


class StudyError(ValueError):
    """Input the study cannot account for: named, never guessed around."""


@dataclass(frozen=True)
class TrainingSet:
    """The private examples a run trained on; fingerprint None: not recorded (unknown)."""

    dataset: str
    size: int | None
    fingerprint: str | None

    def could_be(self, other: TrainingSet) -> bool:
        """Whether the two may be the same examples: an unknown fingerprint matches any."""
        same_fingerprint = None in (self.fingerprint, other.fingerprint) or self.fingerprint == other.fingerprint
        return (self.dataset, self.size) == (other.dataset, other.size) and same_fingerprint

    def describe(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "dataset_size": self.size, "data_fingerprint": self.fingerprint}


@dataclass(frozen=True)
class RunRecord:
    """One run's charged releases and the training set they came from."""

    path: Path
    training_set: TrainingSet
    private: bool
    delta: float | None  # None: non-private runs record none
    history: tuple[tuple[float, float, int], ...]  # charged releases
    uncharged: int  # replays identical to an earlier release: free
    source: str  # FROM_LEDGER or RECONSTRUCTED
    optimizer: str | None = None
    user_seeded: bool = False  # lots and noise from privacy.mechanism_seed: maybe shared with other runs

    @property
    def charged(self) -> int:
        return sum(n for _, _, n in self.history)

    def describe(self) -> dict[str, Any]:
        return {
            "run": str(self.path),
            "optimizer": self.optimizer,
            "private": self.private,
            "ledger": self.source,
            "charged_releases": self.charged,
            "uncharged_releases": self.uncharged,
        }


# ---------------------------------------------------------------------------------------------
# Reading runs


def find_run_dirs(paths: Iterable[Path]) -> list[Path]:
    """The given run directories, or those found below a folder; a run's own subfolders are its own.

    A run directory holds a ledger or a summary.json. Searching stops at one, so a resume
    folder inside a run is not counted as a second run.
    """
    found: dict[Path, Path] = {}
    for root in map(Path, paths):
        if not root.is_dir():
            raise StudyError(f"{root}: no such directory")
        for run in _runs_below(root):
            found.setdefault(run.resolve(), run)
    if not found:
        raise StudyError(f"no run ({LEDGER_FILE} or {SUMMARY_FILE}) under {', '.join(map(str, paths))}")
    return sorted(found.values(), key=str)


def _runs_below(folder: Path) -> list[Path]:
    if is_run_dir(folder):
        return [folder]
    return [run for child in sorted(folder.iterdir()) if child.is_dir() for run in _runs_below(child)]


def is_run_dir(folder: Path) -> bool:
    return (folder / LEDGER_FILE).is_file() or (folder / SUMMARY_FILE).is_file()


def read_run(path: Path) -> RunRecord:
    """The run's releases from its ledger, or reconstructed from its summary.json."""
    path = Path(path)
    summary = _read_json(path / SUMMARY_FILE) if (path / SUMMARY_FILE).is_file() else None
    if (path / LEDGER_FILE).is_file():
        return _from_ledger(path, summary)
    if summary is None:
        raise StudyError(f"{path}: neither {LEDGER_FILE} nor {SUMMARY_FILE}")
    return from_summary(path, summary)


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StudyError(f"{file}: not readable JSON ({error})") from error
    if not isinstance(data, dict):
        raise StudyError(f"{file}: expected a JSON object")
    return data


def from_summary(path: Path, summary: dict[str, Any]) -> RunRecord:
    """A run before ledgers: `steps` releases at its (σ, q), all charged."""
    where = path / SUMMARY_FILE
    sigma = _number(summary, "noise_multiplier", where)
    q = _number(summary, "sample_rate", where)
    steps = summary.get("steps")
    if not _is_count(steps):
        raise StudyError(f"{where}: 'steps' must be a non-negative integer, got {steps!r}")
    # The artifact contract marks non-private runs with noise_multiplier 0; newer ones say so too.
    private = summary.get("private", sigma != 0) is not False and sigma > 0
    return RunRecord(
        path=path,
        training_set=_training_set(summary, where),
        private=private,
        delta=_delta(summary.get("delta"), where) if private else None,
        history=((sigma, q, steps),) if steps else (),
        uncharged=0,
        source=RECONSTRUCTED,
        optimizer=summary.get("optimizer"),
        user_seeded=summary.get("mechanism_randomness") == USER_SEED,
    )


def _from_ledger(path: Path, summary: dict[str, Any] | None) -> RunRecord:
    file = path / LEDGER_FILE
    lines = file.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):
                break  # a torn last line: the crash came before its release reached anything
            raise StudyError(f"{file}:{number}: not valid JSON ({error})") from error
    if not records or not isinstance(records[0], dict) or records[0].get("kind") != "header":
        raise StudyError(f"{file}:1: the first line must be the ledger header")
    header = records[0]
    if header.get("format") != LEDGER_FORMAT:
        raise StudyError(f"{file}:1: ledger format {header.get('format')!r}, this reader knows {LEDGER_FORMAT}")
    history, uncharged = _charged_history(file, records[1:])
    noiseless = any(sigma <= 0 for sigma, _, _ in history)
    private = not noiseless and (summary or {}).get("private", True) is not False
    return RunRecord(
        path=path,
        training_set=_training_set(header, file),
        private=private,
        delta=_delta(header.get("delta"), file) if private else None,
        history=tuple(history),
        uncharged=uncharged,
        source=FROM_LEDGER,
        optimizer=(summary or {}).get("optimizer"),
        user_seeded=(summary or {}).get("mechanism_randomness") == USER_SEED,
    )


def _charged_history(file: Path, releases: Sequence[Any]) -> tuple[History, int]:
    history: History = []
    uncharged = 0
    for number, release in enumerate(releases, start=2):
        where = f"{file}:{number}"
        if not isinstance(release, dict) or release.get("kind") != "release":
            raise StudyError(f"{where}: expected a release line")
        if not isinstance(release.get("charged"), bool):
            raise StudyError(f"{where}: 'charged' must be true or false")
        sigma, q = _number(release, "noise_multiplier", where), _number(release, "sample_rate", where)
        if not release["charged"]:
            uncharged += 1
        elif history and history[-1][:2] == (sigma, q):
            history[-1] = (sigma, q, history[-1][2] + 1)
        else:
            history.append((sigma, q, 1))
    return history, uncharged


def _training_set(record: dict[str, Any], where: Path) -> TrainingSet:
    dataset, size, fingerprint = record.get("dataset"), record.get("dataset_size"), record.get("data_fingerprint")
    if not isinstance(dataset, str) or not dataset:
        raise StudyError(f"{where}: 'dataset' must be a non-empty string, got {dataset!r}")
    if size is not None and not _is_count(size):
        raise StudyError(f"{where}: 'dataset_size' must be a non-negative integer, got {size!r}")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise StudyError(f"{where}: 'data_fingerprint' must be a string, got {fingerprint!r}")
    return TrainingSet(dataset, size, fingerprint or None)


def _number(record: dict[str, Any], key: str, where: Path | str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise StudyError(f"{where}: {key!r} must be a finite number, got {value!r}")
    return float(value)


def _delta(value: Any, where: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise StudyError(f"{where}: a private run needs 'delta' in (0, 1), got {value!r}")
    return float(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---------------------------------------------------------------------------------------------
# Composing


def merged_history(runs: Iterable[RunRecord]) -> History:
    """All charged releases, identical (σ, q) merged into one entry: composition is order-free,
    and PRV's cost grows with the number of distinct entries, not of releases."""
    counts: dict[tuple[float, float], int] = {}
    for run in runs:
        for sigma, q, n in run.history:
            counts[(sigma, q)] = counts.get((sigma, q), 0) + n
    return [(sigma, q, n) for (sigma, q), n in sorted(counts.items())]


def composed_epsilon(runs: Iterable[RunRecord], delta: float) -> float:
    """ε at δ of releasing every run: PRV over the merged charged history; inf if any run is non-private."""
    runs = list(runs)
    if not all(run.private for run in runs):
        return math.inf
    accountant = PrivacyAccountant(delta, ACCOUNTANT)
    accountant.history = merged_history(runs)
    return accountant.epsilon()


@dataclass
class StudyGroup:
    """The runs that may have touched one training set."""

    training_set: TrainingSet
    runs: list[RunRecord] = field(default_factory=list)
    assumed: list[RunRecord] = field(default_factory=list)  # no fingerprint: counted here to be safe

    @property
    def private_runs(self) -> list[RunRecord]:
        return [run for run in self.runs if run.private]

    @property
    def non_private_runs(self) -> list[RunRecord]:
        return [run for run in self.runs if not run.private]

    @property
    def user_seeded_runs(self) -> list[RunRecord]:
        return [run for run in self.private_runs if run.user_seeded]

    def delta(self, override: float | None) -> float | None:
        """--delta, else the δ every private run recorded (they must agree)."""
        if override is not None:
            return override
        deltas = sorted({run.delta for run in self.private_runs})
        if len(deltas) > 1:
            raise StudyError(
                f"the runs on {self.label()} record different δ ({', '.join(map(repr, deltas))}); "
                "compose them at one δ with --delta"
            )
        return deltas[0] if deltas else None

    def label(self) -> str:
        size = "N not recorded" if self.training_set.size is None else f"N={self.training_set.size}"
        fingerprint = self.training_set.fingerprint
        data = f"data {fingerprint[:12]}" if fingerprint else "no data fingerprint recorded"
        return f"{self.training_set.dataset} ({size}, {data})"

    def report(self, delta_override: float | None = None) -> dict[str, Any]:
        delta = self.delta(delta_override)
        per_run = {str(run.path): _json_epsilon(_run_epsilon(run, delta)) for run in self.runs}
        private_total = composed_epsilon(self.private_runs, delta) if self.private_runs else 0.0
        return {
            **self.training_set.describe(),
            "delta": delta,
            "accountant": ACCOUNTANT,
            "runs": [run.describe() for run in self.runs],
            "epsilon_per_run": per_run,
            "epsilon_total": _json_epsilon(math.inf if self.non_private_runs else private_total),
            "epsilon_total_private_runs": _json_epsilon(private_total),
            "non_private_runs": [str(run.path) for run in self.non_private_runs],
            "runs_without_fingerprint": [str(run.path) for run in self.assumed],
            "user_seeded_runs": [str(run.path) for run in self.user_seeded_runs],
            "warnings": self.warnings(),
        }

    def warnings(self) -> list[str]:
        notes = []
        if self.non_private_runs:
            notes.append(
                f"{len(self.non_private_runs)} non-private run(s) trained on {self.label()} without noise: "
                "a study that includes them gives this data no differential-privacy guarantee (ε = inf); "
                "that is fine only if this data is public"
            )
        if self.assumed:
            notes.append(
                f"{len(self.assumed)} run(s) record no data fingerprint and are counted as if they "
                f"trained on {self.label()}"
            )
        if len(self.user_seeded_runs) > 1:
            notes.append(
                f"{len(self.user_seeded_runs)} private runs on {self.label()} drew their lots and noise from a "
                "user-supplied privacy.mechanism_seed: epsilon_total assumes every one of those seeds was distinct "
                "and secret. Runs that shared a seed (a paired comparison) reused one noise draw, and no finite ε "
                "covers them together"
            )
        return notes


def _run_epsilon(run: RunRecord, delta: float | None) -> float:
    if not run.private:
        return math.inf
    if not run.history:
        return 0.0
    return composed_epsilon([run], delta)


def _json_epsilon(value: float) -> float | str:
    return INFINITE if math.isinf(value) else value


def group_runs(runs: Sequence[RunRecord]) -> list[StudyGroup]:
    """One group per known training set; a run without fingerprint joins every set it could be."""
    known: dict[TrainingSet, StudyGroup] = {}
    for run in runs:
        if run.training_set.fingerprint is not None:
            known.setdefault(run.training_set, StudyGroup(run.training_set)).runs.append(run)
    unknown: dict[TrainingSet, StudyGroup] = {}
    for run in runs:
        if run.training_set.fingerprint is not None:
            continue
        matches = [group for key, group in known.items() if run.training_set.could_be(key)]
        for group in matches:
            group.runs.append(run)
            group.assumed.append(run)
        if not matches:
            unknown.setdefault(run.training_set, StudyGroup(run.training_set)).runs.append(run)
    groups = list(known.values()) + list(unknown.values())
    for group in groups:
        group.runs.sort(key=lambda run: str(run.path))
    return sorted(groups, key=lambda g: (g.training_set.dataset, g.training_set.size or 0, g.training_set.fingerprint or ""))


def study_report(runs: Sequence[RunRecord], delta: float | None = None) -> dict[str, Any]:
    """One group: its report at top level. Several: {"groups": [...]} — they are never added."""
    groups = group_runs(runs)
    if len(groups) == 1:
        return groups[0].report(delta)
    return {
        "groups": [group.report(delta) for group in groups],
        "warnings": [
            f"the runs touched {len(groups)} different training sets; each group is composed on its own "
            "(a person present in several sets pays each group's ε)"
        ],
    }


def all_warnings(report: dict[str, Any]) -> list[str]:
    """The report's warnings and its groups', in order: what must be said loudly."""
    groups = report.get("groups", [])
    return list(report["warnings"]) + [warning for group in groups for warning in group["warnings"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpmuon.privacy.study",
        description="Compose the privacy ledgers of every given run that trained on the same private "
        "data (PRV) and print one JSON object: runs, epsilon_per_run, epsilon_total, delta.",
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run directories, or folders searched for them")  # fmt: skip
    parser.add_argument("--delta", type=float, help="compose at this δ (default: the runs' own, which must agree)")
    args = parser.parse_args(argv)
    try:
        if args.delta is not None and not 0 < args.delta < 1:
            raise StudyError(f"--delta must be in (0, 1), got {args.delta}")
        report = study_report([read_run(path) for path in find_run_dirs(args.run_dirs)], args.delta)
    except StudyError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    for warning in all_warnings(report):
        print(f"WARNING: {warning}", file=sys.stderr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
