"""Model construction: random init, a local pretrained directory (the hub path offline), untying."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, tiny_gpt2, token_batch
from helpers_tokenizers import StubTokenizer

from dpmuon.models import IGNORE_INDEX, build_model, context_length, hidden_matrices, lm_head_is_tied, per_example_lm_loss, untie_lm_head, weights_fingerprint


def test_local_directory_loads_like_a_hub_id_and_grows_for_the_pad_token(tmp_path):
    saved = tiny_gpt2(tie=True)
    saved.save_pretrained(tmp_path)
    cfg = {"name_or_path": str(tmp_path), "untie_head": False}
    model = build_model(cfg, StubTokenizer(VOCAB + 1))
    assert model.get_input_embeddings().num_embeddings == VOCAB + 1  # pad row added
    assert torch.equal(model.get_input_embeddings().weight[:VOCAB], saved.get_input_embeddings().weight)
    assert lm_head_is_tied(model) and model.config.pad_token_id == VOCAB
    assert context_length(cfg) == 32


def test_random_init_is_seeded_and_can_be_untied():
    cfg = {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 24, "untie_head": True}
    a, b = build_model(cfg, StubTokenizer(50), seed=3), build_model(cfg, StubTokenizer(50), seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not lm_head_is_tied(a)
    assert torch.equal(a.get_output_embeddings().weight, a.get_input_embeddings().weight)  # a copy, not a share
    assert context_length(cfg) == 24


def test_untying_gives_the_head_its_own_parameter_and_block():
    model = tiny_gpt2(tie=True)
    names_before = {n for n, _ in model.named_parameters()}
    untie_lm_head(model)
    names_after = {n for n, _ in model.named_parameters()}
    assert names_after - names_before == {"lm_head.weight"}
    assert "lm_head.weight" not in hidden_matrices(model)  # the head is not a Muon matrix
    assert set(hidden_matrices(model)) == {f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


def test_weights_fingerprint_survives_a_save_and_load_and_sees_one_changed_entry(tmp_path):
    saved = tiny_gpt2(tie=True)
    saved.save_pretrained(tmp_path)
    loaded = build_model({"name_or_path": str(tmp_path)}, StubTokenizer(VOCAB))
    assert weights_fingerprint(loaded) == weights_fingerprint(saved)
    with torch.no_grad():
        next(loaded.transformer.h[0].parameters()).view(-1)[0] += 1e-6
    assert weights_fingerprint(loaded) != weights_fingerprint(saved)


def test_the_architecture_option_offers_exactly_the_registered_families():
    from dpmuon.models import ARCHITECTURES
    from dpmuon.models.settings import ARCHITECTURE_NAMES

    assert ARCHITECTURE_NAMES == tuple(ARCHITECTURES)


@pytest.mark.parametrize("left_pad", [False, True])
def test_per_example_loss_shifts_the_labels_and_matches_cross_entropy_of_the_sliced_logits(left_pad):
    """The loss predicts each label from the position before it (labels shifted, never the
    logits sliced: that copies a [B, T, vocab] tensor forward and zero-fills another backward), and
    its own cross-entropy (`TokenNLL`) gives F.cross_entropy's losses and gradient to float
    rounding, with exact zeros wherever nothing is predicted: the engines skip those positions."""
    batch = token_batch(4, seed=3, left_pad=left_pad)
    logits = torch.randn(4, batch["input_ids"].shape[1], VOCAB, generator=torch.Generator().manual_seed(0), requires_grad=True)

    class Fixed(torch.nn.Module):  # a model whose logits are given
        def forward(self, **kwargs):
            return type("Output", (), {"logits": logits})()

    losses = per_example_lm_loss(Fixed(), batch)
    (grad,) = torch.autograd.grad(losses.sum(), logits)
    labels = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
    expected = nll.sum(1) / (labels != IGNORE_INDEX).sum(1).clamp_min(1)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-8)
    assert torch.equal(grad.ne(0).any(-1), expected_grad.ne(0).any(-1))  # the same positions exactly zero
    assert not grad[:, -1].any()  # the last position predicts nothing


def test_token_nll_is_stable_at_extreme_logits_and_zero_where_ignored():
    """Logits far apart (a softmax of exact 0s and 1s) give finite losses and the float64
    reference's gradient; an all-ignored batch gives zero losses and an all-zero gradient."""
    from dpmuon.models.lm import TokenNLL

    logits = torch.tensor([[1e4, -1e4, 0.0], [-3e4, 3e4, 2e4], [5.0, 5.0, 5.0]], requires_grad=True)
    labels = torch.tensor([1, 1, IGNORE_INDEX])
    weights = torch.tensor([0.5, 2.0, 7.0])
    nll = TokenNLL.apply(logits, labels)
    (grad,) = torch.autograd.grad((nll * weights).sum(), logits)
    reference = logits.detach().double().requires_grad_()
    ref_nll = F.cross_entropy(reference, labels, ignore_index=IGNORE_INDEX, reduction="none")
    (ref_grad,) = torch.autograd.grad((ref_nll * weights.double()).sum(), reference)
    torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=1e-6)
    assert torch.equal(grad[2], torch.zeros(3))
    ignored = TokenNLL.apply(logits, torch.full((3,), IGNORE_INDEX))
    assert torch.equal(ignored, torch.zeros(3)) and not torch.autograd.grad(ignored.sum(), logits)[0].any()
