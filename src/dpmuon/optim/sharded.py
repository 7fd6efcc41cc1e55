"""Newton–Schulz on row-sharded matrices: each matrix orthogonalized whole, once, on one rank.

FSDP2 (`torch.distributed.fsdp.fully_shard`) shards every parameter, and so its gradient and
the momentum kept beside it, by rows: rank r holds rows [r·c, (r+1)·c) of an m-row matrix,
c = ⌈m / world⌉ (torch.chunk's split; the last ranks may hold fewer rows, or none). Newton–Schulz
needs the whole matrix (its Gram matrix couples every row), so orthogonalizing each shard on its
own would be a different, wrong update; running it on every rank would repeat the work world
times. Here each matrix has one owner rank, chosen by a public rule from the shapes alone
(largest first, to the least-loaded rank), so every rank knows the owners without talking: the
owner gathers the matrix's rows, orthogonalizes it once and scatters the rows of the update back.

Per step and matrix, the communication is its size twice (rows in, rows out) less the owner's
own rows; shards are padded to c rows because gather and scatter move equal-sized tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..row_shards import row_range


def owners(shapes: Sequence[tuple[int, int]], world: int) -> list[int]:
    """The rank that orthogonalizes each matrix: largest first to the least-loaded rank (load: the
    entries it owns; ties to the lower rank). A function of the shapes only: public, the same on
    every rank."""
    load, owner = [0] * world, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + shapes[i][0] * shapes[i][1]
    return owner


def orthogonalize_row_shards(
    shards: Sequence[torch.Tensor], rows: Sequence[int], orthogonalize: Callable[[torch.Tensor], torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """This rank's rows of `orthogonalize(M)` for each matrix M, given this rank's rows of each
    (`shards[i]`: rows `row_range(rows[i], world, rank)` of an rows[i] × n matrix). Every rank
    calls it with its shards of the same matrices in the same order; `orthogonalize` runs once
    per matrix, on its owner."""
    wholes = gather_to_owners(shards, rows, group)
    return scatter_from_owners([None if whole is None else orthogonalize(whole) for whole in wholes], shards, rows, group)


def gather_to_owners(shards: Sequence[torch.Tensor], rows: Sequence[int], group: dist.ProcessGroup | None = None) -> list[torch.Tensor | None]:
    """Each matrix whole on its owner (`owners`), None on the other ranks, from every rank's rows
    of it (as in `orthogonalize_row_shards`). An owner holds all its matrices at once: about
    1/world of them."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    owner = owners([(m, shard.shape[1]) for m, shard in zip(rows, shards)], world)
    wholes: list[torch.Tensor | None] = []
    for shard, m, own in zip(shards, rows, owner):
        ranges = [row_range(m, world, r) for r in range(world)]
        padded = _padded(shard, ranges)
        gathered = [torch.empty_like(padded) for _ in range(world)] if rank == own else None
        dist.gather(padded, gathered, dst=_global(own, group), group=group)
        wholes.append(torch.cat([piece[: stop - start] for piece, (start, stop) in zip(gathered, ranges)]) if rank == own else None)
    return wholes


def scatter_from_owners(
    wholes: Sequence[torch.Tensor | None], shards: Sequence[torch.Tensor], rows: Sequence[int], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """This rank's rows of each matrix, sent by its owner (which passes it whole in `wholes`; the
    others pass None); `shards` give this rank's rows' shapes, as for `gather_to_owners`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    owner = owners([(m, shard.shape[1]) for m, shard in zip(rows, shards)], world)
    received_rows = []
    for whole, shard, m, own in zip(wholes, shards, rows, owner):
        ranges = [row_range(m, world, r) for r in range(world)]
        pieces = [_padded(whole[start:stop], ranges) for start, stop in ranges] if rank == own else None
        received = torch.empty_like(_padded(shard, ranges))
        dist.scatter(received, pieces, src=_global(own, group), group=group)
        received_rows.append(received[: shard.shape[0]])
    return received_rows


def _padded(piece: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """`piece` padded with zero rows to a rank's largest share (rank 0 holds the most rows):
    gather and scatter move equal-sized tensors."""
    padded = piece.new_zeros(ranges[0][1] - ranges[0][0], piece.shape[1])
    padded[: piece.shape[0]] = piece
    return padded


def _global(rank: int, group: dist.ProcessGroup | None) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
