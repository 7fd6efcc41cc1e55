"""A Hugging Face `Trainer` whose every step is one private release of dpmuon's mechanism.

    from dpmuon.integrations.hf import DPTrainer, DPTrainingArguments
    args = DPTrainingArguments(output_dir="runs/hf", learning_rate=2e-3, num_train_epochs=3, per_device_train_batch_size=16,
                               max_grad_norm=0, logging_steps=10, save_steps=100, eval_strategy="steps", report_to="none",
                               target_epsilon=8.0, delta=1e-5, expected_lot_size=256, clip_norm=0.1)
    trainer = DPTrainer(model=model, args=args, train_dataset=train, eval_dataset=valid, data_collator=collate, optimizer="dp_muon")
    trainer.train()

The mechanism is the façade's (`dpmuon.make_private`, facade.py), run dir = `output_dir`. What changes in the Trainer:
- the train "dataloader" yields one Poisson lot per Trainer step, drawn with the mechanism's secret randomness when the
  step asks for it; `per_device_train_batch_size` is the micro-batch the lot is cut into (the lot's size is
  `privacy["expected_lot_size"]` in expectation);
- `training_step` releases the lot (clip, noise, fsynced ledger line, accountant → p.grad) and calls no backward;
- the optimizer is dpmuon's (dp_sgd, dp_adam, dp_muon, dp_muonbc, any name a settings class registered,
  or the class itself) with `learning_rate`, `weight_decay` and Adam's
  betas/epsilon from the arguments (`optimizer_kwargs` for the rest), scheduled over the plan's steps;
- the plan has `max_steps` releases when given (Trainer's own precedence), else ⌈num_train_epochs / q⌉; Trainer steps
  = plan steps, and the logged `epoch` is the expected passes over the data (steps × q);
- every log row carries `epsilon` (spent so far, from the ledger; the `PrivateLogs` callback, first of the
  callbacks, writes it and scrubs the row) and `output_dir/privacy_spent.json` holds it
  beside the ledger `output_dir/privacy_ledger.jsonl`. The lots' training loss is computed from the raw examples
  (outside the guarantee): it is not logged unless `log_nonprivate_train_loss=True`;
- a checkpoint records the ledger's head (checkpoint-N/dpmuon_privacy.json, public) and the mechanism's secret
  generator states (`output_dir/mechanism_state.pt`, owner-only, the last two kept, deleted when the plan is done):
  `train(resume_from_checkpoint=...)` verifies the ledger still holds what the checkpoint saw and replays the steps
  after it with their own lots and noise (an identical replay is free; without the state, fresh draws, charged).

Settings that would void the guarantee, or that the release would silently ignore, are refused in one line naming
the argument (`refuse_unsafe_arguments`, `refuse_unsafe_setup`). Times are a side channel on the secret lots (a step
with more or longer examples takes longer), so unless `publish_timing=True` nothing the trainer writes or logs carries
one: every file and folder under output_dir gets run_files.FROZEN_TIME after each checkpoint and when train() ends;
the logged rows lose Trainer's speed and memory metrics (`train_runtime`, `*_per_second`, `*_mem_*`, …); the progress
bar (elapsed time, it/s) is replaced by Trainer's plain printer; and `report_to` integrations, which stamp every row with
its wall time (W&B's `_timestamp`/`_runtime`, TensorBoard's `wall_time`, MLflow's timestamps) and sample system
metrics, are refused. With `publish_timing=True` they run as in Trainer, except that W&B collects no system metrics
(`WANDB__DISABLE_STATS`, unless set). Evaluation runs as in Trainer; metrics on a private split are outside the
guarantee, as the driver's private validation NLL is.

Trainer's private methods it overrides, three, each because no public hook reaches it:
`_get_train_sampler` (refused: a sampler would shuffle, and the lots are the mechanism's Poisson draws),
`_get_num_items_in_batch` (None: the count is taken from the secret lot's tokens, and the per-example loss
needs none) and `_save_checkpoint` (the mechanism's record and secret state written before Trainer's files, and
checkpoints rotated by step number since their times are frozen). The rest are public methods: the lots
(`get_train_dataloader`, `set_initial_training_values`), the release (`training_step`, which calls no
`compute_loss`, and `create_optimizer`), what is logged (`floating_point_ops`; the rows: the `PrivateLogs` callback),
what is written (`save_model`, `save_state`, `save_metrics`) and the plan's end (`train`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint

from .. import run_folder
from ..errors import UserError
from ..facade import STATED, Lot, PrivateTraining, make_private, make_private_keywords, privacy_keywords, say
from ..models import per_example_lm_loss
from ..optim import build as build_optimizer
from ..optim.for_release import settings_class
from ..privacy.settings import PrivacySettings
from ..privacy.state import discard_mechanism_state
from ..training.run_files import atomic_write_json, freeze_times

PRIVACY_RECORD = "dpmuon_privacy.json"  # in each checkpoint-N/: the ledger's head and length, the plan (public)
PRIVACY_SPENT = "privacy_spent.json"  # in output_dir, beside the ledger: ε spent so far
# make_private's arguments that TrainingArguments decide.
FROM_TRAINING_ARGUMENTS = {
    "epochs": "num_train_epochs",
    "steps": "max_steps",
    "micro_batch_size": "per_device_train_batch_size",
    "run_dir": "output_dir",
}


def _privacy_arguments() -> list[tuple[str, Any, dataclasses.Field]]:
    """PrivacySettings' options as TrainingArguments fields (those make_private takes), with their
    defaults and help: declared once, in dpmuon.privacy.settings. The guarantee and its lot
    (target_epsilon, delta, expected_lot_size) have no default here either: they are stated."""
    hints = typing.get_type_hints(PrivacySettings)
    fields = []
    for f in dataclasses.fields(PrivacySettings):
        if f.name not in privacy_keywords():
            continue
        stated = f.name in STATED or f.default is dataclasses.MISSING
        given = {} if stated else {"default": f.default}
        fields.append((f.name, hints[f.name], dataclasses.field(**given, metadata={"help": f.metadata["help"]})))
    return fields


DPTrainingArguments = dataclasses.make_dataclass(
    "DPTrainingArguments",
    _privacy_arguments(),
    bases=(TrainingArguments,),
    kw_only=True,
    namespace={
        "__doc__": "TrainingArguments with the private release's options (dpmuon.privacy.settings.PrivacySettings: "
        "the driver's privacy.* keys, same defaults and checks); HfArgumentParser reads them like any other.",
        "privacy_settings": lambda self: {name: getattr(self, name) for name, _, _ in _privacy_arguments()},
    },
)
DPTrainingArguments.__module__ = __name__

# Trainer methods the integration replaces: a subclass's own version would be bypassed or bypass the release.
REPLACED_METHODS = ("get_train_dataloader", "_get_train_sampler", "training_step", "compute_loss", "create_optimizer")
NONPRIVATE_LOGS = ("loss", "train_loss")  # means of the raw lots' per-example losses
WITHHELD = "withheld"  # TrainOutput.metrics["train_loss"] when the raw lots' loss is not published (training_loss: NaN)
# Trainer's clock and machine measurements (speed_metrics, the memory tracker): train_runtime, eval_samples_per_second,
# train_steps_per_second, eval_model_preparation_time, train_mem_gpu_peaked_delta, … A step's time and memory track
# its secret lot, so they are not logged (nor returned in metrics, which save_metrics would write) unless published.
TIMING_LOG = re.compile(r"(_runtime|_per_second|_time|_seconds)$|_mem_")


def field_default(name: str) -> Any:
    return TrainingArguments.__dataclass_fields__[name].default


def refuse_unsafe_arguments(args: TrainingArguments) -> None:
    """One line naming the first argument under which the Trainer's step would not be the private release."""
    refusals = [
        (
            args.gradient_accumulation_steps != 1,
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: one Trainer step is one Poisson lot, already cut into "
            "micro-batches of per_device_train_batch_size; set the lot with privacy['expected_lot_size'] and keep 1",
        ),
        (args.fp16, "fp16=True: fp16 grad scaling rescales and may skip the released gradient; train in float32"),
        (
            args.bf16,
            "bf16=True: under bf16 autocast one example's clipped gradient depends on the rest of its micro-batch (the driver's "
            "trainer.fixed_batch_shape handles it, this Trainer does not); train in float32 or with python -m dpmuon.train",
        ),
        (args.n_gpu > 1, f"n_gpu={args.n_gpu}: DataParallel replicas bypass the engine's per-example hooks; expose one GPU (CUDA_VISIBLE_DEVICES)"),
        (
            args.world_size > 1 or bool(args.deepspeed) or bool(args.fsdp),
            f"world_size={args.world_size} / deepspeed / fsdp: the release runs in one process (every rank would draw its own lots and "
            "noise); run one process, or python -m dpmuon.train for data-parallel private training",
        ),
        (
            args.train_sampling_strategy != "random",
            f"train_sampling_strategy={args.train_sampling_strategy!r}: the lots are Poisson samples drawn by the mechanism; "
            "any other order is not what the accountant charges",
        ),
        (
            args.max_grad_norm not in (0, field_default("max_grad_norm")),
            f"max_grad_norm={args.max_grad_norm}: clipping the released (noisy) gradient rescales the noise the optimizers are "
            "calibrated on (DP-MuonBC's bias correction); clipping is per example, privacy['clip_norm']; set max_grad_norm=0",
        ),
        (
            args.optim != field_default("optim"),
            f"optim={args.optim}: the optimizer is dpmuon's; choose it with DPTrainer(optimizer='dp_sgd'|'dp_adam'|'dp_muon'|'dp_muonbc' or a settings class)",
        ),
        (
            args.label_smoothing_factor != 0,
            f"label_smoothing_factor={args.label_smoothing_factor}: the release uses the per-example loss_fn, which would ignore it",
        ),
        (
            args.include_num_input_tokens_seen not in ("no", False),
            "include_num_input_tokens_seen: the tokens in the secret lots are a function of the private data outside the guarantee",
        ),
        (
            args.auto_find_batch_size,
            "auto_find_batch_size=True: a retry after an out-of-memory error restarts the Trainer's loop mid-plan; set per_device_train_batch_size",
        ),
        (
            bool(args.gradient_checkpointing or args.activation_checkpointing),
            "gradient_checkpointing: the engine's per-example hooks are not checked under recomputation; turn it off",
        ),
        (
            args.push_to_hub,
            f"push_to_hub=True: the Trainer uploads output_dir, which holds the secret {run_folder.MECHANISM_STATE} while training; "
            "push the model yourself after training",
        ),
    ]
    for refused, reason in refusals:
        if refused:
            raise UserError(f"DPTrainer: {reason}")


