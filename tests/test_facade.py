"""`dpmuon.make_private`: the driver's mechanism for a user's own model, data and loop.

The façade releases what the driver's mechanism (privacy/mechanism.py, as training/loop.py
configures it) releases for the same lot and seed; ε is the plan's; the budget guard stops the
lots; settings that void the guarantee are refused in one line; the lots are secret by default.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_train import compose_config
from torch import nn

import dpmuon
from dpmuon import facade
from dpmuon.errors import UserError
from dpmuon.facade import Lot
from dpmuon.models import Shape, build_random_lm, hidden_matrices, per_example_lm_loss, position_ids_for
from dpmuon.privacy import LEDGER_FILE, mechanism
from dpmuon.privacy.accountant import PrivacyAccountant, epsilon_after
from dpmuon.privacy.engines import ENGINES
from dpmuon.privacy.engines.base import EXAMPLE_MASK
from dpmuon.privacy.lot_bound import lot_bound
from dpmuon.privacy.mechanism import build_mechanism
from dpmuon.privacy.randomness import OS_ENTROPY
from dpmuon.privacy.seed import MECHANISM_SEED_ENV
from dpmuon.training.loop import privacy_settings

REPO = Path(__file__).resolve().parents[1]
N, LENGTH, VOCAB = 64, 8, 32
SEED = 0x7A57_FACADE_0123_4567_89AB_CDEF  # ≥ 2^64: no weak-seed warning
# The façade's keyword arguments and the driver's overrides for the same mechanism.
SETTINGS = dict(target_epsilon=8.0, delta=1e-3, steps=3, expected_lot_size=16, clip_norm=0.5, noise_multiplier=1.0, accountant="rdp")
OVERRIDES = [
    "privacy.target_epsilon=8.0", "privacy.delta=1e-3", "trainer.steps=3", "privacy.expected_lot_size=16", "privacy.clip_norm=0.5",
    "privacy.noise_multiplier=1.0", "privacy.accountant=rdp", "privacy.constant_time=true", "optimizer=dp_muon",
]  # fmt: skip


def tiny_model() -> nn.Module:
    return build_random_lm("gpt2", Shape(VOCAB, n_layer=1, n_embd=16, n_head=2, n_positions=LENGTH), seed=0).train()


def dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (LENGTH,), generator=g) for _ in range(N)]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.stack(rows)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def make(tmp_path: Path, model: nn.Module | None = None, name: str = "run", **overrides):
    settings = {**SETTINGS, "micro_batch_size": 8, **overrides}
    return dpmuon.make_private(model or tiny_model(), dataset(), collate, per_example_lm_loss, run_dir=tmp_path / name, **settings)


def test_the_release_equals_the_drivers_mechanism_for_the_same_lot_and_seed(tmp_path, monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SEED))
    private = make(tmp_path)
    model = tiny_model()
    (tmp_path / "driver").mkdir()
    driver = build_mechanism(
        model,
        N,
        privacy_settings(compose_config(*OVERRIDES)),
        hidden_matrices=hidden_matrices(model),
        user_secret=SEED,
        run_dir=tmp_path / "driver",
        dataset_name="custom",
        log=lambda message: None,
        example_lengths=[LENGTH] * N,  # the façade measures every row's length from its attention mask
        max_length=LENGTH,
    )
    assert private.plan == driver.plan and private.plan.widths == ((LENGTH, private.plan.max_lot_size),)
    lot = next(private.lots())
    assert lot.indices == driver.next_lot() and len(lot) > 0
    private.release(lot)
    driver.release.release(lot.micro_batches(), per_example_lm_loss, step=1)
    for name, p in private.params.items():
        assert torch.equal(p.grad, driver.release.params[name].grad), name
    assert private.release_noise_std() == driver.release_noise_std()
    assert private.epsilon == driver.epsilon > 0


def test_epsilon_is_the_plans_and_the_ledger_records_every_release(tmp_path):
    private = make(tmp_path)
    optimizer = dpmuon.optim.build("dp_muon", private.model, private, lr=1e-3)
    released = 0
    for lot in private.lots():
        private.release(lot)
        optimizer.step()
        released += 1
    plan = private.plan
    assert released == plan.steps == 3
    # The length histogram's release (rows in widths, measured from the attention mask) is charged first.
    assert plan.prior == ((20.0, 1.0, 1),)
    assert private.epsilon == plan.planned_epsilon == epsilon_after(plan.noise_multiplier, plan.sample_rate, 3, plan.delta, "rdp", plan.slack, plan.prior)
    lines = [json.loads(line) for line in (tmp_path / "run" / LEDGER_FILE).read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["dataset_size"] == N
    assert [(r["step"], r["charged"]) for r in lines[1:]] == [(1, True), (2, True), (3, True)]


def test_the_budget_guard_stops_the_lots_before_the_target(tmp_path):
    first = make(tmp_path, noise_multiplier=0.5, steps=2, target_epsilon=100.0)  # the same run directory: its ledger continues
    for lot in first.lots():
        first.release(lot)
    history = PrivacyAccountant(1e-3, "rdp", first.plan.slack)
    history.history = list(first.mechanism.release.accountant.history)
    # A target that one more σ = 1 release just fits under (a second adds far more than 0.01%).
    target = history.epsilon_with(1, 1.0, first.plan.sample_rate) * 1.0001
    second = make(tmp_path, steps=5, target_epsilon=target)  # its plan alone fits: 5 steps at σ = 1
    released = 0
    for lot in second.lots():
        second.release(lot)
        released += 1
    assert released == 1 and second.epsilon <= target  # the ledger's two releases and this one


def test_a_lot_is_released_once_and_only_lots_from_lots_are_released(tmp_path):
    private = make(tmp_path)
    lot = next(private.lots())
    private.release(lot)
    with pytest.raises(UserError, match="released already"):
        private.release(lot)
    with pytest.raises(UserError, match="takes a lot from lots()"):
        private.release([collate(dataset()[:4])])


def ledger_steps(run: Path) -> list[tuple[int, bool]]:
    return [(r["step"], r["charged"]) for r in map(json.loads, (run / LEDGER_FILE).read_text().splitlines()[1:])]


def test_only_the_oldest_lot_drawn_is_released_and_only_as_drawn(tmp_path):
    private = make(tmp_path)
    lots = list(private.lots())  # drawn ahead: allowed, released in the order drawn
    forged = [Lot(1, list(lots[0].indices), 8, lots[0].micro_batches), copy.copy(lots[0])]
    for lot in forged:  # hand-built or copied: no sample of the secret sampler
        with pytest.raises(UserError, match=r"^release\(\): lot 1 was not drawn by this run's lots\(\)"):
            private.release(lot)
    with pytest.raises(UserError, match=r"^release\(\): lot 3 was drawn after lot 1, which is not released yet"):
        private.release(lots[2])  # skipping lots 1 and 2, or releasing them out of order
    for edit, undo in (
        (lambda: lots[0].indices.append(N - 1), lambda: lots[0].indices.pop()),
        (lambda: setattr(lots[0], "indices", list(range(len(lots[0])))), lambda: setattr(lots[0], "indices", forged[1].indices)),
        (lambda: setattr(lots[0], "step", 9), lambda: setattr(lots[0], "step", 1)),
    ):
        edit()
        with pytest.raises(UserError, match=r"^release\(\): lot 1 was changed after it was drawn") as refused:
            private.release(lots[0])
        assert "\n" not in str(refused.value)
        undo()
    for lot in lots:
        private.release(lot)
    assert ledger_steps(tmp_path / "run") == [(1, True), (2, True), (3, True)]
    assert private.mechanism.release.accountant.steps == 3  # the refusals charged nothing


def test_empty_lots_are_released_and_numbered_so_the_ledger_has_no_gaps(tmp_path, monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SEED))
    sparse = dict(expected_lot_size=1, steps=6)  # q = 1/64: about a third of the lots are empty
    private = make(tmp_path, name="all", **sparse)
    sizes = []
    for lot in private.lots():
        sizes.append(len(lot))
        private.release(lot)
    assert 0 in sizes[:-1] and ledger_steps(tmp_path / "all") == [(s, True) for s in range(1, 7)]
    # A loop that skips the empty lots (its gaps would say which lots were empty) is refused.
    skipping = make(tmp_path, name="skipping", **sparse)
    with pytest.raises(UserError, match=r"^release\(\): lot \d+ was drawn after lot \d+, which is not released yet.*empty ones included"):
        for lot in skipping.lots():
            if len(lot):
                skipping.release(lot)
    assert [s for s, _ in ledger_steps(tmp_path / "skipping")] == list(range(1, sizes.index(0) + 1))


class PatternLots:
    """Lots of prescribed sizes (indices 0, 1, …), cut to the constant-time bound as the real sampler does."""

    def __init__(self, sizes, max_lot_size):
        self.sizes, self.max_lot_size, self.step = sizes, max_lot_size, 0

    def next_lot(self):
        self.step += 1
        size = self.sizes[(self.step - 1) % len(self.sizes)]
        return list(range(size if self.max_lot_size is None else min(size, self.max_lot_size)))

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def spy_on_the_engine(monkeypatch) -> list[dict]:
    """Each micro-batch the fast engine clips: its tensor shapes and how many of its rows are examples."""
    seen, add_clipped_sum = [], ENGINES["fast"].add_clipped_sum

    def spy(self, batch, loss_fn, total):
        seen.append({k: tuple(v.shape) for k, v in batch.items()} | {"examples": int(batch[EXAMPLE_MASK].sum())})
        return add_clipped_sum(self, batch, loss_fn, total)

    monkeypatch.setattr(ENGINES["fast"], "add_clipped_sum", spy)
    return seen


def varied_lengths() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (int(n),), generator=g) for n in torch.randint(1, LENGTH + 1, (N,), generator=g)]


def padded(rows: list[torch.Tensor], width: int | None = LENGTH) -> dict[str, torch.Tensor]:
    """Right-padded to `width` (None: to the micro-batch's longest row), padding masked and unsupervised."""
    width = width or max(len(r) for r in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_constant_time_lots_run_the_same_micro_batches_whatever_their_size_and_lengths(tmp_path, monkeypatch):
    monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, max_lot_size=None, **k: PatternLots([1, 1000, 0], max_lot_size))
    seen = spy_on_the_engine(monkeypatch)
    private = dpmuon.make_private(tiny_model(), varied_lengths(), padded, per_example_lm_loss, run_dir=tmp_path, **SETTINGS, micro_batch_size=8)
    plan = private.plan
    # B_max is the driver's bound, and the chance that a lot is cut to it is charged (in δ).
    assert plan.max_lot_size == lot_bound(N, plan.sample_rate, plan.steps, plan.target_epsilon, plan.delta)[0] < N
    assert plan.slack.bad_event >= plan.truncation_probability > 0
    sizes = []
    for lot in private.lots():
        private.release(lot)
        sizes.append(len(lot))
    assert sizes == [1, plan.max_lot_size, 0]  # 1000 was cut to the bound
    per_step = -(-plan.max_lot_size // 8)
    assert len(seen) == 3 * per_step and len({tuple(sorted((k, v) for k, v in b.items() if k != "examples")) for b in seen}) == 1
    assert [sum(b["examples"] for b in seen[i : i + per_step]) for i in range(0, len(seen), per_step)] == sizes
    assert ledger_steps(tmp_path) == [(1, True), (2, True), (3, True)]


# Rows in a few widths need a length spread the histogram's release can resolve: 3/4 of the examples
# short, 1/4 long, padded to WIDE; σ = 1 for the release (a test's ε, not a default).
WIDE, MANY = 40, 256
WIDTHS = dict(SETTINGS, expected_lot_size=16, length_noise_multiplier=1.0, micro_batch_size=8)


def short_and_long() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    lengths = [int(n) for n in torch.randint(2, 9, (MANY * 3 // 4,), generator=g)] + [int(n) for n in torch.randint(33, WIDE + 1, (MANY // 4,), generator=g)]
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def wide_model() -> nn.Module:
    return build_random_lm("gpt2", Shape(VOCAB, n_layer=1, n_embd=16, n_head=2, n_positions=WIDE), seed=0).train()


def pad_wide(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return padded(rows, width=WIDE)


class ListedLots(PatternLots):
    """These lots in turn, cut to the constant-time bound as the real sampler does."""

    def __init__(self, lots, max_lot_size):
        super().__init__([], max_lot_size)
        self.lots = lots

    def next_lot(self):
        self.step += 1
        return list(self.lots[(self.step - 1) % len(self.lots)])[: self.max_lot_size]


def test_rows_in_widths_run_the_same_micro_batches_for_lots_of_the_longest_and_the_shortest(tmp_path, monkeypatch):
    data = short_and_long()
    by_length = sorted(range(MANY), key=lambda i: len(data[i]))
    lots = [by_length[-16:], by_length[:16], [], by_length[-1000:]]  # the longest, the shortest, none, all (cut to B_max)
    monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, max_lot_size=None, **k: ListedLots(lots, max_lot_size))
    seen = spy_on_the_engine(monkeypatch)
    private = dpmuon.make_private(
        wide_model(), data, pad_wide, per_example_lm_loss, run_dir=tmp_path, steps=4, **{k: v for k, v in WIDTHS.items() if k != "steps"}
    )
    plan = private.plan
    # The widths come from the length histogram's release, recorded in the ledger's header and charged first.
    header = json.loads((tmp_path / LEDGER_FILE).read_text().splitlines()[0])
    assert header["length_release"]["noise_multiplier"] == 1.0 and plan.prior == ((1.0, 1.0, 1),)
    assert len(plan.widths) >= 2 and plan.widths[0][0] == WIDE and sum(rows for _, rows in plan.widths) == plan.max_lot_size
    sizes = []
    for lot in private.lots():
        private.release(lot)
        sizes.append(len(lot))
    assert sizes == [16, 16, 0, plan.max_lot_size]
    steps = [seen[i : i + len(seen) // 4] for i in range(0, len(seen), len(seen) // 4)]
    shapes = [[tuple(sorted((k, v) for k, v in b.items() if k != "examples")) for b in step] for step in steps]
    assert shapes[0] == shapes[1] == shapes[2] == shapes[3]  # the same micro-batches whatever the lot
    assert {b[0][1][1] for b in shapes[0]} == {width for width, _ in plan.widths}  # in the plan's widths, no wider
    assert [sum(b["examples"] for b in step) for step in steps] == sizes  # every example placed (none was left out)
    # No micro-batch holds more tokens than a full-width one.
    assert all(b["input_ids"][0] * b["input_ids"][1] <= 8 * WIDE for b in seen)


def test_rows_in_widths_are_at_most_micro_batch_size_where_the_engine_forms_each_rows_gradient(tmp_path, monkeypatch):
    """The fast engine's narrow widths take more rows (its memory follows tokens); Opacus forms every
    row's gradient, so its micro-batches hold at most micro_batch_size rows in every width."""
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SEED))  # the same histogram release, so the same widths
    data = short_and_long()
    layouts = {}
    for engine in ("fast", "opacus"):
        private = dpmuon.make_private(wide_model(), data, pad_wide, per_example_lm_loss, run_dir=tmp_path / engine, **WIDTHS, engine=engine)
        assert len(private.plan.widths) >= 2 and private.mechanism.release.forms_row_gradients == (engine == "opacus")
        layouts[engine] = private.widths.micro_batches
    assert max(rows for _, _, rows in layouts["fast"]) > 8 >= max(rows for _, _, rows in layouts["opacus"])
    slots = lambda layout: {w: count * rows for w, count, rows in layout}  # noqa: E731
    assert slots(layouts["opacus"]).keys() == slots(layouts["fast"]).keys()
    assert all(slots(layouts["opacus"])[w] >= rows for w, rows in private.plan.widths)  # every width's rows still fit


def test_rows_in_widths_release_what_one_width_releases(tmp_path, monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SEED))  # the same noise in both runs
    data = short_and_long()
    by_length = sorted(range(MANY), key=lambda i: len(data[i]))
    lot = by_length[-10:] + by_length[:30]  # more than the widest rows hold: short ones go to narrow rows
    monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, max_lot_size=None, **k: ListedLots([lot], max_lot_size))
    seen = spy_on_the_engine(monkeypatch)
    grads = {}
    for name, buckets in (("widths", 8), ("one_width", 1)):
        private = dpmuon.make_private(wide_model(), data, pad_wide, per_example_lm_loss, run_dir=tmp_path / name, **WIDTHS, width_buckets=buckets)
        assert (len(private.plan.widths or ()) >= 2) == (buckets > 1) and private.plan.max_lot_size >= len(lot)
        private.release(next(private.lots()))
        grads[name] = {n: p.grad for n, p in private.params.items()}
        if buckets > 1:
            assert any(b["examples"] and b["input_ids"][1] < WIDE for b in seen)  # some examples' rows were cut
    for n, g in grads["widths"].items():
        assert torch.allclose(g, grads["one_width"][n], rtol=0, atol=1e-6), n  # cutting padding off moves a row by fp32 rounding only


def test_rows_in_widths_refuse_what_would_let_the_width_move_a_gradient(tmp_path, capsys, monkeypatch):
    data = short_and_long()

    def by_padded_width(model, batch):  # a loss that scales with the padded width: the row's width would move it
        return per_example_lm_loss(model, batch) * batch["input_ids"].shape[1]

    with pytest.raises(UserError, match=r"^width_buckets: example \d+'s loss .* trailing padding columns are cut off.*width_buckets=1") as refused:
        dpmuon.make_private(wide_model(), data, pad_wide, by_padded_width, run_dir=tmp_path / "a", **WIDTHS)
    assert "\n" not in str(refused.value) and not (tmp_path / "a").exists()
    private = dpmuon.make_private(wide_model(), data, pad_wide, by_padded_width, run_dir=tmp_path / "b", **WIDTHS, width_buckets=1)
    assert private.plan.widths is None and private.plan.prior == ()  # one width: nothing about the lengths released

    # Batches with no attention mask to cut by, or half-precision weights: one width, said.
    def renamed(rows):  # the padding mask under another key
        batch = pad_wide(rows)
        return {"input_ids": batch["input_ids"], "labels": batch["labels"], "mask": batch["attention_mask"]}

    def loss(model, batch):
        return per_example_lm_loss(model, {"input_ids": batch["input_ids"], "labels": batch["labels"], "attention_mask": batch["mask"]})

    private = dpmuon.make_private(wide_model(), data, renamed, loss, run_dir=tmp_path / "c", **WIDTHS)
    assert (
        private.plan.widths is None
        and "constant-time rows all collate_fn's width: collate_fn's batches have no integer or bool [rows, width] 'attention_mask'" in capsys.readouterr().err
    )
    # A collate_fn that later gives an example more tokens than make_private measured: refused before anything is charged.
    longer = {"now": False}

    def changing(rows):
        batch = pad_wide(rows)
        if longer["now"]:
            batch["attention_mask"][:, :] = 1
        return batch

    every = list(range(MANY))  # a lot cut to B_max fills the narrow rows too
    monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, max_lot_size=None, **k: ListedLots([every], max_lot_size))
    private = dpmuon.make_private(wide_model(), data, changing, per_example_lm_loss, run_dir=tmp_path / "d", **WIDTHS)
    longer["now"] = True
    with pytest.raises(UserError, match=r"^make_private: collate_fn gave an example more columns that are not padding"):
        private.release(next(private.lots()))
    assert ledger_steps(tmp_path / "d") == [] and all(p.grad is None for p in private.params.values())


def test_rows_in_widths_refuse_what_the_first_examples_alone_would_not_show(tmp_path):
    data = short_and_long()
    full = [torch.arange(WIDE) % VOCAB] * 8 + data[8:]  # the first micro-batch has no padding to cut

    def attends_to_padding(model, batch):  # every column, padding included, moves every example's loss a little
        ids = batch["input_ids"]
        return per_example_lm_loss(model, batch) + 1e-2 * model(input_ids=ids, position_ids=position_ids_for(torch.ones_like(ids))).logits.mean(dim=(1, 2))

    with pytest.raises(UserError, match=r"^width_buckets: .* changes when the first examples' trailing padding columns are cut off"):
        dpmuon.make_private(wide_model(), full, pad_wide, attends_to_padding, run_dir=tmp_path / "probe", **WIDTHS)
    # The same loss, but only the gradient moves with the width: a gate at zero times the padded width.
    model = wide_model()
    model.register_parameter("gate", nn.Parameter(torch.zeros(())))

    def gated(model, batch):
        return per_example_lm_loss(model, batch) + model.gate * batch["input_ids"].shape[1]

    with pytest.raises(UserError, match=r"^width_buckets: the gradient of parameter 'gate' .* trailing padding columns are cut off"):
        dpmuon.make_private(model, data, pad_wide, gated, run_dir=tmp_path / "gate", **WIDTHS)
    assert not (tmp_path / "probe").exists() and not (tmp_path / "gate").exists()


def test_rows_stay_one_width_where_widths_could_round_by_shape_or_the_run_began_in_one(tmp_path, capsys):
    data = short_and_long()
    float_mask = lambda rows: {**pad_wide(rows), "attention_mask": pad_wide(rows)["attention_mask"].float()}  # noqa: E731
    cases = {
        "float mask": (float_mask, "no integer or bool [rows, width] 'attention_mask'"),
        "tf32": (pad_wide, "fp32 matrix products are set to round to tf32"),
    }
    for name, (collate_fn, said) in cases.items():
        before = torch.get_float32_matmul_precision()
        if name == "tf32":
            torch.set_float32_matmul_precision("high")
        try:
            private = dpmuon.make_private(wide_model(), data, collate_fn, per_example_lm_loss, run_dir=tmp_path / name.replace(" ", "_"), **WIDTHS)
        finally:
            torch.set_float32_matmul_precision(before)
        assert private.plan.widths is None and private.plan.prior == (), name
        assert said in capsys.readouterr().err, name
    # A run directory whose ledger made no length release continues in one width (said), drawing none.
    first = dpmuon.make_private(wide_model(), data, pad_wide, per_example_lm_loss, run_dir=tmp_path / "run", **WIDTHS, width_buckets=1)
    first.release(next(first.lots()))
    again = dpmuon.make_private(wide_model(), data, pad_wide, per_example_lm_loss, run_dir=tmp_path / "run", **WIDTHS)
    assert again.plan.widths is None and "continues a run whose rows were one width" in capsys.readouterr().err


def test_a_rows_length_covers_every_column_that_is_not_padding():
    batch = pad_wide([torch.arange(1, 5), torch.arange(1, 9)])
    assert facade.row_lengths(batch, WIDE).tolist() == [4, 8]
    batch["labels"][0, 10] = 3  # supervised past the attended columns
    batch["loss_mask"] = torch.zeros(2, WIDE, dtype=torch.long)
    batch["loss_mask"][1, 20] = 1  # another key that is not padding
    assert facade.row_lengths(batch, WIDE).tolist() == [11, 21]


def test_filler_rows_add_exactly_nothing_whatever_they_hold(tmp_path, monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SEED))  # the same lot and noise in every run
    grads = {}
    for name, filler, constant in (("ct", 2, True), ("other_filler", 3, True), ("as_drawn", 2, False)):
        monkeypatch.setattr(facade, "FILLER_EXAMPLE", filler)  # two different examples outside the lot
        private = make(tmp_path, name=name, constant_time=constant)
        lot = next(private.lots())
        assert not {2, 3} & set(lot.indices) and len(lot) > 0
        private.release(lot)
        grads[name] = {n: p.grad for n, p in private.params.items()}
    for n, g in grads["ct"].items():
        assert torch.equal(g, grads["other_filler"][n]), n  # bit for bit
        assert torch.allclose(g, grads["as_drawn"][n], rtol=0, atol=1e-6), n  # the release of the lot as drawn, up to fp32 rounding


def test_micro_batches_of_varying_shapes_are_refused_in_one_line(tmp_path, monkeypatch):
    longest = lambda rows: padded(rows, width=None)  # noqa: E731
    refusal = r"^make_private: constant_time=True needs one shape .*'attention_mask' a shape other than the first micro-batch's \(8, 1\) \(the other"
    with pytest.raises(UserError, match=refusal + r".*padding='max_length'") as refused:
        dpmuon.make_private(
            tiny_model(), [torch.tensor([1])] + varied_lengths()[1:], longest, per_example_lm_loss, run_dir=tmp_path / "a", **SETTINGS, micro_batch_size=8
        )
    assert "\n" not in str(refused.value) and not (tmp_path / "a").exists()  # refused before the mechanism exists
    # The first micro-batch's examples all as long as the first. Rows in widths measure every example's length first,
    # and that refuses the narrower micro-batches before the mechanism exists; in one width, the release's own check
    # refuses, before anything is charged.
    data = [torch.arange(LENGTH) % VOCAB] * 8 + [row[: LENGTH // 2] for row in varied_lengths()[8:]]
    with pytest.raises(UserError, match=r"^make_private: constant_time=True needs one shape .*'attention_mask' a shape other than .*\(8, 8\)"):
        dpmuon.make_private(tiny_model(), data, longest, per_example_lm_loss, run_dir=tmp_path / "b", **SETTINGS, micro_batch_size=8)
    assert not (tmp_path / "b").exists()
    monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, max_lot_size=None, **k: PatternLots([N], max_lot_size))
    private = dpmuon.make_private(tiny_model(), data, longest, per_example_lm_loss, run_dir=tmp_path / "b", **SETTINGS, micro_batch_size=8, width_buckets=1)
    with pytest.raises(UserError, match=r"^make_private: constant_time=True needs one shape"):
        private.release(next(private.lots()))
    assert ledger_steps(tmp_path / "b") == [] and all(p.grad is None for p in private.params.values())
    # Whether it failed depended on the lot: a caller who catches the error gets no next lot to learn it from again.
    for call in (lambda: next(private.lots()), private.draw_lot, private.state_dict):
        with pytest.raises(UserError, match=r"^this PrivateTraining stopped when the release of lot 1 failed mid-lot \(UserError\)"):
            call()
    with pytest.raises(UserError, match=r"^make_private: collate_fn returned a tuple: .* a mapping of tensors"):
        dpmuon.make_private(tiny_model(), dataset(), lambda rows: tuple(collate(rows).values()), per_example_lm_loss, run_dir=tmp_path / "c", **SETTINGS)
    as_drawn = dpmuon.make_private(tiny_model(), varied_lengths(), longest, per_example_lm_loss, run_dir=tmp_path / "d", **SETTINGS, constant_time=False)
    as_drawn.release(next(as_drawn.lots()))  # lots as drawn: any shapes


def test_a_rerun_of_a_finished_run_dir_says_it_trains_nothing(tmp_path, capsys):
    first = make(tmp_path, steps=1)
    assert len([first.release(lot) for lot in first.lots()]) == 1
    again = make(tmp_path, steps=1)
    assert list(again.lots()) == [] and again.epsilon == first.epsilon
    said = [line for line in capsys.readouterr().err.splitlines() if "finished" in line]
    assert len(said) == 1 and re.search(r"run_dir .* is finished: .* this run trains nothing; to train again, use a new run_dir", said[0])


def test_a_user_seeded_run_dir_is_not_continued_from_the_seeds_start(tmp_path, monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SEED))
    first = make(tmp_path)
    first.release(next(first.lots()))
    again = make(tmp_path)  # a new process: the seed's streams start over, lot 1's coins and noise would repeat
    with pytest.raises(UserError, match=r"^run_dir=.* holds 1 releases drawn from this mechanism seed, .*\(repeated noise is not private\)"):
        next(again.lots())
    monkeypatch.delenv(MECHANISM_SEED_ENV)
    fresh = make(tmp_path)  # OS entropy: fresh draws, the ledger continues
    fresh.release(next(fresh.lots()))
    assert ledger_steps(tmp_path / "run") == [(1, True), (2, True)]


def test_the_example_says_what_it_trained_when_run_again(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(MECHANISM_SEED_ENV, raising=False)
    monkeypatch.delenv("DPMUON_TOKENIZER", raising=False)  # bytes: offline, small
    spec = importlib.util.spec_from_file_location("train_private_jsonl", REPO / "examples" / "train_private_jsonl.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    outputs = []
    for _ in range(2):
        monkeypatch.setattr(sys, "argv", ["train_private_jsonl.py", "--run-dir", str(tmp_path), "--steps", "1", "--noise-multiplier", "1.0"])
        example.main()
        outputs.append(capsys.readouterr())
    assert outputs[0].out.startswith("trained 1 private steps in this run (1 of the plan's 1 in the ledger)")
    assert outputs[1].out.startswith("trained 0 private steps in this run (1 of the plan's 1 in the ledger)")
    assert "this run trains nothing; to train again, use a new run_dir" in outputs[1].err


def test_batch_norm_in_train_mode_is_refused(tmp_path):
    model = tiny_model()
    model.transformer.add_module("bn", nn.BatchNorm1d(16))
    with pytest.raises(UserError, match=r"^model module 'transformer.bn' is a BatchNorm1d in train mode"):
        make(tmp_path, model)


def test_shuffled_lots_need_an_explicit_opt_in(tmp_path):
    with pytest.raises(UserError, match=r"^make_private: sampling='shuffle' .* allow_shuffle_sampling=True"):
        make(tmp_path, sampling="shuffle")
    with pytest.warns(UserWarning, match="not a valid guarantee"):
        private = make(tmp_path, sampling="shuffle", allow_shuffle_sampling=True)
    assert len(next(private.lots())) == SETTINGS["expected_lot_size"]


def test_a_module_the_engine_cannot_handle_is_refused_in_one_line(tmp_path):
    class Scale(nn.Module):  # a trainable parameter outside every layer rule
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return x * self.weight

    model = tiny_model()
    model.transformer.add_module("scale", Scale())
    with pytest.raises(UserError, match=r"^make_private: .*'transformer\.scale\.weight'") as caught:
        make(tmp_path, model, engine_fallback="error")
    assert "\n" not in str(caught.value)


def test_lots_are_secret_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(MECHANISM_SEED_ENV, raising=False)
    draws = []
    for name in ("a", "b"):
        private = make(tmp_path, name=name)
        assert private.mechanism.randomness.source == OS_ENTROPY
        lots = private.lots()
        draws.append([next(lots).indices for _ in range(3)])
    assert draws[0] != draws[1]


def test_the_optimizer_needs_a_known_name_and_a_learning_rate(tmp_path):
    private = make(tmp_path)
    with pytest.raises(ValueError, match="unknown optimizer 'muon'; valid: dp_sgd, dp_adam, dp_muon, dp_muonbc"):
        dpmuon.optim.build("muon", private.model, private, lr=1e-3)
    with pytest.raises(ValueError, match="needs lr="):
        dpmuon.optim.build("dp_adam", private.model, private)
    muon = dpmuon.optim.build("dp_muonbc", private.model, private, lr=1e-3)
    assert set(muon.parts) == {"muon", "adam"}


def test_the_example_trains_privately_on_a_jsonl_file_and_prints_epsilon(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (MECHANISM_SEED_ENV, "DPMUON_TOKENIZER")}  # bytes: offline, small
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_private_jsonl.py"), "--run-dir", str(tmp_path), "--steps", "3", "--noise-multiplier", "1.0"],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    epsilon = float(re.search(r"^epsilon = (\S+) \(target 8,", done.stdout, re.M).group(1))
    assert math.isfinite(epsilon) and 0 < epsilon <= 8
    lines = (tmp_path / LEDGER_FILE).read_text().splitlines()
    assert len(lines) == 1 + 3 and all(json.loads(line)["charged"] for line in lines[1:])


def test_privacy_keywords_are_the_drivers_options_with_its_checks_and_defaults(tmp_path):
    """make_private's privacy keywords are PrivacySettings' options: a bad value is the command
    line's one-line message, an unknown keyword names the closest valid one, and the guarantee
    and its lot are stated, never defaulted."""
    with pytest.raises(UserError, match=r"^privacy\.clip_norm=-1\.0: must be > 0; valid: a number > 0$"):
        make(tmp_path, clip_norm=-1.0)
    with pytest.raises(UserError, match=r"^make_private: unknown keyword 'clip_nrom' \(did you mean clip_norm\?\); valid: run_dir, epochs, "):
        make(tmp_path, clip_nrom=1.0)
    with pytest.raises(UserError, match=r"^make_private: unknown keyword 'published_seed'"):  # the driver's own bookkeeping
        make(tmp_path, published_seed=True)
    settings = {k: v for k, v in SETTINGS.items() if k != "target_epsilon"}
    with pytest.raises(UserError, match=r"^make_private: target_epsilon=\.\.\. is required"):
        dpmuon.make_private(tiny_model(), dataset(), collate, per_example_lm_loss, run_dir=tmp_path / "r", **settings)
    assert make(tmp_path).plan.max_lot_size is not None  # constant-time lots by default, as in the driver


def released_grads(private) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in private.params.items()}


def test_state_dict_continues_a_run_whose_re_run_steps_replay_for_free(tmp_path):
    """state_dict() keeps the secret generator states owner-only beside the ledger and returns a
    shareable record; a new process given the record replays the lots and noise of the steps after
    it — identical releases, charged once — as the driver's resume does."""
    first = make(tmp_path)
    first.release(first.draw_lot())
    record = first.state_dict()
    lot = first.draw_lot()
    first.release(lot)
    released = released_grads(first)
    assert set(record) == {"step", "plan", "ledger_head", "ledger_length"} and record["step"] == 1
    state_file = tmp_path / "run" / "mechanism_state.pt"
    assert state_file.stat().st_mode & 0o777 == 0o600
    assert "randomness" not in json.dumps(record)

    second = make(tmp_path)  # a new process on the same run_dir: its ledger holds both releases
    second.load_state_dict(json.loads(json.dumps(record)))
    again = second.draw_lot()
    assert (again.step, again.indices) == (2, lot.indices)
    second.release(again)
    assert all(torch.equal(released[name], g) for name, g in released_grads(second).items())
    assert second.mechanism.release.accountant.steps == 2  # the replay is not charged again
    lines = [json.loads(line) for line in (tmp_path / "run" / LEDGER_FILE).read_text().splitlines()[1:]]
    assert [(r["step"], r["charged"]) for r in lines] == [(1, True), (2, True), (2, False)]


def test_a_deleted_or_shortened_ledger_is_not_continued(tmp_path):
    """With a saved state, the releases it recorded must still be in the ledger: a deleted ledger
    is refused when make_private opens the run_dir, a shortened one when the record is loaded."""
    first = make(tmp_path)
    first.release(first.draw_lot())
    first.release(first.draw_lot())
    record = first.state_dict()
    ledger = tmp_path / "run" / LEDGER_FILE
    lines = ledger.read_text().splitlines(keepends=True)
    ledger.write_text("".join(lines[:-1]))
    with pytest.raises(UserError, match=r"cannot continue this run directory: .*the state_dict record"):
        make(tmp_path).load_state_dict(record)
    ledger.unlink()
    with pytest.raises(UserError, match=r"privacy_ledger\.jsonl is missing but mechanism_state\.pt records 3 lines: the ledger was deleted"):
        make(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "checkpoint.pt").write_bytes(b"the user's own file")  # the driver's name, but not the façade's
    assert make(tmp_path, name="mine").mechanism.ledger.length == 1  # a new run: the ledger's header


def test_state_dict_refuses_a_lot_drawn_and_not_released(tmp_path):
    private = make(tmp_path)
    private.draw_lot()
    with pytest.raises(UserError, match=r"^state_dict\(\): lot 1 was drawn and not released"):
        private.state_dict()


def test_the_secret_state_is_deleted_once_the_plans_last_step_is_released(tmp_path):
    """As the driver's: the generator states regenerate the lots and noise, so they are kept only
    while a step is left to replay — a replay after load_state_dict keeps them until its end."""
    private = make(tmp_path)
    private.release(private.draw_lot())
    record = private.state_dict()
    state = tmp_path / "run" / "mechanism_state.pt"
    assert state.exists()
    for lot in private.lots():
        private.release(lot)
    assert not state.exists() and private.plan_done
    private.state_dict()
    assert not state.exists()  # nothing left to replay: nothing secret written

    again = make(tmp_path)  # a replay of steps 2 and 3 from the record: the state is gone, so fresh draws
    again.load_state_dict(record)
    assert not again.plan_done


def test_a_replay_that_cannot_reproduce_its_release_is_redone_fresh_and_charged(tmp_path, capsys):
    """A step re-run after load_state_dict on weights other than those it first saw releases
    something else: that is no replay (its noise would repeat on a different sum), so the
    mechanism redraws lot and noise from fresh entropy and charges the step again."""
    first = make(tmp_path)
    first.release(first.draw_lot())
    record = first.state_dict()
    first.release(first.draw_lot())
    model = tiny_model()
    with torch.no_grad():  # not the weights step 2 first saw (random: a constant shift can pass GPT-2's LayerNorms unseen)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    second = make(tmp_path, model)
    second.load_state_dict(record)
    second.release(second.draw_lot())
    assert "redrawing lot and noise from fresh OS entropy" in capsys.readouterr().err
    lines = [json.loads(line) for line in (tmp_path / "run" / LEDGER_FILE).read_text().splitlines()[1:]]
    assert [(r["step"], r["charged"]) for r in lines] == [(1, True), (2, True), (2, True)]
    assert second.mechanism.release.accountant.steps == 3
