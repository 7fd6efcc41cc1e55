"""What the constant-work tests share (tests/privacy/test_constant_work.py on the CPU,
tests/test_cuda.py on a GPU): a recorder of every aten operation, and lots of one shape whose
contents differ as much as they can."""

from __future__ import annotations

import torch
from conftest import token_batch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dpmuon.privacy.engines.base import EXAMPLE_MASK


class OpLog(TorchDispatchMode):
    """Every aten operation run inside it, with its tensors' shapes, dtypes and devices."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), tuple((tuple(t.shape), t.dtype, t.device.type) for t in tensors)))
        return func(*args, **(kwargs or {}))


def lots_of_one_shape() -> list[dict[str, torch.Tensor]]:
    """Three one-micro-batch lots of the same shapes, for a loss scaled by each row's "weight":
    ordinary examples; a NaN-loss example (dropped), one of a single repeated token (fewer distinct
    (example, token) pairs at the embedding) and a filler row; a 1e30-scaled example (beyond the
    fast engine's TRACE_BOUND: dropped) and another filler row."""
    ordinary = token_batch(4, seed=3) | {"weight": torch.ones(4), EXAMPLE_MASK: torch.ones(4, dtype=torch.bool)}
    odd = dict(ordinary, input_ids=ordinary["input_ids"].clone(), weight=torch.tensor([float("nan"), 1.0, 1.0, 1.0]))
    odd["input_ids"][1] = 5
    odd[EXAMPLE_MASK] = torch.tensor([True, True, True, False])
    huge = dict(ordinary, weight=torch.tensor([1.0, 1.0, 1e30, 1.0]), **{EXAMPLE_MASK: torch.tensor([True, False, True, True])})
    return [ordinary, odd, huge]


def operation_records(make_privatizer, lots, loss_fn) -> list[list[tuple]]:
    """Each lot's first two releases recorded, by a fresh privatizer of a fresh model (an engine
    may leave state on the parameters it hooked): the first runs the one-off checks (the fast
    engine's use check, the conformance check), the second is every later step. Every release
    must leave finite gradients."""
    records = []
    for lot in lots:
        privatizer = make_privatizer()
        with OpLog() as log:
            for _ in range(2):
                privatizer.release([lot], loss_fn)
                assert all(bool(torch.isfinite(p.grad).all()) for p in privatizer.params.values())
        privatizer.close()
        records.append(log.ops)
    return records
