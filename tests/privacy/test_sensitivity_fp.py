"""Floating point must not break the sensitivity bound.

Each example's clipped contribution must have norm ≤ C_W per block as computed (the clip margin,
privacy/clipping.py, absorbs the fp32 rounding), also where its
gradient is a heavily cancelling sum (the norm formulas lose precision there), and under bf16
autocast the release of neighbouring lots D, D ∪ {x} must differ by at most what the noise
was calibrated for — which needs every example's contribution to be independent of the others.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import VOCAB, tiny_gpt2, token_batch
from torch import nn

from dpmuon.data import EncodedExample
from dpmuon.models import IGNORE_INDEX, hidden_matrices, per_example_lm_loss
from dpmuon.privacy import PrivacyAccountant, Privatizer, build_engine, build_partition
from dpmuon.privacy.engines.fast import FastEngine, ghost_weight_norms
from dpmuon.privacy.engines.fast.kernels import GRAM_SLACK, WIDE_GRAM
from dpmuon.privacy.subnormals import flush_supported, flushing
from dpmuon.training.batching import lot_micro_batches

SLACK = 1.0  # none: clipping to C_W·CLIP_MARGIN keeps computed contributions within C_W


pytestmark = pytest.mark.usefixtures("single_thread")


def cancelling_traces(batch=4, positions=100, dim=64, spread=1e-3, seed=0):
    """Layer inputs a_t ≈ u and output gradients b_t ≈ ±v, half of each sign: g = Σ_t b_t a_tᵀ
    nearly cancels, ‖g‖ ≈ 6000× smaller than Σ_t ‖a_t‖‖b_t‖."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.cat([torch.ones(positions // 2), -torch.ones(positions // 2)]).view(1, positions, 1)
    a = torch.randn(batch, 1, dim, generator=g) + spread * torch.randn(batch, positions, dim, generator=g)
    b = signs * torch.randn(batch, 1, dim, generator=g) + spread * torch.randn(batch, positions, dim, generator=g)
    return a, b


def exact_weight_norms(a, b):
    return (a.double().mT @ b.double()).square().sum((1, 2))


def test_ghost_norms_of_cancelling_gradients_are_exact():
    a, b = cancelling_traces()
    exact = exact_weight_norms(a, b)
    assert torch.allclose(ghost_weight_norms(a, b)[0], exact, rtol=1e-8, atol=0)  # fp32 Grams: norms up to 4% low


class Probe(nn.Module):
    """A linear layer fed given inputs, whose loss Σ_t ⟨y_t, b_t⟩ makes b its output gradient."""

    def __init__(self, dim):
        super().__init__()
        self.layer = nn.Linear(dim, dim, bias=False)

    def forward(self, a):
        return self.layer(a)


def probe_loss(model, batch):
    return (model(batch["a"]) * batch["b"]).sum((1, 2))


def block_norm(summed, block):
    return float(torch.sqrt(sum(summed[n].double().square().sum() for n in block.params)))


def assert_contributions_within_threshold(engine, partition, batch, loss_fn):
    """Each example alone in a micro-batch: its clipped sum is its contribution."""
    size = next(iter(batch.values())).shape[0]
    for i in range(size):
        summed, _, stats = engine.clipped_sum({k: v[i : i + 1] for k, v in batch.items()}, loss_fn)
        assert int(stats.clipped.sum()) == len(partition)  # the bound is at stake only when clipping
        for block in partition.blocks:
            assert block_norm(summed, block) <= block.threshold * SLACK, (i, block.name)


@pytest.mark.parametrize("rule", ["ghost", "direct", "mixed"])
def test_cancelling_gradient_is_clipped_to_threshold(rule):
    a, b = cancelling_traces()
    model = Probe(a.shape[2])
    threshold = 0.5 * float(exact_weight_norms(a, b).sqrt().min())
    partition = build_partition(["layer.weight"], clip_mode="flat", clip_norm=threshold)
    engine = FastEngine(model, partition, weight_norms=rule)
    assert_contributions_within_threshold(engine, partition, {"a": a, "b": b}, probe_loss)


