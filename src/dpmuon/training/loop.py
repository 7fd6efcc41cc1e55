"""One training run, top to bottom, in named phases:

    setup → resume → train (per step: budget check, release, optimizer step, metrics row,
    checkpoint) → evaluate → summary

The private part is three lines per step — sample a lot, `privatizer.release(...)`,
`optimizer.step()` — everything else is bookkeeping: logging, checkpoints, resume, signals.
"""

from __future__ import annotations

import contextlib
import errno
import math
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from .. import run_folder
from ..config.schema import blamed_on, one_line
from ..config.schema import validate as validate_config
from ..data import DataError
from ..data.tokenizer import load_tokenizer_or_stand_in
from ..diagnostics import OracleAlignment
from ..durable import WriteFailed, atomic_write
from ..errors import UserError
from ..eval.curves import write_curves
from ..eval.metrics import SCORE_KEYS, score
from ..eval.runs import Run, RunSummary, learning_rates
from ..models import (
    hidden_matrices,
    is_lora,
    lm_head_is_tied,
    per_example_lm_loss,
    save_adapter,
    weights_fingerprint,
)
from ..optim import OptimizerInputs, build_optimizer
from ..optim.schedules import build_scheduler
from ..outcomes import NON_FINITE, Interrupted
from ..privacy import (
    MechanismRandomness,
    NonFiniteReleaseError,
)
from ..privacy.distributed import DataParallel, init_data_parallel
from ..privacy.mechanism import Mechanism, MechanismSettings, build_mechanism, check_plan_inputs
from ..privacy.plan import PrivacyPlan, check_resume_compatible
from ..privacy.randomness import PUBLISHED_SEED, USER_SEED
from ..privacy.state import (
    MECHANISM_STATE_FILE,
    check_ledger_kept,
    discard_mechanism_state,
    ledger_record,
    remove_left_temp_files,
    restore_mechanism,
    save_mechanism_state,
    secret_state,
    verify_ledger,
)
from .batching import lot_micro_batches
from .checkpoint import CHECKPOINT_FILE, load_checkpoint, rng_restore, rng_snapshot, save_checkpoint
from .data import RunData, prepare_data
from .evaluation import decode, token_nll
from .loggers import NullLogger, build_logger
from .run_files import MetricsLog, atomic_write_json, code_version, command_line, freeze_times, repo_relative
from .run_identity import check_same_run, config_identity, run_dir_claimed
from .runtime import StopRequest, autocast_factory, log, resolve_device, resolve_precision
from .secret import record_seed_use, user_mechanism_secret

# OSErrors a write raises where the run folder cannot take it (the privacy ledger's own, a model's
# save_pretrained): full, over quota, failing, read-only, or taken away.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


@dataclass
class Training:
    """What the phases of one run share: its parts, built once by `setup`, and its progress."""

    cfg: DictConfig
    run_dir: Path
    device: torch.device
    parallel: DataParallel
    autocast: Callable
    tokenizer: Any
    tokenizer_source: str  # "loaded", or "built locally" (data.fallback=synthetic)
    data: RunData
    model: torch.nn.Module
    initial_weights: str  # fingerprint before any checkpoint is loaded: the run's starting point
    frozen_weights: str | None  # LoRA: the frozen base's fingerprint (checkpoints leave the base out)
    mechanism: Mechanism  # plan, secret randomness, ledger, partition, release and lot sampler
    generators: dict[str, torch.Generator]
    named: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    oracle: OracleAlignment | None
    fixed_width: int | None  # fixed micro-batch shapes (bf16): see training/batching.py
    metrics: MetricsLog
    diagnostic_rows: MetricsLog | None = None  # diagnostics.jsonl (owner-only): logging.nonprivate_diagnostics=file
    padded_rows: int | None = None  # constant-time lots: the rows this rank processes every step
    logger: Any = None
    start_step: int = 0
    last_step: int = 0
    train_seconds: float = 0.0

    @property
    def plan(self) -> PrivacyPlan:
        return self.mechanism.plan

    @property
    def private(self) -> bool:
        return self.plan.private

    @property
    def diagnostics(self) -> bool:
        """Whether the raw lot's quantities are computed at all (logging.nonprivate_diagnostics)."""
        return diagnostics_mode(self.cfg) != "false"

    @property
    def publish_diagnostics(self) -> bool:
        """Whether they go where the releases go (metrics.jsonl, W&B, console). A non-private run
        has no guarantee to keep: its model is as revealing as its diagnostics."""
        return diagnostics_mode(self.cfg) == "publish" or (self.diagnostics and not self.private)

    @property
    def validate(self) -> bool:
        return bool(self.cfg.eval.get("validation", True))

    @property
    def progress(self) -> bool:
        return bool(self.cfg.logging.progress)

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT_FILE

    @property
    def mechanism_state_path(self) -> Path:
        return self.run_dir / MECHANISM_STATE_FILE


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Train, evaluate and write the run's artifacts; returns the summary (None on ranks > 0).

    One run per folder: the run holds the folder's lock throughout, and a new run refuses a
    folder that holds another run's files (training/run_identity.py)."""
    validate_config(cfg)  # types, ranges and choices: before any data, tokenizer or model is read
    with run_dir_claimed(run_dir, cfg):
        summary = run_claimed(cfg, run_dir)
    if summary is not None and summary["max_lot_size"] is not None:  # constant-time lots
        freeze_times(run_dir)  # last, the lock file removed too: every write and removal of the run is done
    return summary


