"""User code that voids per-example clipping is refused by behaviour, in one line, before any
release is charged (privacy/conformance.py, called by the privatizer's release)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpmuon
from dpmuon.errors import UserError
from dpmuon.models import IGNORE_INDEX, Shape, build_random_lm, hidden_matrices, per_example_lm_loss
from dpmuon.privacy import LEDGER_FILE
from dpmuon.privacy.accountant import PrivacyAccountant
from dpmuon.privacy.blocks import build_partition
from dpmuon.privacy.conformance import check_first_micro_batch, select_rows
from dpmuon.privacy.privatizer import Privatizer

N, LENGTH, VOCAB, WIDTH = 24, 6, 11, 8
SETTINGS = dict(target_epsilon=8.0, delta=1e-3, steps=2, expected_lot_size=8, micro_batch_size=8, clip_norm=0.5, noise_multiplier=1.0, accountant="rdp")


class TinyLM(nn.Module):
    """Embedding → (an optional module) → head: per-example unless `middle` mixes rows."""

    def __init__(self, middle: nn.Module | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.middle = middle or nn.Identity()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.middle(self.embed(input_ids)))


def token_nll(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
    return nll, (labels != IGNORE_INDEX).sum(1)


def own_tokens_loss(model, batch):  # per example: its NLL over its own supervised tokens
    nll, counts = token_nll(model, batch)
    return nll.sum(1) / counts.clamp_min(1)


def dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, LENGTH + 1, (1,), generator=g)),), generator=g) for _ in range(N)]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fixed width (constant-time lots need it); labels -100 on the padding."""
    ids = torch.zeros(len(rows), LENGTH, dtype=torch.long)
    labels = torch.full((len(rows), LENGTH), IGNORE_INDEX)
    for i, row in enumerate(rows):
        ids[i, : len(row)], labels[i, : len(row)] = row, row
    return {"input_ids": ids, "attention_mask": (labels != IGNORE_INDEX).long(), "labels": labels}


def refused_without_charge(tmp_path: Path, loss_fn=own_tokens_loss, model: nn.Module | None = None, **overrides) -> str:
    """make_private (its checks on the first examples) or else the façade's first release fails: the
    one-line message, after checking nothing was charged."""
    with pytest.raises(UserError) as caught:
        private = dpmuon.make_private(model or TinyLM(), dataset(), collate, loss_fn, run_dir=tmp_path / "run", **{**SETTINGS, **overrides})
        private.release(next(private.lots()))
    assert releases_in_ledger(tmp_path) == 0
    message = str(caught.value)
    assert "\n" not in message
    return message


def releases_in_ledger(tmp_path: Path) -> int:
    ledger = tmp_path / "run" / LEDGER_FILE
    lines = ledger.read_text().splitlines() if ledger.exists() else []
    return sum(json.loads(line)["kind"] != "header" for line in lines)


def released(tmp_path: Path, loss_fn=own_tokens_loss, model: nn.Module | None = None, **overrides):
    private = dpmuon.make_private(model or TinyLM(), dataset(), collate, loss_fn, run_dir=tmp_path / "run", **{**SETTINGS, **overrides})
    stats = private.release(next(private.lots()))
    assert private.epsilon > 0
    return stats


# -- 1. shape and finiteness ---------------------------------------------------------------------


def batch_mean_loss(model, batch):
    return own_tokens_loss(model, batch).mean()


def column_loss(model, batch):
    return own_tokens_loss(model, batch)[:, None]


@pytest.mark.parametrize("loss_fn, shape", [(batch_mean_loss, "()"), (column_loss, "(8, 1)")])
def test_a_loss_that_is_not_one_per_row_is_refused_naming_it(tmp_path, loss_fn, shape):
    message = refused_without_charge(tmp_path, loss_fn)
    assert message.startswith(f"loss_fn {loss_fn.__name__} returned a tensor of shape {shape} for a micro-batch of 8 rows")
    assert "micro-batch of 8 rows" in message and "shape [8]" in message and "dpmuon.models.per_example_lm_loss" in message


def test_a_loss_nan_for_every_example_is_refused(tmp_path):
    def all_nan(model, batch):
        return own_tokens_loss(model, batch) * float("nan")

    message = refused_without_charge(tmp_path, all_nan)
    assert message.startswith("loss_fn test_a_loss_nan_for_every_example_is_refused.<locals>.all_nan returned a non-finite loss (NaN/inf) for every one")


