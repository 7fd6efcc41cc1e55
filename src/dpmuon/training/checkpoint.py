"""Checkpoints: the public half of what a resume continues from.

Model, optimizer (momentum buffers and their public noise variance) and scheduler, the public
random streams (DP-MuonBC probes, torch's global RNG for dropout), the privacy plan and the
config identity (a resume may never change the mechanism), and the head and length of the
privacy ledger (a resume refuses a ledger that lost lines). The lot sampler's and the noise's
states are secret and live in the mechanism state (mechanism_state.py); ε is not stored at all:
it is recomposed from the ledger's charged lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import run_folder
from .run_files import atomic_write

CHECKPOINT_FILE = run_folder.CHECKPOINT


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
    if not Path(path).exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
