"""The release on FSDP2's row-sharded weights (`torch.distributed.fsdp.fully_shard`).

Each rank clips its own examples on the whole weights FSDP2 gathers for the forward (the
engine's hooks see them as plain tensors) and adds the clipped sums into a float64 total of each
parameter, as one process does. The totals are reduced, as a sum, to FSDP2's row shards
(`dpmuon.row_shards.row_range`); each rank then adds the noise of exactly its own coordinates
(`GaussianNoise.grid_release_slice` at the shard's flat offset: bit for bit the noise the whole
tensor's release gives them), so every coordinate is noised once, on one rank, and p.grad is
set to the rank's shard of the release as a DTensor (Shard(0)), as FSDP2's optimizer step reads it.

How the float64 sum and the integer grid stay exact. Float addition is not associative: a
reduce-scatter that adds the ranks' totals in an order of its own (a ring starts each chunk at
another rank) may round some coordinates differently, and the grid, round(S/γ + s·z), turns such
an ulp into a whole grid step wherever S/γ + s·z lies that close to a half — rarely, never
provably not. So the order is fixed here: an all-to-all sends every rank its rows of every
rank's total (per rank (W−1)/W of the parameter out and in, what a reduce-scatter moves too), and
the receiver adds them in rank order, ((S₀ + S₁) + S₂) + …: the same float64 additions on every
coordinate, whatever the transport. The lot's total is then a function of each rank's
micro-batches alone — each rank's in order, then the ranks' in rank order, which is also what one
process computes from the same lot split into one micro-batch per rank — and the grid step γ and
the noise are functions of the public std, the key and the coordinates alone, so the release is
that total's single-process release bit for bit (tests/privacy/test_sharded_release.py).

Failures: a rank that cannot release (a grid overflow, a non-finite release, a refused micro-
batch) would leave the others waiting in the next collective forever, so every rank reports
whether it failed at two points of a step (`together`) and all of them raise if any did.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..row_shards import row_range

T = TypeVar("T")


class RankFailedError(RuntimeError):
    """Another rank failed during the sharded release: this one stops with it instead of waiting."""


def sharded(params: Mapping[str, torch.Tensor], world_size: int) -> bool:
    """Whether the parameters are FSDP2 row shards (DTensors, Shard(0) on a 1-D mesh of all ranks);
    refuses a mix, or any other layout, rather than release it wrong."""
    kinds = {isinstance(p, DTensor) for p in params.values()}
    if kinds != {True}:
        if len(kinds) > 1:
            raise ValueError("some trainable parameters are sharded DTensors and some are not: fully_shard the model's root as well")
        return False
    for name, p in params.items():
        if p.device_mesh.ndim != 1 or p.device_mesh.size() != world_size or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"parameter {name!r} is a DTensor placed {tuple(p.placements)} on a mesh of shape {tuple(p.device_mesh.shape)}; "
                f"the sharded release supports FSDP2's dim-0 shards on a 1-D mesh of all {world_size} ranks"
            )
    return True


def rows_of(p: torch.Tensor, world_size: int, rank: int) -> tuple[int, int]:
    """This rank's rows of parameter p (its global shape), checked against its local shard."""
    start, stop = row_range(p.shape[0], world_size, rank)
    local = p.to_local().shape[0] if isinstance(p, DTensor) else p.shape[0]
    if local != stop - start:
        raise ValueError(f"a local shard of {local} rows where FSDP2's split gives rows [{start}, {stop}) of {p.shape[0]}")
    return start, stop


def reduce_rows_in_rank_order(total: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """This rank's rows of Σ_r total_r, the ranks' tensors added in rank order (module docstring).

    Shards are padded to ⌈m/W⌉ rows: the all-to-all moves equal blocks."""
    rows = total.shape[0]
    per_rank = -(-rows // world_size)
    padded = total.new_zeros(world_size * per_rank, *total.shape[1:])
    padded[:rows] = total
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded)  # block r of `received`: rank r's rows of ours
    blocks = received.view(world_size, per_rank, *total.shape[1:])
    mine = blocks[0].clone()
    for block in blocks[1:]:
        mine += block
    start, stop = row_range(rows, world_size, rank)
    return mine[: stop - start]


def together(work: Callable[[], T], rank: int, world_size: int) -> T:
    """work() on this rank, and whether any rank's raised, told to every rank: the failing rank
    raises its own error, the others a RankFailedError naming it. A collective: every rank calls
    it at the same point of a step."""
    error, result = None, None
    try:
        result = work()
    except Exception as err:
        error = err
    said = [None] * world_size
    dist.all_gather_object(said, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, message) for r, message in enumerate(said) if message is not None]
    if failed:
        first, message = failed[0]
        raise RankFailedError(f"rank {first} failed in the sharded release, so this rank stops too: {message}")
    return result


def shard_digest(local: Mapping[str, torch.Tensor], rank: int) -> str | None:
    """The release's digest on rank 0 (None elsewhere), from the ranks' digests of their shards in
    rank order: no rank holds the whole release. It differs from a single process's digest of the
    same values, so a step re-run under another world size reads as another release (refused and
    redone with fresh randomness: the safe side)."""
    from .ledger import release_digest

    mine = release_digest(local)
    everyone = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if rank != 0:
        return None
    h = hashlib.sha256(f"row shards|{len(everyone)}|".encode())
    for r, digest in enumerate(everyone):
        h.update(f"{r}:{digest}|".encode())
    return h.hexdigest()


def as_shard_grad(local: torch.Tensor, p: DTensor) -> DTensor:
    """The local rows of a release as the gradient of FSDP2's sharded parameter p."""
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
