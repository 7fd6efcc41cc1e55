"""Per-example gradients of GPT-2 (Conv1D, wte, wpe, LayerNorm, tied/untied head) vs a naive loop."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, token_batch
from reference import naive_per_example_gradients

from dpmuon.models import per_example_lm_loss
from dpmuon.privacy import build_engine, build_partition
from dpmuon.privacy.clipping import CLIP_MARGIN


@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "untied-head"])
@pytest.mark.parametrize("left_pad", [False, True], ids=["right-pad", "left-pad"])
def test_opacus_per_example_gradients_match_naive_loop(tie, left_pad):
    model = tiny_gpt2(tie=tie)
    batch = token_batch(5, left_pad=left_pad, seed=3)
    expected = naive_per_example_gradients(model, batch)
    names = list(expected)
    engine = build_engine("opacus", model, build_partition(names))
    got, losses = engine.per_example_gradients(batch, per_example_lm_loss)
    assert set(got) == set(expected)
    for name in names:
        assert torch.allclose(got[name], expected[name], atol=1e-6, rtol=1e-4), name
    # The position embedding gets a distinct gradient per example (batch-shaped position ids).
    wpe = got["transformer.wpe.weight"]
    assert not torch.allclose(wpe[0], wpe[1])
    # No gradient of any kind is left behind on the parameters.
    assert all(p.grad is None for p in model.parameters())
    assert losses.shape == (5,)


def test_tied_head_gradient_sums_both_uses():
    """With a tied head the token embedding's gradient has an embedding part and a head part."""
    model = tiny_gpt2(tie=True)
    batch = token_batch(3, seed=1)
    engine = build_engine("opacus", model, build_partition([n for n, _ in model.named_parameters()]))
    got, _ = engine.per_example_gradients(batch, per_example_lm_loss)
    wte = got["transformer.wte.weight"][0]
    # The head touches every vocabulary row; the lookup alone would touch only the used tokens.
    used = set(batch["input_ids"][0].tolist())
    unused_rows = [r for r in range(wte.shape[0]) if r not in used]
    assert wte[unused_rows].abs().sum() > 0


def test_clipped_sum_equals_clipped_naive_gradients():
    model = tiny_gpt2(tie=False)
    batch = token_batch(6, seed=4)
    naive = naive_per_example_gradients(model, batch)
    from dpmuon.models import hidden_matrices

    partition = build_partition(list(naive), clip_norm=0.5, matrix_names=hidden_matrices(model))
    engine = build_engine("opacus", model, partition)
    summed, _, stats = engine.clipped_sum(batch, per_example_lm_loss)
    for block in partition.blocks:
        norms = torch.stack([naive[n].flatten(1).pow(2).sum(1) for n in block.params]).sum(0).sqrt()
        factor = (block.threshold * CLIP_MARGIN / norms).clamp(max=1.0)
        for n in block.params:
            expected = torch.einsum("b,b...->...", factor, naive[n])
            assert torch.allclose(summed[n], expected, atol=1e-6, rtol=1e-4), n
    assert stats.examples == 6 and stats.nonfinite == 0
