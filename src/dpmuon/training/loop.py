"""One training run, top to bottom, in named phases:

    setup → resume → train (per step: budget check, release, optimizer step, metrics row,
    checkpoint) → evaluate → summary

The private part is three lines per step — sample a lot, `privatizer.release(...)`,
`optimizer.step()` — everything else is bookkeeping: logging, checkpoints, resume, signals.

What the phases share is `Training` (run_parts.py). The rest lives with what it concerns:
checkpoints (checkpoint.py), evaluation (evaluation.py), the summary and the run's final files
(summary.py), the non-private diagnostics (diagnostics.py), fixed batch shapes (batching.py).
"""

from __future__ import annotations

import math
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from .. import run_folder
from ..config.schema import blamed_on, one_line
from ..config.schema import validate as validate_config
from ..data import DataError
from ..data.tokenizer import load_tokenizer_or_stand_in
from ..errors import UserError
from ..eval.metrics import SCORE_KEYS
from ..models import hidden_matrices, is_lora, per_example_lm_loss, weights_fingerprint
from ..optim import OptimizerInputs, build_optimizer
from ..optim.schedules import build_scheduler
from ..outcomes import NON_FINITE, Interrupted
from ..privacy import NonFiniteReleaseError
from ..privacy.distributed import DataParallel, init_data_parallel
from ..privacy.mechanism import Mechanism, MechanismSettings, build_mechanism, check_plan_inputs
from ..privacy.plan import check_resume_compatible
from ..privacy.state import (
    MECHANISM_STATE_FILE,
    check_ledger_kept,
    discard_mechanism_state,
    remove_left_temp_files,
    restore_mechanism,
    verify_ledger,
)
from ..privacy.subnormals import start_flushing_threads
from .batching import bucketed_micro_batches, fixed_batch_shape, lot_micro_batches, rank_share
from .checkpoint import CHECKPOINT_FILE, checkpoint, failed_writes_stop, load_checkpoint, restore_weights, rng_restore, save_mechanism, spent_without_checkpoint
from .data import prepare_data
from .diagnostics import build_oracle, diagnostic_fields, diagnostics_mode, restore_oracle
from .evaluation import evaluate, validation_nll
from .fsdp import check_can_shard, for_evaluation, shard_model, shard_optimizer_state
from .loggers import NullLogger, build_logger, public_config
from .run_files import MetricsLog, code_version, command_line, freeze_times
from .run_identity import check_same_run, run_dir_claimed
from .run_parts import Training
from .runtime import StopRequest, autocast_factory, keep_freed_memory, log, resolve_device, resolve_precision
from .secret import record_seed_use, user_mechanism_secret
from .summary import finish, run_summary


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
            if t.sharded:  # rank 0 evaluates alone, on the whole weights (training/fsdp.py)
                t.model = for_evaluation(t.model, t.rebuild_unsharded, t.parallel)
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


def setup_process(cfg: DictConfig, run_dir: Path) -> tuple[torch.device, DataParallel, Path]:
    """Threads, the public seed, the device, the process group and the run folder every rank writes into."""
    device = resolve_device(cfg.trainer.device)
    if device.type == "cpu":  # before any parallel torch work: the worker threads flush subnormals (privacy/subnormals.py)
        start_flushing_threads(cfg.trainer.num_threads)
    elif cfg.trainer.num_threads:
        torch.set_num_threads(int(cfg.trainer.num_threads))
    torch.manual_seed(int(cfg.seed))
    if device.type == "cpu" and cfg.trainer.get("keep_freed_memory", False):  # (absent from runs stored before it)
        keep_freed_memory()  # a step's tensors reuse the last step's memory instead of faulting it in again
    parallel = init_data_parallel(device.type)
    # Every rank writes into rank 0's directory (Hydra's timestamps may differ between ranks).
    run_dir = Path(parallel.broadcast_object(str(run_dir)) if parallel.world_size > 1 else run_dir)
    if parallel.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_left_temp_files(run_dir)  # a kill mid-write left generator states there
        if cfg.resume is None:  # before anything can fail: a resume must know (train.resolve_run)
            record_seed_use(run_dir, user_mechanism_secret(cfg) is not None)
    return device, parallel, run_dir


