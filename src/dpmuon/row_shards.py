"""Which rows of a parameter each rank holds under FSDP2 (`torch.distributed.fsdp.fully_shard`).

Shared by the sharded release (dpmuon.privacy) and the sharded Newton–Schulz (dpmuon.optim),
which may not import each other, and must agree with each other and with FSDP2 on every row.
"""

from __future__ import annotations


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of an m-row tensor that `rank` holds: FSDP2 splits dim 0 as
    torch.chunk does, c = ⌈m / world⌉ rows a rank, so the last ranks may hold fewer, or none."""
    per_rank = -(-rows // world)
    return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