class TiedProbe(nn.Module):
    """An embedding whose weight is also a linear head's: fed ids and given head inputs."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, a):
        return self.embed(ids), self.head(a)


def tied_probe_loss(model, batch):
    embedded, logits = model(batch["ids"], batch["a"])
    return (embedded * batch["b_embed"]).sum((1, 2)) + (logits * batch["b_head"]).sum((1, 2))


def opposing_tied_batch(batch=3, positions=16, vocab=64, dim=32, spread=1e-3, seed=0):
    """Output gradients that make the embedding's gradient rows ≈ −(the head's), so that
    ‖G_head + G_embed‖² is ~1e-6 of ‖G_head‖² + ‖G_embed‖²: their sum cancels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:positions] for _ in range(batch)])
    a = torch.randn(batch, positions, dim, generator=g)
    b_head = torch.zeros(batch, positions, vocab).scatter_(2, ids.unsqueeze(1).expand(-1, positions, -1), torch.randn(batch, positions, positions, generator=g))
    head_rows = (b_head.double().mT @ a.double()).gather(1, ids.unsqueeze(2).expand(-1, -1, dim))
    b_embed = (spread * torch.randn(batch, positions, dim, generator=g, dtype=torch.float64) - head_rows).float()
    return {"ids": ids, "a": a, "b_head": b_head, "b_embed": b_embed}


def exact_tied_norms(batch):
    head = batch["b_head"].double().mT @ batch["a"].double()
    rows = batch["ids"].unsqueeze(2).expand(-1, -1, head.shape[2])
    return (head.scatter_add(1, rows, batch["b_embed"].double())).square().sum((1, 2)).sqrt()


@pytest.mark.parametrize("rule, vocab", [("ghost", 64), ("direct", 64), ("ghost", WIDE_GRAM + 100)])
def test_tied_weight_whose_parts_cancel_is_clipped_to_threshold(rule, vocab):
    """Also over a vocabulary, where the head's Gram rounds in fp32 and its bound is absorbed
    only once the cross term is in (the whole is ~1e-6 of the head's part)."""
    batch = opposing_tied_batch(vocab=vocab)
    model = TiedProbe(vocab, 32)
    partition = build_partition(["embed.weight"], clip_mode="flat", clip_norm=0.5 * float(exact_tied_norms(batch).min()))
    engine = FastEngine(model, partition, weight_norms=rule)
    assert_contributions_within_threshold(engine, partition, batch, tied_probe_loss)


