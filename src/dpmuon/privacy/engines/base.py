"""What a per-example gradient engine does: Σ_i clip(g_i) for one micro-batch, block by block.

Engines differ only in how they get per-example block norms and the clipped sum (Opacus
instantiates per-example gradients; the fast engine never does). The privatizer owns
everything else — thresholds, noise, accounting — so every engine yields the same mechanism.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..blocks import BlockPartition
from ..clipping import ClipStats

# loss_fn(model, batch) → per-example losses, shape [B]; the gradient of example i's loss is g_i.
PerExampleLoss = Callable[[nn.Module, Mapping[str, Any]], torch.Tensor]


class PerExampleEngine(ABC):
    def __init__(self, model: nn.Module, partition: BlockPartition):
        self.model = model
        self.partition = partition
        named = dict(model.named_parameters())
        unknown = [n for n in partition.param_names if n not in named]
        if unknown:
            raise ValueError(f"partition names parameters the model does not have: {unknown[:5]}")
        self.params: dict[str, nn.Parameter] = {n: named[n] for n in partition.param_names}
        self.block_of = partition.block_index()
        self.thresholds = partition.thresholds

    @abstractmethod
    def clipped_sum(self, batch: Mapping[str, Any], loss_fn: PerExampleLoss) -> tuple[dict[str, torch.Tensor], torch.Tensor, ClipStats]:
        """Return (Σ_i c_i,W g_i,W per parameter name in fp32, per-example losses [B], stats).

        Must leave no per-example or non-private gradient behind on the parameters.
        """

    def close(self) -> None:
        """Remove hooks and buffers from the model."""


ENGINES: dict[str, type[PerExampleEngine]] = {}


def register_engine(name: str):
    def decorator(cls: type[PerExampleEngine]) -> type[PerExampleEngine]:
        ENGINES[name] = cls
        return cls

    return decorator


def build_engine(name: str, model: nn.Module, partition: BlockPartition) -> PerExampleEngine:
    if name not in ENGINES:
        raise ValueError(f"unknown per-example gradient engine {name!r}; valid: {', '.join(sorted(ENGINES))}")
    return ENGINES[name](model, partition)
