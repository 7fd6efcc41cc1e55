"""What a study costs: the composed privacy of every run that touched one private dataset.

    python -m dpmuon.eval.study RUN_DIR... [--delta D]     (or: dpmuon-study RUN_DIR...)

Each run's ε holds for that run alone. A study that tunes, repeats seeds and compares
optimizers on the same private examples releases all of those runs, so its privacy is the
composition of every charged release of every run: this module reads the runs' (σ, q)
histories from their folders, and privacy/composition.py merges and composes them with the PRV
accountant at one δ.

Where a run's releases come from:
- `privacy_ledger.jsonl` (one line per release; only `"charged": true` lines cost anything; a
  chained ledger must chain: an edited or removed line is an error, never skipped; and it must be
  the ledger the `summary.json` beside it was written from: its head and length, its charged
  lines (`releases_charged`) and its last step (`steps`) — a chain checked on its own cannot see
  that its last lines were cut or that it was re-chained over fewer);
- else `summary.json` (no ledger: the ledger was lost, or the run predates ledgers):
  `releases_charged` releases at its (σ, q) — never fewer than its `steps` — marked
  "reconstructed from summary.json". Re-run steps after a resume are charged releases too, so
  `steps` alone would under-count them.

Runs are grouped by dataset (e2e, dart, …), not by the exact examples: a run on any subset of a
dataset — another N, other excluded origins, the same files under another path — could have
touched any of its examples, so every run on a dataset is composed with every other. Runs on
other datasets (e.g. a public pretraining run) form their own groups: they neither add to nor
hide a group's cost. The groups list the data fingerprints their runs recorded.

A non-private run (no noise) on a group's data gives the group no guarantee at all: its
`epsilon_total` is "inf" (a string: strict JSON has no infinity, and null could pass for
"unknown"), the run is listed under `non_private_runs` with a warning on stderr, and
`epsilon_total_private_runs` reports what the DP runs alone compose to.

A private run without secret randomness — a ledger-less summary that records no
`mechanism_randomness`: it predates secret randomness, and its lots and noise followed from its
published `seed` — has no guarantee either: its ε and every total it enters are "no guarantee",
and it is listed under `runs_without_secret_randomness`. (Ledgers and secret randomness came in
together: a run with a ledger drew its randomness from OS entropy or a user seed.) So is a run
whose mechanism seed was published (`published_seed_runs`): its summary's `mechanism_randomness`
is privacy.randomness.PUBLISHED_SEED, or it was user-seeded and a mechanism_seeds.json lies in its
folder or one above it (results/bc_regime/fair/).

Composition assumes the runs' noise was independent. A run seeded by the user
(`"mechanism_randomness"` says so in its summary) shares its lots and noise with every run given
the same seed: subtracting two such releases cancels the noise, and no finite ε covers those runs
together. Summaries never record the seed, so the study cannot tell which runs shared one: it
lists them under `user_seeded_runs` and warns when two or more private runs of a group were
user-seeded.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..jsontext import to_json
from ..privacy.accountant import ReleaseSlack
from ..privacy.composition import ACCOUNTANT, History, RunRecord, composed_epsilon
from ..privacy.ledger import FORMAT as LEDGER_FORMAT
from ..privacy.ledger import line_hash, read_chain
from ..privacy.randomness import PUBLISHED_SEED, USER_SEED
from ..run_folder import LEDGER, SUMMARY
from .runs import RunFormatError, read_json_object, run_dirs_below

__all__ = ["StudyError", "StudyGroup", "find_run_dirs", "group_runs", "is_run_dir", "read_run", "study_epsilon", "study_report"]

FROM_LEDGER = LEDGER
STUDY_MARKERS = (LEDGER, SUMMARY)  # a run folder, to the study: one that released (a ledger) or finished
RECONSTRUCTED = "reconstructed from summary.json"
INFINITE = "inf"
NO_GUARANTEE = "no guarantee"
USAGE_ERROR = 2
LEDGER_FORMATS = (1, LEDGER_FORMAT)  # 1: before the hash chain (its lines are read, not checked)
# Published mechanism seeds (results/bc_regime/fair/): a user-seeded run in or below the folder
# that holds this file drew its lots and noise from a seed anyone can read.
PUBLISHED_SEEDS = "mechanism_seeds.json"


class StudyError(RunFormatError):
    """Input the study cannot account for: named, never guessed around."""


# ---------------------------------------------------------------------------------------------
# Reading runs


def find_run_dirs(paths: Sequence[Path]) -> list[Path]:
    """The given run directories, or those found below a folder; a run's own subfolders are its own.

    A run directory holds a ledger or a summary.json. Searching stops at one, so a resume
    folder inside a run is not counted as a second run.
    """
    found: dict[Path, Path] = {}
    for root in map(Path, paths):
        if not root.is_dir():
            raise StudyError(f"{root}: no such directory")
        for run in run_dirs_below(root, STUDY_MARKERS):
            found.setdefault(run.resolve(), run)
    if not found:
        raise StudyError(f"no run ({LEDGER} or {SUMMARY}) under {', '.join(map(str, paths))}")
    return sorted(found.values(), key=str)


def is_run_dir(folder: Path) -> bool:
    return any((Path(folder) / marker).is_file() for marker in STUDY_MARKERS)


def read_run(path: Path) -> RunRecord:
    """The run's releases from its ledger, or reconstructed from its summary.json."""
    path = Path(path)
    summary = read_json_object(path / SUMMARY) if (path / SUMMARY).is_file() else None
    if (path / LEDGER).is_file():
        return _from_ledger(path, summary)
    if summary is None:
        raise StudyError(f"{path}: neither {LEDGER} nor {SUMMARY}")
    return from_summary(path, summary)