def run_claimed(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """`run`, in a folder this process holds."""
    version, command = code_version(), command_line()  # of the code that starts the run (argv holds no seed: see train.cli)
    t = setup(cfg, run_dir)
    try:
        with failed_writes_stop(t):
            resume(t)
            stop_reason = train(t)
    finally:
        t.mechanism.close()
        t.parallel.leave()  # nothing after training is collective: rank 0 evaluates alone
    if not t.parallel.is_main:  # rank 0 evaluates and writes the artifacts
        return None
    try:
        with failed_writes_stop(t):
            diverged = stop_reason is not None and stop_reason.startswith(NON_FINITE)
            test_nll, scores = (None, dict.fromkeys(SCORE_KEYS)) if diverged else evaluate(t)
            if test_nll is not None and not math.isfinite(test_nll):
                stop_reason = f"{NON_FINITE}: the test NLL is {test_nll} after step {t.last_step} (the model diverged; lower the learning rate)"
                log(stop_reason)
            summary = run_summary(t, stop_reason, test_nll, scores, version, command).as_dict()
            finish(t, summary)
    finally:  # training is over, even if evaluation or the logger failed: no step is left to replay
        discard_mechanism_state(t.run_dir, keep=bool(t.cfg.privacy.get("keep_mechanism_state", False)))
    return summary


# ---- setup -------------------------------------------------------------------------------------


def setup(cfg: DictConfig, run_dir: Path) -> Training:
    """Process, data, plan, model, mechanism and optimizer, in the order errors should surface."""
    if cfg.trainer.num_threads:
        torch.set_num_threads(int(cfg.trainer.num_threads))
    torch.manual_seed(int(cfg.seed))
    device = resolve_device(cfg.trainer.device)
    parallel = init_data_parallel(device.type)
    # Every rank writes into rank 0's directory (Hydra's timestamps may differ between ranks).
    run_dir = Path(parallel.broadcast_object(str(run_dir)) if parallel.world_size > 1 else run_dir)
    if parallel.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_left_temp_files(run_dir)  # a kill mid-write left generator states there
        if cfg.resume is None:  # before anything can fail: a resume must know (train.resolve_run)
            record_seed_use(run_dir, user_mechanism_secret(cfg) is not None)

    # Data first: input errors surface before any model is built or downloaded.
    with blamed_on("model.tokenizer", cfg.model.tokenizer):
        tokenizer, tokenizer_source = load_tokenizer_or_stand_in(cfg.model.tokenizer, cfg.model.get("bpe_merges"), cfg.data.get("fallback", "none"), log)
    model_settings = instantiate(cfg.model, _convert_="all")  # its `_target_`: models.settings.ModelSettings
    with blamed_on("model.name_or_path", cfg.model.name_or_path):
        max_length = model_settings.context_length()
    try:
        data = prepare_data(
            cfg.dataset, cfg.data, tokenizer, max_length, log, progress=bool(cfg.logging.progress), publish_counts=diagnostics_mode(cfg) == "publish"
        )
    except OSError as err:  # e.g. an unreadable file: name it, and the key that says where data comes from
        raise DataError(
            f"cannot read {err.filename or 'the data'}: {err.strerror or one_line(err)}; "
            "data.root sets the data folder (null: $DPMUON_DATA_DIR, else data/raw/)"
        ) from err
    settings = privacy_settings(cfg)
    check_plan_inputs(settings, len(data.train))  # δ < 1/N and the other plan checks need only N: before the model
    with blamed_on("model.name_or_path", cfg.model.name_or_path):
        model = model_settings.build(tokenizer, seed=int(cfg.seed)).to(device)
    initial_weights = weights_fingerprint(model)
    matrices = hidden_matrices(model)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    mechanism = run_mechanism(cfg, settings, run_dir, model, len(data.train), matrices, parallel)
    plan = mechanism.plan
    generators = {"probes": torch.Generator(device=device).manual_seed(int(cfg.seed) * 3 + 3)}
    optimizer = build_optimizer(
        OmegaConf.to_container(cfg.optimizer, resolve=True),
        OptimizerInputs(params=named, hidden_matrices=matrices, release_noise_std=mechanism.release_noise_std(), generator=generators["probes"]),
    )
    with blamed_on("optimizer.warmup_steps", cfg.optimizer.warmup_steps):
        scheduler = build_scheduler(optimizer, cfg.optimizer.schedule, plan.steps, int(cfg.optimizer.warmup_steps))
    oracle = build_oracle(cfg, getattr(optimizer, "parts", {}).get("muon"), {p: n for n, p in named.items()}, mechanism.release, parallel)
    # Under bf16 a kernel's rounding depends on the batch shape: fixed shapes keep each example's
    # clipped contribution independent of the rest of the lot (see training/batching.py).
    # Constant-time lots need them too: a micro-batch's width would time its longest example.
    constant = plan.max_lot_size is not None
    fixed_shape = plan.private and (constant or fixed_batch_shape(cfg, resolve_precision(cfg.trainer.precision, device)))
    own_file = plan.private and diagnostics_mode(cfg) == "file" and parallel.is_main  # rank 0 writes the run's files
    if plan.private and not constant and diagnostics_mode(cfg) != "publish":
        log("privacy.constant_time=false: step times track the lot sizes, and so do the times W&B, the console and the file times record")
    return Training(
        cfg=cfg,
        run_dir=run_dir,
        device=device,
        parallel=parallel,
        autocast=autocast_factory(cfg.trainer.precision, device),
        tokenizer=tokenizer,
        tokenizer_source=tokenizer_source,
        data=data,
        model=model,
        initial_weights=initial_weights,
        frozen_weights=weights_fingerprint(model, frozen_only=True) if is_lora(model) else None,
        mechanism=mechanism,
        generators=generators,
        named=named,
        optimizer=optimizer,
        scheduler=scheduler,
        oracle=oracle,
        fixed_width=min(int(cfg.dataset.max_length), max_length) if fixed_shape else None,
        metrics=MetricsLog(run_dir / run_folder.METRICS),
        diagnostic_rows=MetricsLog(run_dir / run_folder.DIAGNOSTICS, secret=True) if own_file else None,
        padded_rows=-(-plan.max_lot_size // parallel.world_size) if constant else None,  # shard() gives rank 0 the most
    )


def run_mechanism(
    cfg: DictConfig, settings: MechanismSettings, run_dir: Path, model: torch.nn.Module, dataset_size: int, matrices: dict, parallel: DataParallel
) -> Mechanism:
    """The run's mechanism (privacy/mechanism.py), its ledger in the run directory."""
    if settings.private:
        parallel.on_main(lambda: check_ledger_kept(run_dir))
    # The mechanism's randomness is secret (never from `seed`); `seed` drives what is public.
    return build_mechanism(
        model,
        dataset_size,
        settings,
        hidden_matrices=matrices,
        user_secret=user_mechanism_secret(cfg),
        run_dir=run_dir,
        dataset_name=cfg.dataset.name,
        public_seed=int(cfg.seed),
        parallel=parallel,
        log=log,
    )


# Privacy options a run stored before they existed ran without: a resume keeps what it ran with.
OPTIONS_BEFORE_THEY_EXISTED = {"constant_time": False, "engine_fallback": "generic"}


def privacy_settings(cfg: DictConfig) -> MechanismSettings:
    """The mechanism's settings in a run's config (privacy.*, trainer.epochs/steps, optimizer.private)."""
    privacy = OmegaConf.to_container(cfg.privacy, resolve=True)
    return MechanismSettings(
        **(OPTIONS_BEFORE_THEY_EXISTED | privacy),
        epochs=cfg.trainer.epochs,
        steps=cfg.trainer.steps,
        private=bool(cfg.optimizer.private),
    )


# ---- resume ------------------------------------------------------------------------------------


def resume(t: Training) -> None:
    """Continue from the checkpoint and the mechanism state, if any; open the metrics and logger."""
    state = load_checkpoint(t.checkpoint_path)
    logger_id = None
    if state is not None:
        check_same_run(state.get("config_identity"), t.cfg, t.run_dir)
        check_resume_compatible(state["plan"], t.plan)
        verify_ledger(t.mechanism.ledger, state, CHECKPOINT_FILE)
        restore_weights(t, state)
        t.optimizer.load_state_dict(state["optimizer"])
        t.scheduler.load_state_dict(state["scheduler"])
        rng_restore(state["rng"], t.generators)
        t.start_step, t.train_seconds, logger_id = state["step"], state.get("train_seconds", 0.0), state.get("logger_id")
    elif t.private and t.mechanism.release.accountant.steps and not t.mechanism.within_budget():
        raise UserError(spent_without_checkpoint(t))
    t.last_step = t.start_step
    saved = None
    if t.private:
        saved = restore_mechanism(t.mechanism, t.mechanism_state_path, t.start_step, log)
        if saved is not None and saved.get("data_fingerprint", t.data.train_source) != t.data.train_source:
            raise UserError(
                f"cannot resume {t.run_dir}: its training examples differ from the ones this run started on "
                f"({MECHANISM_STATE_FILE} records another content hash); resume it on the data it began with"
            )
    if t.oracle is not None and t.start_step > 0:
        restore_oracle(t.oracle, saved, t.start_step)
    if state is not None or (t.mechanism.ledger is not None and t.mechanism.ledger.releases):
        spent = t.mechanism.release.accountant.epsilon()
        log(f"resumed from step {t.start_step} of {t.plan.steps}" + (f", ε so far {spent:.4f} (from the ledger)" if t.private else ""))
    if t.parallel.is_main:
        moved = t.metrics.set_aside_after(t.start_step)
        if moved:
            log(f"{moved} metrics line(s) (rows of steps past {t.start_step}, or damaged lines) moved to {t.metrics.superseded_path.name}, marked, not deleted")
        config = {**public_config(t.cfg), "plan": t.plan.as_dict()}
        if t.diagnostic_rows is not None:
            t.diagnostic_rows.set_aside_after(t.start_step)
        t.logger = build_logger(t.cfg.logger, t.run_dir, config, logger_id, t.run_dir.name, per_step=t.publish_diagnostics)
    else:
        t.logger = NullLogger()
    if t.private and t.start_step == 0 and t.parallel.is_main:  # a kill before the first checkpoint can still replay
        save_mechanism(t, 0)


def save_mechanism(t: Training, step: int) -> None:
    # The examples' content hash checks that a resume trains on the same data; it is owner-only
    # here, since a hash of the private set is a membership oracle (training/data.py).
    state = {**secret_state(t.mechanism), "data_fingerprint": t.data.train_source}
    if t.oracle is not None:  # the noise-free mirrors are as secret as the noise
        state["oracle"] = t.oracle.state_dict()
    save_mechanism_state(t.mechanism_state_path, step, state)


def restore_oracle(oracle: OracleAlignment, saved: dict | None, step: int) -> None:
    """The noise-free mirrors from the mechanism state restored at `step` (None: none was)."""
    if saved is not None and "oracle" in saved:
        oracle.load_state_dict(saved["oracle"])
    else:
        log(f"no oracle mirrors saved at step {step}: they restart from zero (rows from here on see only the steps since)")


def checkpoint(t: Training, step: int) -> None:
    if not t.parallel.is_main:
        return
    if t.private:  # the secret half first: a checkpoint never exists without its mechanism state
        save_mechanism(t, step)
    save_checkpoint(
        t.checkpoint_path,
        {
            "step": step,
            "model": checkpoint_weights(t),
            **({"frozen_weights_sha256": t.frozen_weights} if t.frozen_weights else {}),
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "rng": rng_snapshot(t.generators),
            "plan": t.plan.as_dict(),
            "config_identity": config_identity(t.cfg),  # what a resume must configure alike (run_identity.py)
            **({"train_seconds": t.train_seconds} if t.publish_diagnostics else {}),
            "logger_id": t.logger.run_id,
            **ledger_record(t.mechanism.ledger),
        },
    )


def checkpoint_weights(t: Training) -> dict[str, torch.Tensor]:
    """The model's weights a checkpoint keeps: all of them, or a LoRA run's trained ones only (its
    frozen base is rebuilt from the config on resume, and checked against its fingerprint)."""
    if t.frozen_weights is None:
        return t.model.state_dict()
    return {name: value for name, value in t.model.state_dict().items() if name in t.named}


def restore_weights(t: Training, state: dict[str, Any]) -> None:
    saved_base = state.get("frozen_weights_sha256")
    if saved_base is None:  # every weight saved (full fine-tuning, or a LoRA checkpoint written before)
        t.model.load_state_dict(state["model"])
        return
    if saved_base != t.frozen_weights:
        raise UserError(
            f"cannot resume {t.run_dir}: the frozen base model built from model.name_or_path={t.cfg.model.name_or_path} is not the "
            f"one the run started from (weights fingerprint {str(t.frozen_weights)[:12]}…, {CHECKPOINT_FILE} records {saved_base[:12]}…); "
            "resume with the base model it began with"
        )
    if set(state["model"]) != set(t.named):
        raise UserError(f"cannot resume {t.run_dir}: {CHECKPOINT_FILE} holds other trained weights than this model's adapters")
    t.model.load_state_dict(state["model"], strict=False)


# ---- training ----------------------------------------------------------------------------------


def train(t: Training) -> str | None:
    """Every remaining step; returns why training stopped early (the budget guard, a non-finite
    validation NLL) or None."""
    if t.start_step == 0 and t.validate and t.parallel.is_main and not any(r.get("step") == 0 for r in t.metrics.rows()):
        # Where the curves start: the public initial weights, before any release.
        t.logger.log(_finite({"step": 0, "val_nll": validation_nll(t)}), publish=True)
    t.model.train()
    with StopRequest() as stop:
        bar = tqdm(
            range(t.start_step + 1, t.plan.steps + 1),
            desc="train",
            disable=not (t.progress and t.parallel.is_main),
            initial=t.start_step,
            total=t.plan.steps,
            # Unless diagnostics are published the bar shows no rate or elapsed time (step time tracks
            # the lot), and redraws once per step rather than when enough time has passed.
            bar_format=None if t.publish_diagnostics else "{l_bar}{bar}| {n_fmt}/{total_fmt}",
            **({} if t.publish_diagnostics else {"mininterval": 0, "miniters": 1}),
        )
        for step in bar:
            reason = t.mechanism.budget_stop(step)
            if reason:
                log(f"{reason}; stopping")
                checkpoint(t, t.last_step)
                return reason
            row = train_step(t, step)
            if row.get("val_nll") is not None and not math.isfinite(row["val_nll"]):
                # Validation NLL is published in the row: stopping on it reveals nothing more.
                reason = f"{NON_FINITE}: the validation NLL is {row['val_nll']} at step {step} (the model diverged; lower the learning rate)"
                log(f"{reason}; stopping")
                return reason
            bar.set_postfix({k: f"{row[k]:.4g}" for k in ("train_loss", "val_nll", "epsilon") if row.get(k) is not None})
            t.scheduler.step()  # after the row: it logs the rate this step used
            stopping = stop.requested(t.parallel)
            ckpt_every = int(t.cfg.trainer.checkpoint_every)
            if (ckpt_every and step % ckpt_every == 0) or step == t.plan.steps or stopping:
                checkpoint(t, step)
            if stopping:
                t.logger.finish()
                log(f"checkpointed at step {step}; resume with: python -m dpmuon.train resume={t.run_dir}")
                raise Interrupted(stop.signum or signal.SIGTERM, said=True)
        bar.close()
    return None


def train_step(t: Training, step: int) -> dict[str, Any]:
    """Release one lot, step the optimizer, log the step's metrics row (returned)."""
    started = time.perf_counter()
    try:
        stats = release_step(t, step)
    except NonFiniteReleaseError as err:
        raise UserError(f"step {step}: {err}") from None
    oracle_fields = t.oracle.step() if t.oracle else {}  # before the optimizer moves the weights
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    broken = [n for n, p in t.named.items() if not torch.isfinite(p).all()]
    if broken:  # stop before a checkpoint could save the broken weights
        raise UserError(f"step {step}: parameters became non-finite ({broken[0]}, …); lower the learning rate")
    elapsed = time.perf_counter() - started
    t.train_seconds += elapsed
    t.last_step = step
    row, diagnostics = metrics_row(t, step, stats, oracle_fields, elapsed)
    if t.publish_diagnostics:
        row.update(diagnostics)
    elif diagnostics and t.diagnostic_rows is not None:
        t.diagnostic_rows.append(_finite({"step": step, **diagnostics}))
    evaluated = "val_nll" in row or step == t.plan.steps
    t.logger.log(_finite(row), publish=evaluated)
    return row


def release_step(t: Training, step: int):
    """Sample a lot and release it (a replay that cannot reproduce its output is redone fresh)."""
    return t.mechanism.release_lot(step, t.mechanism.next_lot(), lambda lot: lot_batches(t, lot), loss_function(t), log)


def lot_batches(t: Training, lot: list[int]):
    """This rank's share of the lot as device micro-batches."""
    size, pad_id = int(t.cfg.trainer.micro_batch_size), t.tokenizer.pad_token_id
    shard = t.parallel.shard(lot)
    batches = lot_micro_batches(t.data.train, shard, size, pad_id, fixed_width=t.fixed_width, fixed_rows=t.fixed_width is not None, pad_to=t.padded_rows)
    for batch in batches:
        yield {k: v.to(t.device) for k, v in batch.items()}


def loss_function(t: Training):
    def loss_fn(model, batch):
        with t.autocast():
            return per_example_lm_loss(model, batch)

    return loss_fn


def metrics_row(t: Training, step: int, stats, oracle_fields: dict, elapsed: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The step's metrics row (functions of the releases: public) and, with diagnostics on, the
    raw lot's quantities (outside the guarantee; empty when off)."""
    row: dict[str, Any] = {"step": step, "lr": t.optimizer.param_groups[0]["lr"]}
    with_epsilon = step % max(1, int(t.cfg.logging.epsilon_every)) == 0 or step == t.plan.steps
    row.update(t.mechanism.release.public_step_fields(with_epsilon))  # (a replayed, uncharged release is marked in the ledger)
    names = {p: n for n, p in t.named.items()}
    diagnose = getattr(t.optimizer, "diagnostics", None)
    every = int(t.cfg.logging.per_matrix_every)
    per_matrix = step == t.plan.steps or bool(every and step % every == 0)
    for key, values in (diagnose() if diagnose else {}).items():  # computed from the release: public
        if per_matrix:
            row[key] = {names[p]: v for p, v in values.items()}
        row[f"{key}_median"] = statistics.median(values.values())
    diagnostics = {**diagnostic_fields(stats, t.mechanism.partition, t.private), **oracle_fields, "step_seconds": elapsed} if t.diagnostics else {}
    eval_every = int(t.cfg.trainer.eval_every) if t.validate else 0
    if t.parallel.is_main and (bool(eval_every and step % eval_every == 0) or (t.validate and step == t.plan.steps)):
        row["val_nll"] = validation_nll(t)
    return row, diagnostics


def validation_nll(t: Training) -> float:
    batch = int(t.cfg.eval.batch_size) * 4
    return token_nll(t.model, t.data.valid, t.tokenizer.pad_token_id, batch, t.device, t.autocast, t.progress, "valid nll")


# ---- evaluation and summary --------------------------------------------------------------------


def evaluate(t: Training) -> tuple[float | None, dict]:
    """Test NLL and decoding (skipped when eval.test=false: the test set stays unseen)."""
    cfg, pad_id = t.cfg, t.tokenizer.pad_token_id
    if not cfg.eval.test:
        return None, dict.fromkeys(SCORE_KEYS)
    log("evaluating on the test set")
    test_nll = token_nll(t.model, t.data.test, pad_id, int(cfg.eval.batch_size) * 4, t.device, t.autocast, t.progress, "test nll")
    generations = decode(t.model, t.tokenizer, [item.source for item in t.data.test_items], cfg.eval, t.device, t.autocast, t.progress)
    atomic_write(t.run_dir / run_folder.GENERATIONS, lambda f: f.write("".join(g.replace("\n", " ") + "\n" for g in generations).encode()))
    return test_nll, score(generations, [item.references for item in t.data.test_items])


def run_summary(t: Training, stop_reason: str | None, test_nll: float | None, scores: dict, version: str, command: str) -> RunSummary:
    """The run's summary.json: what was run, what it cost in privacy, and what it scored."""
    cfg, plan = t.cfg, t.plan
    return RunSummary(
        dataset=cfg.dataset.name,
        data_source=t.data.data_source,
        tokenizer_source=t.tokenizer_source,
        optimizer=cfg.optimizer.name,
        model=cfg.model.name,
        seed=int(cfg.seed),
        learning_rates=learning_rates(cfg.optimizer),
        private=plan.private,
        target_epsilon=plan.target_epsilon,
        epsilon=t.mechanism.release.accountant.epsilon(),
        delta=plan.delta,
        delta_times_n=plan.delta_times_n,
        noise_multiplier=plan.noise_multiplier,
        sample_rate=plan.sample_rate,
        expected_lot_size=plan.expected_lot_size,
        dataset_size=plan.dataset_size,
        steps=t.last_step,
        planned_steps=plan.steps,
        releases_charged=t.mechanism.release.accountant.steps,
        **ledger_record(t.mechanism.ledger),
        release_slack=asdict(plan.slack) if plan.private else None,
        stopped_by_budget_guard=stop_reason is not None and not stop_reason.startswith(NON_FINITE),
        stop_reason=stop_reason,
        validation_split=validation_split(cfg) if t.validate else None,
        accountant=plan.accountant,
        **mechanism_fields(cfg, plan.private, t.mechanism.randomness),
        world_size=t.parallel.world_size,
        tied_lm_head=lm_head_is_tied(t.model),
        initial_weights_sha256=t.initial_weights,
        final_weights_sha256=weights_fingerprint(t.model),
        test_nll=test_nll,
        val_nll=_last(t.metrics.rows(), "val_nll"),
        **{key: scores[key] for key in SCORE_KEYS if key != "metric_implementations"},
        metric_implementations=scores["metric_implementations"] or {},  # nothing scored: no scorers
        test_sources=len(t.data.test_items) if cfg.eval.test else 0,
        train_seconds=t.train_seconds if t.publish_diagnostics else None,
        max_lot_size=t.plan.max_lot_size,
        nonprivate_values_logged=nonprivate_values_logged(t),
        git_commit=version,
        command=command,
        run_dir=repo_relative(str(t.run_dir.resolve())),
    )


def mechanism_fields(cfg: DictConfig, private: bool, randomness: MechanismRandomness) -> dict[str, Any]:
    """How the release was made; a non-private run has no mechanism (and samples Poisson lots)."""
    if not private:
        return {"mechanism_randomness": None, "clip_mode": None, "clip_norm": None, "sampling": "poisson", "engine": None}
    return {
        # A published seed regenerates every lot and noise draw: the ε below is then no guarantee.
        "mechanism_randomness": PUBLISHED_SEED if cfg.privacy.get("published_seed") and randomness.source == USER_SEED else randomness.source,
        "clip_mode": cfg.privacy.clip_mode,
        "clip_norm": float(cfg.privacy.clip_norm),
        "sampling": cfg.privacy.sampling,
        "engine": cfg.privacy.engine,
    }


def finish(t: Training, summary: dict[str, Any]) -> None:
    """Write the summary and curves, save the model if asked, and remove what must not outlive the run."""
    if is_lora(t.model):  # always: a few adapter matrices, and the run's model is the base plus them
        save_adapter(t.model, t.run_dir / run_folder.ADAPTER)
    if t.cfg.trainer.save_model:
        # A LoRA run's full model has its adapters merged into the base weights (the model's last use).
        (t.model.merge_and_unload() if is_lora(t.model) else t.model).save_pretrained(t.run_dir / run_folder.MODEL)
        t.tokenizer.save_pretrained(t.run_dir / run_folder.MODEL)
    atomic_write_json(t.run_dir / run_folder.SUMMARY, summary)
    t.logger.summary(summary)
    figures = write_curves([Run(t.run_dir, summary)], t.run_dir / run_folder.CURVES, diagnostics=False)  # the run folder's are publishable
    t.logger.images({f"curves/{path.stem}": path for path in figures})
    t.logger.finish()
    if not t.cfg.trainer.keep_checkpoint:
        t.checkpoint_path.unlink(missing_ok=True)
    shown = {k: summary[k] for k in ("test_nll", "val_nll", "bleu", "rouge_l", "epsilon") if summary[k] is not None}
    on = " on the SYNTHETIC stand-in data (data.fallback), not E2E" if summary["data_source"] == "synthetic" else ""
    log("done: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()) + f"{on} → {t.run_dir}")


# ---- the parts -----------------------------------------------------------------------------------


@contextlib.contextmanager
def failed_writes_stop(t: Training):
    """A run file that cannot be written (a full disk, a quota, an I/O error) ends the run where
    it is, before another release, in one line that says how far it got and how to go on."""
    try:
        yield
    except OSError as err:
        if not isinstance(err, WriteFailed) and err.errno not in WRITE_ERRNOS:
            raise
        failed = err if isinstance(err, WriteFailed) else WriteFailed(err.filename or t.run_dir, err)
        raise UserError(
            f"{failed}; the run stopped after step {t.last_step} of {t.plan.steps}, releasing nothing more; "
            f"free space (or fix the folder), then resume with: python -m dpmuon.train resume={t.run_dir}"
        ) from err


def spent_without_checkpoint(t: Training) -> str:
    """Why a resume with no checkpoint is refused once the budget allows no further release."""
    accountant = t.mechanism.release.accountant
    return (
        f"cannot resume {t.run_dir}: its ledger charges {accountant.steps} releases (ε {accountant.epsilon():.4g} of "
        f"privacy.target_epsilon={t.plan.target_epsilon:g}) and the budget allows no more, but no {CHECKPOINT_FILE} holds the "
        f"weights they trained, so the resumed run would report the initial weights; restore {CHECKPOINT_FILE} from a copy, "
        "or start a new run in a new directory (these releases stay spent)"
    )


def build_oracle(cfg: DictConfig, muon, names: dict, release, parallel: DataParallel) -> OracleAlignment | None:
    """logging.oracle_alignment: the noise-free buffer beside the real one (non-private)."""
    if not cfg.logging.get("oracle_alignment", False):
        return None
    if diagnostics_mode(cfg) == "false":
        raise UserError("logging.oracle_alignment=true needs logging.nonprivate_diagnostics=file or publish: it is computed from the noise-free private signal")
    if muon is None or not cfg.optimizer.private:
        raise UserError(f"logging.oracle_alignment=true needs a private Muon-family optimizer; got optimizer={cfg.optimizer.name}")
    if parallel.world_size > 1:
        raise UserError("logging.oracle_alignment=true runs in one process only (each rank sees only its shard's clipped sum)")
    oracle = OracleAlignment(muon, names, release.release_noise_std(), seed=int(cfg.seed))
    release.observe_noise_free = oracle.observe
    return oracle


def diagnostics_mode(cfg: DictConfig) -> str:
    """logging.nonprivate_diagnostics as "false", "file" or "publish" (true: publish, as it used to)."""
    setting = cfg.logging.nonprivate_diagnostics
    if setting is True or setting is False:
        return "publish" if setting else "false"
    return str(setting)


def fixed_batch_shape(cfg: DictConfig, precision: str) -> bool:
    """trainer.fixed_batch_shape: auto means on exactly when the forward runs in bf16 (off there:
    warned, and refused where privacy.secure_noise=true promises an exact mechanism)."""
    setting = cfg.trainer.get("fixed_batch_shape", "auto")
    fixed = precision == "bf16" if setting == "auto" else bool(setting)
    if precision == "bf16" and not fixed:
        inexact = "under bf16 the rest of the lot moves each clipped contribution by up to ~0.7% of C, so the sensitivity bound is not exact"
        if cfg.privacy.get("secure_noise", False):
            raise UserError(f"trainer.fixed_batch_shape=false: {inexact}; valid with privacy.secure_noise=true: auto or true")
        log(f"warning: trainer.fixed_batch_shape=false: {inexact}")
    return fixed


def validation_split(cfg: DictConfig) -> str:
    """Whether the validation NLL is covered: a private set's own validation split is not."""
    return "public" if cfg.eval.get("validation_split", "private") == "public" else "private (not covered)"


def public_config(cfg: DictConfig) -> dict:
    """The resolved config as it may be published (W&B): it holds no seed (see training/secret.py)."""
    return OmegaConf.to_container(cfg, resolve=True)


def diagnostic_fields(stats, partition, private: bool) -> dict[str, Any]:
    """Quantities computed from the raw lot, outside the guarantee (logging.nonprivate_diagnostics)."""
    fields: dict[str, Any] = {"train_loss": stats.train_loss, "lot_size": stats.lot_size}
    if private:
        fields.update(mean_grad_norm=stats.mean_grad_norm, nonfinite_examples=stats.nonfinite)
        fractions = stats.clip_fraction()
        if fractions:
            fields["clip_fraction"] = sum(fractions) / len(fractions)
            fields["clip_fraction_by_block"] = {b.name: f for b, f in zip(partition.blocks, fractions)}
    return fields


def nonprivate_values_logged(t: Training) -> list[str]:
    """The names of the values outside the guarantee that the run's published record holds: those
    of `diagnostic_fields`, the step and train times, and the oracle's fields ("oracle_*")."""
    if not t.publish_diagnostics:
        return []
    names = ["train_loss", "lot_size"]
    if t.private:
        names += ["mean_grad_norm", "nonfinite_examples", "clip_fraction", "clip_fraction_by_block"]
    return names + ["step_seconds", "train_seconds"] + (["oracle_*"] if t.oracle is not None else [])


def _finite(row: dict) -> dict:
    """JSON has no inf/NaN: such values are logged as null."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out[key] = _finite(value)
        elif isinstance(value, float) and not math.isfinite(value):
            out[key] = None
        else:
            out[key] = value
    return out


def _last(rows: list[dict], key: str):
    """The last logged value of `key`: None when it was non-finite (logged as null), not an older one."""
    values = [r[key] for r in rows if key in r]
    return values[-1] if values else None
