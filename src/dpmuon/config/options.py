"""`python -m dpmuon.train --options`: every option with its type, default and help.

Types, ranges and help come from the schema: the settings classes of the groups (GROUP_CLASSES,
and the classes the other groups' `_target_` names);
defaults from composing conf/ itself, per option of a config group where they differ between
its options.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ..settings import check_settings_stored
from .schema import GROUP_CLASSES, Option, repo_options, shown_value

GROUPS = ("dataset", "model", "optimizer", "privacy", "recipe", "logger")  # conf/<group>/*.yaml
SECTIONS = ("", "data", "dataset", "model", "optimizer", "recipe", "privacy", "trainer", "eval", "logging", "logger")
MISSING = object()


def describe_options(config_dir: str) -> str:
    check_settings_stored(config_dir)
    defaults = collect_defaults(config_dir)
    choices = {group: group_options(config_dir, group) for group in (*GROUPS, "experiment")}
    lines = ["dpmuon options: python -m dpmuon.train [group=option ...] [key=value ...]", ""]
    for section in SECTIONS:
        lines.append(section_header(section, choices, defaults["__choices__"]))
        for option in (o for o in repo_options().values() if o.group == section):
            lines.append(option_line(option, defaults.get(option.key, {})))
        lines.append("")
    lines.append(f"experiment=  (conf/experiment/, # @package _global_ deltas): {', '.join(choices['experiment'])}")
    return "\n".join(lines)


def group_options(config_dir: str, group: str) -> list[str]:
    return sorted(p.stem for p in (Path(config_dir) / group).glob("*.yaml"))


def collect_defaults(config_dir: str) -> dict:
    """key → {label: composed value}: label "" for the default config, else each group option."""
    values: dict = {}
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        base = compose(config_name="config")
        # From the defaults list, not a `name` key: conf/privacy/*.yaml have none.
        chosen = compose(config_name="config", return_hydra_config=True).hydra.runtime.choices
        values["__choices__"] = {group: chosen.get(group) for group in GROUPS}
        _record(values, "", base)
        for group in GROUPS:
            for name in group_options(config_dir, group):
                _record(values, name, compose(config_name="config", overrides=[f"{group}={name}"]), group)
    return values


def _record(values: dict, label: str, cfg, group: str | None = None) -> None:
    for option in repo_options().values():
        if group is not None and option.group != group:
            continue
        value = OmegaConf.select(cfg, option.key, default=MISSING, throw_on_resolution_failure=False)
        if value is not MISSING:
            values.setdefault(option.key, {})[label] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def section_header(section: str, choices: dict, chosen: dict) -> str:
    declared = f"; declared by {GROUP_CLASSES[section].__module__}.{GROUP_CLASSES[section].__qualname__}" if section in GROUP_CLASSES else ""
    if section in GROUPS:
        return f"[{section}]  {section}=  {' | '.join(choices[section])}  (default {chosen[section]}; conf/{section}/{declared})"
    return f"[{section or 'top level'}]  (conf/config.yaml{declared})"


def option_line(option: Option, values: dict) -> str:
    """`key  valid  default  help`, then each group option's value where they differ (or the
    default config lacks the key)."""
    default = shown_value(values[""]) if "" in values else "-"
    line = f"  {option.key:<38} {option.valid():<34} {default:<14} {option.help}"
    by_option = {label: value for label, value in values.items() if label}
    differs = len({shown_value(v) for v in by_option.values()}) > 1 or "" not in values
    names_itself = all(str(v) == label for label, v in by_option.items())  # e.g. dataset.name
    if by_option and differs and not names_itself:
        line += "\n" + " " * 6 + "per option: " + ", ".join(f"{label} {shown_value(v)}" for label, v in by_option.items())
    return line
