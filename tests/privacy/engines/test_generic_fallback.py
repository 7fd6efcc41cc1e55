"""The engines' fallback for trainable modules without a rule (`privacy.engine_fallback`):
the fast engine's generic torch.func rule and Opacus' functorch, against the naive loop —
keyword arguments, several inputs and outputs, repeated calls, shared parameters, real HF
families with their rules taken away — and the refusals of what they cannot do exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, fast_squared_norms, tiny_gpt2, token_batch
from reference import assert_close_dicts, assert_close_norms, naive_reference, partition_for
from test_coverage import tiny_model
from torch import nn

from dpmuon.models import per_example_lm_loss
from dpmuon.privacy import build_engine, build_partition
from dpmuon.privacy.engines.base import add_to_lot_total
from dpmuon.privacy.engines.fast import LAYER_RULES, FastEngine

pytestmark = pytest.mark.usefixtures("single_thread")

C = 0.01


class Mixer(nn.Module):
    """y = g ⊙ x · scale + b ⊙ shift, plus a second output: several inputs, a keyword-only
    float, a tuple out — nothing a layer rule knows."""

    def __init__(self, size: int):
        super().__init__()
        self.g = nn.Parameter(1 + 0.1 * torch.randn(size))
        self.b = nn.Parameter(0.1 * torch.randn(size))

    def forward(self, x, shift=None, *, scale=1.0):
        return x * self.g * scale + shift * self.b, x.square().mean(-1)


class MixerNet(nn.Module):
    """Embedding → the same Mixer twice (the second call fed by the first) → Linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.mixer = Mixer(8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids):
        h = self.embed(ids)
        first, aux = self.mixer(h, shift=h.flip(1))
        second, _ = self.mixer(first.tanh(), h, scale=0.5)
        return self.head(second) * aux.unsqueeze(-1)


class Gain(nn.Module):
    def __init__(self, gain: nn.Parameter):
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


class ScaledLookup(nn.Embedding):
    """An embedding subclass no rule knows (dispatch is by exact type)."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


class SharedNet(nn.Module):
    """Two generic modules sharing one parameter, and an unknown embedding tied to a Linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = ScaledLookup(VOCAB, 8)
        shared = nn.Parameter(1 + 0.1 * torch.randn(8))
        self.gain_a, self.gain_b = Gain(shared), Gain(shared)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.gain_b(self.gain_a(self.embed(ids)).tanh()))


def loss_fn(model, batch):
    return model(batch["input_ids"]).square().mean((1, 2))


BATCH = {"input_ids": torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))}


def everything(model):
    return build_partition([n for n, _ in model.named_parameters()], clip_norm=C)


def check_fast_against_naive(model, partition, batch, loss):
    ref_squared, ref_summed = naive_reference(model, partition, batch, loss)
    engine = FastEngine(model, partition)
    assert_close_norms(fast_squared_norms(engine, batch, loss)[0], {n: v.double() for n, v in ref_squared.items()})
    summed, _, stats = engine.clipped_sum(batch, loss)
    assert_close_dicts(summed, ref_summed)
    assert stats.clipped.sum() > 0
    return engine


def test_generic_rule_handles_keywords_several_outputs_and_repeated_calls():
    model = MixerNet()
    engine = check_fast_against_naive(model, everything(model), BATCH, loss_fn)
    assert engine.fallback_summary.startswith("engine fallback (generic") and "mixer (Mixer)" in engine.fallback_summary
    assert f"{16 / sum(p.numel() for p in model.parameters()):.2%} of trainable parameters" in engine.fallback_summary


def test_shared_parameters_with_a_generic_holder_are_formed_once_over_all_their_holders():
    model = SharedNet()
    engine = check_fast_against_naive(model, everything(model), BATCH, loss_fn)
    # The tied Linear head joins its unknown embedding in the generic rule: one formed gradient.
    assert "head (Linear)" in engine.fallback_summary and "embed (ScaledLookup)" in engine.fallback_summary
    assert engine.tied == [] and any(len(group) == 2 for group in engine.generic_groups)


class ShiftedGain(Gain):
    """A generic module sharing its gain and holding a parameter of its own."""

    def __init__(self, gain: nn.Parameter):
        super().__init__(gain)
        self.shift = nn.Parameter(0.1 * torch.randn(8))

    def forward(self, x):
        return x * self.gain + self.shift


class SharedOwnNet(SharedNet):
    """SharedNet whose second gain also has its own parameter: merged into the first's trace, it
    is booked with the group, not by the first module's names."""

    def __init__(self):
        super().__init__()
        self.gain_b = ShiftedGain(self.gain_a.gain)


@pytest.mark.parametrize("model_name", ["tied-gpt2", "shared-generic", "shared-generic-own"])
def test_adding_into_the_lot_total_module_by_module_adds_what_clipped_sum_returns(model_name):
    """The privatizer's path books each parameter's fp32 sum into the float64 total as soon as its
    last module is done (a tied weight after its embedding; a merged generic group's members at
    once): the same totals, bit for bit, as adding each micro-batch's whole clipped_sum."""
    if model_name == "tied-gpt2":
        model, loss, batch = tiny_gpt2(tie=True), per_example_lm_loss, token_batch(6, seed=2)
    else:
        model = SharedNet() if model_name == "shared-generic" else SharedOwnNet()
        loss, batch = loss_fn, {"input_ids": torch.randint(0, VOCAB, (6, 6), generator=torch.Generator().manual_seed(2))}
    engine = FastEngine(model, everything(model))
    halves = [{k: v[rows] for k, v in batch.items()} for rows in (slice(0, 3), slice(3, 6))]
    expected: dict[str, torch.Tensor] = {}
    for half in halves:
        add_to_lot_total(expected, engine.clipped_sum(half, loss)[0])
    total: dict[str, torch.Tensor] = {}
    for half in halves:
        engine.add_clipped_sum(half, loss, total)
    assert total.keys() == expected.keys() == {n for n, p in model.named_parameters()}
    assert all(total[name].dtype == torch.float64 and torch.equal(total[name], expected[name]) for name in expected)


