"""The fast engine (ghost / direct norms + book-keeping sums) against the Opacus reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, fast_squared_norms, tiny_gpt2, token_batch
from reference import (
    ATOL,
    LARGE_C,
    PARTITIONS,
    RTOL,
    SMALL_C,
    assert_close_dicts,
    assert_close_norms,
    naive_reference,
    opacus_reference,
    partition_for,
)
from torch import nn

from dpmuon.models import per_example_lm_loss, position_ids_for
from dpmuon.privacy import PrivacyAccountant, Privatizer, build_partition, per_example_block_norms
from dpmuon.privacy.engines.fast import FastEngine, prefers_ghost


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny tensors gain nothing from threads, and on a shared 2-core box a busy neighbour makes
    OpenMP's spinning threads tens of times slower; restored afterwards for other test modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("clip_norm", [SMALL_C, LARGE_C], ids=["clipping", "no-clipping"])
@pytest.mark.parametrize("options", list(PARTITIONS.values()), ids=list(PARTITIONS))
@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "untied-head"])
@pytest.mark.parametrize("left_pad", [False, True], ids=["right-pad", "left-pad"])
def test_fast_matches_opacus(tie, left_pad, options, clip_norm):
    model = tiny_gpt2(tie=tie)
    partition = partition_for(model, clip_norm, **options)
    batch = token_batch(5, left_pad=left_pad, seed=7)
    ref_squared, ref_summed, ref_stats = opacus_reference(model, partition, batch)

    engine = FastEngine(model, partition)
    squared, _ = fast_squared_norms(engine, batch, per_example_lm_loss)
    summed, losses, stats = engine.clipped_sum(batch, per_example_lm_loss)

    assert_close_norms(squared, ref_squared)
    norms, ref_norms = per_example_block_norms(partition, squared), per_example_block_norms(partition, ref_squared)
    assert torch.allclose(norms, ref_norms, atol=ATOL, rtol=RTOL)
    assert_close_dicts(summed, ref_summed)
    assert torch.equal(stats.clipped, ref_stats.clipped) and stats.nonfinite == 0 and stats.examples == 5
    assert stats.norm_sum == pytest.approx(ref_stats.norm_sum, rel=RTOL)
    assert losses.shape == (5,) and not losses.requires_grad
    clipped_fraction = stats.clipped.float().mean() / 5
    assert clipped_fraction > 0.9 if clip_norm == SMALL_C else clipped_fraction == 0


@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "untied-head"])
def test_ghost_and_direct_norms_agree(tie):
    model = tiny_gpt2(tie=tie)
    partition = partition_for(model, 0.05)
    batch = token_batch(4, seed=2)
    results = {}
    for rule in ("ghost", "direct"):
        engine = FastEngine(model, partition, weight_norms=rule)
        squared, _ = fast_squared_norms(engine, batch, per_example_lm_loss)
        summed, _, _ = engine.clipped_sum(batch, per_example_lm_loss)
        results[rule] = squared, summed
    ref_squared, ref_summed, _ = opacus_reference(model, partition, batch)
    for squared, summed in results.values():
        assert_close_norms(squared, ref_squared)
        assert_close_dicts(summed, ref_summed)


def test_mixed_rule_picks_the_cheaper_form():
    # ghost ~ T²(d_in + d_out), direct ~ T·d_in·d_out
    assert prefers_ghost("mixed", positions=64, d_in=128, d_out=50258)  # LM head, short sequences
    assert not prefers_ghost("mixed", positions=1024, d_in=32, d_out=32)  # long sequences, small layer
    assert prefers_ghost("ghost", positions=1024, d_in=32, d_out=32)
    assert not prefers_ghost("direct", positions=4, d_in=4096, d_out=4096)
    with pytest.raises(ValueError, match="weight norm rule"):
        FastEngine(tiny_gpt2(), partition_for(tiny_gpt2(), 1.0), weight_norms="fastest")


def nan_for_example(example: torch.Tensor, gradient: bool):
    """A loss function under which the example with these token ids has a NaN loss (by what it
    holds, as data makes one): its gradients are NaN everywhere (`gradient`), or finite (NaN added
    to the loss, whose derivative is still 1)."""

    def loss_fn(model, batch):
        losses = per_example_lm_loss(model, batch)
        hit = (batch["input_ids"] == example).all(1)
        return losses * torch.where(hit, float("nan"), 1.0) if gradient else losses + torch.where(hit, float("nan"), 0.0)

    return loss_fn


def without_example(batch: dict, index: int) -> dict:
    return {k: torch.cat([v[:index], v[index + 1 :]]) for k, v in batch.items()}


@pytest.mark.parametrize("gradient", [True, False], ids=["nan-gradient", "nan-loss-only"])
@pytest.mark.parametrize("rule", ["ghost", "direct"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "untied-head"])
def test_nonfinite_example_contributes_nothing(tie, rule, gradient):
    model = tiny_gpt2(tie=tie)
    partition = partition_for(model, 0.05)
    batch = token_batch(5, seed=5)
    engine = FastEngine(model, partition, weight_norms=rule)
    summed, losses, stats = engine.clipped_sum(batch, nan_for_example(batch["input_ids"][2], gradient))
    expected, _, clean_stats = engine.clipped_sum(without_example(batch, 2), per_example_lm_loss)
    assert stats.nonfinite == 1 and stats.examples == 5
    assert torch.isnan(losses[2]) and torch.isfinite(losses[[0, 1, 3, 4]]).all()
    assert torch.equal(stats.clipped, clean_stats.clipped)
    for name in expected:
        assert torch.isfinite(summed[name]).all(), name
        assert torch.allclose(summed[name], expected[name], atol=ATOL, rtol=RTOL), name


def test_a_model_whose_gradient_is_not_finite_on_the_public_stand_in_is_refused():
    """The use check runs on public values, so a NaN it meets comes from the code, not a lot."""
    model = tiny_gpt2()

    def nan_first_row(model, batch):  # by position: no example's values make it
        losses = per_example_lm_loss(model, batch)
        return losses * torch.where(torch.arange(len(losses)) == 0, float("nan"), 1.0)

    with pytest.raises(ValueError, match="so the model cannot be checked"):
        FastEngine(model, partition_for(model, 0.05)).clipped_sum(token_batch(3, seed=1), nan_first_row)


def test_nonfinite_activation_contributes_nothing():
    """NaN inside the network (not only in the loss): the example's activations are NaN too."""
    model = tiny_gpt2(tie=True)
    partition = partition_for(model, 0.05)
    batch = token_batch(4, seed=6)

    def poison_example_1(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[1, 3] = float("inf")
        return output

    engine = FastEngine(model, partition)
    expected, _, _ = engine.clipped_sum(without_example(batch, 1), per_example_lm_loss)
    handle = model.transformer.h[0].register_forward_hook(poison_example_1)
    try:
        summed, _, stats = engine.clipped_sum(batch, per_example_lm_loss)
    finally:
        handle.remove()
    assert stats.nonfinite == 1
    assert_close_dicts(summed, expected)


def test_no_gradient_left_on_parameters():
    model = tiny_gpt2(tie=True)
    engine = FastEngine(model, partition_for(model, 0.1))
    engine.clipped_sum(token_batch(3), per_example_lm_loss)
    fast_squared_norms(engine, token_batch(3), per_example_lm_loss)
    assert all(p.grad is None for p in model.parameters())
    # The hooks are removed after every call: a plain forward records nothing.
    assert all(not m._forward_hooks for m in model.modules())


def test_privatizer_release_equals_opacus_without_noise():
    lots = [token_batch(6, seed=s) for s in range(2)]
    released = {}
    for engine in ("opacus", "fast"):
        model = tiny_gpt2(tie=True)
        privatizer = Privatizer(
            model,
            partition_for(model, 0.05),
            noise_multiplier=0.0,
            expected_lot_size=6,
            sample_rate=1.0,
            accountant=PrivacyAccountant(1e-5),
            engine=engine,
        )
        for lot in lots:
            halves = [{k: v[:2] for k, v in lot.items()}, {k: v[2:] for k, v in lot.items()}]
            stats = privatizer.release(halves, per_example_lm_loss)
        released[engine] = ({n: p.grad.clone() for n, p in privatizer.params.items()}, stats)
        privatizer.close()
    (fast, fast_stats), (reference, ref_stats) = released["fast"], released["opacus"]
    assert_close_dicts(fast, reference, atol=1e-7)
    assert torch.equal(fast_stats.clipped, ref_stats.clipped)
    assert fast_stats.train_loss == pytest.approx(ref_stats.train_loss)


def test_module_called_twice_sums_both_calls():
    """GPT-2 looks token_type_ids up in the token embedding: a second call of wte."""
    model = tiny_gpt2(tie=True)
    partition = partition_for(model, 0.05)
    batch = token_batch(4, seed=8)
    batch["token_type_ids"] = torch.randint(0, VOCAB, batch["input_ids"].shape, generator=torch.Generator().manual_seed(1))

    def loss_with_token_types(model, batch):
        mask = batch["attention_mask"]
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids_for(mask), token_type_ids=batch["token_type_ids"]).logits
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none")
        return nll.sum(1)

    ref_squared, ref_summed, _ = opacus_reference(model, partition, batch, loss_with_token_types)
    engine = FastEngine(model, partition)
    squared, _ = fast_squared_norms(engine, batch, loss_with_token_types)
    summed, _, _ = engine.clipped_sum(batch, loss_with_token_types)
    assert_close_norms(squared, ref_squared)
    assert_close_dicts(summed, ref_summed)


