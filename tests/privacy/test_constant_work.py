"""Constant-time lots fix a step's shapes; the release must not branch on the lot's values either.

Every aten operation of a constant-time release is recorded with its tensors' shapes and dtypes,
for lots of the same shapes but very different contents, and the records must be equal: a path
taken only for some lots (zeroing a NaN example's rows, a data-sized torch.unique, a boolean
selection of the examples, a one-off check that waits for a finite micro-batch) is a timing
channel that padding does not close. Each lot is released twice by a fresh privatizer, so the
first release's one-off checks are recorded too. tests/test_cuda.py runs the same on a GPU.
"""

from __future__ import annotations

import pytest
from conftest import tiny_gpt2
from helpers_constant_work import lots_of_one_shape, operation_records

from dpmuon.models import per_example_lm_loss
from dpmuon.privacy import PrivacyAccountant, Privatizer, build_partition


def weighted_lm_loss(model, batch):
    return per_example_lm_loss(model, batch) * batch["weight"]


@pytest.mark.parametrize("engine", ["fast", "opacus"])
def test_a_constant_time_release_runs_the_same_operations_whatever_the_lot_holds(engine):
    partition = build_partition([n for n, _ in tiny_gpt2(tie=True).named_parameters()], clip_norm=0.1)
    records = operation_records(
        lambda: Privatizer(tiny_gpt2(tie=True), partition, 1.0, 4.0, 0.1, PrivacyAccountant(1e-5), engine=engine, constant_time=True),
        lots_of_one_shape(),
        weighted_lm_loss,
    )
    assert len(records[0]) > 100
    assert records[1] == records[0]
    assert records[2] == records[0]
