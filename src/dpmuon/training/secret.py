"""The user's mechanism seed: from the environment or an owner-only file, never the command line.

A user seed regenerates every lot and every noise draw of a run, so it is as secret as the noise.
Whatever is on the command line reaches `ps`, shell history, Hydra's `.hydra/*.yaml` and
`multirun.yaml`, `override_dirname` (and so run directory names), W&B's recorded argv and the
summary's command; so the driver refuses a seed there before Hydra writes anything, and takes
it from `DPMUON_MECHANISM_SEED` (a process's environment is readable only by its owner) or from
the file named by `privacy.mechanism_seed_file` (a path: public; the file must be owner-only).

Whether a run used a user seed (never its value) is recorded in `<run>/mechanism_seed_used.json`
at setup: a resume that finds no mechanism state must not silently draw OS entropy instead.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

from ..errors import UserError
from .run_files import atomic_write_json

MECHANISM_SEED_ENV = "DPMUON_MECHANISM_SEED"
SEED_FILE_KEY = "privacy.mechanism_seed_file"
SEED_USE_FILE = "mechanism_seed_used.json"
MAKE_ONE = "python -c 'import secrets; print(secrets.randbits(128))'"
# A seed is searched for like a password: below 2^64 a search over seeds that reproduces the
# released lots or noise is within reach.
STRONG_SEED = 2**64
WEAK_SEED_WARNING = f"warning: a mechanism seed below 2^64 can be found by search; make one with `{MAKE_ONE}`"
HOW_TO_SEED = f"give it as {MECHANISM_SEED_ENV}=<int> in the environment or {SEED_FILE_KEY}=<owner-only file> (make one with `{MAKE_ONE}`)"
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
    text, source = os.environ.get(MECHANISM_SEED_ENV), MECHANISM_SEED_ENV
    path = privacy.get("mechanism_seed_file")
    if text is not None and path is not None:
        raise UserError(f"both {MECHANISM_SEED_ENV} and {SEED_FILE_KEY}={path} give a mechanism seed; keep one")
    if path is not None:
        text, source = read_seed_file(Path(path).expanduser()), f"{SEED_FILE_KEY}={path}"
    if text is None:
        return None
    try:
        secret = int(text.strip())
    except ValueError:
        raise UserError(f"{source}: the mechanism seed is not an integer (value not shown); valid: an integer >= 0") from None
    if secret < 0:
        raise UserError(f"{source}: the mechanism seed is negative (value not shown); valid: an integer >= 0")
    return secret


def read_seed_file(path: Path) -> str:
    """The file's text, if only its owner, this user, can read it (it holds the secret)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise UserError(f"{SEED_FILE_KEY}={path}: cannot open ({err.strerror}); valid: an existing file holding one integer") from None
    with os.fdopen(fd, encoding="utf-8") as f:
        info = os.fstat(f.fileno())  # of the file opened, not of whatever the path names later
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{SEED_FILE_KEY}={path}: not a regular file; valid: a file holding one integer")
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise UserError(f"{SEED_FILE_KEY}={path}: others may read or change it; it must be yours and owner-only: chmod 600 {path}")
        try:
            return f.read()
        except UnicodeDecodeError:  # (its message would quote the bytes)
            raise UserError(f"{SEED_FILE_KEY}={path}: not text (content not shown); valid: a file holding one integer") from None


def record_seed_use(run_dir: Path, used: bool) -> None:
    """Record whether this run draws from a user seed (a fact, no value) for a later resume."""
    atomic_write_json(Path(run_dir) / SEED_USE_FILE, {"user_seed": used})


def recorded_seed_use(run_dir: Path) -> bool | None:
    """Whether the run was started with a user seed (None: a run directory from before this record)."""
    path = Path(run_dir) / SEED_USE_FILE
    return bool(json.loads(path.read_text(encoding="utf-8"))["user_seed"]) if path.exists() else None
