"""The fast engine's layer-rule registry: exact-type dispatch, registering a rule for a
third-party class (in both engines), and a loud refusal that says how to register one."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, fast_squared_norms
from opacus.grad_sample.utils import GradSampleHooks, GradSampleHooksFastGradientClipping
from reference import assert_close_dicts, assert_close_norms, naive_reference
from torch import nn

from dpmuon.privacy import build_engine, build_partition
from dpmuon.privacy.engines import register_rms_norm
from dpmuon.privacy.engines.fast import LAYER_RULES, FastEngine, Layer, RMSNormLayer, Trace, register_layer, rule_for
from dpmuon.privacy.engines.opacus_samplers import rms_norm_grad_sample

C = 0.01


class ThirdPartyRMSNorm(nn.Module):
    """An HF-style RMSNorm of a model dpmuon has never seen (a class of its own)."""

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


class Gain(nn.Module):
    """y = x ⊙ g: a layer no built-in rule knows."""

    def __init__(self, size: int):
        super().__init__()
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(size))

    def forward(self, x):
        return x * self.gain


class GainRule(Layer):
    """Per-example gradient of g: Σ_t b_t ⊙ x_t."""

    def trace(self, inputs, grads):
        size = self.module.gain.numel()
        return Trace(torch.cat([x.reshape(x.shape[0], -1, size) for x in inputs], 1), torch.cat([g.reshape(g.shape[0], -1, size) for g in grads], 1))

    def _grads(self, trace):
        return (trace.inputs.float() * trace.grads.float()).sum(1)

    def squared_norms(self, trace):
        return {self.names["gain"]: self._grads(trace).square().sum(1)}

    def clipped_sums(self, trace, scale_of):
        name = self.names["gain"]
        return {name: scale_of(name) @ self._grads(trace)}


def net(middle: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), middle, nn.Linear(8, 5, bias=False))


def loss_fn(model, batch):
    return model(batch["input_ids"]).square().mean((1, 2))


BATCH = {"input_ids": torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))}


def partition(model):
    return build_partition([n for n, _ in model.named_parameters()], clip_norm=C, matrix_names=["2.weight"])


@pytest.fixture
def registry_snapshot():
    """Registrations a test makes are undone afterwards (the registries are process-wide)."""
    registries = [LAYER_RULES, GradSampleHooks.GRAD_SAMPLERS, GradSampleHooksFastGradientClipping.GRAD_SAMPLERS]
    saved = [dict(registry) for registry in registries]
    yield
    for registry, entries in zip(registries, saved):
        registry.clear()
        registry.update(entries)


def test_under_fallback_error_an_unknown_module_is_refused_naming_it_and_how_to_register_a_rule():
    model = net(ThirdPartyRMSNorm(8))
    with pytest.raises(
        ValueError, match=r"'1\.weight' is held by module '1' of type ThirdPartyRMSNorm.*register_layer\(ThirdPartyRMSNorm\).*register_rms_norm"
    ):
        FastEngine(model, partition(model), fallback="error")


def test_dispatch_is_by_exact_type():
    class MyLinear(nn.Linear):  # may use its weight differently in its own forward
        pass

    assert rule_for(nn.Linear(2, 2)) is not None and rule_for(nn.RMSNorm(2)) is RMSNormLayer
    assert rule_for(MyLinear(2, 2)) is None


def test_a_registered_third_party_rms_norm_matches_the_naive_loop_in_both_engines(registry_snapshot):
    model = net(ThirdPartyRMSNorm(8))
    register_rms_norm(ThirdPartyRMSNorm)
    assert GradSampleHooks.GRAD_SAMPLERS[ThirdPartyRMSNorm] is rms_norm_grad_sample  # not Opacus' functorch fallback
    ref_squared, ref_summed = naive_reference(model, partition(model), BATCH, loss_fn)
    fast = FastEngine(model, partition(model))
    assert_close_norms(fast_squared_norms(fast, BATCH, loss_fn)[0], ref_squared)
    assert_close_dicts(fast.clipped_sum(BATCH, loss_fn)[0], ref_summed)
    opacus = build_engine("opacus", model, partition(model))
    try:
        assert_close_dicts(opacus.clipped_sum(BATCH, loss_fn)[0], ref_summed)
    finally:
        opacus.close()


def test_a_custom_rule_for_a_new_layer_matches_the_naive_loop(registry_snapshot):
    model = net(Gain(8))
    register_layer(Gain)(GainRule)
    ref_squared, ref_summed = naive_reference(model, partition(model), BATCH, loss_fn)
    engine = FastEngine(model, partition(model))
    assert_close_norms(fast_squared_norms(engine, BATCH, loss_fn)[0], {n: v.double() for n, v in ref_squared.items()})
    assert_close_dicts(engine.clipped_sum(BATCH, loss_fn)[0], ref_summed)


def test_torch_rms_norm_matches_the_naive_loop():
    model = net(nn.RMSNorm(8, eps=1e-6))
    ref_squared, ref_summed = naive_reference(model, partition(model), BATCH, loss_fn)
    engine = FastEngine(model, partition(model))
    assert_close_norms(fast_squared_norms(engine, BATCH, loss_fn)[0], ref_squared)
    assert_close_dicts(engine.clipped_sum(BATCH, loss_fn)[0], ref_summed)


def test_only_layer_subclasses_can_be_registered():
    with pytest.raises(TypeError, match="must subclass fast.Layer"):
        register_layer(Gain)(object)