class LinearNet(nn.Module):
    """nn.Linear layers with biases (GPT-2 has none), an embedding with a padding row, LayerNorm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16, padding_idx=0)
        self.hidden = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, 5)

    def forward(self, ids):
        return self.out(self.norm(torch.tanh(self.hidden(self.embed(ids)))))


def linear_net_loss(model, batch):
    return model(batch["input_ids"]).square().mean((1, 2))


@pytest.mark.parametrize("rule", ["ghost", "direct"])
def test_linear_layers_with_bias_and_padding_row(rule):
    model = LinearNet()
    names = [n for n, _ in model.named_parameters()]
    partition = build_partition(names, clip_norm=0.01, matrix_names=["hidden.weight", "out.weight"])
    batch = {"input_ids": torch.randint(0, 4, (6, 7), generator=torch.Generator().manual_seed(0))}  # many padding ids
    # Opacus' embedding sampler ignores padding_idx (it scatters into the padding row, which
    # autograd leaves at zero), so the reference here is a loop over examples.
    ref_squared, ref_summed = naive_reference(model, partition, batch, linear_net_loss)
    engine = FastEngine(model, partition, weight_norms=rule)
    squared, _ = fast_squared_norms(engine, batch, linear_net_loss)
    summed, _, _ = engine.clipped_sum(batch, linear_net_loss)
    assert_close_norms(squared, ref_squared)
    assert_close_dicts(summed, ref_summed)
    assert summed["embed.weight"][0].abs().sum() == 0  # the padding row gets no gradient


def test_bf16_autocast_gives_fp32_results_close_to_fp32():
    model = tiny_gpt2(tie=True)
    partition = partition_for(model, 1e6)
    batch = token_batch(3, seed=9)

    def autocast_loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return per_example_lm_loss(model, batch)

    engine = FastEngine(model, partition)
    exact, _, _ = engine.clipped_sum(batch, per_example_lm_loss)
    mixed, _, _ = engine.clipped_sum(batch, autocast_loss)
    for name, value in mixed.items():
        assert value.dtype == torch.float32
        scale = exact[name].norm()
        assert (value - exact[name]).norm() <= 0.05 * scale + 1e-8, name


def test_norms_and_sums_stay_fp32_inside_an_autocast_region():
    """A caller may run the whole release under autocast: the engine's own products must not
    drop to bf16 (here the forward itself is kept in fp32, so results must match exactly)."""
    model = tiny_gpt2(tie=True)
    partition = partition_for(model, 0.05)
    batch = token_batch(3, seed=11)

    def fp32_loss(model, batch):
        with torch.autocast("cpu", enabled=False):
            return per_example_lm_loss(model, batch)

    engine = FastEngine(model, partition)
    expected, _, _ = engine.clipped_sum(batch, per_example_lm_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _, _ = engine.clipped_sum(batch, fp32_loss)
    assert_close_dicts(got, expected)


class Gain(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(size))

    def forward(self, x):
        return x * self.gain


def test_unsupported_trainable_module_is_refused_under_fallback_error():
    model = nn.Sequential(nn.Embedding(VOCAB, 8), Gain(8), nn.Linear(8, 3))
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match=r"'1\.gain'.*Gain"):
        FastEngine(model, build_partition(names, clip_mode="flat"), fallback="error")
    model[1].gain.requires_grad_(False)  # frozen, it is no concern of the privatizer
    FastEngine(model, build_partition([n for n, p in model.named_parameters() if p.requires_grad], clip_mode="flat"), fallback="error")


def test_unsupported_sharing_and_embedding_options_are_refused():
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    model = nn.Sequential(first, second)
    with pytest.raises(ValueError, match="shared by modules of types Linear, Linear"):
        FastEngine(model, build_partition([n for n, _ in model.named_parameters()], clip_mode="flat"))
    model = nn.Sequential(nn.Embedding(VOCAB, 4, scale_grad_by_freq=True))
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        FastEngine(model, build_partition(["0.weight"], clip_mode="flat"))


def test_parameters_outside_the_partition_are_refused():
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="outside the block partition"):
        FastEngine(model, build_partition(["transformer.wpe.weight"], clip_mode="flat"))


def test_unbatched_position_ids_are_reported():
    model = tiny_gpt2()
    engine = FastEngine(model, partition_for(model, 1.0))

    def shared_positions(model, batch):
        logits = model(input_ids=batch["input_ids"]).logits  # GPT-2 builds position ids of shape [1, T]
        return logits.float().square().mean((1, 2))

    with pytest.raises(ValueError, match="batch-shaped position_ids"):
        engine.clipped_sum(token_batch(3), shared_positions)


def test_clip_factors_of_fast_norms_bound_every_block():
    """End to end: each example's clipped block contribution has norm ≤ C_W."""
    model = tiny_gpt2(tie=True)
    partition = partition_for(model, 0.02)
    batch = token_batch(3, seed=10)
    engine = FastEngine(model, partition)
    single = []
    for i in range(3):
        summed, _, _ = engine.clipped_sum({k: v[i : i + 1] for k, v in batch.items()}, per_example_lm_loss)
        single.append(summed)
    for block in partition.blocks:
        for summed in single:
            norm = torch.sqrt(sum(summed[n].pow(2).sum() for n in block.params))
            assert norm <= block.threshold  # as computed: the clip margin absorbs fp32 rounding