def test_one_nan_example_is_dropped_not_refused():
    """An example whose loss is NaN (by what it holds) gets factor 0 and adds nothing — a
    per-example rule, so Δ holds: counted, not refused."""
    rows = dataset()[:8]
    token = int(rows[0][0])

    def nan_for_one_token(model, batch):
        nan = torch.where(batch["input_ids"][:, 0] == token, float("nan"), 0.0)
        return own_tokens_loss(model, batch) + nan

    model = TinyLM()
    stats = privatizer_of(model).release([collate(rows)], nan_for_one_token)
    assert 1 <= stats.nonfinite < 8
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def privatizer_of(model: nn.Module) -> Privatizer:
    """The privatizer the driver and the façade release through, without a ledger."""
    return Privatizer(model, build_partition([n for n, _ in model.named_parameters()], clip_norm=0.5), 1.0, 8, 0.3, PrivacyAccountant(1e-5))


def test_a_loss_whose_nan_spreads_to_the_other_examples_gradients_is_refused():
    """torch.where's backward multiplies the unused NaN branch by 0: every example's gradient is
    NaN, so one example would make the engine drop all the others."""
    rows = dataset()[:8]
    token = int(rows[0][0])

    def where_nan(model, batch):
        losses = own_tokens_loss(model, batch)
        return torch.where(batch["input_ids"][:, 0] == token, losses * float("nan"), losses)

    model = TinyLM()
    with pytest.raises(UserError, match=r"^loss_fn .*where_nan mixes the examples of a micro-batch"):
        privatizer_of(model).release([collate(rows)], where_nan)
    assert all(p.grad is None for p in model.parameters())


# -- 2. coupling between examples ---------------------------------------------------------------


def num_items_in_batch_loss(model, batch):  # Hugging Face's convention: the micro-batch's token count
    nll, counts = token_nll(model, batch)
    return nll.sum(1) / counts.sum()


def per_row_count_loss(model, batch):  # … or its number of rows
    return own_tokens_loss(model, batch) / len(batch["input_ids"])


def by_position_loss(model, batch):  # a weight by the row's place: removing an example moves the others'
    losses = own_tokens_loss(model, batch)
    return losses * torch.arange(1, len(losses) + 1)


@pytest.mark.parametrize("loss_fn", [num_items_in_batch_loss, per_row_count_loss, by_position_loss])
def test_a_loss_whose_value_depends_on_the_other_examples_is_refused(tmp_path, loss_fn):
    message = refused_without_charge(tmp_path, loss_fn)
    assert message.startswith(f"loss_fn {loss_fn.__name__} couples the examples of a micro-batch: row ")
    assert "num_items_in_batch" in message