def from_summary(path: Path, summary: dict[str, Any]) -> RunRecord:
    """A run without a ledger: its charged releases, all at its (σ, q)."""
    where = path / SUMMARY
    sigma = _number(summary, "noise_multiplier", where)
    q = _number(summary, "sample_rate", where)
    counts = {key: summary.get(key) for key in ("steps", "releases_charged") if summary.get(key) is not None}
    for key, value in counts.items():
        if not _is_count(value):
            raise StudyError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    if not counts:
        raise StudyError(f"{where}: 'releases_charged' or 'steps' must be a non-negative integer, got {summary.get('steps')!r}")
    # Every step up to `steps` was released at least once, and a resume charges re-run steps
    # again: releases_charged counts those. Neither may shrink the other.
    releases = max(counts.values())
    # The artifact contract marks non-private runs with noise_multiplier 0; newer ones say so too.
    private = summary.get("private", sigma != 0) is not False and sigma > 0
    published = published_seed(path, summary)
    return RunRecord(
        path=path,
        **_training_set(summary, where),
        private=private,
        delta=_delta(summary.get("delta"), where) if private else None,
        history=(*_length_release(summary, "length_noise_multiplier", where), *(((sigma, q, releases),) if releases else ())),
        uncharged=0,
        source=RECONSTRUCTED,
        optimizer=summary.get("optimizer"),
        user_seeded=summary.get("mechanism_randomness") == USER_SEED,
        secret_randomness=bool(summary.get("mechanism_randomness")) and not published,
        published_seed=published,
        slack=_slack(summary, where),
    )


def published_seed(path: Path, summary: dict[str, Any] | None) -> bool:
    """Whether the run's mechanism seed is public: its summary says so, or it was user-seeded and a
    mechanism_seeds.json lies in its folder or a folder above it."""
    randomness = str((summary or {}).get("mechanism_randomness") or "")
    if randomness == PUBLISHED_SEED:
        return True
    return randomness == USER_SEED and any((folder / PUBLISHED_SEEDS).is_file() for folder in (path.resolve(), *path.resolve().parents))


