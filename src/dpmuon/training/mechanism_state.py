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

import os
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CHECKPOINT_FILE
from .run_files import atomic_write

MECHANISM_STATE_FILE = "mechanism_state.pt"
KEPT_STATES = 2


def save_mechanism_state(path: Path, step: int, state: dict[str, Any]) -> None:
    """Record the mechanism's state at `step` (owner read/write only, atomically)."""
    states = _read(path)
    states[int(step)] = state
    states = {s: states[s] for s in sorted(states)[-KEPT_STATES:]}

    def write(f) -> None:
        os.fchmod(f.fileno(), 0o600)  # before any secret byte is written
        torch.save(states, f)

    atomic_write(path, write)


def load_mechanism_state(path: Path, step: int) -> dict[str, Any] | None:
    """The state saved at `step`, or None when there is none (file missing or other steps)."""
    return _read(path).get(int(step))


def has_saved_state(run_dir: Path) -> bool:
    """Whether the run saved anything a resume continues from: its mechanism state or a checkpoint.

    A run given `privacy.mechanism_seed` that has neither stopped during setup; its stored
    config holds no seed (scrubbed), so only its original command can start it with that seed.
    """
    return any((Path(run_dir) / name).exists() for name in (MECHANISM_STATE_FILE, CHECKPOINT_FILE))


def _read(path: Path) -> dict[int, dict[str, Any]]:
    if not Path(path).exists():
        return {}
    return torch.load(path, map_location="cpu", weights_only=False)