def trainer_hyperparameters(cls: type, args: TrainingArguments) -> dict[str, Any]:
    """TrainingArguments' rate, weight decay and Adam settings as the options of the optimizer's
    settings class: Adam's at the top where the class has them (DP-Adam), in its `adam` part where
    it has one (the Muon family: the non-matrix tensors' Adam)."""
    adam = {"betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon}
    options = {f.name for f in dataclasses.fields(cls)}
    hyper: dict[str, Any] = {"lr": args.learning_rate, "weight_decay": args.weight_decay}
    if adam.keys() <= options:
        hyper |= adam
    elif "adam" in options:
        hyper["adam"] = {**adam, "weight_decay": args.weight_decay}
    return hyper


def privacy_options(args: TrainingArguments | None, privacy: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The privacy options, from DPTrainingArguments' fields or `privacy=` (said once, not both)."""
    if isinstance(args, DPTrainingArguments):
        if privacy is not None:
            raise UserError("DPTrainer: privacy= and DPTrainingArguments both give the privacy options; give them once (DPTrainingArguments' fields)")
        return args.privacy_settings()
    if privacy is None and args is not None:
        raise UserError(
            "DPTrainer: no privacy options: use args=DPTrainingArguments(output_dir=..., target_epsilon=..., delta=..., expected_lot_size=...) "
            "(or privacy=dict(target_epsilon=..., ...) beside TrainingArguments)"
        )
    return privacy or {}


def refuse_unsafe_setup(cls: type, args: TrainingArguments | None, train_dataset: Any, privacy: Mapping[str, Any], trainer_kwargs: Mapping) -> None:
    """One line naming the first Trainer argument or override that would replace or escape the private release."""
    if args is None:
        raise UserError("DPTrainer: args: give TrainingArguments(output_dir=...); the privacy ledger is written there")
    for name in ("optimizers", "optimizer_cls_and_kwargs"):
        if trainer_kwargs.get(name) not in (None, (None, None)):
            raise UserError(f"DPTrainer: {name}: the optimizer is dpmuon's, built over the release; choose it with optimizer=<name>")
    for name, reason in (
        ("compute_loss_func", "returns the batch's mean loss; the release needs per-example losses: pass loss_fn=<per-example loss>"),
        ("model_init", "a re-initialized model would escape the mechanism built on the first; pass model="),
    ):
        if trainer_kwargs.get(name) is not None:
            raise UserError(f"DPTrainer: {name}: {reason}")
    for method in REPLACED_METHODS:
        if getattr(cls, method) is not getattr(DPTrainer, method):
            raise UserError(f"DPTrainer: {cls.__name__}.{method} is overridden: the private release replaces it (lots are Poisson samples)")
    if train_dataset is None:
        raise UserError("DPTrainer: train_dataset: the private training set is required (len() and [i])")
    given = set(privacy) & set(FROM_TRAINING_ARGUMENTS)
    if given:
        key = sorted(given)[0]
        raise UserError(f"DPTrainer: privacy[{key!r}]: set it as TrainingArguments.{FROM_TRAINING_ARGUMENTS[key]}")
    known = set(make_private_keywords())
    unknown = sorted(set(privacy) - known)
    if unknown:
        valid = ", ".join(sorted(known - set(FROM_TRAINING_ARGUMENTS)))
        raise UserError(f"DPTrainer: privacy[{unknown[0]!r}] is no setting of dpmuon.make_private; valid: {valid}")


def labelled_lm_loss(collator: Callable) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The default per-example loss (per_example_lm_loss), refusing in one line a collator whose batches have no labels."""
    name = getattr(collator, "__qualname__", type(collator).__name__)

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping) and "labels" not in batch:
            raise UserError(
                f"DPTrainer: data_collator={name} returned {sorted(batch)} without 'labels': the default loss_fn (per_example_lm_loss) "
                "needs labels (-100 where no loss), e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False); or pass loss_fn="
            )
        return per_example_lm_loss(model, batch)

    return loss


def rotate_checkpoints_by_step(run_dir: Path, limit: int | None, best: str | None) -> None:
    """Keep the last `limit` checkpoint-N folders by N, and the best. (Trainer's own rotation orders them by mtime, the
    same for every frozen folder: it would delete by name, checkpoint-12 before checkpoint-8.)"""
    folders = sorted(
        (path for path in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if path.is_dir() and path.name.split("-")[-1].isdigit()),
        key=lambda path: int(path.name.split("-")[-1]),
    )
    if not limit or limit <= 0 or not folders:
        return
    kept = {folders[-1], *([Path(best)] if best else [])}  # the last, to resume from
    deletable = [path for path in folders if path not in kept]
    for path in deletable[: max(0, len(folders) - max(limit, len(kept)))]:
        shutil.rmtree(path, ignore_errors=True)


class PoissonLots:
    """The train 'dataloader': one `Lot` per Trainer step, its indices drawn by the mechanism when the step asks."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def __len__(self) -> int:
        return self.trainer.private.plan.steps

    def __iter__(self) -> Iterator[Lot]:
        trainer = self.trainer
        while trainer.next_step <= trainer.private.plan.steps:
            stop = trainer.private.mechanism.budget_stop(trainer.next_step)
            if stop:
                say(f"{stop}; stopping")
                trainer.budget_stopped = True
                trainer.control.should_training_stop = True
                return
            step, trainer.next_step = trainer.next_step, trainer.next_step + 1
            yield trainer.draw_lot(step)


class PrivateLogs(TrainerCallback):
    """What a logged row carries: ε spent so far, epoch as the expected passes over the data (steps × q),
    and neither timing nor memory (unless published) nor the raw lots' loss (unless asked for). It runs first
    among the callbacks, so the reporters, the printer and `state.log_history` see only the scrubbed row."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        # Before Trainer logs or saves this step: its epoch would be the fraction of the plan done.
        state.epoch = state.global_step * self.trainer.private.plan.sample_rate

    def on_log(self, args, state, control, logs=None, **kwargs):
        # `logs` is also the metrics train() and evaluate() return; log_history[-1] is Trainer's copy of it.
        for row in (logs, state.log_history[-1]):
            for key in [k for k in row if not self.trainer.publish_timing and TIMING_LOG.search(k)]:
                del row[key]
            for key in () if self.trainer.log_nonprivate_train_loss else NONPRIVATE_LOGS:
                row.pop(key, None)
            row["epsilon"] = self.trainer.epsilon_spent()


class DPTrainer(Trainer):
    """`transformers.Trainer` whose steps are dpmuon's private releases (see the module's docstring).

    The privacy options (target_epsilon, delta, expected_lot_size, clip_norm, clip_mode, noise_multiplier,
    accountant, …: `dpmuon.privacy.settings.PrivacySettings`) are fields of `args=DPTrainingArguments(...)`, or
    `privacy=dict(...)` beside plain TrainingArguments — except those TrainingArguments give (epochs, steps,
    micro_batch_size, run_dir). `loss_fn(model, batch)` returns the per-example losses [B] (default: the causal-LM loss over
    `labels` ≠ -100, as the driver's: the collator gives input_ids, attention_mask and labels, e.g.
    DataCollatorForLanguageModeling(tokenizer, mlm=False)). The mechanism is `trainer.private` (a `PrivateTraining`).
    TrainingArguments are adjusted in place: max_grad_norm 1.0 → 0 (said), ignore_data_skip → True, and, unless
    `publish_timing=True` (see the module's docstring), disable_tqdm → True (said); report_to integrations are refused.
    `train()` returns `training_loss` NaN and `metrics["train_loss"] == "withheld"` (the raw lots' loss is outside the
    guarantee) unless `log_nonprivate_train_loss=True`.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        *,
        privacy: Mapping[str, Any] | None = None,
        optimizer: str | type = "dp_muon",
        optimizer_kwargs: Mapping[str, Any] | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] = per_example_lm_loss,
        log_nonprivate_train_loss: bool = False,
        publish_timing: bool = False,
        **trainer_kwargs: Any,
    ):
        privacy = privacy_options(args, privacy)
        refuse_unsafe_setup(type(self), args, train_dataset, privacy, trainer_kwargs)
        refuse_unsafe_arguments(args)
        if args.max_grad_norm:  # the default 1.0 is on in every TrainingArguments: not a choice to refuse
            say(f"max_grad_norm={args.max_grad_norm} set to 0: the released gradient is not clipped again (clipping is per example)")
            args.max_grad_norm = 0.0
        args.ignore_data_skip = True  # lots come from the mechanism's restored state on resume, not from skipped batches
        self.publish_timing = publish_timing
        self._keep_timing_unpublished(args, trainer_kwargs.get("callbacks") or [])

        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset, **trainer_kwargs)
        self.optimizer_name, self.optimizer_kwargs = optimizer, dict(optimizer_kwargs or {})
        self.log_nonprivate_train_loss = log_nonprivate_train_loss
        self.private = self._make_private(labelled_lm_loss(self.data_collator) if loss_fn is per_example_lm_loss else loss_fn, privacy)
        self.next_step = 1  # the next release's number in the ledger
        self.budget_stopped = False
        self._epsilon_at: tuple[int, float] | None = None  # (charged releases, ε)
        self.callback_handler.callbacks.insert(0, PrivateLogs(self))

    def _keep_timing_unpublished(self, args: TrainingArguments, callbacks: list) -> None:
        """Refuse the reporting integrations and memory metrics, and turn off the progress bar, unless timing is published."""
        integrations = {cls: name for name, cls in INTEGRATION_TO_CALLBACK.items()}
        reporters = list(args.report_to or []) + [
            integrations[c if isinstance(c, type) else type(c)] for c in callbacks if (c if isinstance(c, type) else type(c)) in integrations
        ]
        if "wandb" in reporters:  # W&B samples CPU, GPU, memory and disk every few seconds: the step's load, on a timeline
            os.environ.setdefault("WANDB__DISABLE_STATS", "true")
        if self.publish_timing:
            return
        if reporters:
            raise UserError(
                f"DPTrainer: report_to={reporters}: every integration stamps each logged row with its wall time (W&B's _timestamp and "
                "_runtime, TensorBoard's wall_time, MLflow's timestamp), and step times are a side channel on the secret lots; "
                "report_to='none' (trainer.state.log_history and trainer_state.json keep the rows), or pass publish_timing=True"
            )
        if not args.skip_memory_metrics:
            raise UserError(
                "DPTrainer: skip_memory_metrics=False: the memory a step takes tracks its secret lot, and the metrics carry it; keep "
                "skip_memory_metrics=True, or pass publish_timing=True"
            )
        if not args.disable_tqdm:
            say("disable_tqdm set to True: the progress bar shows elapsed times and step rates (pass publish_timing=True to keep it)")
            args.disable_tqdm = True

    def _make_private(self, loss_fn: Callable, privacy: Mapping[str, Any]) -> PrivateTraining:
        args, dataset, collate = self.args, self.train_dataset, self.data_collator
        # The columns Trainer would drop before collating (the model's forward takes only some).
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="Training")
        self._collate, self._dataset = collate, dataset
        by_steps = args.max_steps > 0
        return make_private(
            self.model,
            dataset,
            collate,
            loss_fn,
            run_dir=args.output_dir,
            steps=args.max_steps if by_steps else None,
            epochs=None if by_steps else float(args.num_train_epochs),
            micro_batch_size=int(args.per_device_train_batch_size),
            **privacy,
        )

    # -- data: one Poisson lot per step ----------------------------------------------------------------

    def get_train_dataloader(self) -> PoissonLots:
        return PoissonLots(self)

    def _get_train_sampler(self, train_dataset=None):
        raise UserError("DPTrainer draws Poisson lots from the mechanism; it has no train sampler")

    def draw_lot(self, step: int) -> Lot:
        """Lot `step` of the ledger, drawn by the façade (bound to it: released once, in the order drawn;
        constant-time micro-batches unless privacy['constant_time'] is False)."""
        return self.private.draw_lot(step)

    def set_initial_training_values(self, args: TrainingArguments, dataloader: PoissonLots) -> tuple:
        # One Trainer "epoch" runs the whole plan: lots are independent samples, not passes over the data.
        plan = self.private.plan
        lot = plan.expected_lot_size
        return 1, plan.steps, plan.dataset_size, plan.steps * lot, lot, plan.steps, plan.steps

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> None:
        return None  # the per-example loss normalizes itself; a lot's token count is not public

    def floating_point_ops(self, inputs: Any) -> int:
        return 0  # counted from a secret lot's tokens it would be a function of the private data

    # -- the step: release, no backward --------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: Lot, num_items_in_batch: Any = None) -> torch.Tensor:
        """Release the lot into p.grad (clip, noise, ledger, accountant); the Trainer's optimizer step follows.
        Returns the lot's mean per-example loss when `log_nonprivate_train_loss`, else 0."""
        self.model.train()  # the engine's per-example hooks are on self.model's modules, not on Trainer's wrapper `model`
        stats = self.private.release(inputs)  # a re-run step its saved noise cannot reproduce is redone fresh (Mechanism.release_lot)
        loss = stats.train_loss if self.log_nonprivate_train_loss and math.isfinite(stats.train_loss) else 0.0
        return torch.tensor(loss, device=self.args.device)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            args = self.args
            try:
                hyper = {**trainer_hyperparameters(settings_class(self.optimizer_name), args), **self.optimizer_kwargs}
                self.optimizer = build_optimizer(self.optimizer_name, self.model, self.private, **hyper)
            except (ValueError, TypeError) as err:  # an unknown or bad hyperparameter
                raise UserError(f"DPTrainer: optimizer={self.optimizer_name!r}: {err}") from None
        return self.optimizer

    # -- what is logged and written --------------------------------------------------------------------

    def epsilon_spent(self) -> float:
        """ε spent so far (the accountant's composition is not free: computed once per charged release count)."""
        charged = self.private.mechanism.release.accountant.steps
        if self._epsilon_at is None or self._epsilon_at[0] != charged:
            self._epsilon_at = (charged, self.private.epsilon)
        return self._epsilon_at[1]

    def write_privacy_spent(self) -> None:
        """`output_dir/privacy_spent.json`: ε spent (from the ledger beside it) against the plan."""
        plan, accountant = self.private.plan, self.private.mechanism.release.accountant
        spent = {
            "epsilon": self.epsilon_spent(),
            "delta": plan.delta,
            "target_epsilon": plan.target_epsilon,
            "charged_releases": accountant.steps,
            "plan": plan.as_dict(),
            "ledger": self.private.ledger_path.name,
        }
        atomic_write_json(Path(self.args.output_dir) / PRIVACY_SPENT, spent)

    # -- checkpoints and resume --------------------------------------------------------------------------

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        step = self.state.global_step
        # The secret half first (owner-only, outside the checkpoint folders people copy and share).
        record = self.private.state_dict(step)
        folder = Path(self._get_output_dir(trial)) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(folder / PRIVACY_RECORD, record)
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # rotated below, by step number
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        rotate_checkpoints_by_step(folder.parent, limit, self.state.best_model_checkpoint)
        self.write_privacy_spent()
        self.freeze_output_times()

    # Trainer's writers a script calls after train(): what they write would carry the end time.
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if not _internal_call:  # (a checkpoint freezes when it is complete)
            self.freeze_output_times()

    def save_state(self) -> None:
        super().save_state()
        self.freeze_output_times()

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        super().save_metrics(split, metrics, combined)
        self.freeze_output_times()

    def freeze_output_times(self) -> None:
        """Every file and folder in output_dir gets FROZEN_TIME (unless `publish_timing`): their mtimes would date the steps."""
        if not self.publish_timing and Path(self.args.output_dir).is_dir():
            freeze_times(Path(self.args.output_dir))

    @property
    def mechanism_state_path(self) -> Path:
        return Path(self.args.output_dir) / run_folder.MECHANISM_STATE

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any):
        if self.plan_done:
            raise UserError("DPTrainer.train: this trainer's plan is spent (every release made); a new plan needs a new output_dir")
        if not isinstance(self.callback_handler.callbacks[0], PrivateLogs):
            raise UserError("DPTrainer.train: its PrivateLogs callback must stay first (it keeps timing and the raw loss out of every row)")
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise UserError(f"DPTrainer: resume_from_checkpoint=True: no checkpoint in output_dir={self.args.output_dir}")
        if resume_from_checkpoint:
            self._resume_mechanism(Path(resume_from_checkpoint))
        elif self.private.mechanism.ledger.releases:
            raise UserError(
                f"DPTrainer: output_dir={self.args.output_dir} holds {self.private.ledger_path.name} with "
                f"{len(self.private.mechanism.ledger.releases)} releases: continue it with train(resume_from_checkpoint=...), or train in a "
                "new output_dir (those releases still count against this data set)"
            )
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=trial, **kwargs)
        finally:
            self.write_privacy_spent()
            if self.plan_done:  # no step is left to replay
                discard_mechanism_state(Path(self.args.output_dir), keep=False)
                self.private.close()
            self.freeze_output_times()  # last: every write and removal of the run is done
        if self.log_nonprivate_train_loss:
            return output
        # Trainer's training_loss would be the mean of training_step's zeros: a made-up value, not a private one.
        return TrainOutput(output.global_step, math.nan, {**output.metrics, "train_loss": WITHHELD})

    @property
    def plan_done(self) -> bool:
        """Every release of the plan is made (or the budget guard stopped the lots)."""
        return self.state.global_step >= self.private.plan.steps or self.budget_stopped

    def _resume_mechanism(self, checkpoint: Path) -> None:
        """Continue the ledger from `checkpoint`: verify it still holds every line the checkpoint saw, then
        restore the secret draws saved there so the steps after it replay (or draw fresh ones, charged)."""
        record_path = checkpoint / PRIVACY_RECORD
        if not record_path.is_file():
            raise UserError(
                f"DPTrainer: resume_from_checkpoint={checkpoint}: no {PRIVACY_RECORD} (not written by a DPTrainer), so the ledger "
                "cannot be checked against it; resume from a checkpoint this trainer saved"
            )
        record = json.loads(record_path.read_text(encoding="utf-8"))
        try:
            self.private.load_state_dict(record)
        except UserError as err:
            raise UserError(f"DPTrainer: cannot continue output_dir={self.args.output_dir} from {checkpoint.name}/{PRIVACY_RECORD}: {err}") from None
        self.next_step = self.private.next_step