def _from_ledger(path: Path, summary: dict[str, Any] | None) -> RunRecord:
    file = path / LEDGER
    *lines, _torn = file.read_bytes().split(b"\n")  # a torn last line: its release was never used
    records, error = read_chain(file, lines)
    if error is not None:
        raise StudyError(error)
    if not records:
        raise StudyError(f"{file}:1: the first line must be the ledger header")
    header = records[0]
    if header.get("format") not in LEDGER_FORMATS:
        raise StudyError(f"{file}:1: ledger format {header.get('format')!r}, this reader knows {', '.join(map(str, LEDGER_FORMATS))}")
    history, uncharged = _charged_history(file, records[1:])
    history = [*_length_release(header.get("length_release") or {}, "noise_multiplier", file), *history]
    if summary is not None:
        _check_against_summary(path, lines, records[1:], summary)
    noiseless = any(sigma <= 0 for sigma, _, _ in history)
    private = not noiseless and (summary or {}).get("private", True) is not False
    published = published_seed(path, summary)
    return RunRecord(
        path=path,
        **_training_set(header, file),
        private=private,
        delta=_delta(header.get("delta"), file) if private else None,
        history=tuple(history),
        uncharged=uncharged,
        source=FROM_LEDGER,
        optimizer=(summary or {}).get("optimizer"),
        user_seeded=(summary or {}).get("mechanism_randomness") == USER_SEED,
        secret_randomness=not published,
        published_seed=published,
        slack=_slack(header, file),
    )


