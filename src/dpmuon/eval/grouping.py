"""Grouping runs into table rows / curve lines: one group per (optimizer, model, target ε).

Runs are only ever averaged over seeds of the same setting; runs of different models or
privacy targets stay in separate groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dpmuon.config.roster import optimizer_names
from dpmuon.eval.runs import Run

# Row order of tables and curves: the roster's (conf/optimizer/*.yaml, `display.rank`).
_OPTIMIZER_ORDER = optimizer_names()


@dataclass(frozen=True)
class GroupKey:
    optimizer: str
    model: str
    target_epsilon: float | None  # None for non-private runs (or a private run that recorded none)
    private: bool

    def sort_key(self) -> tuple:
        known = self.optimizer in _OPTIMIZER_ORDER
        rank = _OPTIMIZER_ORDER.index(self.optimizer) if known else len(_OPTIMIZER_ORDER)
        no_target = self.target_epsilon is None
        return (rank, self.optimizer, self.model, not self.private, no_target, self.target_epsilon or 0.0)


@dataclass(frozen=True)
class RunGroup:
    key: GroupKey
    runs: tuple[Run, ...]
    label: str


def runs_by_dataset(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs split by dataset, datasets in sorted order."""
    datasets: dict[str, list[Run]] = {}
    for run in runs:
        datasets.setdefault(run.dataset, []).append(run)
    return dict(sorted(datasets.items()))


def group_runs(runs: Sequence[Run]) -> list[RunGroup]:
    """One dataset's runs grouped and ordered: DP methods, non-private references, the rest."""
    members: dict[GroupKey, list[Run]] = {}
    for run in runs:
        key = GroupKey(run.optimizer, run.model, run.target_epsilon, run.is_private)
        members.setdefault(key, []).append(run)
    models = {key.model for key in members}
    targets = {key.target_epsilon for key in members if key.target_epsilon is not None}
    return [
        RunGroup(key, tuple(members[key]), _label(key, show_model=len(models) > 1, show_target=len(targets) > 1))
        for key in sorted(members, key=GroupKey.sort_key)
    ]


def format_epsilon(value: float) -> str:
    return f"{value:g}"


def _label(key: GroupKey, show_model: bool, show_target: bool) -> str:
    """The optimizer, disambiguated by model / ε only where the dataset mixes several."""
    details = [key.model] if show_model else []
    if show_target and key.target_epsilon is not None:
        details.append(f"ε={format_epsilon(key.target_epsilon)}")
    return f"{key.optimizer} ({', '.join(details)})" if details else key.optimizer
