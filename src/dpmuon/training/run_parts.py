"""One run's parts and progress (`Training`): built once by the loop's `setup`, then read and
advanced by its phases — the loop itself, the checkpoints, the evaluation and the summary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from .. import run_folder
from ..diagnostics import OracleAlignment
from ..privacy.distributed import DataParallel
from ..privacy.mechanism import Mechanism
from ..privacy.plan import PrivacyPlan
from ..privacy.state import MECHANISM_STATE_FILE
from .data import RunData
from .diagnostics import diagnostics_mode
from .run_files import MetricsLog


@dataclass
class Training:
    """What the phases of one run share: its parts, built once by `setup`, and its progress."""

    cfg: DictConfig
    run_dir: Path
    device: torch.device
    parallel: DataParallel
    autocast: Callable
    tokenizer: Any
    tokenizer_source: str  # "loaded", or "built locally" (data.fallback=synthetic)
    data: RunData
    model: torch.nn.Module
    initial_weights: str  # fingerprint before any checkpoint is loaded: the run's starting point
    frozen_weights: str | None  # LoRA: the frozen base's fingerprint (checkpoints leave the base out)
    mechanism: Mechanism  # plan, secret randomness, ledger, partition, release and lot sampler
    generators: dict[str, torch.Generator]
    named: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    oracle: OracleAlignment | None
    fixed_width: int | None  # fixed micro-batch shapes (bf16): see training/batching.py
    metrics: MetricsLog
    diagnostic_rows: MetricsLog | None = None  # diagnostics.jsonl (owner-only): logging.nonprivate_diagnostics=file
    padded_rows: int | None = None  # constant-time lots: the rows this rank processes every step
    widths: tuple[tuple[int, int], ...] | None = None  # ...in these (width, rows), when bucketed by width
    # trainer.strategy=fsdp: the model is in FSDP2 row shards, and this builds it unsharded (for
    # rank 0's evaluation after training: training/fsdp.py)
    rebuild_unsharded: Callable[[], torch.nn.Module] | None = None
    logger: Any = None
    start_step: int = 0
    last_step: int = 0
    train_seconds: float = 0.0

    @property
    def plan(self) -> PrivacyPlan:
        return self.mechanism.plan

    @property
    def private(self) -> bool:
        return self.plan.private

    @property
    def diagnostics(self) -> bool:
        """Whether the raw lot's quantities are computed at all (logging.nonprivate_diagnostics)."""
        return diagnostics_mode(self.cfg) != "false"

    @property
    def publish_diagnostics(self) -> bool:
        """Whether they go where the releases go (metrics.jsonl, W&B, console). A non-private run
        has no guarantee to keep: its model is as revealing as its diagnostics."""
        return diagnostics_mode(self.cfg) == "publish" or (self.diagnostics and not self.private)

    @property
    def sharded(self) -> bool:
        return self.rebuild_unsharded is not None

    @property
    def validate(self) -> bool:
        return bool(self.cfg.eval.get("validation", True))

    @property
    def progress(self) -> bool:
        return bool(self.cfg.logging.progress)

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / run_folder.CHECKPOINT

    @property
    def mechanism_state_path(self) -> Path:
        return self.run_dir / MECHANISM_STATE_FILE
