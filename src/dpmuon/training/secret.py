"""The user's mechanism seed: from the environment or an owner-only file, never the command line.

A user seed regenerates every lot and every noise draw of a run, so it is as secret as the noise.
Whatever is on the command line reaches `ps`, shell history, Hydra's `.hydra/*.yaml` and
`multirun.yaml`, `override_dirname` (and so run directory names), W&B's recorded argv and the
summary's command; so the driver refuses a seed there before Hydra writes anything, and takes
it from `DPMUON_MECHANISM_SEED` (a process's environment is readable only by its owner) or from
the file named by `privacy.mechanism_seed_file` (a path: public; the file must be owner-only):
privacy/seed.py reads them.

Whether a run used a user seed (never its value) is recorded in `<run>/mechanism_seed_used.json`
at setup: a resume that finds no mechanism state must not silently draw OS entropy instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

from .. import run_folder
from ..errors import UserError
from ..privacy.seed import HOW_TO_SEED, MECHANISM_SEED_ENV, SEED_FILE_KEY, STRONG_SEED, WEAK_SEED_WARNING, user_seed
from .run_files import atomic_write_json

__all__ = ["MECHANISM_SEED_ENV", "SEED_FILE_KEY", "STRONG_SEED", "WEAK_SEED_WARNING"]  # the seed's policy, from privacy/seed.py

SEED_USE_FILE = run_folder.SEED_USE
_SEED_KEY = re.compile(r"mechanism_seed(?!_file)")  # the seed's key, not the file key
_SEED_DICT_KEY = re.compile(r"mechanism_seed(?!_file)['\"]?\s*:")  # `privacy={mechanism_seed: …}`


def seed_on_command_line(args: list[str]) -> bool:
    """Whether any argument gives a mechanism seed: as its key (`privacy.mechanism_seed=…`, `+…`,
    `++…`, `~…`, sweeps, `hydra.sweeper.params.privacy.mechanism_seed=…`) or as a key inside its
    value (`privacy={mechanism_seed: …}`). A value that merely names it (a path) is no seed."""
    parser = OverridesParser.create()
    for arg in args:
        if not _SEED_KEY.search(arg):
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # not an override Hydra can read: it mentions the seed, so refuse it
            return True
        value = arg.split("=", 1)[1] if "=" in arg else ""
        if _SEED_KEY.search(override.key_or_group) or _SEED_DICT_KEY.search(value):
            return True
    return False


def refusal() -> str:
    """The one-line error for a seed on the command line (never repeating the argument)."""
    return f"privacy.mechanism_seed on the command line would be written into Hydra's records and shown by `ps`; {HOW_TO_SEED}"


def user_mechanism_secret(cfg: Mapping) -> int | None:
    """The user's mechanism seed (None: none given, the run draws OS entropy). Its value is never shown."""
    privacy = cfg.get("privacy") or {}
    if privacy.get("mechanism_seed") is not None:  # e.g. from an experiment YAML: Hydra has recorded it already
        raise UserError(f"privacy.mechanism_seed is not a config key (its value would be recorded in the run's files); {HOW_TO_SEED}")
    return user_seed(privacy.get("mechanism_seed_file"))


def record_seed_use(run_dir: Path, used: bool) -> None:
    """Record whether this run draws from a user seed (a fact, no value) for a later resume."""
    atomic_write_json(Path(run_dir) / SEED_USE_FILE, {"user_seed": used})


def recorded_seed_use(run_dir: Path) -> bool | None:
    """Whether the run was started with a user seed (None: a run directory from before this record)."""
    path = Path(run_dir) / SEED_USE_FILE
    return bool(json.loads(path.read_text(encoding="utf-8"))["user_seed"]) if path.exists() else None
