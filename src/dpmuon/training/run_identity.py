"""A run's identity and its folder: which configuration a run directory belongs to.

A run directory holds one run. Its stored configuration (`.hydra/config.yaml`, and the copy in
every checkpoint) is the run's identity: a resume continues exactly that run, and a new run
never takes over a folder that holds another run's files (a fresh run there would load the
old checkpoint, extend the old ledger and rewrite the old summary under a new name).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .. import run_folder
from ..errors import UserError
from ..run_folder import RUN_STATE, SUMMARY
from .run_lock import run_dir_locked

# What a resume may change: settings of the process, not of the run (docs/privacy.md, "Resume and crash safety").
RESUME_ADJUSTABLE = ("trainer.num_threads", "logging.progress", "hydra.verbose")
# Not part of the identity: where a resume was started from, and what a resume may change.
NOT_IDENTITY = {"resume", *RESUME_ADJUSTABLE}
# RUN_STATE (the files that make a folder a run's) and NOT_A_RUN (what a run that stopped before
# it trained leaves; a failed command removes the folder it made if nothing else is there,
# launch.py): run_folder.py, with every other name a run writes.
STORED_CONFIG = Path(run_folder.STORED_CONFIG)
SHOWN_KEYS = 4
_ABSENT = object()


def config_identity(cfg: DictConfig) -> dict[str, Any]:
    """The resolved configuration as flat `key: value` pairs, without NOT_IDENTITY."""
    tree = OmegaConf.to_container(cfg, resolve=True)
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            flat[prefix] = node

    walk("", tree)
    return {key: value for key, value in flat.items() if key not in NOT_IDENTITY}


def identity_differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Keys whose values differ (or that only one side has): names first, then the outermost
    (optimizer.name says more than optimizer.adam.eps)."""
    differing = (key for key in stored.keys() | current.keys() if stored.get(key, _ABSENT) != current.get(key, _ABSENT))
    return sorted(differing, key=lambda key: (not key.endswith("name"), key.count("."), key))


def shown_keys(keys: list[str]) -> str:
    return ", ".join(keys[:SHOWN_KEYS]) + (f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")


def stored_identity(run_dir: Path) -> dict[str, Any] | None:
    """The identity of the run stored in `run_dir`, or None if it has none that resolves here."""
    path = Path(run_dir) / STORED_CONFIG
    if not path.is_file():
        return None
    try:
        return config_identity(OmegaConf.load(path))
    except (OmegaConfBaseException, OSError, ValueError):
        return None


def run_files(run_dir: Path) -> list[str]:
    """The RUN_STATE files in `run_dir`."""
    return [name for name in RUN_STATE if (Path(run_dir) / name).exists()]


def check_new_run_dir(run_dir: Path, cfg: DictConfig) -> None:
    """Refuse to start a new run in a folder that holds another run's files."""
    found = run_files(run_dir)
    if not found:
        return
    if SUMMARY in found:
        raise UserError(f"{run_dir} holds a finished run (summary.json): a new run there would overwrite it; choose another hydra.run.dir")
    stored = stored_identity(run_dir)
    if stored is None:
        raise UserError(f"{run_dir} holds a run's files ({shown_keys(found)}) but no stored config that resolves; choose another hydra.run.dir")
    differences = identity_differences(stored, config_identity(cfg))
    if not differences:
        raise UserError(
            f"{run_dir} holds an unfinished run of this configuration: continue it with "
            f"`python -m dpmuon.train resume={run_dir}`, or choose another hydra.run.dir"
        )
    raise UserError(f"{run_dir} holds another run (its configuration differs at {shown_keys(differences)}); choose another hydra.run.dir")


def check_resumable(run_dir: Path) -> None:
    """A folder that `resume=` can continue: a dpmuon run that has not finished."""
    if not Path(run_dir).is_dir():
        raise UserError(f"cannot resume {run_dir}: no such directory")
    if run_folder.is_finished(run_dir):
        raise UserError(f"{run_dir} already finished (summary.json exists); nothing to resume")
    if not (Path(run_dir) / STORED_CONFIG).is_file():
        raise UserError(f"cannot resume {run_dir}: {Path(run_dir) / STORED_CONFIG} not found (is this a dpmuon run directory?)")


def check_same_run(stored: dict[str, Any] | None, cfg: DictConfig, run_dir: Path) -> None:
    """A checkpoint continues only the configuration that wrote it (None: an older checkpoint,
    which the plan check alone guards)."""
    if stored is None:
        return
    differences = identity_differences(stored, config_identity(cfg))
    if differences:
        raise UserError(
            f"cannot continue {run_dir}: its checkpoint was written by another configuration "
            f"(it differs at {shown_keys(differences)}); start a new run in another hydra.run.dir"
        )


def is_rank0() -> bool:
    """Rank 0 of a torchrun job (or a single process): the rank that holds the folder's lock."""
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def run_dir_claimed(run_dir: Path, cfg: DictConfig):
    """The block runs in a folder this process holds (rank 0) and that holds no other run (a new
    run; a resume continues the run that is there)."""
    with run_dir_locked(run_dir) if is_rank0() else contextlib.nullcontext():
        if cfg.get("resume") is None:
            check_new_run_dir(run_dir, cfg)
        yield
