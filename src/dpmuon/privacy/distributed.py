"""Data parallelism for the private release, across processes (torchrun).

The DP mechanism must not change with the number of processes: every rank draws the same
Poisson lot (same sampler seed) and takes a disjoint shard of it; the ranks' *clipped* sums are
all-reduced, with the Gaussian noise added once (by rank 0, before the reduction), so every
rank ends up with the identical released gradient and steps an identical optimizer. This is why
torch's DistributedDataParallel is not used: it would all-reduce raw, unclipped gradients.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from ..errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class DataParallel:
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, lot: Sequence[int]) -> list[int]:
        """This rank's part of the (globally identical) lot."""
        return list(lot[self.rank :: self.world_size])

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        """In-place sum over ranks, flattened into one buffer (one collective per step)."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def leave(self) -> None:
        """Destroy the process group: a gloo rank that exits with it alive can abort at interpreter
        shutdown (its worker threads outlive Python), failing a run that had finished. Under FSDP2
        the threads outlive this too; `outcomes.end_distributed_process` ends such a process."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, work: Callable[[], T]) -> T:
        """`work()` on rank 0, its result broadcast to every rank. A refusal it raises (UserError)
        is raised on every rank: rank 0 stopping alone would leave the others waiting forever in
        their next collective."""
        if self.world_size == 1:
            return work()
        outcome = None
        if self.is_main:
            try:
                outcome = ("done", work())
            except UserError as err:
                refusal = err
                outcome = ("refused", str(err))
        kind, value = self.broadcast_object(outcome)
        if kind == "refused":
            raise refusal if self.is_main else UserError(value)
        return value


SINGLE = DataParallel(rank=0, world_size=1)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_data_parallel(device_type: str) -> DataParallel:
    """Join the torchrun process group (NCCL for GPU tensors, gloo for CPU ones); single process otherwise."""
    if not launched_by_torchrun():
        return SINGLE
    if not dist.is_initialized():
        # On GPU, CPU-side collectives (stats, stop flags, broadcast lots) go through gloo.
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo")
    return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size())
