"""The one naive per-example reference every engine is checked against: one autograd pass per
example, then per-block clipping by the definition; plus Opacus' materialized per-example
gradients, and the tolerances the comparisons use."""

from __future__ import annotations

import torch
from torch import nn

from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.privacy import build_engine, build_partition, clip_factors, per_example_block_norms


def naive_per_example_gradients(model: nn.Module, batch: dict, names: list[str] | None = None, loss_fn=per_example_lm_loss) -> dict[str, torch.Tensor]:
    """{name: [B, *shape]} one example at a time through plain autograd (zeros where unused)."""
    names = names or [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    per_example = {n: [] for n in names}
    for i in range(batch["input_ids"].shape[0]):
        single = {k: v[i : i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(loss_fn(model, single).sum(), [params[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads):
            per_example[n].append(g.detach() if g is not None else torch.zeros_like(params[n]))
    return {n: torch.stack(v) for n, v in per_example.items()}


ATOL, RTOL = 1e-6, 1e-4
# Thresholds that clip (almost) every block of every example, and ones that never bind.
SMALL_C, LARGE_C = 1e-3, 1e6
PARTITIONS = {
    "per_matrix-split-per_tensor": {"clip_mode": "per_matrix", "threshold_rule": "split", "other_blocks": "per_tensor"},
    "per_matrix-scalar-group": {"clip_mode": "per_matrix", "threshold_rule": "scalar", "other_blocks": "group"},
    "flat": {"clip_mode": "flat"},
}


def partition_for(model: nn.Module, clip_norm: float, **options):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return build_partition(names, clip_norm=clip_norm, matrix_names=hidden_matrices(model), **options)


def opacus_reference(model, partition, batch, loss_fn=per_example_lm_loss):
    """(per-parameter squared norms, clipped sums, stats) from materialized per-example gradients."""
    engine = build_engine("opacus", model, partition)
    try:
        grads, _ = engine.per_example_gradients(batch, loss_fn)
        squared = {n: g.flatten(1).pow(2).sum(1) for n, g in grads.items()}
        summed, _, stats = engine.clipped_sum(batch, loss_fn)
    finally:
        engine.close()
    return squared, summed, stats


def naive_reference(model, partition, batch, loss_fn):
    """(per-parameter squared norms, clipped sums) from one autograd pass per example."""
    names = partition.param_names
    grads = naive_per_example_gradients(model, batch, names, loss_fn)
    squared = {n: g.flatten(1).pow(2).sum(1) for n, g in grads.items()}
    factors = clip_factors(per_example_block_norms(partition, squared), partition.thresholds)
    block_of = partition.block_index()
    summed = {n: torch.einsum("b,b...->...", factors[:, block_of[n]].to(g.dtype), g) for n, g in grads.items()}
    return squared, summed


def assert_close_dicts(got: dict, expected: dict, atol: float = ATOL, rtol: float = RTOL, dtype: torch.dtype = torch.float32):
    """allclose per tensor, with atol also scaled down to the tensor's size: heavily clipped
    sums are ~1e-5 per entry, where a bare atol of 1e-6 would hide 10% errors."""
    assert set(got) == set(expected)
    for name in expected:
        assert got[name].dtype == dtype, name
        assert got[name].shape == expected[name].shape, name
        scale = float(expected[name].abs().max()) if expected[name].numel() else 0.0
        tolerance = min(atol, 1e-5 * scale) if scale > 0 else atol
        assert torch.allclose(got[name], expected[name].to(dtype), atol=tolerance, rtol=rtol), name


def assert_close_norms(got: dict, expected: dict):
    """The fast engine's float64 squared norms against a reference's."""
    assert_close_dicts(got, expected, atol=1e-10, dtype=torch.float64)