def _check_against_summary(path: Path, lines: Sequence[bytes], releases: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    """The ledger must be the one the run's summary.json was written from: a chain read on its own
    cannot see that its last lines were cut (`head -n 3`) or that it was re-chained over fewer."""
    charged = sum(1 for release in releases if release.get("charged") is True)
    last_step = max((release["step"] for release in releases if _is_count(release.get("step"))), default=0)
    recorded = {"ledger_head": (summary.get("ledger_head"), line_hash(lines[-1])),
                "ledger_length": (summary.get("ledger_length"), len(lines)),
                "releases_charged": (summary.get("releases_charged"), charged)}  # fmt: skip
    for key, (expected, found) in recorded.items():
        if expected is not None and expected != found:
            raise StudyError(_disagrees(path, key, expected, found))
    steps = summary.get("steps")
    if _is_count(steps) and last_step < steps:  # a resumed run re-releases steps, so lines may outnumber steps, never fall short
        raise StudyError(_disagrees(path, "steps", steps, f"releases up to step {last_step}"))


def _disagrees(path: Path, key: str, expected: Any, found: Any) -> str:
    return (
        f"{path}: {LEDGER} does not match {SUMMARY} ({key} {expected!r}, the ledger has {found!r}): the ledger was "
        "truncated, edited or replaced, so the study would under-count the run; restore the run's own ledger, "
        f"or move {LEDGER} aside to count the run from its {SUMMARY}"
    )


def _charged_history(file: Path, releases: Sequence[dict[str, Any]]) -> tuple[History, int]:
    history: History = []
    uncharged = 0
    for number, release in enumerate(releases, start=2):
        where = f"{file}:{number}"
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


def _length_release(record: dict[str, Any], key: str, where: Path) -> History:
    """The length histogram's release before step 1 (constant-time lots bucketed by width), as
    history: its σ is `record[key]` (None or absent: the run made none)."""
    return [] if record.get(key) is None else [(_number(record, key, where), 1.0, 1)]


def _training_set(record: dict[str, Any], where: Path) -> dict[str, Any]:
    dataset, size, fingerprint = record.get("dataset"), record.get("dataset_size"), record.get("data_fingerprint")
    if not isinstance(dataset, str) or not dataset:
        raise StudyError(f"{where}: 'dataset' must be a non-empty string, got {dataset!r}")
    if size is not None and not _is_count(size):
        raise StudyError(f"{where}: 'dataset_size' must be a non-negative integer, got {size!r}")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise StudyError(f"{where}: 'data_fingerprint' must be a string, got {fingerprint!r}")
    return {"dataset": dataset, "dataset_size": size, "fingerprint": fingerprint or None}


def _number(record: dict[str, Any], key: str, where: Path | str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise StudyError(f"{where}: {key!r} must be a finite number, got {value!r}")
    return float(value)


def _slack(record: dict[str, Any], where: Path) -> ReleaseSlack:
    """The per-release slack a ledger header or summary records (runs before it: none)."""
    slack = record.get("release_slack") or {}
    return ReleaseSlack(**{key: _number(slack, key, where) for key in ("epsilon", "bad_event") if key in slack})


def _delta(value: Any, where: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise StudyError(f"{where}: a private run needs 'delta' in (0, 1), got {value!r}")
    return float(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---------------------------------------------------------------------------------------------
# Reporting


def study_epsilon(runs: Sequence[RunRecord], delta: float | None) -> float | str:
    """What releasing every run costs, as the report says it: ε, "inf" or "no guarantee"."""
    if any(not run.private for run in runs):
        return INFINITE
    if any(not run.secret_randomness for run in runs):
        return NO_GUARANTEE
    if not any(run.history for run in runs):
        return 0.0
    epsilon = composed_epsilon(runs, delta)
    return epsilon if math.isfinite(epsilon) else INFINITE  # the bad events fit no split of δ: StudyGroup.warnings says so


@dataclass
class StudyGroup:
    """Every run on one dataset: whichever subset each used, it could have touched any example."""

    dataset: str
    runs: list[RunRecord] = field(default_factory=list)

    @property
    def private_runs(self) -> list[RunRecord]:
        return [run for run in self.runs if run.private]

    @property
    def non_private_runs(self) -> list[RunRecord]:
        return [run for run in self.runs if not run.private]

    @property
    def runs_without_secret_randomness(self) -> list[RunRecord]:
        return [run for run in self.private_runs if not run.secret_randomness]

    @property
    def published_seed_runs(self) -> list[RunRecord]:
        return [run for run in self.private_runs if run.published_seed]

    @property
    def user_seeded_runs(self) -> list[RunRecord]:
        return [run for run in self.private_runs if run.user_seeded]

    def delta(self, override: float | None) -> float | None:
        """--delta, else the δ every private run recorded (they must agree)."""
        if override is not None:
            return override
        deltas = sorted({run.delta for run in self.private_runs})
        if len(deltas) > 1:
            raise StudyError(f"the runs on {self.label()} record different δ ({', '.join(map(repr, deltas))}); compose them at one δ with --delta")
        return deltas[0] if deltas else None

    def sizes(self) -> list[int]:
        return sorted({run.dataset_size for run in self.runs if run.dataset_size is not None})

    def fingerprints(self) -> list[str]:
        return sorted({run.fingerprint for run in self.runs if run.fingerprint is not None})

    def label(self) -> str:
        sizes = self.sizes()
        if not sizes:
            return f"{self.dataset} (N not recorded)"
        return f"{self.dataset} (N={', '.join(map(str, sizes))}{'; every subset counted together' if len(sizes) > 1 else ''})"

    def report(self, delta_override: float | None = None) -> dict[str, Any]:
        delta = self.delta(delta_override)
        total = study_epsilon(self.runs, delta)
        return {
            "dataset": self.dataset,
            "dataset_sizes": self.sizes(),
            "data_fingerprints": self.fingerprints(),
            "delta": delta,
            "accountant": ACCOUNTANT,
            "runs": [run.describe() for run in self.runs],
            "epsilon_per_run": {str(run.path): study_epsilon([run], delta) for run in self.runs},
            "epsilon_total": total,
            "epsilon_total_private_runs": study_epsilon(self.private_runs, delta),
            "non_private_runs": [str(run.path) for run in self.non_private_runs],
            "runs_without_secret_randomness": [str(run.path) for run in self.runs_without_secret_randomness],
            "published_seed_runs": [str(run.path) for run in self.published_seed_runs],
            "user_seeded_runs": [str(run.path) for run in self.user_seeded_runs],
            "warnings": self.warnings(total, delta),
        }

    def warnings(self, total: float | str | None = None, delta: float | None = None) -> list[str]:
        """What must be said loudly; with the group's total at δ, also why a guaranteed total is inf."""
        notes = []
        if self.non_private_runs:
            notes.append(
                f"{len(self.non_private_runs)} non-private run(s) trained on {self.label()} without noise: "
                "a study that includes them gives this data no differential-privacy guarantee (ε = inf); "
                "that is fine only if this data is public"
            )
        if self.published_seed_runs:
            notes.append(
                f"{len(self.published_seed_runs)} private run(s) on {self.label()} drew their lots and noise from a published "
                f"mechanism seed ({PUBLISHED_SEEDS}, or mechanism_randomness says so): anyone can regenerate and subtract the "
                "noise, so no ε covers them, alone or in the study (no guarantee)"
            )
        if len(self.runs_without_secret_randomness) > len(self.published_seed_runs):
            notes.append(
                f"{len(self.runs_without_secret_randomness) - len(self.published_seed_runs)} private run(s) on {self.label()} "
                "record no secret mechanism randomness (they predate it: lots and noise followed from the published seed, "
                "so anyone can regenerate and subtract the noise): no ε covers them, alone or in the study (no guarantee)"
            )
        if total == INFINITE and all(run.guaranteed for run in self.runs):
            notes.append(
                f"the {len(self.runs)} run(s) on {self.label()} compose to no finite ε at δ = {delta:g}: their bad events "
                "(truncated constant-time lots, the grid noise's tail) cost more than δ at the composed ε, and each run's "
                "own ε at δ/k as well; compose them at a larger --delta, or fewer runs together"
            )
        secret_seeds = [run for run in self.user_seeded_runs if not run.published_seed]  # published ones: said above
        if len(secret_seeds) > 1:
            notes.append(
                f"{len(secret_seeds)} private runs on {self.label()} drew their lots and noise from a "
                "user-supplied mechanism_seed (DPMUON_MECHANISM_SEED or privacy.mechanism_seed_file): epsilon_total "
                "assumes every one of those seeds was distinct "
                "and secret. Runs that shared a seed (a paired comparison) reused one noise draw, and no finite ε "
                "covers them together"
            )
        return notes


def group_runs(runs: Sequence[RunRecord]) -> list[StudyGroup]:
    """One group per dataset: runs on any subsets of it, from any path, are composed together."""
    groups: dict[str, StudyGroup] = {}
    for run in runs:
        groups.setdefault(run.dataset, StudyGroup(run.dataset)).runs.append(run)
    for group in groups.values():
        group.runs.sort(key=lambda run: str(run.path))
    return [groups[name] for name in sorted(groups)]


def study_report(runs: Sequence[RunRecord], delta: float | None = None) -> dict[str, Any]:
    """One group: its report at top level. Several: {"groups": [...]} — they are never added."""
    groups = group_runs(runs)
    if len(groups) == 1:
        return groups[0].report(delta)
    return {
        "groups": [group.report(delta) for group in groups],
        "warnings": [
            f"the runs touched {len(groups)} different datasets; each group is composed on its own (a person present in several datasets pays each group's ε)"
        ],
    }


def all_warnings(report: dict[str, Any]) -> list[str]:
    """The report's warnings and its groups', in order: what must be said loudly."""
    groups = report.get("groups", [])
    return list(report["warnings"]) + [warning for group in groups for warning in group["warnings"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpmuon.eval.study",
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
    except RunFormatError as error:  # StudyError, or a summary.json that is not JSON
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    for warning in all_warnings(report):
        print(f"WARNING: {warning}", file=sys.stderr)
    print(to_json(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