def setup(cfg: DictConfig, run_dir: Path) -> Training:
    """Process, data, plan, model, mechanism and optimizer, in the order errors should surface."""
    device, parallel, run_dir = setup_process(cfg, run_dir)

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
    sharded = cfg.trainer.get("strategy", "ddp") == "fsdp"  # (absent from runs stored before it)
    if sharded:
        check_can_shard(parallel, settings.private, settings.constant_time)
    with blamed_on("model.name_or_path", cfg.model.name_or_path):
        model = model_settings.build(tokenizer, seed=int(cfg.seed)).to(device)
    initial_weights = weights_fingerprint(model)
    frozen_weights = weights_fingerprint(model, frozen_only=True) if is_lora(model) else None
    matrices = hidden_matrices(model)
    if sharded:  # before the mechanism and the optimizer see the parameters: fully_shard replaces them
        model = shard_model(model, parallel, device)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    width, one_shape = row_shape(cfg, max_length, device)
    mechanism = run_mechanism(cfg, settings, run_dir, model, data.train, width, one_shape, matrices, parallel)
    plan = mechanism.plan
    generators = {"probes": torch.Generator(device=device).manual_seed(int(cfg.seed) * 3 + 3)}
    optimizer = build_optimizer(
        OmegaConf.to_container(cfg.optimizer, resolve=True),
        OptimizerInputs(params=named, hidden_matrices=matrices, release_noise_std=mechanism.release_noise_std(), generator=generators["probes"]),
    )
    with blamed_on("optimizer.warmup_steps", cfg.optimizer.warmup_steps):
        scheduler = build_scheduler(optimizer, cfg.optimizer.schedule, plan.steps, int(cfg.optimizer.warmup_steps))
    oracle = build_oracle(cfg, getattr(optimizer, "parts", {}).get("muon"), {p: n for n, p in named.items()}, mechanism.release, parallel)
    constant = plan.max_lot_size is not None  # constant-time lots: fixed shapes too (a width would time the longest example)
    fixed_shape = plan.private and (constant or one_shape)
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
        frozen_weights=frozen_weights,
        rebuild_unsharded=(lambda: model_settings.build(tokenizer, seed=int(cfg.seed)).to(device)) if sharded else None,
        mechanism=mechanism,
        generators=generators,
        named=named,
        optimizer=optimizer,
        scheduler=scheduler,
        oracle=oracle,
        fixed_width=width if fixed_shape else None,
        metrics=MetricsLog(run_dir / run_folder.METRICS),
        diagnostic_rows=MetricsLog(run_dir / run_folder.DIAGNOSTICS, secret=True) if own_file else None,
        padded_rows=-(-plan.max_lot_size // parallel.world_size) if constant else None,  # shard() gives rank 0 the most
        widths=rank_share(plan.widths, parallel.world_size) if plan.widths else None,
    )


def row_shape(cfg: DictConfig, context_length: int, device: torch.device) -> tuple[int, bool]:
    """The width of fixed-shape rows, and whether every micro-batch must have one shape: under bf16
    a kernel's rounding depends on the batch shape, and one shape keeps each example's clipped
    contribution independent of the rest of the lot (see training/batching.py)."""
    return min(int(cfg.dataset.max_length), context_length), fixed_batch_shape(cfg, resolve_precision(cfg.trainer.precision, device))


def run_mechanism(
    cfg: DictConfig,
    settings: MechanismSettings,
    run_dir: Path,
    model: torch.nn.Module,
    train: list,
    width: int,
    one_shape: bool,
    matrices: dict,
    parallel: DataParallel,
) -> Mechanism:
    """The run's mechanism (privacy/mechanism.py) over the training examples `train`, its ledger
    in the run directory; constant-time rows at most `width` tokens wide, in width buckets unless
    every micro-batch must have `one_shape`."""
    # Width buckets under bf16 would move the other examples' contributions: which width an
    # example gets depends on the longer ones in its lot, and bf16 kernels round by shape.
    if one_shape and settings.private and settings.constant_time and int(settings.width_buckets) > 1:
        log("constant-time lots in one width: under bf16 width buckets would move other examples' contributions (privacy.width_buckets is for fp32)")
    if settings.private:
        parallel.on_main(lambda: check_ledger_kept(run_dir))
    # The mechanism's randomness is secret (never from `seed`); `seed` drives what is public.
    return build_mechanism(
        model,
        len(train),
        settings,
        hidden_matrices=matrices,
        user_secret=user_mechanism_secret(cfg),
        run_dir=run_dir,
        dataset_name=cfg.dataset.name,
        public_seed=int(cfg.seed),
        parallel=parallel,
        log=log,
        example_lengths=None if one_shape else [len(example.input_ids) for example in train],
        max_length=width,
    )