def test_constant_time_engine_computes_every_position_and_releases_the_same(monkeypatch):
    """Skipping positions without an output gradient (padding) is exact but makes the work depend
    on how many rows are real; under constant time the kernels see every position."""
    from dpmuon.models import hidden_matrices
    from dpmuon.privacy.engines.fast import layers

    model = tiny_gpt2(tie=False)
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.1, matrix_names=hidden_matrices(model))
    batch = token_batch(6, seed=9)
    seen = []
    ghost = layers.ghost_weight_norms
    monkeypatch.setattr(layers, "ghost_weight_norms", lambda a, b, active=None: seen.append(active) or ghost(a, b, active))
    skipping, _, _ = FastEngine(model, partition, weight_norms="ghost").clipped_sum(batch, per_example_lm_loss)
    assert any(not bool(active.all()) for active in seen)  # padding and prompt positions are skipped
    seen.clear()
    constant, _, _ = FastEngine(model, partition, weight_norms="ghost", constant_time=True).clipped_sum(batch, per_example_lm_loss)
    assert seen and all(bool(active.all()) for active in seen)
    for name, total in skipping.items():
        assert torch.allclose(constant[name], total, rtol=1e-5, atol=1e-8), name


def test_a_position_is_skipped_only_when_its_output_gradient_is_exactly_zero():
    """Skipping is exact only for rows that are zero in every entry: a lone subnormal, a NaN or
    an infinity keeps its row (a squared norm would underflow or drop the NaN), ±0 does not,
    and under constant time no row is skipped."""
    from dpmuon.privacy.engines.fast import Trace

    grads = torch.zeros(2, 6, 50_000)
    grads[0, 0, 49_999] = 1e-45  # subnormal: its square underflows to 0 in fp32
    grads[0, 1, 3] = float("nan")
    grads[0, 2, 7] = float("-inf")
    grads[0, 3, 11] = -0.0
    grads[0, 4, 13] = -1e-45  # a lone negative subnormal among zeros
    grads[0, 5, 17] = float("nan")
    grads[0, 5, 19] = -1.0  # a NaN beside a negative entry
    grads[1, 4] = torch.randn(50_000)
    grads[1, 5, :100] = -0.0  # ±0 mixed
    inputs = torch.randn(2, 6, 4)
    expected = torch.tensor([[True, True, True, False, True, True], [False, False, False, False, True, False]])
    assert torch.equal(Trace(inputs, grads).active(), expected)
    assert bool(Trace(inputs, grads, keep_all=True).active().all())