def test_opacus_sums_stay_fp32_inside_an_autocast_region():
    """A caller may run the release under autocast: the sum over examples must not drop to bf16
    (its rounding would grow with the lot). The forward is kept fp32, so results must match."""
    model = tiny_gpt2(tie=True)
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.05, matrix_names=hidden_matrices(model))
    batch = token_batch(3, seed=11)

    def fp32_loss(model, batch):
        with torch.autocast("cpu", enabled=False):
            return per_example_lm_loss(model, batch)

    engine = build_engine("opacus", model, partition)
    expected, _, _ = engine.clipped_sum(batch, per_example_lm_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _, _ = engine.clipped_sum(batch, fp32_loss)
    engine.close()
    for name in expected:
        assert got[name].dtype == torch.float32, name
        assert torch.allclose(got[name], expected[name], rtol=1e-5, atol=1e-9), name


# ---- bf16 autocast over neighbouring lots ---------------------------------------------------

PAD = VOCAB - 1
WIDTH = 32  # the tiny model's context


def random_examples(count, seed, shortest=4, longest=WIDTH):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(shortest, longest + 1, (1,), generator=g))
        prompt = int(torch.randint(1, length // 2 + 1, (1,), generator=g))
        ids = torch.randint(0, PAD, (length,), generator=g).tolist()
        out.append(EncodedExample(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def bf16_loss(model, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return per_example_lm_loss(model, batch)


def noise_free_release(model, partition, engine, examples, lot, micro_batch_size=4):
    privatizer = Privatizer(
        model,
        partition,
        noise_multiplier=0.0,
        expected_lot_size=1.0,
        sample_rate=1.0,
        accountant=PrivacyAccountant(1e-5),
        engine=engine,
    )
    batches = lot_micro_batches(examples, lot, micro_batch_size, PAD, fixed_width=WIDTH, fixed_rows=True)
    stats = privatizer.release(batches, bf16_loss)
    released = {n: p.grad.clone() for n, p in privatizer.params.items()}
    privatizer.close()
    return released, stats


@pytest.mark.parametrize("engine", ["fast", "opacus"])
def test_neighbouring_lots_differ_by_at_most_the_sensitivity_under_bf16(engine):
    """With fixed micro-batch shapes, adding x changes the bf16 release by x's contribution only.

    x is the shortest example, so it regroups every micro-batch: with dynamic shapes the others'
    contributions move here by 5e-3·C_W in sum, and the difference exceeds C_W by 2–3e-4.
    """
    model = tiny_gpt2(tie=True)
    partition = build_partition([n for n, _ in model.named_parameters()], clip_mode="per_matrix", clip_norm=1e-3, matrix_names=hidden_matrices(model))
    examples = random_examples(13, seed=0) + [EncodedExample([5, 6, 7], [IGNORE_INDEX, 6, 7])]
    lot = list(range(13))
    without_x, stats = noise_free_release(model, partition, engine, examples, lot)
    with_x, stats_x = noise_free_release(model, partition, engine, examples, lot + [13])
    assert (stats.lot_size, stats_x.lot_size) == (13, 14)  # filler rows are not examples
    squares = []
    for block in partition.blocks:
        difference = block_norm({n: with_x[n] - without_x[n] for n in block.params}, block)
        assert difference <= block.threshold * SLACK, block.name
        squares.append(difference**2)
    assert sum(squares) ** 0.5 <= partition.sensitivity * SLACK


# ---- underflow: an absolute error, so the thresholds have a floor ------------------------------


def clipped_contribution(a, b, threshold, norms):
    """One example's clipped book-keeping sum, as the fast engine computes it, and its norm."""
    from dpmuon.privacy.clipping import clip_factors
    from dpmuon.privacy.engines.fast import weighted_outer_sum

    factors = clip_factors(norms(a, b).double().sqrt().unsqueeze(1), [threshold]).float()
    return float(weighted_outer_sum(a, b, factors[:, 0], out_in=True).double().norm())


@pytest.mark.skipif(not flush_supported(), reason="no flush-to-zero on this CPU")
@pytest.mark.parametrize("flush", [False, True])
def test_flushed_products_in_a_sum_break_a_tiny_threshold(flush):
    """A 1 × 1 layer whose gradient Σ_t a_t·b_t = 2⁻¹¹⁹ − 1024·2⁻¹³⁰ = 2⁻¹²⁰: its 1024 small
    products are subnormal, so under flush-to-zero the book-keeping sum reads 2⁻¹¹⁹ — clipped at
    C_W = 2⁻¹²¹, the contribution is 2·C_W (the norm, float64, is exact either way)."""
    a = torch.full((1, 1025, 1), 2.0**-65)
    b = torch.full((1, 1025, 1), -(2.0**-65))
    b[0, -1, 0] = 2.0**-54
    threshold = 2.0**-121
    with flushing() if flush else contextlib.nullcontext():
        contribution = clipped_contribution(a, b, threshold, lambda a, b: ghost_weight_norms(a, b)[0])
    assert contribution > 1.9 * threshold if flush else contribution <= threshold


@pytest.mark.skipif(not flush_supported(), reason="no flush-to-zero on this CPU")
@pytest.mark.parametrize("flush, entry", [(True, 2.0**-70), (False, 2.0**-76)])
def test_fp32_squares_that_underflow_break_a_tiny_threshold(flush, entry):
    """Direct fp32 norms of a gradient whose 4096 entries have squares below fp32's range (flushed
    under flush-to-zero, rounded to 0 below 2⁻¹⁵⁰ without): the norm reads 0, the example is not
    clipped, and it contributes 2·C_W at C_W = 32·entry (2.7e-20 and 4.2e-22: the floor was once
    1e-20, for the flushed sums above only)."""
    from dpmuon.privacy.engines.fast import direct_weight_norms

    a = torch.full((1, 1, 64), entry**0.5)
    threshold = 32 * entry
    with flushing() if flush else contextlib.nullcontext():
        assert float(direct_weight_norms(a, a)) == 0.0
        contribution = clipped_contribution(a, a, threshold, direct_weight_norms)
    assert contribution == pytest.approx(2 * threshold)


def crafted_example(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One example's (a, b) at a 1 × 1 layer, built against the fp32 book-keeping:
    underflow: a normal product 1.01·3e28 and a tiny input (1e-10) times −3e38, which cancel to
    1% — scaled by the factor (~3e-30), the tiny input is subnormal and flushed, and the rest,
    ~100·C_W, is summed unclipped against it; overflow: products +3e38, +3e38, −3e38, −3e38,
    which cancel exactly (norm 0, factor 1) but whose fp32 partial sums leave fp32's range, so the
    sum would not be finite. (The layer's weight is 0, so the loss itself stays finite.)"""
    if case == "underflow":
        return torch.tensor([[[1.0], [1e-10]]]), torch.tensor([[[3e38 * 1e-10 * 1.01], [-3e38]]])
    return torch.full((1, 4, 1), 1e19), torch.tensor([[[3e19], [3e19], [-3e19], [-3e19]]])


@pytest.mark.skipif(not flush_supported(), reason="no flush-to-zero on this CPU")
@pytest.mark.parametrize("case, flush", [("underflow", True), ("underflow", False), ("overflow", False)])
def test_an_example_with_traces_beyond_the_bound_is_dropped(case, flush, monkeypatch):
    """Beside an ordinary example, the crafted one contributes nothing and is counted as dropped,
    so the release is the ordinary example's alone. Without TRACE_BOUND the crafted one alone
    contributes ~100·C_W flushed (underflow) or makes the sum non-finite, which stops the run
    whenever it is drawn (overflow)."""
    from dpmuon.privacy.engines.fast import layers

    crafted_a, crafted_b = crafted_example(case)
    g = torch.Generator().manual_seed(0)
    positions = crafted_a.shape[1]
    ordinary = {"a": torch.randn(1, positions, 1, generator=g), "b": torch.randn(1, positions, 1, generator=g)}
    both = {"a": torch.cat([crafted_a, ordinary["a"]]), "b": torch.cat([crafted_b, ordinary["b"]])}
    partition = build_partition(["layer.weight"], clip_mode="flat", clip_norm=1e-3)
    model = Probe(1)
    nn.init.zeros_(model.layer.weight)
    engine = FastEngine(model, partition, weight_norms="ghost")
    with flushing() if flush else contextlib.nullcontext():
        summed, _, stats = engine.clipped_sum(both, probe_loss)
        alone, _, _ = engine.clipped_sum(ordinary, probe_loss)
        monkeypatch.setattr(layers, "TRACE_BOUND", float("inf"))
        unguarded, _, _ = engine.clipped_sum({"a": crafted_a, "b": crafted_b}, probe_loss)
    assert stats.nonfinite == 1 and stats.examples == 2
    assert torch.equal(summed["layer.weight"], alone["layer.weight"])
    if case == "overflow":
        assert not torch.isfinite(unguarded["layer.weight"]).all()
    elif flush:
        assert block_norm(unguarded, partition.blocks[0]) > 50 * 1e-3
    else:  # gradual underflow loses at most 2⁻¹⁵⁰·3e38 here: clipped as analysed
        assert block_norm(unguarded, partition.blocks[0]) <= 1e-3


def test_thresholds_below_the_floor_are_refused():
    from dpmuon.privacy.blocks import MIN_THRESHOLD, Block, BlockPartition

    with pytest.raises(ValueError, match="need a finite C_W ≥ 1e-12"):
        BlockPartition((Block("layer", ("layer.weight",), 2.0**-70),))
    with pytest.raises(ValueError, match="privacy.clip_norm"):  # C/√2 per matrix: below the floor
        build_partition(["a.weight", "b.weight"], clip_mode="per_matrix", clip_norm=1.2 * MIN_THRESHOLD, matrix_names=["a.weight", "b.weight"])
    assert build_partition(["layer.weight"], clip_mode="flat", clip_norm=MIN_THRESHOLD).blocks[0].threshold == MIN_THRESHOLD


# ---- the lot total and the skipped positions ------------------------------------------------


def test_lot_total_is_float64_for_every_lot():
    """A lot of 1024 in micro-batches of 8: the total is the exact sum to float64 rounding, and it
    is float64 from the first micro-batch on, so no lot's size changes how (or how long) it adds."""
    from dpmuon.privacy.engines.base import add_to_lot_total

    g = torch.Generator().manual_seed(0)
    parts = [{"w": torch.randn(5, 3, generator=g)} for _ in range(128)]
    summed = {}
    for part in parts:
        add_to_lot_total(summed, part)
        assert summed["w"].dtype == torch.float64
    exact = torch.stack([p["w"].double() for p in parts]).sum(0)
    assert torch.allclose(summed["w"], exact, rtol=0, atol=1e-12)


def test_lot_total_added_in_pieces_is_the_whole_add_bit_for_bit(monkeypatch):
    """The CPU adds into a total piece by piece (LOT_TOTAL_PIECE elements): every piece, the last
    short one and transposed (non-contiguous) parts added into a contiguous total included, gets
    what one whole add gives it."""
    from dpmuon.privacy.engines import base

    monkeypatch.setattr(base, "LOT_TOTAL_PIECE", 7)
    g = torch.Generator().manual_seed(2)
    parts = [
        {"w": torch.randn(6, 5, generator=g) * 10.0 ** float(i), "t": torch.randn(4, 6, generator=g).mT if i > -3 else torch.randn(6, 4, generator=g)}
        for i in range(-3, 4)
    ]
    summed = {}
    for part in parts:
        base.add_to_lot_total(summed, part)
    expected = {name: parts[0][name].double() for name in parts[0]}
    for part in parts[1:]:
        for name, value in part.items():
            expected[name] += value
    assert all(torch.equal(summed[name], expected[name]) for name in expected)


def test_positions_without_output_gradient_are_skipped_exactly():
    """Zero b_t rows (padding, an unlabelled prompt at the LM head) leave the norms and the
    book-keeping sum unchanged when the kernels skip them."""
    from dpmuon.privacy.engines.fast import weighted_outer_sum

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 12, 6, generator=g), torch.randn(4, 12, 9, generator=g)
    b[:, :5] = 0  # a prompt
    b[2, 8:] = 0  # padding of one example
    active = b.ne(0).any(-1)
    norms, grads, rounding = ghost_weight_norms(a, b, active)
    assert norms.dtype == grads.dtype == torch.float64 and not rounding.any()  # float64 Grams at 9 features
    assert torch.allclose(norms, exact_weight_norms(a, b), rtol=1e-12, atol=0)
    assert torch.allclose(grads, b.double().square().sum((1, 2)), rtol=1e-12, atol=0)
    scale = torch.rand(4, generator=g)
    for out_in in (True, False):
        expected = torch.einsum("i,itj,itk->jk", scale.double(), b.double(), a.double())
        got = weighted_outer_sum(a, b, scale, out_in, active=active).double()
        assert torch.allclose(got, expected if out_in else expected.T, atol=1e-6), out_in


def cancelling_wide_traces(batch=6, positions=24, d_in=16, spread=1e-4, seed=0):
    """cancelling_traces with output gradients over a vocabulary (WIDE_GRAM features, where the
    CPU's Grams are fp32 in chunks): ‖g‖² is ~1e-8 of (Σ_t ‖a_t‖‖b_t‖)², far below fp32's rounding."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.cat([torch.ones(positions // 2), -torch.ones(positions // 2)]).view(1, positions, 1)
    a = torch.randn(batch, 1, d_in, generator=g) + spread * torch.randn(batch, positions, d_in, generator=g)
    b = signs * torch.randn(batch, 1, WIDE_GRAM + 100, generator=g) + spread * torch.randn(batch, positions, WIDE_GRAM + 100, generator=g)
    return a, b


def test_a_wide_grams_rounding_is_bounded_and_absorbed():
    """Over a vocabulary the Grams round in fp32: the norm may come out far from ‖g‖² when the
    sum cancels, but never by more than the bound returned with it, and the norm the engine clips
    with (`within_gram_slack`) is then ≥ ‖g‖²/(1 + GRAM_SLACK). Ordinary sequences stay within the
    slack, so their norms are left as computed."""
    from dpmuon.privacy.engines.fast.kernels import within_gram_slack

    a, b = cancelling_wide_traces()
    exact = exact_weight_norms(a, b)
    norms, grads, rounding = ghost_weight_norms(a, b)
    assert ((norms - exact).abs() <= rounding).all() and (rounding > 0).all()
    assert ((norms - exact).abs() > GRAM_SLACK * exact).any()  # the slack alone would not cover it
    assert (within_gram_slack(norms, rounding) * (1 + GRAM_SLACK) >= exact).all()
    assert (grads >= b.double().square().sum((1, 2))).all()  # the trace errs towards the bound
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 20, 16, generator=g), torch.randn(3, 20, WIDE_GRAM + 100, generator=g)
    norms, _, rounding = ghost_weight_norms(a, b)
    assert torch.equal(within_gram_slack(norms, rounding), norms)
    assert torch.allclose(norms, exact_weight_norms(a, b), rtol=1e-6, atol=0)


def test_a_wide_cancelling_gradient_is_clipped_to_threshold():
    a, b = cancelling_wide_traces()

    class WideProbe(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(a.shape[2], b.shape[2], bias=False)

        def forward(self, x):
            return self.layer(x)

    threshold = 0.5 * float(exact_weight_norms(a, b).sqrt().min())
    partition = build_partition(["layer.weight"], clip_mode="flat", clip_norm=threshold)
    engine = FastEngine(WideProbe(), partition, weight_norms="ghost")
    assert_contributions_within_threshold(engine, partition, {"a": a, "b": b}, probe_loss)


def test_wide_grams_stay_float64_when_fp32_matmuls_are_set_below_ieee():
    """`torch.set_float32_matmul_precision("medium")` lets the CPU's fp32 products run in bf16,
    which the fp32 bound does not cover: the Grams are then float64 again, with no rounding to bound."""
    a, b = cancelling_wide_traces(batch=1)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        norms, _, rounding = ghost_weight_norms(a, b)
    finally:
        torch.set_float32_matmul_precision(before)
    assert not rounding.any()
    assert torch.allclose(norms, exact_weight_norms(a, b), rtol=1e-6, atol=0)  # fp32 Grams: off by 100% or more here


@pytest.mark.parametrize("engine", ["fast-ghost", "fast-direct", "opacus"])
def test_a_coarse_fp32_matmul_setting_does_not_reach_the_clipped_sums(engine):
    """`torch.set_float32_matmul_precision("medium")` (bf16 products, on a CPU with bf16 units as
    this one; elsewhere the setting changes nothing and this passes either way): the user's
    forward and backward keep it, the engines' norms and sums do not (`ieee_fp32_matmuls`): the
    fast engine's book-keeping sum otherwise came out 1.5× C_W (Opacus' sum over examples, which
    runs inside it too, did not break on these inputs)."""
    a, b = cancelling_traces(batch=2)
    model = Probe(a.shape[2])
    threshold = 0.5 * float(exact_weight_norms(a, b).sqrt().min())
    partition = build_partition(["layer.weight"], clip_mode="flat", clip_norm=threshold)
    name, _, rule = engine.partition("-")
    built = FastEngine(model, partition, weight_norms=rule) if name == "fast" else build_engine("opacus", model, partition)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert_contributions_within_threshold(built, partition, {"a": a, "b": b}, probe_loss)
        assert torch.get_float32_matmul_precision() == "medium"  # the caller's setting, after the release
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_wide_gram_holds_a_bounded_number_of_chunk_grams_at_once(monkeypatch):
    """A long sequence's chunk Grams ([T, T] each, a few hundred of them over a vocabulary) are
    formed a budget's worth at a time: the same Gram, bit for bit, in several groups; an example
    without active positions gives an empty one."""
    from dpmuon.privacy.engines.fast import kernels

    x = torch.randn(40, WIDE_GRAM + 100, generator=torch.Generator().manual_seed(3))
    whole, *error = kernels._gram(x)
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", 3 * 40 * 40 * 5)  # five chunks a call: seven calls
    grouped, *_ = kernels._gram(x)
    assert torch.equal(grouped, whole) and error[0] > 0
    assert torch.allclose(whole, x.double() @ x.double().T, rtol=0, atol=error[0] * float(x.norm(dim=1).max()) ** 2)
    assert kernels._gram(x[:0])[0].shape == (0, 0)