def collate_to_longest(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Padded to the micro-batch's longest example: the width depends on which examples share it."""
    width = max(len(row) for row in rows)
    return {k: v[:, :width] for k, v in collate(rows).items()}


def per_width_loss(model, batch):  # each example's NLL over the padded width: the longest example sets everyone's scale
    nll, _ = token_nll(model, batch)
    return nll.sum(1) / nll.shape[1]


def test_a_loss_that_depends_on_the_padded_width_is_refused_when_make_private_is_called(tmp_path):
    # The row probes keep the columns as collated, so only collating the examples apart shows it.
    with pytest.raises(UserError) as caught:
        dpmuon.make_private(TinyLM(), dataset(), collate_to_longest, per_width_loss, run_dir=tmp_path / "run", constant_time=False, **SETTINGS)
    message = str(caught.value)
    assert message.startswith("loss_fn per_width_loss couples the examples of a micro-batch: row ") and "collated on their own" in message
    assert "\n" not in message and not (tmp_path / "run" / LEDGER_FILE).exists()


def test_a_per_example_loss_passes_whatever_width_the_examples_are_collated_to(tmp_path):
    private = dpmuon.make_private(TinyLM(), dataset(), collate_to_longest, own_tokens_loss, run_dir=tmp_path / "run", constant_time=False, **SETTINGS)
    private.release(next(private.lots()))
    assert private.epsilon > 0


def centred_loss(model, batch):  # same values, but each gradient moves with the others' losses
    losses = own_tokens_loss(model, batch)
    return losses - losses.mean() + losses.mean().detach()


def test_a_loss_whose_gradient_depends_on_the_other_examples_is_refused(tmp_path):
    message = refused_without_charge(tmp_path, centred_loss)
    assert message.startswith("loss_fn centred_loss mixes the examples of a micro-batch")


class RowMixer(nn.Module):
    """A custom module that adds the micro-batch's mean activation to every row."""

    def forward(self, x):
        return x + x.mean(0, keepdim=True)


class Block(nn.Module):  # the mixer inside a parent, to be named as the innermost culprit
    def __init__(self):
        super().__init__()
        self.mix = RowMixer()
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(self.mix(x))


@pytest.mark.parametrize(
    "middle, name",
    [(Block(), "'middle.mix' (RowMixer)"), (nn.BatchNorm1d(LENGTH, track_running_stats=False), "'middle' (BatchNorm1d)")],
    ids=["custom", "batch-norm-batch-statistics"],
)
def test_a_model_that_mixes_rows_is_refused_naming_the_module(tmp_path, middle, name):
    """Through the privatizer alone (the driver's path): the façade also refuses batch-norm by class."""
    model = TinyLM(middle).train()
    privatizer = privatizer_of(model)
    with pytest.raises(UserError, match=rf"^model module {re.escape(name)} mixes the examples of a micro-batch") as caught:
        privatizer.release([collate(dataset()[:8])], own_tokens_loss)
    assert "\n" not in str(caught.value)
    assert privatizer.accountant.steps == 0
    assert all(p.grad is None for p in model.parameters())


def test_the_custom_mixer_is_refused_through_the_facade_too(tmp_path):
    message = refused_without_charge(tmp_path, model=TinyLM(Block()))
    assert message.startswith("model module 'middle.mix' (RowMixer) mixes the examples of a micro-batch")


def test_per_example_code_passes_dropout_layer_norm_and_a_one_row_micro_batch_included(tmp_path):
    """No false alarm: dropout in train mode (the probes keep the RNG and run in eval mode),
    per-instance norms, variable lengths and a micro-batch of one row (checked as that row twice)."""
    middle = nn.Sequential(nn.Dropout(0.3), nn.LayerNorm(WIDTH), nn.InstanceNorm1d(LENGTH))
    released(tmp_path, model=TinyLM(middle).train())
    model = TinyLM(middle).train()
    for rows in (dataset()[:4], dataset()[:1]):
        before = torch.get_rng_state()
        assert check_first_micro_batch(model, collate(rows), own_tokens_loss)
        assert torch.equal(torch.get_rng_state(), before)  # a resumed run draws the dropout masks an uninterrupted one does


def test_rows_are_selected_keeping_the_collated_width():
    batch = {**collate(dataset()[:4]), "name": "x", "scale": torch.ones(1)}
    part = select_rows(batch, [2, 2], 4)
    assert part["input_ids"].shape == (2, LENGTH) and torch.equal(part["input_ids"][0], batch["input_ids"][2])
    assert part["name"] == "x" and part["scale"].shape == (1,)


# -- 3. buffers written in the forward -----------------------------------------------------------


class Counter(nn.Module):
    """A custom module that keeps a statistic of what it saw in a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(WIDTH))

    def forward(self, x):
        self.seen += x.detach().flatten(0, 1).mean(0)
        return x


class Replacer(Counter):  # … or replaces the buffer outright
    def forward(self, x):
        self.seen = x.detach().flatten(0, 1).mean(0)
        return x


class Cache(nn.Module):  # … or keeps what it saw as a plain attribute, which later calls read
    def forward(self, x):
        last = getattr(self, "last", None)
        self.last = x.detach().mean()
        return x if last is None else x + 0 * last


class UpdatedCache(Cache):  # … the attribute there before the release, then written in place
    def __init__(self):
        super().__init__()
        self.last = torch.zeros(())

    def forward(self, x):
        self.last.add_(x.detach().mean())
        return x


@pytest.mark.parametrize(
    "middle, culprit",
    [
        (nn.InstanceNorm1d(LENGTH, track_running_stats=True), "'middle' (InstanceNorm1d) wrote its buffer 'running_mean'"),
        (Counter(), "'middle' (Counter) wrote its buffer 'seen'"),
        (Replacer(), "'middle' (Replacer) wrote its buffer 'seen'"),
        (Cache(), "'middle' (Cache) added its tensor attribute 'last'"),
        (UpdatedCache(), "'middle' (UpdatedCache) wrote its tensor attribute 'last'"),
    ],
    ids=["instance-norm", "in-place", "replaced", "cache-added", "cache-written"],
)
def test_a_module_that_writes_a_buffer_in_forward_is_refused_and_the_buffer_restored(tmp_path, middle, culprit):
    model = TinyLM(middle).train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    message = refused_without_charge(tmp_path, model=model, width_buckets=1)  # the release's own check (rows in widths: see below)
    assert message.startswith(f"model module {culprit} during the release's forward")
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n  # no trace of the private examples left in the model
    last = getattr(model.middle, "last", None)
    assert last is None or float(last) == 0.0


def test_a_model_whose_shapes_tie_positions_to_the_width_is_refused_rows_in_widths(tmp_path):
    # A norm over the positions, with running statistics of max_length entries, cannot take a narrower row.
    model = TinyLM(nn.InstanceNorm1d(LENGTH, track_running_stats=True)).train()
    message = refused_without_charge(tmp_path, model=model)
    assert re.match(r"width_buckets: loss_fn \S+ failed on example 0 with its trailing padding columns cut off \(.*\); .* pass width_buckets=1", message)
    assert not (tmp_path / "run").exists()  # before the mechanism exists


class PaddingMixedInTraining(nn.Module):
    """Identity in eval mode; in train mode each row's positions, its padding too, are mixed."""

    def forward(self, x):
        return x + x.mean(dim=1, keepdim=True) if self.training else x


def test_a_model_that_mixes_padding_in_train_mode_only_is_refused_rows_in_widths(tmp_path):
    # Eval mode shows nothing: the releases run in train mode, where a row's width would move its loss.
    message = refused_without_charge(tmp_path, model=TinyLM(PaddingMixedInTraining()).train())
    assert re.match(r"width_buckets: example \d+'s loss \(loss_fn own_tokens_loss, train mode\) changes when .* cut off", message), message
    assert not (tmp_path / "run").exists()  # before the mechanism exists
    # With dropout the train-mode forward draws randomness, so it cannot be compared: only eval mode is checked (docs/privacy.md).
    noisy = TinyLM(nn.Sequential(nn.Dropout(0.2), PaddingMixedInTraining())).train()
    assert dpmuon.make_private(noisy, dataset(), collate, own_tokens_loss, run_dir=tmp_path / "noisy", **SETTINGS).widths is not None
    assert dpmuon.make_private(TinyLM().train(), dataset(), collate, own_tokens_loss, run_dir=tmp_path / "plain", **SETTINGS).widths is not None


def test_a_buffer_written_on_a_later_release_is_refused_too(tmp_path):
    class LateCounter(Counter):
        armed = False

        def forward(self, x):
            if self.armed:
                self.seen += 1
            return x

    model = TinyLM(LateCounter())
    private = dpmuon.make_private(model, dataset(), collate, own_tokens_loss, run_dir=tmp_path / "run", **SETTINGS)
    lots = private.lots()
    private.release(next(lots))
    model.middle.armed = True  # writes from the second release on, after the first one's checks
    with pytest.raises(UserError, match=r"^model module 'middle' \(LateCounter\) wrote its buffer 'seen'"):
        private.release(next(lots))
    assert releases_in_ledger(tmp_path) == 1


def test_a_parameter_written_in_forward_is_refused(tmp_path):
    class Tracker(nn.Module):
        def __init__(self):
            super().__init__()
            self.ema = nn.Parameter(torch.zeros(WIDTH), requires_grad=False)

        def forward(self, x):
            self.ema.data.mul_(0.9).add_(x.detach().flatten(0, 1).mean(0))
            self.ema.add_(0)  # .data writes escape the version counter; any tracked write shows
            return x

    message = refused_without_charge(tmp_path, model=TinyLM(Tracker()))
    assert message.startswith("model module 'middle' (Tracker) wrote its parameter 'ema'")


# -- 4. stock Hugging Face GPT-2 -----------------------------------------------------------------


def gpt2() -> nn.Module:
    return build_random_lm("gpt2", Shape(VOCAB, n_layer=1, n_embd=8, n_head=2, n_positions=LENGTH), seed=0).train()


def test_stock_gpt2_without_position_ids_is_refused_saying_what_to_do(tmp_path):
    def no_position_ids(model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
        return nll.sum(1) / (labels != IGNORE_INDEX).sum(1).clamp_min(1)

    message = refused_without_charge(tmp_path, no_position_ids, gpt2())
    assert message.startswith("model module 'transformer.wpe' (Embedding) was computed once (output shape (1, 6, 8))")
    assert "position_ids_for(attention_mask)" in message and "per_example_lm_loss" in message


def test_stock_gpt2_trains_with_per_example_lm_loss(tmp_path):
    model = gpt2()
    assert hidden_matrices(model)
    released(tmp_path, per_example_lm_loss, model)