@pytest.mark.parametrize(
    "kept",
    [
        [1, 2, 3, 7, 8, 20, 21, 22, 23, 24, 25, 26],  # a run behind a gap of one row: moved a row at a time
        [2, 3, 4, 5, 6, 10, 11],  # a run of five behind a gap of two: pieces of 2, 2 and 1
        [0, 1, 2, 5, 9, 10, 11, 12, 30],  # leading rows already in place
        list(range(0, 40, 2)),  # every other row
        [39],
        [],
    ],
)
def test_rows_moved_in_place_are_the_rows_a_copy_holds(kept):
    from dpmuon.privacy.engines.fast.kernels import compact_rows_

    x = torch.randn(40, 7)
    keep = torch.tensor(kept, dtype=torch.long)
    moved = compact_rows_(x.clone(), keep)
    assert moved is not None and torch.equal(moved, x.index_select(0, keep))


def test_rows_that_would_move_in_many_pieces_are_left_to_a_copy():
    """A long run behind a one-row gap would move a row at a time: refused, the tensor untouched."""
    from dpmuon.privacy.engines.fast.kernels import compact_rows_

    x = torch.randn(300, 5)
    before = x.clone()
    assert compact_rows_(x, torch.arange(1, 300)) is None
    assert torch.equal(x, before)


