"""`dpmuon.make_private`: the driver's private release for your own model, data and loop.

    private = dpmuon.make_private(model, train_dataset, collate_fn, loss_fn, target_epsilon=8.0, delta=1e-5,
                                  epochs=3, expected_lot_size=256, clip_norm=0.1, run_dir="runs/mine")
    optimizer = dpmuon.optim.build("dp_muon", model, private, lr=1e-3)
    for lot in private.lots():  # Poisson lots of example indices, micro-batched by collate_fn
        private.release(lot)    # clip, noise, ledger, accountant → p.grad
        optimizer.step()
    print(private.epsilon)

The mechanism is the driver's own (privacy/mechanism.py): the same plan, secret randomness,
fsynced hash-chained ledger in `run_dir`, accountant and budget guard. What this module adds is
the refusal of what would void the guarantee in code the driver does not control: batch-norm in
train mode, shuffled lots without an explicit opt-in, a lot that is not the next one drawn
(hand-built, edited, released twice, skipped or out of order), a data set that cannot be
indexed, and — with constant-time lots, the default — micro-batches whose shapes vary. Where
collate_fn's batches carry an attention mask, constant-time rows come in the driver's few fixed
widths (privacy.width_buckets), cut from collate_fn's width, after a check that cutting padding
off moves no example's loss.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .data.encoding import IGNORE_INDEX
from .errors import UserError, one_line
from .models import hidden_matrices
from .privacy.conformance import check_padding_cut, check_user_code
from .privacy.engines import PerExampleLoss
from .privacy.engines.base import EXAMPLE_MASK
from .privacy.ledger import LEDGER_FILE, ledger_header
from .privacy.lot_bound import bucket_micro_batches, micro_batch_members
from .privacy.mechanism import Mechanism, MechanismSettings, buckets_by_width, build_mechanism, check_plan_inputs
from .privacy.plan import check_resume_compatible
from .privacy.privatizer import ReleaseStats
from .privacy.randomness import USER_SEED
from .privacy.seed import user_seed
from .privacy.settings import PrivacySettings
from .privacy.state import (
    MECHANISM_STATE_FILE,
    check_ledger_kept,
    discard_mechanism_state,
    ledger_record,
    restore_mechanism,
    save_mechanism_state,
    secret_state,
    verify_ledger,
)

# The example whose rows fill a constant-time micro-batch up (any would do: filler rows add nothing).
FILLER_EXAMPLE = 0
# The batch key whose zeros mark a row's padding (Hugging Face's): with it, constant-time rows come
# in a few fixed widths (privacy.width_buckets), each cut from the width collate_fn pads to.
PADDING_MASK = "attention_mask"


def say(message: str) -> None:
    print(f"[dpmuon] {message}", file=sys.stderr, flush=True)


@dataclass(eq=False)  # compared by identity: a copy with the same fields is not the lot drawn
class Lot:
    """One Poisson lot: the examples' indices in the training set, drawn by `lots()` and released
    once, in the order drawn (see `PrivateTraining.release`)."""

    step: int  # its release's number in the ledger (lots are numbered as drawn)
    indices: list[int]
    micro_batch_size: int
    _batches: Callable[[], Iterator[Any]] = field(repr=False)
    released: bool = False

    def __len__(self) -> int:
        return len(self.indices)

    def micro_batches(self) -> Iterator[Any]:
        """The collated micro-batches the release processes: at most `micro_batch_size` examples
        each, or in width buckets as many as `micro_batch_size` full-width rows' tokens; with
        constant-time lots always the same micro-batches, filler rows marked False in
        batch[EXAMPLE_MASK]."""
        return self._batches()


@dataclass(frozen=True)
class RowWidths:
    """Constant-time rows in the plan's widths: every example's length (private: used only to
    place it), the width collate_fn pads to, each width's micro-batches (width, count, rows each:
    lot_bound.bucket_micro_batches) and the tensor shapes of a micro-batch of (rows, width)."""

    lengths: list[int] = field(repr=False)  # the private lengths: never in a printed repr
    max_length: int
    micro_batches: tuple[tuple[int, int, int], ...]
    shapes: dict[tuple[int, int], dict[str, tuple[int, ...]]]


class PrivateTraining:
    """A model's private release over one training set (build it with `make_private`)."""

    def __init__(
        self,
        model: nn.Module,
        dataset: Sequence,
        collate_fn: Callable,
        loss_fn: PerExampleLoss,
        mechanism: Mechanism,
        micro_batch_size: int,
        run_dir: Path,
        shapes: dict[str, tuple[int, ...]] | None = None,
        widths: RowWidths | None = None,
    ):
        self.model, self.dataset, self.collate_fn, self.loss_fn = model, dataset, collate_fn, loss_fn
        self.mechanism = mechanism
        self.micro_batch_size = micro_batch_size
        self.run_dir = run_dir
        self.hidden_matrices = {n: layout for n, layout in hidden_matrices(model).items() if n in mechanism.release.params}
        # Constant-time lots: every release processes at least this many rows (B_max, privacy/lot_bound.py),
        # in micro-batches of micro_batch_size rows or in the plan's widths; None: lots as drawn.
        self.padded_rows = mechanism.plan.max_lot_size
        # The engines read the filler rows' mask; loss_fn sees the batch as collate_fn made it.
        self._release_loss = loss_fn if self.padded_rows is None else without_example_mask(loss_fn)
        self.shapes = shapes  # constant-time lots: every micro-batch's tensor shapes (`fixed_shapes`)
        self.widths = widths  # constant-time rows in the plan's widths (None: every row collate_fn's width)
        # Lots are numbered as drawn, after the steps of a ledger the run directory already holds.
        self.next_step = 1 + max((r["step"] for r in mechanism.ledger.releases), default=0) if mechanism.ledger else 1
        # Drawn and not yet released, in the order drawn: (lot, its step, its indices as drawn).
        self._pending: deque[tuple[Lot, int, tuple[int, ...]]] = deque()
        self._stopped: str | None = None  # why nothing more is drawn or released (a release failed mid-lot)

    # -- what the optimizer may know (public) --------------------------------------------------

    @property
    def params(self) -> dict[str, nn.Parameter]:
        """The trainable parameters the release writes (name → parameter)."""
        return dict(self.mechanism.release.params)

    def release_noise_std(self) -> dict[str, float]:
        """Per-entry noise std of each parameter's released gradient (public)."""
        return self.mechanism.release_noise_std()

    # -- the private steps -----------------------------------------------------------------------

    @property
    def plan(self):
        """The privacy plan fixed before the first lot: N, q, steps, σ, planned ε (privacy/plan.py)."""
        return self.mechanism.plan

    @property
    def epsilon(self) -> float:
        """ε spent so far at the plan's δ, composed from the ledger's charged releases."""
        return self.mechanism.epsilon

    @property
    def ledger_path(self) -> Path:
        return self.mechanism.ledger.path

    def lots(self) -> Iterator[Lot]:
        """The plan's lots, drawn with the mechanism's secret randomness; stops early where one
        more release would exceed the target ε (the budget guard). Says so when the run
        directory's ledger already holds every release of the plan: nothing is left to train."""
        self._refuse_if_stopped()
        charged = self.mechanism.release.accountant.steps
        if charged >= self.plan.steps:
            say(
                f"run_dir {self.run_dir} is finished: its ledger already charges {charged} releases, the plan has {self.plan.steps}, so "
                "lots() yields none and this run trains nothing; to train again, use a new run_dir (the releases here still count)"
            )
            return
        for _ in range(self.plan.steps - charged - len(self._pending)):
            stop = self.mechanism.budget_stop(self.next_step)
            if stop:
                say(f"{stop}; no more lots")
                return
            yield self.draw_lot()

    def draw_lot(self, step: int | None = None) -> Lot:
        """The next lot of the secret sampler, numbered `step` (default: after the last one drawn).
        lots() draws with it; an integration that re-runs the steps after a checkpoint (DPTrainer)
        gives their numbers, and the ledger charges such a re-run unless its release is identical."""
        self._refuse_if_stopped()
        self._refuse_redrawing_a_user_seed()
        step = self.next_step if step is None else int(step)
        self.next_step = step + 1
        drawn = tuple(self.mechanism.next_lot())
        lot = Lot(step, list(drawn), self.micro_batch_size, lambda: self._micro_batches(drawn))
        self._pending.append((lot, step, drawn))
        return lot

    def _refuse_if_stopped(self) -> None:
        if self._stopped is not None:
            raise UserError(self._stopped)

    def _refuse_redrawing_a_user_seed(self) -> None:
        """A user seed's streams start over in every process: continuing a ledger from them would
        draw the first lots and noise again, and a release whose noise repeats an earlier one's is no
        longer private (their difference has no noise). OS entropy is fresh in each process, and an
        integration that restores the streams' saved position (DPTrainer) has draws > 0."""
        randomness, ledger = self.mechanism.randomness, self.mechanism.ledger
        if ledger is not None and ledger.releases and randomness.source == USER_SEED and randomness.sampler.draws == 0:
            raise UserError(
                f"run_dir={self.run_dir} holds {len(ledger.releases)} releases drawn from this mechanism seed, and a new process "
                "would draw the same lots and noise again (repeated noise is not private); continue with no seed (OS entropy), "
                "or start a new run_dir"
            )

    def release(self, lot: Lot) -> ReleaseStats:
        """Clip, noise, write the ledger line (fsynced), charge the accountant, then set p.grad
        of every trainable parameter to the released gradient. Returns the lot's statistics:
        computed from the raw examples, they are NOT private (do not log or publish them).

        Only the oldest lot drawn and not yet released, unchanged, is released: an empty lot too
        (noise only, charged, numbered), so the ledger's steps have no gaps that say which lots
        were empty. Refusing is what keeps the accountant truthful; charging every drawn lot
        would not: releasing lots chosen (or ordered) by what they hold — a lot with a given
        example, say — is no longer Poisson sampling, whatever is charged for the others.
        """
        self._refuse_if_stopped()
        if not isinstance(lot, Lot):
            raise UserError(f"release() takes a lot from lots(), got {type(lot).__name__}: only the secret Poisson lots are accounted for")
        position = next((i for i, (drawn, _, _) in enumerate(self._pending) if drawn is lot), None)
        if position is None and lot.released:
            raise UserError(f"lot {lot.step} was released already: a second release of one lot is no fresh Poisson sample (the accountant would undercount it)")
        if position is None:
            raise UserError(
                f"release(): lot {lot.step} was not drawn by this run's lots(): a hand-built, copied or other run's Lot is no secret "
                "Poisson sample the accountant covers; release the lots lots() yields"
            )
        _, step, indices = self._pending[position]
        if position > 0:
            raise UserError(
                f"release(): lot {step} was drawn after lot {self._pending[0][1]}, which is not released yet: release every lot in the "
                "order drawn, empty ones included (releasing lots chosen by what they hold is not the Poisson sampling the accountant charges)"
            )
        if lot.step != step or tuple(lot.indices) != indices:
            raise UserError(
                f"release(): lot {step} was changed after it was drawn (its step or indices): only the lot the secret sampler drew "
                "is accounted for; release it unchanged"
            )
        if not self.mechanism.within_budget():
            raise UserError(f"release refused: it would exceed the target ε={self.plan.target_epsilon} (ε spent {self.epsilon:.4f})")
        refuse_batch_norm_in_train_mode(self.model)
        self._pending.popleft()
        lot.released = True
        try:
            stats = self.mechanism.release_lot(step, list(indices), self._micro_batches, self._release_loss, say)
        except Exception as err:
            # Whether a release fails mid-lot (a collate function that lengthens an example, a shape,
            # the loss) can depend on the lot, and no charge covers that; a caller who caught the error
            # and drew the next lot could learn it again and again. So this object stops here.
            self._stopped = (
                f"this PrivateTraining stopped when the release of lot {step} failed mid-lot ({type(err).__name__}): whether a release "
                "fails can depend on the lot, and nothing charges that, so it draws and releases nothing more; fix the cause, then "
                "continue in a new make_private on the same run_dir from your last state_dict() record (load_state_dict replays "
                f"lot {step} where the secret state is kept)"
            )
            raise
        if self.plan_done:  # nothing is left to replay: the secret generator states go, as the driver's do
            discard_mechanism_state(self.run_dir, keep=False)
        return stats

    @property
    def plan_done(self) -> bool:
        """The plan's last step is released (not merely charged: steps re-run after
        load_state_dict replay with the saved state until then)."""
        return self.next_step > self.plan.steps and not self._pending

    def close(self) -> None:
        """Remove the engine's hooks from the model."""
        self.mechanism.close()

    # -- saving and continuing (privacy/state.py) ----------------------------------------------

    @property
    def mechanism_state_path(self) -> Path:
        return self.run_dir / MECHANISM_STATE_FILE

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """Where the mechanism stands after release `step` (default: the last lot drawn), as a
        record you may store beside your model's checkpoint and share: the step, the plan, and
        the ledger's head and length. The secret half — the lot sampler's and the noise's
        generator states, which regenerate the lots and noise — goes to run_dir's owner-only
        mechanism_state.pt (the last two kept, deleted once the plan's releases are all made),
        never into the record."""
        self._refuse_if_stopped()  # its lot was drawn and never released: a record after it would skip that lot
        if self._pending and step is None:
            raise UserError(
                f"state_dict(): lot {self._pending[0][1]} was drawn and not released; release every lot drawn before saving "
                "(a lot skipped on resume would be one chosen after it was seen)"
            )
        step = self.next_step - 1 if step is None else int(step)
        if not self.plan_done:  # once it is, no step is left to replay and the secret state is not kept
            save_mechanism_state(self.mechanism_state_path, step, secret_state(self.mechanism))
        return {"step": step, "plan": self.plan.as_dict(), **ledger_record(self.mechanism.ledger)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict()` record: refused unless the plan is the same and run_dir's
        ledger still holds every line the record (and the secret state saved with it) saw — a
        deleted, truncated or edited ledger would forget releases. The steps after it then replay
        their lots and noise (an identical release is free), or, if the secret state is gone, draw
        fresh ones (each re-run step a new, charged release)."""
        try:
            check_resume_compatible(state["plan"], self.plan)
            step = int(state["step"])
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"load_state_dict(): not a record of PrivateTraining.state_dict() ({one_line(err)})") from None
        verify_ledger(self.mechanism.ledger, state, "the state_dict record")
        restore_mechanism(self.mechanism, self.mechanism_state_path, step, say)
        self._pending.clear()
        self.next_step = step + 1
        say(f"continuing at step {self.next_step} of {self.plan.steps}, ε so far {self.epsilon:.4f} (from the ledger)")

    def _micro_batches(self, indices: Sequence[int]) -> Iterator[Any]:
        size = self.micro_batch_size
        if self.padded_rows is None:
            for start in range(0, len(indices), size):
                yield self._collated(list(indices[start : start + size]))
            return
        if self.widths is not None:  # each width's micro-batches, the lot's examples placed longest first
            for width, rows, members in micro_batch_members([self.widths.lengths[i] for i in indices], self.widths.micro_batches):
                yield self._padded([indices[j] for j in members], rows, width)
            return
        # ⌈B_max / micro_batch_size⌉ micro-batches whatever the lot's size (the sampler cut a larger one).
        for start in range(0, self.padded_rows, size):
            yield self._padded(list(indices[start : start + size]))

    def _collated(self, indices: list[int]) -> Any:
        device = next(iter(self.params.values())).device
        return to_device(self.collate_fn([self.dataset[i] for i in indices]), device)

    def _padded(self, indices: list[int], rows: int | None = None, width: int | None = None) -> dict[str, Any]:
        """A constant-time micro-batch: the examples, then filler rows up to `rows` (default
        micro_batch_size); with `width`, its rows cut to that many columns (`cut_to_width`).

        A filler row is example 0 again, fetched and collated as any row is (so it costs what a
        real one costs), and marked False in EXAMPLE_MASK: the engines give it factor 0 and leave
        it out of every count, so whatever it holds it adds exactly nothing to the release."""
        rows = rows or self.micro_batch_size
        batch = collated_mapping(self.collate_fn, [self.dataset[i] for i in indices + [FILLER_EXAMPLE] * (rows - len(indices))])
        if width is None:
            check_same_shapes(tensor_shapes(batch), self.shapes)
        else:
            batch = cut_to_width(batch, width, self.widths.max_length, examples=len(indices))
            check_same_shapes(tensor_shapes(batch), self.widths.shapes[(rows, width)])
        device = next(iter(self.params.values())).device
        return to_device({**batch, EXAMPLE_MASK: torch.arange(rows) < len(indices)}, device)


def make_private(
    model: nn.Module,
    train_dataset: Sequence,
    collate_fn: Callable[[list[Any]], Any],
    loss_fn: PerExampleLoss,
    *,
    run_dir: str | Path,
    epochs: float | None = None,
    steps: int | None = None,
    micro_batch_size: int = 32,
    allow_shuffle_sampling: bool = False,
    dataset_name: str = "custom",
    **privacy: Any,
) -> PrivateTraining:
    """The private release of `model`'s trainable parameters over `train_dataset` (indexable:
    len() and [i]); `collate_fn(examples)` makes a micro-batch, `loss_fn(model, batch)` returns
    its per-example losses, shape [B] (e.g. dpmuon.models.per_example_lm_loss).

    `privacy` are the options of `dpmuon.privacy.settings.PrivacySettings` — the driver's
    privacy.* keys, with the same defaults and checks — of which `target_epsilon`, `delta` and
    `expected_lot_size` are required: `clip_norm`, `clip_mode`, `noise_multiplier`, `accountant`, ….
    σ is calibrated to `target_epsilon` at `delta` over `epochs` (or `steps`) of lots of
    `expected_lot_size` expected examples, unless `noise_multiplier` is given (then its ε must
    fit the target). The ledger goes to `run_dir`/privacy_ledger.jsonl (one it already holds is
    continued: its releases count). The mechanism's randomness is secret: OS entropy, or a seed
    from $DPMUON_MECHANISM_SEED or an owner-only `mechanism_seed_file`. `dataset_name` names the
    private set in the ledger (runs on one set compose: python -m dpmuon.eval.study).
    `constant_time` (True by default): every release runs the same micro-batches, filled up to
    B_max rows that add nothing (docs/privacy.md#constant-time-lots), so collate_fn must give
    them one shape (a fixed width); False: lots as drawn, whose step times must not be published.
    Where its batches carry an integer or bool `attention_mask` [rows, width] and every other
    tensor is [rows] or [rows, width, …], the parameters are not half precision and fp32 products
    are IEEE (no TF32: set before make_private), constant-time Poisson lots come in up to
    `width_buckets` fixed widths, cut from that width: the length histogram is released once for
    them (charged, in the ledger's header), every example's length being the columns up to its last
    attended, supervised (labels ≠ -100) or otherwise non-padding one (docs/privacy.md);
    `width_buckets=1` keeps every row collate_fn's width, as does a run_dir whose ledger has none.
    """
    settings = facade_settings(privacy, epochs, steps)
    refuse_unsafe_arguments(model, train_dataset, epochs, steps, settings.sampling, allow_shuffle_sampling, micro_batch_size)
    check_plan_inputs(settings, len(train_dataset))
    shapes = checked_user_code(model, train_dataset, collate_fn, loss_fn, micro_batch_size, settings.constant_time)
    lengths = lengths_for_widths(model, train_dataset, collate_fn, loss_fn, micro_batch_size, settings, Path(run_dir)) if shapes is not None else None
    secret = user_seed(settings.mechanism_seed_file, seed_file_key="mechanism_seed_file")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    check_ledger_kept(run_dir, checkpoint=False)  # a deleted ledger under a run that saved its state: its releases would be lost to ε
    try:
        matrices = hidden_matrices(model)
        mechanism = build_mechanism(
            model, len(train_dataset), settings, hidden_matrices=matrices, user_secret=secret, run_dir=run_dir, dataset_name=dataset_name, log=say,
            example_lengths=lengths, max_length=shapes[PADDING_MASK][1] if lengths is not None else None,
        )  # fmt: skip
    except ValueError as err:  # the partition's or the engine's: a setting or a layer it cannot privatize
        raise UserError(f"make_private: {one_line(err)}") from None
    if not settings.constant_time:
        say("constant_time=False: step times track the secret lot sizes; publish none of them (per-step timestamps, W&B system metrics, profiles)")
    widths = mechanism.plan.widths
    if lengths is not None and widths:
        max_rows = micro_batch_size if mechanism.release.forms_row_gradients else None
        widths = row_widths(lengths, widths, shapes[PADDING_MASK][1], micro_batch_size, max_rows, collate_fn, train_dataset)
    else:
        widths = None
    return PrivateTraining(model, train_dataset, collate_fn, loss_fn, mechanism, micro_batch_size, run_dir, shapes, widths)


# PrivacySettings options make_private does not take: the driver's bookkeeping of its own run folder.
DRIVER_ONLY = ("published_seed", "keep_mechanism_state")
# Options the caller states: the driver's config has them from its dataset and experiment.
STATED = ("target_epsilon", "delta", "expected_lot_size")


def privacy_keywords() -> list[str]:
    """make_private's keywords that are privacy options (PrivacySettings' fields)."""
    return [f.name for f in dataclasses.fields(PrivacySettings) if f.name not in DRIVER_ONLY]


def make_private_keywords() -> list[str]:
    """Every keyword make_private takes: its own, then the privacy options."""
    own = [name for name, p in inspect.signature(make_private).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return own + privacy_keywords()


def facade_settings(privacy: Mapping[str, Any], epochs: float | None, steps: int | None) -> MechanismSettings:
    """make_private's privacy keywords as the mechanism's settings; an unknown keyword is one
    line naming it and the valid ones (PrivacySettings checks the values, as the driver does)."""
    unknown = [key for key in privacy if key not in privacy_keywords()]
    if unknown:
        near = difflib.get_close_matches(unknown[0], make_private_keywords(), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise UserError(f"make_private: unknown keyword {unknown[0]!r}{hint}; valid: {', '.join(make_private_keywords())}")
    missing = [key for key in STATED if key not in privacy]
    if missing:
        raise UserError(
            f"make_private: {missing[0]}=... is required: the guarantee (target_epsilon, delta) and the lot it is made for "
            "(expected_lot_size) are stated, never defaulted"
        )
    return MechanismSettings(**privacy, epochs=epochs, steps=steps)


def refuse_unsafe_arguments(model, train_dataset, epochs, steps, sampling: str, allow_shuffle_sampling: bool, micro_batch_size) -> None:
    """make_private's refusals that need no mechanism, each in one line naming the argument."""
    if (epochs is None) == (steps is None):
        raise UserError("make_private: give exactly one of epochs=<passes over the data> and steps=<releases>")
    if not (hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__")):
        raise UserError(f"make_private: train_dataset ({type(train_dataset).__name__}) must support len() and [i]: Poisson lots pick examples by index")
    if sampling == "shuffle" and not allow_shuffle_sampling:
        raise UserError(
            "make_private: sampling='shuffle' draws fixed-size lots that the Poisson-subsampled accountant does not cover, so ε would not be a "
            "guarantee; use sampling='poisson', or pass allow_shuffle_sampling=True to reproduce such a run knowingly"
        )
    if not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
        raise UserError(f"make_private: micro_batch_size={micro_batch_size!r}; valid: an integer >= 1")
    refuse_batch_norm_in_train_mode(model)


def refuse_batch_norm_in_train_mode(model: nn.Module) -> None:
    """Batch-norm in train mode normalizes each example by its micro-batch's statistics: one
    example then moves every other example's gradient, which per-example clipping cannot bound."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise UserError(
                f"model module {name!r} is a {type(module).__name__} in train mode: its batch statistics mix the examples, so per-example "
                "clipping does not bound one example's influence; put it in eval mode (module.eval()), or use GroupNorm / LayerNorm"
            )


def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters are (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def to_device(batch: Any, device: torch.device) -> Any:
    """A collated micro-batch with its tensors on the model's device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def checked_user_code(model: nn.Module, dataset: Sequence, collate_fn: Callable, loss_fn: PerExampleLoss, micro_batch_size: int, constant_time: bool):
    """make_private's checks of the user's code on the training set's first examples, before the
    mechanism exists: collate_fn's fixed shapes (returned; None without constant-time lots), then
    loss_fn and the model (privacy/conformance.py `check_user_code`)."""
    shapes = fixed_shapes(dataset, collate_fn, micro_batch_size) if constant_time else None
    device = model_device(model)
    check_user_code(model, loss_fn, lambda rows: to_device(collate_fn([dataset[i] for i in rows]), device), min(micro_batch_size, len(dataset)))
    return shapes


def fixed_shapes(dataset: Sequence, collate_fn: Callable, micro_batch_size: int) -> dict[str, tuple[int, ...]]:
    """The tensor shapes every constant-time micro-batch must have: a filler-only one's. One of
    the first examples must match, so that a collate_fn padding to each micro-batch's longest
    example is refused before the mechanism exists; the release checks every micro-batch."""
    filler = dataset[FILLER_EXAMPLE]
    shapes = tensor_shapes(collated_mapping(collate_fn, [filler] * micro_batch_size))
    first = [dataset[i] for i in range(min(micro_batch_size, len(dataset)))]
    check_same_shapes(tensor_shapes(collated_mapping(collate_fn, first + [filler] * (micro_batch_size - len(first)))), shapes)
    return shapes


def lengths_for_widths(
    model: nn.Module, dataset: Sequence, collate_fn: Callable, loss_fn: PerExampleLoss, micro_batch_size: int, settings, run_dir: Path
) -> list[int] | None:
    """Every example's length (`row_lengths`, as collate_fn pads it) where constant-time rows can
    come in a few widths, after `check_padding_cut` on the first examples and on a probe; None
    where they cannot (said): one width, nothing released. Whether they can depends on the
    settings, the parameters, the structure of collate_fn's batches and run_dir's ledger header
    (a run continued keeps its rows' layout), never on the examples' values."""
    if not buckets_by_width(settings):
        return None
    first = collated_mapping(collate_fn, [dataset[i] for i in range(min(micro_batch_size, len(dataset)))])
    why = why_one_width(model, first) or one_width_ledger(run_dir)
    if why:
        say(f"constant-time rows all collate_fn's width: {why}")
        return None
    max_length = first[PADDING_MASK].shape[1]
    device = model_device(model)
    row = {k: v[:1] for k, v in first.items()}
    measured = row_lengths(first, max_length).tolist()
    alone = [cut_to_width({k: v[i : i + 1] for k, v in first.items()}, max(1, n), max_length) for i, n in enumerate(measured)]
    check_padding_cut(model, loss_fn, to_device(first, device), [to_device(one, device) for one in alone])
    # A probe whatever the first examples' lengths: example 0 with its columns from `cut` on masked and unsupervised.
    cut = max(1, measured[0] // 2)
    probe = {k: v.clone() for k, v in row.items()}
    probe[PADDING_MASK][:, cut:] = 0
    if isinstance(probe.get("labels"), torch.Tensor) and probe["labels"].shape == probe[PADDING_MASK].shape:
        probe["labels"][:, cut:] = IGNORE_INDEX
    check_padding_cut(model, loss_fn, to_device(probe, device), [to_device(cut_to_width(probe, cut, max_length), device)])
    say(f"collating the {len(dataset):,} training examples once to measure their lengths (rows in up to {settings.width_buckets} widths)")
    lengths = []
    for start in range(0, len(dataset), micro_batch_size):  # collated as the release collates them
        rows = [dataset[i] for i in range(start, min(start + micro_batch_size, len(dataset)))]
        lengths += row_lengths(collated_mapping(collate_fn, rows), max_length).tolist()
    return lengths


def one_width_ledger(run_dir: Path) -> str | None:
    """Why a run continued in `run_dir` keeps one width: its ledger made no length release."""
    header = ledger_header(run_dir / LEDGER_FILE)
    if header is not None and header.get("kind") == "header" and not header.get("length_release"):
        return f"{run_dir / LEDGER_FILE} continues a run whose rows were one width (it released no length histogram)"
    return None


def why_one_width(model: nn.Module, batch: Mapping) -> str | None:
    """Why rows cannot come in a few widths (None if they can): half-precision parameters or fp32
    products rounded to TF32/bf16 (kernels round by shape, so a row's width would move its
    contribution), or a batch whose tensors are not [rows] and [rows, max_length, …] with an
    integer or bool [rows, max_length] PADDING_MASK to cut them by."""
    half = next((n for n, p in model.named_parameters() if p.dtype in (torch.float16, torch.bfloat16)), None)
    if half is not None:
        return f"parameter {half!r} is {dict(model.named_parameters())[half].dtype}, and half-precision kernels round by shape"
    rounded = [b.fp32_precision for b in (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul) if b.fp32_precision not in ("none", "ieee")]
    if rounded:
        return f"fp32 matrix products are set to round to {rounded[0]} (torch.set_float32_matmul_precision), and those kernels round by shape"
    mask = batch.get(PADDING_MASK)
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and not mask.is_floating_point()):
        return f"collate_fn's batches have no integer or bool [rows, width] {PADDING_MASK!r} marking each row's padding"
    for key, value in batch.items():
        if not (isinstance(value, torch.Tensor) and (value.dim() == 1 or (value.dim() >= 2 and value.shape[1] == mask.shape[1]))):
            what = f"of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            return f"collate_fn's {key!r} is {what}, neither [rows] nor [rows, {mask.shape[1]}, …]"
    return None


def row_lengths(batch: Mapping, max_length: int) -> torch.Tensor:
    """Each row's length: 1 + its last column attended (PADDING_MASK ≠ 0), supervised (labels ≠
    -100) or, in any [rows, max_length, …] tensor, other than the row's last column (padding
    repeats one value to the end), so that cutting the row to a width at least that long cuts
    only columns nothing attends to, supervises or fills with anything but padding."""
    mask = batch[PADDING_MASK]
    check_same_shapes({PADDING_MASK: tuple(mask.shape)}, {PADDING_MASK: (mask.shape[0], max_length)})
    used = mask != 0
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.shape == mask.shape:
        used = used | (labels != IGNORE_INDEX)
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == mask.shape:
            used = used | (value != value[:, -1:]).reshape(*mask.shape, -1).any(dim=2)
    return (used.cpu() * torch.arange(1, max_length + 1)).amax(dim=1)


def cut_to_width(batch: Mapping, width: int, max_length: int, examples: int | None = None) -> dict[str, Any]:
    """The batch's [rows, max_length, …] tensors cut to their first `width` columns. With
    `examples`: refused if one of the first `examples` rows is longer than `width` now, while
    its row was chosen from the length measured at make_private (collate_fn must collate an
    example the same way every time)."""
    if examples is not None and bool((row_lengths(batch, max_length)[:examples] > width).any()):  # every row measured: the same work whatever the lot
        raise UserError(
            f"make_private: collate_fn gave an example more columns that are not padding than when make_private measured it, so the "
            f"row of {width} columns placed for it would cut its tokens; collate each example the same way every time — nothing was charged"
        )
    return {k: v[:, :width] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == max_length else v for k, v in batch.items()}


def row_widths(lengths: list[int], buckets, max_length: int, micro_batch_size: int, max_rows: int | None, collate_fn: Callable, dataset: Sequence) -> RowWidths:
    """The plan's widths (buckets: (width, rows), widest first) as micro-batches of at most
    micro_batch_size full-width rows' tokens and `max_rows` rows each, with the shapes every one
    of them must have."""
    micro_batches = bucket_micro_batches(buckets, micro_batch_size * max_length, max_rows)
    filler = dataset[FILLER_EXAMPLE]
    shapes = {(rows, width): tensor_shapes(cut_to_width(collated_mapping(collate_fn, [filler] * rows), width, max_length)) for width, _, rows in micro_batches}
    return RowWidths(lengths, max_length, micro_batches, shapes)


def collated_mapping(collate_fn: Callable, rows: list[Any]) -> Mapping:
    batch = collate_fn(rows)
    if not isinstance(batch, Mapping):
        raise UserError(
            f"make_private: collate_fn returned a {type(batch).__name__}: constant-time lots mark their filler rows with a batch key, "
            "so it must return a mapping of tensors (e.g. {'input_ids': ..., 'attention_mask': ..., 'labels': ...})"
        )
    return batch


def check_same_shapes(shapes: Mapping[str, tuple[int, ...]], first: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a micro-batch whose tensor shapes are not the first's: a wider one takes longer, and
    the step's time would tell how long the lot's examples are."""
    differ = [key for key in sorted(first.keys() | shapes.keys()) if shapes.get(key) != first.get(key)]
    if differ:
        key = differ[0]
        raise UserError(
            f"make_private: constant_time=True needs one shape for every micro-batch, but collate_fn (DPTrainer: data_collator) gave "
            f"{key!r} a shape other than the first micro-batch's {first.get(key)} (the other is not printed: it can tell a lot's "
            "lengths), so step times would track the secret lots; pad "
            "to a fixed width (e.g. a tokenizer's padding='max_length', or a collator's pad_to_multiple_of=<max length>), or pass "
            "constant_time=False and publish no step times"
        )


def tensor_shapes(batch: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in a collated micro-batch (nested mappings and sequences), by key path."""
    if isinstance(batch, torch.Tensor):
        return {prefix or "batch": tuple(batch.shape)}
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(batch, (list, tuple)) else ()
    shapes: dict[str, tuple[int, ...]] = {}
    for key, value in items:
        shapes |= tensor_shapes(value, f"{prefix}.{key}" if prefix else str(key))
    return shapes


def without_example_mask(loss_fn: PerExampleLoss) -> PerExampleLoss:
    """loss_fn called on the batch without the engines' EXAMPLE_MASK key (a loss that passes
    model(**batch) would choke on it); it keeps loss_fn's name for messages that name it."""

    @functools.wraps(loss_fn)
    def loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return loss_fn(model, {k: v for k, v in batch.items() if k != EXAMPLE_MASK})

    return loss
