"""Every example's clipped block norm is at most C_W; the partition's thresholds and Δ."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_gpt2, token_batch

from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.privacy import build_engine, build_partition, clip_factors
from dpmuon.privacy.clipping import CLIP_MARGIN


def test_clip_factors_bound_every_block_norm():
    g = torch.Generator().manual_seed(0)
    norms = torch.rand(64, 5, generator=g) * 4
    norms[3, 2] = 0.0
    thresholds = [0.5, 1.0, 2.0, 0.1, 3.0]
    f = clip_factors(norms, thresholds)
    assert torch.all(f <= 1.0) and torch.all(f >= 0.0)
    assert torch.all(f * norms < torch.tensor(thresholds))
    # Unclipped blocks are untouched; clipped blocks land on the threshold less the rounding margin.
    margin = torch.tensor(thresholds) * CLIP_MARGIN
    below = norms <= margin
    assert torch.all(f[below] == 1.0)
    assert torch.allclose((f * norms)[~below], margin.expand_as(norms)[~below])


def test_nonfinite_example_gets_zero_factor_in_every_block():
    norms = torch.tensor([[1.0, 2.0], [float("nan"), 0.5], [0.1, float("inf")]])
    f = clip_factors(norms, [1.0, 1.0])
    assert f[0].tolist() == [CLIP_MARGIN, 0.5 * CLIP_MARGIN]  # a norm at C_W is clipped too: the margin
    assert f[1].tolist() == [0.0, 0.0] and f[2].tolist() == [0.0, 0.0]


def test_a_factor_that_fp32_cannot_hold_to_its_precision_is_zero():
    """Rounded to fp32, as the engines scale with it, a subnormal factor can grow by 1.67×: a
    gradient C_W/(0.6·2⁻¹⁴⁹) long would contribute 1.67·C_W. It contributes 0 instead."""
    subnormal = 0.6 * 2.0**-149
    assert torch.tensor(subnormal, dtype=torch.float64).float().item() == 2.0**-149  # what it would be
    norms = torch.tensor([[CLIP_MARGIN / subnormal, CLIP_MARGIN / 2.0**-126]], dtype=torch.float64)
    f = clip_factors(norms, [1.0, 1.0])
    assert f[0, 0] == 0.0 and f[0, 1] == 2.0**-126  # the smallest normal factor is kept, exactly


@pytest.mark.parametrize(
    "mode,rule,other",
    [("per_matrix", "split", "per_tensor"), ("per_matrix", "scalar", "per_tensor"), ("per_matrix", "split", "group"), ("flat", "split", "per_tensor")],
)
def test_engine_output_for_single_examples_respects_thresholds(mode, rule, other):
    """A one-example micro-batch's clipped sum is that example's clipped gradient."""
    model = tiny_gpt2(tie=True)
    names = [n for n, _ in model.named_parameters()]
    partition = build_partition(names, clip_mode=mode, clip_norm=0.05, threshold_rule=rule, other_blocks=other, matrix_names=hidden_matrices(model))
    engine = build_engine("opacus", model, partition)
    batch = token_batch(4, seed=7)
    clipped_blocks = 0
    for i in range(4):
        single = {k: v[i : i + 1] for k, v in batch.items()}
        summed, _, stats = engine.clipped_sum(single, per_example_lm_loss)
        for block in partition.blocks:
            norm = math.sqrt(sum(float(summed[n].pow(2).sum()) for n in block.params))
            assert norm <= block.threshold, block.name  # as computed: the margin absorbs fp32 rounding
        clipped_blocks += int(stats.clipped.sum())
    assert clipped_blocks > 0  # the threshold is small enough that clipping actually happened


def test_threshold_rules_and_sensitivity():
    names = ["a", "b", "c", "d"]
    split = build_partition(names, clip_norm=0.1, threshold_rule="split", matrix_names=["a", "b"])
    assert len(split) == 4 and all(math.isclose(t, 0.05) for t in split.thresholds)
    assert math.isclose(split.sensitivity, 0.1)
    scalar = build_partition(names, clip_norm=0.1, threshold_rule="scalar", matrix_names=["a", "b"])
    assert math.isclose(scalar.sensitivity, 0.2)
    grouped = build_partition(names, clip_norm=0.1, other_blocks="group", matrix_names=["a", "b"])
    assert [b.params for b in grouped.blocks] == [("a",), ("b",), ("c", "d")]
    assert math.isclose(grouped.sensitivity, 0.1)
    by_size = build_partition(names, clip_norm=0.1, threshold_rule="by_size", sizes={"a": 1, "b": 4, "c": 4, "d": 7})
    assert by_size.thresholds == pytest.approx([0.025, 0.05, 0.05, 0.1 * math.sqrt(7 / 16)])
    assert math.isclose(by_size.sensitivity, 0.1)
    flat = build_partition(names, clip_mode="flat", clip_norm=0.1)
    assert len(flat) == 1 and flat.sensitivity == 0.1


@pytest.mark.parametrize(
    "kwargs,message", [({"clip_mode": "per_row"}, "unknown clip mode"), ({"clip_norm": 0.0}, "clip norm"), ({"threshold_rule": "sqrt"}, "threshold rule")]
)
def test_bad_partition_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_partition(["a"], **kwargs)
