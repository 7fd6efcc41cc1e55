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
train mode, shuffled lots without an explicit opt-in, a lot released twice, a data set that
cannot be indexed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import UserError, one_line
from .models import hidden_matrices
from .privacy.engines import PerExampleLoss
from .privacy.mechanism import Mechanism, PrivacySettings, build_mechanism, check_plan_inputs
from .privacy.privatizer import ReleaseStats
from .privacy.seed import user_seed


def say(message: str) -> None:
    print(f"[dpmuon] {message}", file=sys.stderr, flush=True)


@dataclass
class Lot:
    """One Poisson lot: the examples' indices in the training set, released at most once."""

    step: int  # its release's number in the ledger (lots are numbered as drawn)
    indices: list[int]
    micro_batch_size: int
    _batches: Callable[[list[int]], Any] = field(repr=False)
    released: bool = False

    def __len__(self) -> int:
        return len(self.indices)

    def micro_batches(self) -> Iterator[Any]:
        """The lot in collated micro-batches of at most `micro_batch_size` examples."""
        for start in range(0, len(self.indices), self.micro_batch_size):
            yield self._batches(self.indices[start : start + self.micro_batch_size])


class PrivateTraining:
    """A model's private release over one training set (build it with `make_private`)."""

    def __init__(self, model: nn.Module, dataset: Sequence, collate_fn: Callable, loss_fn: PerExampleLoss, mechanism: Mechanism, micro_batch_size: int):
        self.model, self.dataset, self.collate_fn, self.loss_fn = model, dataset, collate_fn, loss_fn
        self.mechanism = mechanism
        self.micro_batch_size = micro_batch_size
        self.hidden_matrices = {n: layout for n, layout in hidden_matrices(model).items() if n in mechanism.release.params}
        # Lots are numbered as drawn, after the steps of a ledger the run directory already holds:
        # every release has its own step, even when lots are drawn ahead of their release.
        self.lots_drawn = max((r["step"] for r in mechanism.ledger.releases), default=0) if mechanism.ledger else 0

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
        more release would exceed the target ε (the budget guard)."""
        for _ in range(self.plan.steps - self.mechanism.release.accountant.steps):
            if not self.mechanism.within_budget():
                say(f"budget guard: one more release would exceed ε={self.plan.target_epsilon} (ε spent {self.epsilon:.4f}); no more lots")
                return
            self.lots_drawn += 1
            yield Lot(self.lots_drawn, self.mechanism.next_lot(), self.micro_batch_size, self._collated)

    def release(self, lot: Lot) -> ReleaseStats:
        """Clip, noise, write the ledger line (fsynced), charge the accountant, then set p.grad
        of every trainable parameter to the released gradient. Returns the lot's statistics:
        computed from the raw examples, they are NOT private (do not log or publish them)."""
        if not isinstance(lot, Lot):
            raise UserError(f"release() takes a lot from lots(), got {type(lot).__name__}: only the secret Poisson lots are accounted for")
        if lot.released:
            raise UserError(f"lot {lot.step} was released already: a second release of one lot is no fresh Poisson sample (the accountant would undercount it)")
        if not self.mechanism.within_budget():
            raise UserError(f"release refused: it would exceed the target ε={self.plan.target_epsilon} (ε spent {self.epsilon:.4f})")
        refuse_batch_norm_in_train_mode(self.model)
        lot.released = True
        return self.mechanism.release.release(lot.micro_batches(), self.loss_fn, lot.step)

    def close(self) -> None:
        """Remove the engine's hooks from the model."""
        self.mechanism.close()

    def _collated(self, indices: list[int]) -> Any:
        device = next(iter(self.params.values())).device
        return to_device(self.collate_fn([self.dataset[i] for i in indices]), device)


def make_private(
    model: nn.Module,
    train_dataset: Sequence,
    collate_fn: Callable[[list[Any]], Any],
    loss_fn: PerExampleLoss,
    *,
    target_epsilon: float,
    delta: float,
    expected_lot_size: int,
    run_dir: str | Path,
    epochs: float | None = None,
    steps: int | None = None,
    clip_norm: float = 0.1,
    clip_mode: str = "per_matrix",
    micro_batch_size: int = 32,
    noise_multiplier: float | None = None,
    accountant: str = "prv",
    threshold_rule: str = "split",
    other_blocks: str = "per_tensor",
    noise_allocation: str = "uniform",
    engine: str = "fast",
    engine_fallback: str = "generic",
    sampling: str = "poisson",
    allow_shuffle_sampling: bool = False,
    secure_noise: bool = False,
    mechanism_seed_file: str | Path | None = None,
    dataset_name: str = "custom",
) -> PrivateTraining:
    """The private release of `model`'s trainable parameters over `train_dataset` (indexable:
    len() and [i]); `collate_fn(examples)` makes a micro-batch, `loss_fn(model, batch)` returns
    its per-example losses, shape [B] (e.g. dpmuon.models.per_example_lm_loss).

    σ is calibrated to `target_epsilon` at `delta` over `epochs` (or `steps`) of lots of
    `expected_lot_size` expected examples, unless `noise_multiplier` is given (then its ε must
    fit the target). The ledger goes to `run_dir`/privacy_ledger.jsonl (one it already holds is
    continued: its releases count). The mechanism's randomness is secret: OS entropy, or a seed
    from $DPMUON_MECHANISM_SEED or an owner-only `mechanism_seed_file`. `dataset_name` names the
    private set in the ledger (runs on one set compose: python -m dpmuon.eval.study).
    The other settings are the driver's privacy.* keys (conf/privacy/per_matrix.yaml).
    Lots are processed as drawn (no privacy.constant_time): step times track the secret lot
    sizes, so do not publish them (per-step timestamps, W&B system metrics, profiles).
    """
    refuse_unsafe_arguments(model, train_dataset, epochs, steps, sampling, allow_shuffle_sampling, micro_batch_size)
    settings = PrivacySettings(
        target_epsilon=float(target_epsilon),
        delta=float(delta),
        expected_lot_size=int(expected_lot_size),
        epochs=epochs,
        steps=steps,
        noise_multiplier=noise_multiplier,
        accountant=accountant,
        clip_mode=clip_mode,
        clip_norm=float(clip_norm),
        threshold_rule=threshold_rule,
        other_blocks=other_blocks,
        noise_allocation=noise_allocation,
        engine=engine,
        engine_fallback=engine_fallback,
        sampling=sampling,
        secure_noise=secure_noise,
    )
    check_plan_inputs(settings, len(train_dataset))
    secret = user_seed(mechanism_seed_file, seed_file_key="mechanism_seed_file")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        mechanism = build_mechanism(
            model,
            len(train_dataset),
            settings,
            hidden_matrices=hidden_matrices(model),
            user_secret=secret,
            run_dir=run_dir,
            dataset_name=dataset_name,
            log=say,
        )
    except ValueError as err:  # the partition's or the engine's: a setting or a layer it cannot privatize
        raise UserError(f"make_private: {one_line(err)}") from None
    return PrivateTraining(model, train_dataset, collate_fn, loss_fn, mechanism, micro_batch_size)


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


def to_device(batch: Any, device: torch.device) -> Any:
    """A collated micro-batch with its tensors on the model's device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
