"""Learning-rate schedules over a run's planned steps (public: they cost no privacy).

The factor multiplies each group's configured rate. With t optimizer steps already taken
(t = 0 before step 1), W warmup steps and T planned steps:

    warmup (t < W):   (t + 1) / (W + 1)          — the peak is reached at step W + 1
    then, p = (t - W) / (T - W) ∈ [0, 1):
        constant      1
        linear        1 - p
        cosine        (1 + cos(π p)) / 2
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from .choices import SCHEDULES


def lr_factor(t: int, schedule: str, total_steps: int, warmup_steps: int) -> float:
    if t < warmup_steps:
        return (t + 1) / (warmup_steps + 1)
    progress = (t - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, total_steps: int, warmup_steps: int) -> LambdaLR:
    """A torch scheduler stepping `schedule` once per optimizer step (its state is checkpointed)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup must end before the last of the {total_steps} planned steps")
    return LambdaLR(optimizer, functools.partial(lr_factor, schedule=schedule, total_steps=total_steps, warmup_steps=warmup_steps))
