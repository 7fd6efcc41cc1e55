"""`<run dir>/mechanism_state.pt`: the secret half of a checkpoint.

Resuming must replay the lots and noise the interrupted run would have drawn (so that a re-run
step releases exactly what it released before, at no privacy cost), which needs the lot
sampler's and the noise generator's states. Those states regenerate the mechanism's draws, so
they live apart from `checkpoint.pt` (which people copy, share and publish), in a file only the
owner can read, that is deleted when the run completes (`privacy.keep_mechanism_state=true`
keeps it). It holds the states at the last two checkpoints: a kill between writing this file
and the checkpoint still finds the state that matches the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import run_folder
from .checkpoint import CHECKPOINT_FILE, load_verified
from .run_files import atomic_write, temp_files

MECHANISM_STATE_FILE = run_folder.MECHANISM_STATE
KEPT_STATES = 2
RESTORE_STATE = f"restore {MECHANISM_STATE_FILE} from an intact copy (or delete it: re-run steps then draw fresh randomness and are charged)"


def save_mechanism_state(path: Path, step: int, state: dict[str, Any]) -> None:
    """Record the mechanism's state at `step` (owner read/write only, atomically)."""
    states = _read(path)
    states[int(step)] = state
    states = {s: states[s] for s in sorted(states)[-KEPT_STATES:]}

    atomic_write(path, lambda f: torch.save(states, f), secret=True)  # 0600 before any secret byte is written


def load_mechanism_state(path: Path, step: int) -> dict[str, Any] | None:
    """The state saved at `step`, or None when there is none (file missing or other steps)."""
    return _read(path).get(int(step))


def saved_mechanism_states(path: Path) -> dict[int, dict[str, Any]]:
    """Every state the file holds, by step (empty when there is no file)."""
    return _read(path)


def has_saved_state(run_dir: Path) -> bool:
    """Whether the run saved anything a resume continues from: its mechanism state or a checkpoint.

    A run given a user mechanism seed that has neither stopped during setup: no file of the
    run holds the seed, so a resume needs it given again (see training/secret.py).
    """
    return any((Path(run_dir) / name).exists() for name in (MECHANISM_STATE_FILE, CHECKPOINT_FILE))


def remove_left_temp_files(run_dir: Path) -> None:
    """Delete the mechanism-state temp files of writes killed midway: they hold generator states."""
    for tmp in temp_files(Path(run_dir) / MECHANISM_STATE_FILE):
        tmp.unlink(missing_ok=True)


def discard_mechanism_state(run_dir: Path, keep: bool) -> None:
    """Training is over: no step is left to replay, so the secret state goes (unless `keep`)."""
    if not keep:
        (Path(run_dir) / MECHANISM_STATE_FILE).unlink(missing_ok=True)
    remove_left_temp_files(run_dir)


def _read(path: Path) -> dict[int, dict[str, Any]]:
    if not Path(path).exists():
        return {}
    return load_verified(path, RESTORE_STATE)
