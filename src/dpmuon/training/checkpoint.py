"""Checkpoints: the public half of what a resume continues from.

Model, optimizer (momentum buffers and their public noise variance) and scheduler, the public
random streams (DP-MuonBC probes, torch's global RNG for dropout), the privacy plan and the
config identity (a resume may never change the mechanism), and the head and length of the
privacy ledger (a resume refuses a ledger that lost lines). The lot sampler's and the noise's
states are secret and live in the mechanism state (privacy/state.py); ε is not stored at all:
it is recomposed from the ledger's charged lines.

A checkpoint is written atomically (temp file, fsync, rename: run_files.atomic_write) and
checked before it is loaded (`load_verified`): torch.save writes a zip archive whose central
directory comes last and whose every entry carries a CRC-32, so a file cut short (a copy onto
a full disk) lacks the directory and an altered byte fails its entry's checksum. torch.load
checks neither: it loads a flipped byte as a changed weight, and fails deep inside on a torn
file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import run_folder
from ..durable import atomic_write, load_verified
from ..errors import UserError

CHECKPOINT_FILE = run_folder.CHECKPOINT
# What every checkpoint the loop writes holds; one without them was written by something else.
CHECKPOINT_KEYS = ("step", "model", "optimizer", "scheduler", "rng", "plan")
RESTORE_CHECKPOINT = (
    f"restore {CHECKPOINT_FILE} from an intact copy (or delete it: the run then continues from step 0, and every release it made stays charged)"
)


def rng_snapshot(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    states = {name: g.get_state() for name, g in generators.items()}
    states["torch_global"] = torch.get_rng_state()
    if torch.cuda.is_available():
        states["cuda_global"] = torch.cuda.get_rng_state_all()
    return states


def rng_restore(states: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    for name, g in generators.items():
        g.set_state(states[name])
    torch.set_rng_state(states["torch_global"])
    if "cuda_global" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda_global"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at `path` (None: there is none); refuses one that is incomplete or damaged."""
    if not Path(path).exists():
        return None
    state = load_verified(path, RESTORE_CHECKPOINT)
    missing = [key for key in CHECKPOINT_KEYS if key not in state] if isinstance(state, dict) else list(CHECKPOINT_KEYS)
    if missing:
        raise UserError(f"cannot resume from {path}: it is no complete checkpoint (no {missing[0]!r} entry); {RESTORE_CHECKPOINT}")
    return state
