"""Checkpoints: everything needed to continue a run exactly where it stopped.

Model and optimizer (momentum buffers and their public noise variance), every random stream
(lot sampler, privacy noise, DP-MuonBC probes, torch's global RNG for dropout), the accountant
ledger and the privacy plan (a resume may never reset or change the mechanism).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .run_files import atomic_write

CHECKPOINT_FILE = "checkpoint.pt"


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
