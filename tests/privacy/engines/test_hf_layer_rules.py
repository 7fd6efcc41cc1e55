"""The HF classes the engines have fast rules for: each class's own forward against the maths its
rule assumes, on random inputs — so a transformers release that changes a forward fails here
rather than clipping a wrong gradient — and each registration in both engines."""

from __future__ import annotations

import pytest
import torch
from opacus.grad_sample.utils import GradSampleHooks
from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding
from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

from dpmuon.privacy.engines.fast import LAYER_RULES, RMSNormLayer
from dpmuon.privacy.engines.fast.layers import OffsetEmbeddingLayer, ScaledEmbeddingLayer
from dpmuon.privacy.engines.norms import HF_OFFSET_RMS_NORMS, HF_RMS_NORMS, rms_normalized
from dpmuon.privacy.engines.opacus_samplers import embedding_grad_sample, rms_norm_grad_sample

D = 12
EPS = 0.3  # large, so a rule that misreads ε fails


def random_input(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed)) * 2


def test_every_family_norm_class_is_listed():
    names = {cls.__name__ for cls in HF_RMS_NORMS + HF_OFFSET_RMS_NORMS}
    expected = {"Llama", "Qwen2", "Qwen3", "Mistral", "Olmo2", "Phi3", "Gemma", "Gemma2"}
    assert names == {f"{family}RMSNorm" for family in expected}


@pytest.mark.parametrize("cls", HF_RMS_NORMS, ids=lambda c: c.__name__)
def test_rms_norm_forward_is_gamma_times_the_rules_normalized_input(cls):
    norm = cls(D, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D))
    x = random_input()
    assert torch.allclose(norm(x), norm.weight * rms_normalized(norm, x), atol=1e-6)
    assert LAYER_RULES[cls] is RMSNormLayer and GradSampleHooks.GRAD_SAMPLERS[cls] is rms_norm_grad_sample


@pytest.mark.parametrize("cls", HF_OFFSET_RMS_NORMS, ids=lambda c: c.__name__)
def test_offset_rms_norm_forward_is_one_plus_gamma_times_the_rules_normalized_input(cls):
    """Gemma's: (1 + γ) ⊙ x̂, whose gradient in γ is x̂ as for γ ⊙ x̂ — the same rule."""
    norm = cls(D, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D))
    x = random_input(1)
    assert torch.allclose(norm(x), (1 + norm.weight) * rms_normalized(norm, x), atol=1e-6)
    assert LAYER_RULES[cls] is RMSNormLayer and GradSampleHooks.GRAD_SAMPLERS[cls] is rms_norm_grad_sample


@pytest.mark.parametrize("cls", [GemmaTextScaledWordEmbedding, Gemma2TextScaledWordEmbedding], ids=lambda c: c.__name__)
def test_scaled_embedding_forward_is_a_lookup_times_its_scale_and_the_rule_scales_the_gradient(cls):
    embedding = cls(30, D, padding_idx=0, embed_scale=3.5)
    ids = torch.randint(0, 30, (2, 7), generator=torch.Generator().manual_seed(2))
    assert torch.equal(embedding(ids), embedding.weight[ids] * 3.5)
    b = torch.randn(2, 7, D)
    trace = ScaledEmbeddingLayer(embedding, {"weight": "w"}).trace([ids], [b])
    padding = (ids == 0).unsqueeze(-1)
    assert torch.allclose(trace.grads, (b * 3.5).masked_fill(padding, 0))
    assert LAYER_RULES[cls] is ScaledEmbeddingLayer and GradSampleHooks.GRAD_SAMPLERS[cls] is embedding_grad_sample


@pytest.mark.parametrize("given_positions", [False, True], ids=["from-mask", "position_ids"])
def test_opt_positions_are_an_offset_lookup_of_the_ids_the_rule_records(given_positions):
    embedding = OPTLearnedPositionalEmbedding(16, D)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    kwargs = {"position_ids": (mask.cumsum(1) - 1).clamp_min(0)} if given_positions else {}
    args = (mask, 0)
    out = embedding(*args, **kwargs)
    ids, outputs = OffsetEmbeddingLayer(embedding, {"weight": "w"}).record(args, kwargs, out)
    assert outputs == [out] and torch.equal(out, embedding.weight[ids])
    assert LAYER_RULES[OPTLearnedPositionalEmbedding] is OffsetEmbeddingLayer


def test_opacus_embedding_sampler_leaves_the_padding_row_without_gradient():
    embedding = torch.nn.Embedding(10, 3, padding_idx=1)
    ids = torch.tensor([[1, 2, 1], [3, 3, 1]])
    b = torch.randn(2, 3, 3)
    per_example = embedding_grad_sample(embedding, [ids], b)[embedding.weight]
    for i in range(2):
        expected = torch.autograd.grad((embedding(ids[i : i + 1]) * b[i : i + 1]).sum(), embedding.weight)[0]
        assert torch.allclose(per_example[i], expected)
    assert per_example[:, 1].abs().sum() == 0
