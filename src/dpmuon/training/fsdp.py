"""`trainer.strategy=fsdp`: the driver's model in FSDP2 row shards (`torch.distributed.fsdp.fully_shard`).

Under torchrun each rank then holds 1/W of every weight, of its released gradient and of the
optimizer state kept beside it. The release works on those shards (privacy/sharded.py), and so
does Muon's Newton–Schulz (optim/sharded.py). What the driver itself does differently is here:

- **Sharding**: each of the model's repeated blocks (the classes a Hugging Face model names in
  `_no_split_modules`) is one FSDP unit; the rest (embeddings, the tied head, the final norm) is
  the root's unit.
- **Checkpoints hold whole tensors**, as a single process writes them. Every rank takes part in
  gathering each sharded tensor, one at a time, and rank 0 keeps it on the CPU (`whole`). A
  resume cuts each rank's rows back out (`as_shards`, `shard_optimizer_state`), so a checkpoint
  resumes under any world size and either strategy. The cost: rank 0's CPU memory holds the model
  and its optimizer state whole while it writes.
- **Evaluation**: after training, rank 0 rebuilds the unsharded model from the gathered weights
  and evaluates alone, as under DDP (`unsharded`): decoding needs the model on one device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import UserError
from ..privacy.distributed import DataParallel
from ..privacy.sharded import as_shard_grad, rows_of


def check_can_shard(parallel: DataParallel, private: bool, constant_time: bool) -> None:
    """Refuse a run FSDP2 would hang or that it cannot shard. FSDP2's forward and backward are
    collectives (each unit's weights are gathered from every rank), so every rank must run the
    same micro-batches in the same shapes, whatever its share of the lot: constant-time lots fix
    them (rows padded to a public count, in public widths); lots as drawn, or a non-private run's,
    would leave a rank with fewer micro-batches waiting forever for the others."""
    if parallel.world_size < 2:
        raise UserError(
            "trainer.strategy=fsdp shards the model over torchrun's processes, and this run has one; "
            "start it with torchrun --nproc_per_node=N (N ≥ 2), or use trainer.strategy=ddp"
        )
    if not (private and constant_time):
        raise UserError(
            "trainer.strategy=fsdp runs private releases of constant-time lots only (optimizer.private=true, privacy.constant_time=true): "
            "FSDP2's forward is a collective, so every rank must run the same micro-batches, which constant-time lots fix; "
            "use trainer.strategy=ddp for this run"
        )


def shard_model(model: torch.nn.Module, parallel: DataParallel, device: torch.device) -> torch.nn.Module:
    """`model`, fully_shard-ed in place over all ranks: each repeated block a unit, the root one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (parallel.world_size,))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules())[1:]:
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    # The root too gives its gathered weights back after each forward (FSDP2 keeps them by
    # default): a forward outside a release (validation) must leave the model as the release's
    # state guard (privacy/conformance.py) saw it, sharded.
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def whole(state: Any, keep: bool) -> Any:
    """`state` (a state dict, nested dicts and lists) with each sharded tensor gathered whole, on
    the CPU where `keep` (rank 0), None elsewhere. A collective: every rank calls it on the same
    structure, and the tensors are gathered one at a time, in order."""
    if isinstance(state, DTensor):
        gathered = state.full_tensor()
        return gathered.cpu() if keep else None
    if isinstance(state, Mapping):
        return {key: whole(value, keep) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(whole(value, keep) for value in state)
    return state


def as_shards(saved: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Saved whole tensors as this rank's shards of the live ones where those are sharded."""
    return {name: rows_like(value, live[name]) if name in live else value for name, value in saved.items()}


def rows_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value`, a whole tensor of `like`'s global shape, as this rank's rows of it when `like` is
    one of FSDP2's row shards (a DTensor); unchanged otherwise."""
    if not isinstance(like, DTensor) or isinstance(value, DTensor):
        return value
    if tuple(value.shape) != tuple(like.shape):
        raise UserError(f"cannot resume: a saved tensor of shape {tuple(value.shape)} where the sharded model has {tuple(like.shape)}")
    start, stop = rows_of(like, like.device_mesh.size(), like.device_mesh.get_local_rank())
    return as_shard_grad(value[start:stop].to(device=like.to_local().device).clone(), like)


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After `optimizer.load_state_dict` from whole tensors: each state tensor of a sharded
    parameter's shape (its momentum, Adam's moments) as this rank's rows of it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            entries = optimizer.state.get(p)
            if isinstance(p, DTensor) and entries:
                for key, value in entries.items():
                    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(p.shape):
                        entries[key] = rows_like(value, p)


def for_evaluation(model: torch.nn.Module, build: Callable[[], torch.nn.Module], parallel: DataParallel) -> torch.nn.Module:
    """The model rank 0 evaluates: the sharded `model`'s weights in an unsharded one from `build()`
    (the other ranks keep `model`). A collective."""
    weights = whole(model.state_dict(), keep=parallel.is_main)
    if not parallel.is_main:
        return model
    plain = build()
    plain.load_state_dict(weights)
    return plain
