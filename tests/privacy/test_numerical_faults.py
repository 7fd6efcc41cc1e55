"""A NaN/inf example contributes nothing and is counted; a non-finite release aborts."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, token_batch

from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.privacy import NonFiniteReleaseError, PrivacyAccountant, Privatizer, build_engine, build_partition


def poisoned(example: torch.Tensor, value: float, added: bool = False):
    """A per-example loss under which the example with these token ids (by what it holds, as data
    makes one) is multiplied by NaN/inf (so is its gradient), or has NaN/inf added (its gradient
    stays finite, its loss does not)."""

    def loss_fn(model, batch):
        losses = per_example_lm_loss(model, batch)
        hit = (batch["input_ids"] == example).all(1)
        return losses + torch.where(hit, value, 0.0) if added else losses * torch.where(hit, value, 1.0)

    return loss_fn


@pytest.mark.parametrize("engine_name", ["opacus", "fast"])
@pytest.mark.parametrize("value,added", [(float("nan"), False), (float("inf"), False), (float("nan"), True)])
def test_nonfinite_example_contributes_zero_and_is_counted(engine_name, value, added):
    model = tiny_gpt2()
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.5, matrix_names=hidden_matrices(model))
    engine = build_engine(engine_name, model, partition)
    batch = token_batch(5, seed=2)
    summed, losses, stats = engine.clipped_sum(batch, poisoned(batch["input_ids"][2], value, added))
    clean = {k: torch.cat([v[:2], v[3:]]) for k, v in batch.items()}
    expected, _, clean_stats = engine.clipped_sum(clean, per_example_lm_loss)
    assert stats.nonfinite == 1 and clean_stats.nonfinite == 0
    for name in summed:
        assert torch.isfinite(summed[name]).all(), name
        assert torch.allclose(summed[name], expected[name], atol=1e-6), name


def test_privatizer_release_stays_finite_and_reports_the_dropped_example():
    model = tiny_gpt2()
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.5)
    pz = Privatizer(model, partition, noise_multiplier=1.0, expected_lot_size=5, sample_rate=0.1, accountant=PrivacyAccountant(1e-5))
    batch = token_batch(5, seed=1)
    first = batch["input_ids"][0]

    def loss_fn(model, rows):  # NaN for one example by what it holds: a NaN by position couples the rows (refused)
        losses = per_example_lm_loss(model, rows)
        return losses * torch.where((rows["input_ids"] == first).all(1), float("nan"), 1.0)

    stats = pz.release([batch], loss_fn)
    assert stats.nonfinite == 1 and stats.lot_size == 5
    assert all(torch.isfinite(p.grad).all() for p in pz.params.values())
    assert stats.train_loss == stats.train_loss  # the NaN loss is excluded from the mean


def test_nonfinite_release_aborts_before_touching_gradients(monkeypatch):
    """A broken engine (e.g. an overflow in a clipped sum) must stop the step, not corrupt it."""
    model = tiny_gpt2()
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.5)
    pz = Privatizer(model, partition, noise_multiplier=1.0, expected_lot_size=5, sample_rate=0.1, accountant=PrivacyAccountant(1e-5))
    honest = pz._engine.add_clipped_sum

    def overflowing(batch, loss_fn, total):
        losses, stats = honest(batch, loss_fn, total)
        total["transformer.ln_f.bias"] += float("inf")
        return losses, stats

    monkeypatch.setattr(pz._engine, "add_clipped_sum", overflowing)
    with pytest.raises(NonFiniteReleaseError, match="transformer.ln_f.bias"):
        pz.release([token_batch(5)], per_example_lm_loss)
    assert all(p.grad is None for p in model.parameters())
    assert pz.accountant.steps == 0
