"""Grouping runs into table rows / curve lines: one group per (optimizer, model, target ε).

Runs are only ever averaged over seeds of the same setting; runs of different models or
privacy targets stay in separate groups. Within a group, runs that differ in any other setting
(SETTING_KEYS of their summaries, their config's optimizer section) or that repeat a seed are
refused in one line naming the key and the runs, unless the caller pools them (`--pool`): then
the group records what differs (`RunGroup.pooled`) and the reports say so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from dpmuon.config.roster import optimizer_names
from dpmuon.eval.runs import Run, RunFormatError
from dpmuon.run_folder import stored_configs

# Row order of tables and curves: the roster's (conf/optimizer/*.yaml, `display.rank`).
_OPTIMIZER_ORDER = optimizer_names()
# What a run's summary records of its setting: runs averaged as one must agree on all of them.
# Not compared: the seed (what is averaged over), what the seed decides (initial weights under a
# random init), results, provenance, and how the randomness was drawn (a resume reseeds it).
SETTING_KEYS = (
    "private", "target_epsilon", "delta", "steps", "planned_steps", "expected_lot_size", "sample_rate",
    "noise_multiplier", "dataset_size", "data_fingerprint", "validation_split", "test_sources", "learning_rates",
    "accountant", "clip_mode", "clip_norm", "sampling", "engine", "max_lot_size", "world_size", "tied_lm_head",
)  # fmt: skip
POOL_HINT = "pass --pool to average them anyway, or point the report at runs of one setting"


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
    pooled: tuple[str, ...] = ()  # the settings its runs differ in ("seed" for a repeated seed): only with pool=True


def runs_by_dataset(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs split by dataset, datasets in sorted order."""
    datasets: dict[str, list[Run]] = {}
    for run in runs:
        datasets.setdefault(run.dataset, []).append(run)
    return dict(sorted(datasets.items()))


def group_runs(runs: Sequence[Run], pool: bool = False) -> list[RunGroup]:
    """One dataset's runs grouped and ordered: DP methods, non-private references, the rest.

    A group whose runs differ in a setting or repeat a seed is refused (RunFormatError), or with
    pool=True kept, naming what differs."""
    members: dict[GroupKey, list[Run]] = {}
    for run in runs:
        key = GroupKey(run.optimizer, run.model, run.target_epsilon, run.is_private)
        members.setdefault(key, []).append(run)
    models = {key.model for key in members}
    targets = {key.target_epsilon for key in members if key.target_epsilon is not None}
    groups = []
    for key in sorted(members, key=GroupKey.sort_key):
        label = _label(key, show_model=len(models) > 1, show_target=len(targets) > 1)
        differences = unlike_settings(members[key])
        if differences and not pool:
            setting, (first, second) = differences[0]
            raise RunFormatError(f"the runs averaged as {label} {_difference(setting, first, second)}: {POOL_HINT}")
        groups.append(RunGroup(key, tuple(members[key]), label, tuple(setting for setting, _ in differences)))
    return groups


def unlike_settings(runs: Sequence[Run]) -> list[tuple[str, tuple[Run, Run]]]:
    """Each setting two of `runs` differ in ("seed": two share one), with a pair of runs that shows it."""
    found: dict[str, tuple[Run, Run]] = {}
    for setting, value in (*((key, lambda run, key=key: _summary_value(run, key)) for key in SETTING_KEYS),
                           ("optimizer settings", _optimizer_config)):  # fmt: skip
        seen: dict[str, Run] = {}
        for run in runs:
            recorded = value(run)
            if recorded is not _ABSENT:
                seen.setdefault(repr(recorded), run)
        if len(seen) > 1:
            found[setting] = tuple(seen.values())[:2]
    by_seed: dict[int, Run] = {}
    for run in runs:
        if run.seed in by_seed and "seed" not in found:
            found["seed"] = (by_seed[run.seed], run)
        by_seed.setdefault(run.seed, run)
    return list(found.items())


_ABSENT = object()  # a key older than the run's record, or a step count a stopped run cut short


def _summary_value(run: Run, key: str) -> Any:
    if key not in run.summary or (key == "steps" and run.summary.get("stop_reason")):  # stopped early: planned_steps still agrees
        return _ABSENT
    return run.summary[key]


def _optimizer_config(run: Run) -> Any:
    """The run's whole optimizer section (momentum, betas, Newton–Schulz steps, …), where its config is stored."""
    for config in stored_configs(run.path):
        if config.is_file():
            return OmegaConf.to_container(OmegaConf.load(config).get("optimizer") or {}, resolve=False)
    return _ABSENT


def _difference(setting: str, first: Run, second: Run) -> str:
    if setting == "seed":
        return f"repeat seed {first.seed} ({first.path}, {second.path}), which would count one seed twice as n=2"
    if setting == "optimizer settings":
        return f"differ in their config's optimizer section ({first.path}, {second.path})"
    return f"differ in {setting!r}: {first.summary[setting]!r} ({first.path}) vs {second.summary[setting]!r} ({second.path})"


def format_epsilon(value: float) -> str:
    return f"{value:g}"


def _label(key: GroupKey, show_model: bool, show_target: bool) -> str:
    """The optimizer, disambiguated by model / ε only where the dataset mixes several."""
    details = [key.model] if show_model else []
    if show_target and key.target_epsilon is not None:
        details.append(f"ε={format_epsilon(key.target_epsilon)}")
    return f"{key.optimizer} ({', '.join(details)})" if details else key.optimizer