def test_book_keeping_that_overwrites_its_gradients_sums_what_a_copy_sums():
    from dpmuon.privacy.engines.fast.kernels import weighted_outer_sum

    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 12, 6, generator=generator), torch.randn(4, 12, 300, generator=generator)
    b[:, :5] = 0  # an unlabelled prompt
    b[2, 9:] = 0  # padding
    active = b.ne(0).any(-1)
    scale = torch.rand(4, generator=generator)
    copied = weighted_outer_sum(a, b, scale, out_in=True, active=active)
    assert torch.equal(weighted_outer_sum(a, b.clone(), scale, out_in=True, active=active, overwrite_b=True), copied)


class TwoBranches(nn.Module):
    """out = left(h) + right(h): autograd hands both linear layers the same output-gradient tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.left = nn.Linear(8, 6)
        self.right = nn.Linear(8, 6)

    def forward(self, ids):
        h = self.embed(ids)
        return self.left(h) + self.right(h)


def two_branch_loss(model, batch):
    # Half the positions carry no loss, so the book-keeping keeps only the other rows.
    return (model(batch["input_ids"]).square().sum(2) * batch["weights"]).sum(1)


def test_layers_handed_one_gradient_tensor_each_get_their_own_sums():
    """Rows reordered in place for one layer's book-keeping must not be another layer's rows."""
    model = TwoBranches()
    names = [n for n, _ in model.named_parameters()]
    partition = build_partition(names, clip_norm=0.05, matrix_names=["left.weight", "right.weight"])
    generator = torch.Generator().manual_seed(4)
    batch = {"input_ids": torch.randint(0, VOCAB, (5, 9), generator=generator), "weights": (torch.arange(9) % 2).float().expand(5, 9)}
    engine = FastEngine(model, partition)
    losses, calls, _ = engine._forward(batch, two_branch_loss)
    traces = engine._backward(losses, calls)
    assert traces[model.left].grads.untyped_storage().data_ptr() == traces[model.right].grads.untyped_storage().data_ptr()
    assert not traces[model.left].exclusive and not traces[model.right].exclusive
    ref_squared, ref_summed = naive_reference(model, partition, batch, two_branch_loss)
    summed, _, _ = engine.clipped_sum(batch, two_branch_loss)
    assert_close_dicts(summed, ref_summed)
    assert torch.equal(summed["left.bias"], summed["right.bias"]) and torch.equal(summed["left.weight"], summed["right.weight"])


def test_the_lm_heads_rows_are_moved_in_place_where_it_holds_its_gradients(monkeypatch):
    """The tied GPT-2's head holds its own output gradients: its book-keeping moves their rows in
    place (no copy of the head's active rows) and still releases what Opacus does."""
    from dpmuon.privacy.engines.fast import kernels

    moved = []
    compact = kernels.compact_rows_
    monkeypatch.setattr(kernels, "compact_rows_", lambda x, keep: moved.append(x.shape[1]) or compact(x, keep))
    model = tiny_gpt2(tie=True)
    partition = partition_for(model, SMALL_C)
    batch = token_batch(4, seed=5)
    _, ref_summed, _ = opacus_reference(model, partition, batch, per_example_lm_loss)
    summed, _, _ = FastEngine(model, partition).clipped_sum(batch, per_example_lm_loss)
    assert VOCAB in moved
    assert_close_dicts(summed, ref_summed)