# Privacy options a run stored before they existed ran without: a resume keeps what it ran with.
OPTIONS_BEFORE_THEY_EXISTED = {"constant_time": False, "engine_fallback": "generic", "width_buckets": 1}


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
        if t.sharded:  # the checkpoint holds whole tensors: each rank takes its rows
            shard_optimizer_state(t.optimizer)
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


# ---- training ----------------------------------------------------------------------------------


def train(t: Training) -> str | None:
    """Every remaining step; returns why training stopped early (the budget guard, a non-finite
    validation NLL) or None."""
    if t.start_step == 0 and t.validate and validates(t) and not initial_validation_logged(t):
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
            reason = diverged(t, step, row)  # (the validation NLL is published in the row: stopping on it reveals nothing more)
            if reason:
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


def validates(t: Training) -> bool:
    """Whether this rank computes the validation NLL: rank 0 (which logs it), and every rank when
    the model is sharded, since each forward then gathers weights from all of them."""
    return t.parallel.is_main or t.sharded


def validation_step(t: Training, step: int) -> bool:
    """Whether the validation NLL is computed after `step` (a public schedule)."""
    eval_every = int(t.cfg.trainer.eval_every) if t.validate else 0
    return bool(eval_every and step % eval_every == 0) or (t.validate and step == t.plan.steps)


def diverged(t: Training, step: int, row: dict[str, Any]) -> str | None:
    """Why training stops after `step`: a non-finite validation NLL. Every rank stops with rank 0:
    under DDP rank 0 alone validates, and tells the others on the validation steps."""
    value = row.get("val_nll")
    reason = None
    if value is not None and not math.isfinite(value):
        reason = f"{NON_FINITE}: the validation NLL is {value} at step {step} (the model diverged; lower the learning rate)"
    if t.parallel.world_size > 1 and not t.sharded and validation_step(t, step):
        reason = t.parallel.broadcast_object(reason)
    return reason


def initial_validation_logged(t: Training) -> bool:
    """Whether the metrics already hold step 0's row (rank 0 reads them, and tells a sharded run's
    ranks, which validate together)."""
    logged = any(r.get("step") == 0 for r in t.metrics.rows()) if t.parallel.is_main else None
    return t.parallel.broadcast_object(logged) if t.sharded else bool(logged)


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
    broken = non_finite_parameters(t)
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


def non_finite_parameters(t: Training) -> list[str]:
    """The trained parameters holding a non-finite entry: on any rank's rows, when sharded."""
    found = [n for n, p in t.named.items() if not torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()]
    if not t.sharded:
        return found
    flags = torch.tensor([float(n in found) for n in t.named])
    t.parallel.all_reduce_sum([flags])  # every rank stops, or none
    return [n for n, flag in zip(t.named, flags.tolist()) if flag]


def release_step(t: Training, step: int):
    """Sample a lot and release it (a replay that cannot reproduce its output is redone fresh)."""
    return t.mechanism.release_lot(step, t.mechanism.next_lot(), lambda lot: lot_batches(t, lot), loss_function(t), log)


def lot_batches(t: Training, lot: list[int]):
    """This rank's share of the lot as device micro-batches."""
    size, pad_id = int(t.cfg.trainer.micro_batch_size), t.tokenizer.pad_token_id
    if t.widths is not None:
        # Longest first, dealt out in turn: each rank's share fits its share of the buckets.
        ordered = sorted(lot, key=lambda i: (-len(t.data.train[i].input_ids), i))
        max_rows = size if t.mechanism.release.forms_row_gradients else None  # else as many rows as full-width tokens allow
        batches = bucketed_micro_batches(t.data.train, t.parallel.shard(ordered), t.widths, size * t.fixed_width, pad_id, max_rows)
    else:
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
    if validates(t) and validation_step(t, step):
        row["val_nll"] = validation_nll(t)
    return row, diagnostics


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
