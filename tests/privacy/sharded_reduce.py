"""The rank-order reduction's worker, in a module of its own: a spawned process imports the
worker's module, and this one loads torch and dpmuon.privacy.sharded only (no transformers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpmuon.outcomes import end_distributed_process
from dpmuon.privacy.sharded import reduce_rows_in_rank_order

ROWS = (7, 1, 4)  # with 3 ranks: 3 rows a rank, a matrix rank 1 and 2 hold no row of, and 2 rows a rank


def rank_total(rows: int, rank: int) -> torch.Tensor:
    """Rank r's float64 total, of scale 10^{3r}: added in another order, some rows round otherwise."""
    return torch.randn(rows, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rows + rank)) * 10.0 ** (3 * rank)


def worker(rank: int, init_file: str, out: str, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save([reduce_rows_in_rank_order(rank_total(m, rank), world, rank) for m in ROWS], f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    end_distributed_process()
