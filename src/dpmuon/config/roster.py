"""The optimizer roster: `conf/optimizer/*.yaml` is the one list of optimizers.

The Makefile, the sweeps, table and curve ordering and colours, the reproduction and bench
scripts and the tests read it from here; adding an optimizer is its settings class (registered
under the YAML's name, `@settings("optimizer", name=...)`) and one YAML listing it in its defaults.
Reads the YAML files and the settings classes' stored options itself (no torch), because Hydra's
compose needs the global state a running driver holds when it imports the readers of this list;
tests/config/test_configs.py checks that it reads each YAML as Hydra composes it.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from ..errors import UserError
from ..paths import CONFIG_DIR
from ..settings import check_settings_stored

__all__ = ["RosterEntry", "optimizer_names", "optimizer_roster"]

OPTIMIZER_DIR = CONFIG_DIR / "optimizer"


@dataclass(frozen=True)
class RosterEntry:
    name: str
    target: str  # the settings class (`_target_`)
    private: bool
    rank: int
    color: str


def group_yaml(group: str, name: str) -> DictConfig:
    """conf/<group>/<name>.yaml merged over what its `defaults` list names (unresolved): the
    group's other files, and a settings class's options (`/settings/<group>/<Class>@_here_`)."""
    own = OmegaConf.load(CONFIG_DIR / group / f"{name}.yaml")
    parents = [entry for entry in own.pop("defaults", []) if entry != "_self_"]
    return OmegaConf.merge(*(stored_settings(entry) if entry.startswith("/") else group_yaml(group, entry) for entry in parents), own)


def stored_settings(entry: str) -> DictConfig:
    """The options a settings class stored in Hydra's ConfigStore (dpmuon.settings.settings)."""
    path = entry.split("@")[0].lstrip("/")
    return OmegaConf.create(ConfigStore.instance().load(f"{path}.yaml").node)


@functools.cache
def optimizer_roster() -> tuple[RosterEntry, ...]:
    """Every optimizer of conf/optimizer/, in display order (rank, then name)."""
    check_settings_stored(CONFIG_DIR)
    entries = []
    for path in OPTIMIZER_DIR.glob("*.yaml"):
        cfg = group_yaml("optimizer", path.stem)
        if cfg.get("name") != path.stem:
            raise UserError(f"conf/optimizer/{path.name}: name: {cfg.get('name')} (inherited), not the file's name; set name: {path.stem} in it")
        entries.append(RosterEntry(path.stem, str(cfg._target_), bool(cfg.private), int(cfg.display.rank), str(cfg.display.color)))
    return tuple(sorted(entries, key=lambda e: (e.rank, e.name)))


def optimizer_names(private: bool | None = None) -> tuple[str, ...]:
    """Names in display order; `private=True`/`False` keeps only the DP / non-private ones."""
    return tuple(e.name for e in optimizer_roster() if private is None or e.private == private)


def _sweep_list(which: str = "") -> str:
    """`${dpmuon.optimizers:private}` in a sweep: the roster's names, comma-separated, in order."""
    choices = {"": None, "private": True, "non_private": False}
    if which not in choices:
        raise ValueError(f"dpmuon.optimizers takes one of {', '.join(map(repr, choices))}, got {which!r}")
    return ",".join(optimizer_names(choices[which]))


OmegaConf.register_new_resolver("dpmuon.optimizers", _sweep_list, replace=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the optimizer roster, comma-separated (for make and Hydra sweeps).")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--private", action="store_true", help="only the differentially private optimizers")
    which.add_argument("--non-private", action="store_true", help="only the non-private references")
    args = parser.parse_args(argv)
    private = True if args.private else False if args.non_private else None
    try:
        print(",".join(optimizer_names(private)))
    except UserError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
