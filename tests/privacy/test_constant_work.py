"""Constant-time lots fix a step's shapes; the release must not branch on the lot's values either.

Every aten operation of a constant-time release is recorded with its tensors' shapes and dtypes,
for lots of the same shapes but very different contents, and the records must be equal: a path
taken only for some lots (zeroing a NaN example's rows, a data-sized torch.unique, a boolean
selection of the examples) is a timing channel that padding does not close.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, token_batch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dpmuon.models import per_example_lm_loss
from dpmuon.privacy import PrivacyAccountant, Privatizer, build_partition
from dpmuon.privacy.engines.base import EXAMPLE_MASK


class OpLog(TorchDispatchMode):
    """Every aten operation run inside it, with its tensors' shapes and dtypes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), tuple((tuple(t.shape), t.dtype) for t in tensors)))
        return func(*args, **(kwargs or {}))


def weighted_lm_loss(model, batch):
    return per_example_lm_loss(model, batch) * batch["weight"]


def lots_of_one_shape() -> list[dict]:
    """Ordinary examples; a NaN-loss example (dropped), one of a single repeated token (fewer
    distinct (example, token) pairs at the embedding) and a filler row; a 1e30-scaled example
    (beyond TRACE_BOUND: dropped) and another filler row."""
    ordinary = token_batch(4, seed=3) | {"weight": torch.ones(4), EXAMPLE_MASK: torch.ones(4, dtype=torch.bool)}
    odd = dict(ordinary, input_ids=ordinary["input_ids"].clone(), weight=torch.tensor([float("nan"), 1.0, 1.0, 1.0]))
    odd["input_ids"][1] = 5
    odd[EXAMPLE_MASK] = torch.tensor([True, True, True, False])
    huge = dict(ordinary, weight=torch.tensor([1.0, 1.0, 1e30, 1.0]), **{EXAMPLE_MASK: torch.tensor([True, False, True, True])})
    return [ordinary, odd, huge]


@pytest.mark.parametrize("engine", ["fast", "opacus"])
def test_a_constant_time_release_runs_the_same_operations_whatever_the_lot_holds(engine):
    model = tiny_gpt2(tie=True)
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.1)
    privatizer = Privatizer(model, partition, 1.0, 4.0, 0.1, PrivacyAccountant(1e-5), engine=engine, constant_time=True)
    lots = lots_of_one_shape()
    privatizer.release([lots[0]], weighted_lm_loss)  # the one-off checks of a first micro-batch
    logs = []
    for lot in lots:
        with OpLog() as log:
            stats = privatizer.release([lot], weighted_lm_loss)
        logs.append(log.ops)
        assert all(torch.isfinite(p.grad).all() for p in privatizer.params.values())
    privatizer.close()
    assert stats.nonfinite == 1 and stats.lot_size == 3  # the last lot: its huge example dropped, a filler row
    assert len(logs[0]) > 100
    assert logs[1] == logs[0]
    assert logs[2] == logs[0]