@pytest.fixture
def without_hf_rules(monkeypatch):
    """The fast engine as if it knew none of the HF norm and embedding classes."""
    for cls in [c for c in LAYER_RULES if c.__module__.startswith("transformers.models.")]:
        monkeypatch.delitem(LAYER_RULES, cls)


@pytest.mark.parametrize("family", ["gemma", "qwen3", "opt"])
def test_real_families_without_their_rules_train_exactly_through_the_generic_rule(family, without_hf_rules):
    model = tiny_model(family)
    partition = partition_for(model, C)
    engine = check_fast_against_naive(model, partition, token_batch(3, length=10, seed=5), per_example_lm_loss)
    assert "Norm" in engine.fallback_summary or "Embedding" in engine.fallback_summary


def test_fallback_error_refuses_in_both_engines():
    model = MixerNet()
    with pytest.raises(ValueError, match=r"'mixer\.g' is held by module 'mixer' of type Mixer.*privacy\.engine_fallback=generic"):
        FastEngine(model, everything(model), fallback="error")
    with pytest.raises(ValueError, match=r"'mixer' of type Mixer .* has no Opacus grad sampler and privacy.engine_fallback=error"):
        build_engine("opacus", model, everything(model), fallback="error")
    with pytest.raises(ValueError, match="unknown privacy.engine_fallback 'maybe'"):
        FastEngine(model, everything(model), fallback="maybe")


def test_opacus_functorch_fallback_matches_the_naive_loop_and_refuses_keyword_calls():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), Gain(nn.Parameter(1 + 0.1 * torch.randn(8))), nn.Linear(8, 5))
    _, ref_summed = naive_reference(model, everything(model), BATCH, loss_fn)
    engine = build_engine("opacus", model, everything(model))
    try:
        assert "1 (Gain)" in engine.fallback_summary
        assert_close_dicts(engine.clipped_sum(BATCH, loss_fn)[0], ref_summed)
    finally:
        engine.close()
    keyed = MixerNet()
    engine = build_engine("opacus", keyed, everything(keyed))
    try:
        keyed(BATCH["input_ids"])  # outside a release (evaluation, decoding), any call is fine
        with pytest.raises(ValueError, match=r"'mixer' \(Mixer\) has no Opacus grad sampler.*keywords \['shift'\]"):
            engine.clipped_sum(BATCH, loss_fn)
    finally:
        engine.close()


class NoisyGain(Gain):
    def forward(self, x):
        return nn.functional.dropout(x * self.gain, 0.5, training=True)


class BatchCentered(Gain):
    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) * self.gain  # example i's output depends on the others


@pytest.mark.parametrize(("middle", "message"), [(NoisyGain, "cannot form per-example gradients of NoisyGain"), (BatchCentered, "do not add up")])
def test_what_the_generic_rule_cannot_do_exactly_is_refused(middle, message):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), middle(nn.Parameter(1 + 0.1 * torch.randn(8))), nn.Linear(8, 5))
    engine = FastEngine(model, everything(model))
    with pytest.raises(ValueError, match=message):
        engine.clipped_sum(BATCH, loss_fn)


class OutsideUse(nn.Module):
    """A head that reuses the embedding's weight through F.linear: a use no module call shows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.embed = nn.Embedding(VOCAB, 8)

    def forward(self, ids):
        return nn.functional.linear(self.embed(ids).tanh(), self.embed.weight)


def test_a_parameter_used_outside_its_modules_calls_is_refused_on_the_first_micro_batch():
    model = OutsideUse()
    engine = FastEngine(model, everything(model))
    with pytest.raises(ValueError, match=r"'embed\.weight' do not add up to its batch gradient.*used outside the calls"):
        engine.clipped_sum(BATCH, loss_fn)
    tied = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB, bias=False))
    tied[1].weight = tied[0].weight  # the same sharing through module calls is seen, and passes
    engine = FastEngine(tied, everything(tied))
    engine.clipped_sum(BATCH, loss_fn)
    assert engine.uses_checked


def test_the_use_check_cannot_be_passed_by_a_first_micro_batch_without_gradient():
    """The check runs on a public stand-in of the first micro-batch, not on its rows: a first
    micro-batch whose losses all weigh 0 (filler rows without labels, as a constant-time lot
    with few examples has) gives zero gradients on both sides, which would pass it for good."""

    def weighted(model, batch):
        return loss_fn(model, batch) * batch["weight"]

    model = OutsideUse()
    engine = FastEngine(model, everything(model))
    with pytest.raises(ValueError, match="do not add up to its batch gradient"):
        engine.clipped_sum(BATCH | {"weight": torch.zeros(4)}, weighted)
