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

import contextlib
import json
import os
import re
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, ListConfig, OmegaConf

from .. import run_folder
from ..errors import UserError
from ..privacy.seed import HOW_TO_SEED, MECHANISM_SEED_ENV, SEED_FILE_KEY, STRONG_SEED, WEAK_SEED_WARNING, user_seed
from .run_files import atomic_write_json

__all__ = ["MECHANISM_SEED_ENV", "SEED_FILE_KEY", "STRONG_SEED", "WEAK_SEED_WARNING"]  # the seed's policy, from privacy/seed.py

SEED_USE_FILE = run_folder.SEED_USE
# The seed's key or its variable, in any case and any form (`privacy.mechanism_seed`,
# `hydra.job.env_set.DPMUON_MECHANISM_SEED`); the file key names only a path.
_SEED_NAME = re.compile(r"mechanism_seed(?!_file)", re.IGNORECASE)
_SEED_ASSIGNED = re.compile(r"mechanism_seed(?!_file)['\"]?\s*[:=]", re.IGNORECASE)  # `privacy={mechanism_seed: …}`
# Resolvers that read the environment, and the name they are given (an interpolation in it
# builds the name out of parts the name check cannot see).
_ENV_READ = re.compile(r"\$\{\s*(?:oc\.env|env|oc\.decode)\s*:", re.IGNORECASE)
_COMPUTED_ENV_NAME = re.compile(r"\$\{\s*(?:oc\.env|env)\s*:[^}]*?\$\{", re.IGNORECASE)
# A seed whose digits may occur in a config by chance (a search finds one this small anyway):
# only the environment's route (the canary below) is checked for it.
_SCANNED_SEED = 2**32


def seed_on_command_line(args: list[str]) -> str | None:
    """The argument (its key, or its position) that gives or reads the mechanism seed, else None:
    one naming `mechanism_seed` as its key (`privacy.mechanism_seed=…`, `+…`, `++…`, `~…`, sweeps,
    `hydra.sweeper.params.…`) or as a key in its value (`privacy={mechanism_seed: …}`), any case;
    one naming $DPMUON_MECHANISM_SEED anywhere (`hydra.job.env_set.…`, `${oc.env:…}`); one reading
    the environment under a name built from interpolations. A path that merely names the seed
    (`privacy.mechanism_seed_file=…/mechanism_seed`) is no seed."""
    parser = OverridesParser.create()
    for position, arg in enumerate(args, start=1):
        if not (_SEED_NAME.search(arg) or _ENV_READ.search(arg)):
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # not an override Hydra can read: it mentions the seed or the environment, so refuse it
            return f"argument {position}"
        key = override.key_or_group
        value = arg.split("=", 1)[1] if "=" in arg else ""
        if MECHANISM_SEED_ENV.lower() in arg.lower() or _SEED_NAME.search(key) or _SEED_ASSIGNED.search(value) or _COMPUTED_ENV_NAME.search(value):
            return key
    return None


def refusal(where: str) -> str:
    """The one-line error for a seed on the command line (never repeating the argument's value)."""
    return (
        f"{where}: the command line names or reads the mechanism seed (privacy.mechanism_seed, {MECHANISM_SEED_ENV} via "
        f"hydra.job.env_set or ${{oc.env:…}}), and it is written into Hydra's records and shown by `ps`; {HOW_TO_SEED}"
    )


def user_mechanism_secret(cfg: Mapping) -> int | None:
    """The user's mechanism seed (None: none given, the run draws OS entropy), once the config is
    known to hold it nowhere (refuse_seed_in_config). Its value is never shown."""
    privacy = cfg.get("privacy") or {}
    secret = user_seed(privacy.get("mechanism_seed_file"))
    if privacy.get("published_seed") and secret is None:
        raise UserError(
            f"privacy.published_seed=true: this run draws OS entropy, so it has no seed to publish; valid: false, or a seed "
            f"given in {MECHANISM_SEED_ENV} or {SEED_FILE_KEY}"
        )
    refuse_seed_in_config(cfg, secret)
    return secret


def refuse_seed_in_config(cfg: Mapping, secret: int | None) -> None:
    """Refuse a config (Hydra's section included, where given) that would carry the seed into what
    the run writes — `.hydra/*.yaml`, the run folder's name, W&B's config and group, checkpoint.pt:
    a key naming it (`privacy.mechanism_seed`, `hydra.job.env_set.DPMUON_MECHANISM_SEED`), a value
    read from $DPMUON_MECHANISM_SEED by any interpolation (found by resolving with a canary seed in
    its place, so it is found whatever resolver reads it and whatever the seed), or the seed's own
    value typed into it (decimal, as an integer or in a string, or hex)."""
    node = cfg if isinstance(cfg, (DictConfig, ListConfig)) else OmegaConf.create(dict(cfg))
    canary = secrets.randbits(127) | 1 << 127  # 39 digits: in no config by chance
    literal = secret if secret is not None and secret >= _SCANNED_SEED else None
    with _environment_seed(str(canary)):
        for key, value in _resolved_leaves(node):
            if _SEED_NAME.search(key.rsplit(".", 1)[-1]) and value is not None:  # (older runs' configs say `mechanism_seed: null`)
                raise UserError(f"{key}: the config names the mechanism seed, and its value would be recorded in the run's files; {HOW_TO_SEED}")
            if _holds(value, canary):
                raise UserError(
                    f"{key}: its value is read from {MECHANISM_SEED_ENV} (an interpolation such as ${{oc.env:…}}), so the seed "
                    "would be written into .hydra/, W&B, checkpoint.pt and the run folder's name; valid: a value that does not come from the seed"
                )
            if literal is not None and _holds(value, literal):
                raise UserError(
                    f"{key}: holds the mechanism seed's value (not shown), which would be written into .hydra/, W&B, checkpoint.pt "
                    f"and the run folder's name; the seed belongs only in {MECHANISM_SEED_ENV} or {SEED_FILE_KEY}"
                )


def _holds(value: object, seed: int) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return value == seed
    return isinstance(value, str) and (str(seed) in value or f"{seed:x}" in value.lower())


def _resolved_leaves(node: DictConfig | ListConfig, path: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, resolved value) of every key; a container's own key with the container as its value."""
    # Hydra's section last: a refusal names the user's key, not Hydra's setting that interpolates it.
    keys = sorted(node.keys(), key=lambda key: key == "hydra") if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        full = f"{path}.{key}" if path else str(key)
        try:
            value = node[key]
        except Exception:  # a missing value, or one Hydra fills in only at run time (hydra.job.num): nothing to hold a seed yet
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            yield full, value
            yield from _resolved_leaves(value, full)
        else:
            yield full, value


@contextlib.contextmanager
def _environment_seed(value: str) -> Iterator[None]:
    """$DPMUON_MECHANISM_SEED set to `value` for the duration (restored after, even if unset before)."""
    before = os.environ.get(MECHANISM_SEED_ENV)
    os.environ[MECHANISM_SEED_ENV] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[MECHANISM_SEED_ENV]
        else:
            os.environ[MECHANISM_SEED_ENV] = before


def record_seed_use(run_dir: Path, used: bool) -> None:
    """Record whether this run draws from a user seed (a fact, no value) for a later resume."""
    atomic_write_json(Path(run_dir) / SEED_USE_FILE, {"user_seed": used})


def recorded_seed_use(run_dir: Path) -> bool | None:
    """Whether the run was started with a user seed (None: a run directory from before this record)."""
    path = Path(run_dir) / SEED_USE_FILE
    return bool(json.loads(path.read_text(encoding="utf-8"))["user_seed"]) if path.exists() else None
