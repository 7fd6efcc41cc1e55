"""Lots into micro-batches: dynamic shapes, or fixed ones whose filler rows change nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB, tiny_gpt2
from omegaconf import OmegaConf

from dpmuon.data import EncodedExample, collate
from dpmuon.models import IGNORE_INDEX, hidden_matrices, per_example_lm_loss
from dpmuon.privacy import PrivacyAccountant, Privatizer, build_engine, build_partition
from dpmuon.privacy.distributed import SINGLE
from dpmuon.privacy.engines.base import EXAMPLE_MASK
from dpmuon.training.batching import bucketed_micro_batches, lot_micro_batches
from dpmuon.training.loop import lot_batches

PAD = VOCAB - 1


def example(length: int, prompt: int = 2) -> EncodedExample:
    ids = [(7 * length + 3 * t) % PAD for t in range(length)]
    return EncodedExample(ids, [IGNORE_INDEX] * prompt + ids[prompt:])


EXAMPLES = [example(n) for n in (9, 4, 12, 6, 3, 11, 5)]


pytestmark = pytest.mark.usefixtures("single_thread")


def test_dynamic_shapes_sort_by_length_and_pad_each_micro_batch_to_its_longest():
    lot = [0, 2, 3, 5, 6]
    batches = list(lot_micro_batches(EXAMPLES, lot, 2, PAD))
    by_length = sorted(lot, key=lambda i: len(EXAMPLES[i].input_ids))
    expected = [collate([EXAMPLES[i] for i in by_length[k : k + 2]], PAD) for k in range(0, 5, 2)]
    assert len(batches) == 3
    for got, want in zip(batches, expected):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_fixed_shapes_pad_to_the_width_and_fill_the_last_micro_batch():
    lot = [0, 1, 2, 3, 4]
    dynamic = list(lot_micro_batches(EXAMPLES, lot, 2, PAD))
    fixed = list(lot_micro_batches(EXAMPLES, lot, 2, PAD, fixed_width=16, fixed_rows=True))
    assert [tuple(b["input_ids"].shape) for b in fixed] == [(2, 16)] * 3
    for small, big in zip(dynamic, fixed):
        rows, width = small["input_ids"].shape
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(big[key][:rows, :width], small[key])
        assert (big["input_ids"][:rows, width:] == PAD).all() and (big["attention_mask"][:rows, width:] == 0).all()
        assert (big["labels"][:rows, width:] == IGNORE_INDEX).all()
    assert [b[EXAMPLE_MASK].tolist() for b in fixed] == [[True, True], [True, True], [True, False]]
    filler = {k: v[1] for k, v in fixed[-1].items()}
    assert (filler["labels"] == IGNORE_INDEX).all() and filler["attention_mask"][0] == 1  # no gradient, not fully masked


def test_fixed_width_alone_keeps_the_rows_and_adds_no_mask():
    batches = list(lot_micro_batches(EXAMPLES, [0, 1, 2], 2, PAD, fixed_width=12))
    assert [tuple(b["input_ids"].shape) for b in batches] == [(2, 12), (1, 12)]
    assert all(EXAMPLE_MASK not in b for b in batches)


def test_bad_requests_are_refused_and_an_empty_lot_gives_nothing():
    with pytest.raises(ValueError, match="12 tokens does not fit the fixed width of 10"):
        list(lot_micro_batches(EXAMPLES, [0, 2], 2, PAD, fixed_width=10))
    with pytest.raises(ValueError, match="micro_batch_size"):
        list(lot_micro_batches(EXAMPLES, [0], 0, PAD))
    assert list(lot_micro_batches(EXAMPLES, [], 4, PAD, fixed_width=16, fixed_rows=True)) == []


@pytest.mark.parametrize("engine", ["fast", "opacus"])
def test_filler_rows_release_and_count_nothing(engine):
    """The same lot with dynamic and with fixed shapes: same release, same statistics."""
    lot = list(range(len(EXAMPLES)))
    results = []
    for fixed in (False, True):
        model = tiny_gpt2(tie=True)
        partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.05, matrix_names=hidden_matrices(model))
        privatizer = Privatizer(
            model,
            partition,
            noise_multiplier=0.0,
            expected_lot_size=7.0,
            sample_rate=1.0,
            accountant=PrivacyAccountant(1e-5),
            engine=engine,
        )
        batches = lot_micro_batches(EXAMPLES, lot, 3, PAD, fixed_width=16 if fixed else None, fixed_rows=fixed)
        stats = privatizer.release(batches, per_example_lm_loss)
        results.append(({n: p.grad.clone() for n, p in privatizer.params.items()}, stats))
        privatizer.close()
    (dynamic, stats), (fixed, fixed_stats) = results
    for name in dynamic:
        assert torch.allclose(fixed[name], dynamic[name], rtol=1e-4, atol=1e-9), name
    assert (fixed_stats.lot_size, fixed_stats.loss_count, fixed_stats.nonfinite) == (7, 7, 0)
    assert torch.equal(fixed_stats.clipped, stats.clipped) and int(stats.clipped.sum()) > 0
    assert fixed_stats.loss_sum == pytest.approx(stats.loss_sum, rel=1e-5)
    assert fixed_stats.norm_sum == pytest.approx(stats.norm_sum, rel=1e-5)


BUCKETS = ((16, 3), (8, 4), (5, 2))  # (width, rows), widest first


def shapes(batches):
    return [({k: tuple(v.shape) for k, v in b.items()}, int(b[EXAMPLE_MASK].sum())) for b in batches]


def test_width_buckets_run_the_same_shapes_whatever_the_lot():
    """Lots of the longest, the shortest, none or too many examples: the same micro-batches (each
    width's rows in equal micro-batches of ≤ 24 tokens), each example in a row at least as wide as it."""
    pool = [example(n) for n in (16, 15, 14, 13, 8, 7, 6, 5, 4, 3, 2)]
    runs = {name: list(bucketed_micro_batches(pool, lot, BUCKETS, 24, PAD)) for name, lot in
            {"long": [0, 1, 2], "short": [8, 9, 10], "none": [], "all": list(range(len(pool)))}.items()}  # fmt: skip
    layouts = {name: [s for s, _ in shapes(batches)] for name, batches in runs.items()}
    assert all(layout == layouts["none"] for layout in layouts.values())
    assert [s["input_ids"] for s in layouts["none"]] == [(1, 16), (1, 16), (1, 16), (2, 8), (2, 8), (2, 5)]
    placed = {name: sum(n for _, n in shapes(batches)) for name, batches in runs.items()}
    assert placed == {"long": 3, "short": 3, "none": 0, "all": 9}  # all 11: two fit no row left (the charged bad event)
    for batch in runs["all"]:
        lengths = (batch["input_ids"] != PAD).sum(dim=1)
        assert (lengths[batch[EXAMPLE_MASK]] <= batch["input_ids"].shape[1]).all()


def test_rows_per_micro_batch_are_capped_where_the_engine_holds_memory_per_row():
    """Narrow widths take as many rows as full-width tokens allow (the fast engine's memory follows
    tokens); with max_rows (an engine that forms each row's gradient) no micro-batch holds more,
    and the slots of each width are as many as without the cap."""
    pool = [example(n) for n in (16, 15, 14, 13, 8, 7, 6, 5, 4, 3, 2)]
    free = [s["input_ids"] for s, _ in shapes(bucketed_micro_batches(pool, [], BUCKETS, 24, PAD))]
    capped = [s["input_ids"] for s, _ in shapes(bucketed_micro_batches(pool, [], BUCKETS, 24, PAD, max_rows=1))]
    assert max(rows for rows, _ in free) == 2 and capped == [(1, 16)] * 3 + [(1, 8)] * 4 + [(1, 5)] * 2
    slots = lambda layout: {w: sum(r for r, width in layout if width == w) for _, w in layout}  # noqa: E731
    assert slots(capped) == {w: r for w, r in BUCKETS} and all(slots(free)[w] >= r for w, r in BUCKETS)
    # The driver caps them by what its engine says (Opacus, or the fast engine's generic fallback).
    for forms, most in ((False, 2), (True, 1)):
        t = SimpleNamespace(
            cfg=OmegaConf.create({"trainer": {"micro_batch_size": 1}}), tokenizer=SimpleNamespace(pad_token_id=PAD), widths=BUCKETS,
            data=SimpleNamespace(train=pool), parallel=SINGLE, fixed_width=16, device=torch.device("cpu"),
            mechanism=SimpleNamespace(release=SimpleNamespace(forms_row_gradients=forms)),
        )  # fmt: skip
        assert max(b["input_ids"].shape[0] for b in lot_batches(t, [0, 5, 9])) == most


def test_width_buckets_release_what_one_width_releases():
    """Rows bucketed by width or all at one width: the same clipped sum (the fast engine keeps every
    position under constant time; padding changes no example's gradient)."""
    lot = [0, 2, 3, 5, 6]
    released = []
    for bucketed in (False, True):
        model = tiny_gpt2(tie=True)
        partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.05, matrix_names=hidden_matrices(model))
        accountant = PrivacyAccountant(1e-5)
        privatizer = Privatizer(model, partition, noise_multiplier=0.0, expected_lot_size=5.0, sample_rate=1.0, accountant=accountant, constant_time=True)
        one_width = lot_micro_batches(EXAMPLES, lot, 3, PAD, fixed_width=16, fixed_rows=True, pad_to=9)
        batches = bucketed_micro_batches(EXAMPLES, lot, BUCKETS, 24, PAD) if bucketed else one_width
        stats = privatizer.release(batches, per_example_lm_loss)
        released.append(({n: p.grad.clone() for n, p in privatizer.params.items()}, stats.lot_size))
        privatizer.close()
    (one, size), (bucketed, bucketed_size) = released
    assert size == bucketed_size == 5
    for name in one:
        assert torch.allclose(bucketed[name], one[name], rtol=1e-4, atol=1e-9), name


def test_a_malformed_example_mask_is_refused():
    model = tiny_gpt2()
    engine = build_engine("fast", model, build_partition([n for n, _ in model.named_parameters()], clip_mode="flat"))
    batch = next(lot_micro_batches(EXAMPLES, [0, 1], 2, PAD, fixed_rows=True))
    batch[EXAMPLE_MASK] = torch.tensor([1, 0])
    with pytest.raises(ValueError, match="bool tensor of shape"):
        engine.clipped_sum(batch, per_example_lm_loss)
