"""Newton–Schulz on FSDP2's row shards (2 gloo processes): each matrix orthogonalized whole, once,
on its owner, and every rank gets its rows of exactly the single-process update."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dpmuon.optim.newton_schulz import newton_schulz
from dpmuon.optim.sharded import orthogonalize_row_shards, owners
from dpmuon.outcomes import end_distributed_process
from dpmuon.row_shards import row_range

SHAPES = [(5, 7), (64, 32), (3, 9), (1, 4), (8, 8)]  # odd row counts, and one with a rank holding no row


def matrices() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(m, n, generator=g) for m, n in SHAPES]


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The row ranges are FSDP2's own: fully_shard a model of these shapes and read its local shards.
        model = nn.Sequential(*(nn.Linear(n, m, bias=False) for m, n in SHAPES))
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        local_rows = [layer.weight.to_local().shape[0] for layer in model]
        calls = []

        def counted(matrix: torch.Tensor) -> torch.Tensor:
            calls.append(tuple(matrix.shape))
            return newton_schulz(matrix)

        shards = [full[slice(*row_range(full.shape[0], 2, rank))] for full in matrices()]
        updates = orthogonalize_row_shards(shards, [m for m, _ in SHAPES], counted)
        torch.save(updates, f"{out}.{rank}.pt")
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump({"local_rows": local_rows, "calls": calls}, f)
    finally:
        dist.destroy_process_group()
    end_distributed_process()  # (on success only: a raised error still reaches mp.spawn)


def test_each_rank_gets_its_rows_of_the_whole_matrix_update_computed_once(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    expected = [newton_schulz(full) for full in matrices()]
    found = [json.loads((tmp_path / f"out.{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        updates = torch.load(tmp_path / f"out.{rank}.pt")
        assert found[rank]["local_rows"] == [len(range(*row_range(m, 2, rank))) for m, _ in SHAPES]  # FSDP2's split
        for update, whole, (m, _) in zip(updates, expected, SHAPES):
            assert torch.equal(update, whole[slice(*row_range(m, 2, rank))])
    # Newton–Schulz ran once per matrix (not per rank, not per shard), on whole matrices, on their owners.
    calls = [tuple(shape) for rank in (0, 1) for shape in found[rank]["calls"]]
    assert sorted(calls) == sorted(SHAPES)
    assert [sorted(map(tuple, found[rank]["calls"])) for rank in (0, 1)] == [
        sorted(shape for shape, owner in zip(SHAPES, owners(SHAPES, 2)) if owner == rank) for rank in (0, 1)
    ]


def test_owners_balance_the_entries_largest_first():
    assert owners([(64, 32), (5, 7), (3, 9), (8, 8)], 2) == [0, 1, 1, 1]
    assert owners([(4, 4)] * 4, 2) == [0, 1, 0, 1]
    assert [row_range(5, 2, r) for r in (0, 1)] == [(0, 3), (3, 5)] and row_range(1, 2, 1) == (1, 1)
