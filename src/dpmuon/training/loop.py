"""One training run, top to bottom: setup → private training → evaluation → artifacts.

The private part is three lines per step — sample a lot, `privatizer.release(...)`,
`optimizer.step()` — everything else is bookkeeping: logging, checkpoints, resume, signals.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from ..config.schema import blamed_on
from ..config.schema import validate as validate_config
from ..data import load_tokenizer
from ..diagnostics import OracleAlignment
from ..errors import UserError
from ..eval.curves import write_curves
from ..eval.metrics import SCORE_KEYS, score
from ..eval.runs import Run
from ..models import build_model, context_length, hidden_matrices, lm_head_is_tied, per_example_lm_loss, weights_fingerprint
from ..optim import OptimizerInputs, build_optimizer
from ..optim.schedules import build_scheduler
from ..privacy import (
    LEDGER_FILE,
    GaussianNoise,
    LedgerMismatchError,
    MechanismRandomness,
    NonFiniteReleaseError,
    NonPrivateRelease,
    PrivacyAccountant,
    PrivacyLedger,
    Privatizer,
    ReplayMismatchError,
    build_lot_sampler,
    build_partition,
)
from ..privacy.blocks import partition_summary
from ..privacy.distributed import DataParallel, init_data_parallel
from .batching import lot_micro_batches
from .checkpoint import CHECKPOINT_FILE, load_checkpoint, rng_restore, rng_snapshot, save_checkpoint
from .data import prepare_data
from .evaluation import decode, token_nll
from .loggers import NullLogger, build_logger
from .mechanism_state import MECHANISM_STATE_FILE, load_mechanism_state, save_mechanism_state
from .plan import check_resume_compatible, make_plan
from .redact import REDACTED, redact
from .run_files import MetricsLog, atomic_write, atomic_write_json, code_version, command_line


def log(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # one voice under torchrun
        tqdm.write(f"[dpmuon] {message}", file=sys.stderr)


def resolve_device(name: str) -> torch.device:
    if name not in ("auto", "cpu", "cuda"):
        raise UserError(f"unknown trainer.device {name!r}; valid: auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is available")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # torchrun: one GPU per process
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` is bf16 autocast on GPU and fp32 on CPU."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast_factory(precision: str, device: torch.device):
    """bf16 autocast for the model's forward; clipping, noise and optimizer stay fp32."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext
    if precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise UserError(f"unknown trainer.precision {precision!r}; valid: auto, fp32, bf16")


class StopRequest:
    """SIGINT/SIGTERM finish the current step, checkpoint and exit; a second signal aborts."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.signum = signum
        log(f"received {signal.Signals(signum).name}: finishing this step, then checkpointing")

    def requested(self, parallel: DataParallel) -> bool:
        """Stop if any rank was signalled, so that all ranks stop at the same step."""
        if parallel.world_size == 1:
            return self.signum is not None
        flag = torch.tensor([1.0 if self.signum is not None else 0.0])
        parallel.all_reduce_sum([flag])
        return bool(flag.item() > 0)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def build_release(cfg: DictConfig, model, named: dict, matrices: dict, plan, noise: GaussianNoise, parallel: DataParallel, ledger):
    """The mechanism of the plan: (partition, accountant, privatizer), or the non-private release.

    The accountant starts from the ledger's charged releases: ε spent always comes from there.
    """
    if not plan.private:
        return None, None, NonPrivateRelease(model, parallel)
    sizes = {n: p.numel() for n, p in named.items()}
    partition = build_partition(
        named,
        clip_mode=cfg.privacy.clip_mode,
        clip_norm=float(cfg.privacy.clip_norm),
        threshold_rule=cfg.privacy.threshold_rule,
        other_blocks=cfg.privacy.other_blocks,
        matrix_names=matrices,
        sizes=sizes,
    )
    log(f"clipping: {cfg.privacy.clip_mode}, {partition_summary(partition, sizes)}")
    accountant = PrivacyAccountant(plan.delta, plan.accountant)
    history = ledger.charged_history() if ledger is not None else []
    accountant.history = parallel.broadcast_object(history) if parallel.world_size > 1 else history
    privatizer = Privatizer(
        model,
        partition,
        noise_multiplier=plan.noise_multiplier,
        expected_lot_size=plan.expected_lot_size,
        sample_rate=plan.sample_rate,
        accountant=accountant,
        noise=noise,
        noise_allocation=cfg.privacy.noise_allocation,
        engine=cfg.privacy.engine,
        parallel=parallel,
        ledger=ledger,
    )
    return partition, accountant, privatizer


def open_ledger(cfg: DictConfig, run_dir: Path, plan, data, parallel: DataParallel) -> PrivacyLedger | None:
    """The run's privacy ledger (rank 0 of a private run), created or continued."""
    if not plan.private or not parallel.is_main:
        return None
    header = {
        "dataset": cfg.dataset.name,
        "dataset_size": plan.dataset_size,
        "data_fingerprint": data.train_source,
        "delta": plan.delta,
        "accountant": plan.accountant,
    }
    try:
        return PrivacyLedger(run_dir / LEDGER_FILE, header)
    except LedgerMismatchError as err:
        raise UserError(f"cannot continue this run directory: {err}") from None


def mechanism_randomness(cfg: DictConfig, device: torch.device, parallel: DataParallel) -> MechanismRandomness:
    """Secret lot and noise generators; all ranks share rank 0's (they must draw the same lots)."""
    seed = cfg.privacy.get("mechanism_seed")
    randomness = MechanismRandomness(None if seed is None else int(seed), device, secure=bool(cfg.privacy.secure_noise))
    share_rank0_randomness(randomness, parallel)
    return randomness


def share_rank0_randomness(randomness: MechanismRandomness, parallel: DataParallel) -> None:
    """Every rank takes rank 0's generator states: all ranks must draw the same lots."""
    if parallel.world_size > 1:
        randomness.load_state_dict(parallel.broadcast_object(randomness.state_dict() if parallel.is_main else None))


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Train, evaluate and write the run's artifacts; returns the summary (None on ranks > 0)."""
    validate_config(cfg)  # types, ranges and choices: before any data, tokenizer or model is read
    version, command = code_version(), redact(command_line())  # of the code that starts the run
    if cfg.trainer.num_threads:
        torch.set_num_threads(int(cfg.trainer.num_threads))
    torch.manual_seed(int(cfg.seed))
    device = resolve_device(cfg.trainer.device)
    parallel = init_data_parallel(device.type)
    # Every rank writes into rank 0's directory (Hydra's timestamps may differ between ranks).
    run_dir = Path(parallel.broadcast_object(str(run_dir)) if parallel.world_size > 1 else run_dir)
    if parallel.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    autocast = autocast_factory(cfg.trainer.precision, device)
    diagnostics = bool(cfg.logging.nonprivate_diagnostics)
    progress = bool(cfg.logging.progress)
    private = bool(cfg.optimizer.private)
    validate = bool(cfg.eval.get("validation", True))

    # ---- data and model -------------------------------------------------------------------
    # Data first: input errors surface before any model is built or downloaded.
    with blamed_on("model.tokenizer", cfg.model.tokenizer):
        tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.get("bpe_merges"))
    with blamed_on("model.name_or_path", cfg.model.name_or_path):
        max_length = context_length(cfg.model)
    data = prepare_data(cfg.dataset, cfg.data, tokenizer, max_length, log)
    pad_id = tokenizer.pad_token_id

    # ---- privacy plan: q, steps and σ are fixed before step 1 ------------------------------
    plan = make_plan(
        private=private,
        dataset_size=len(data.train),
        expected_lot_size=int(cfg.privacy.expected_lot_size),
        epochs=cfg.trainer.epochs,
        steps=cfg.trainer.steps,
        target_epsilon=float(cfg.privacy.target_epsilon),
        delta=float(cfg.privacy.delta),
        accountant=str(cfg.privacy.accountant),
        noise_multiplier=cfg.privacy.noise_multiplier,
    )
    if private:
        log(
            f"privacy plan: N={plan.dataset_size:,}, q={plan.sample_rate:.5f}, {plan.steps} steps, "
            f"σ={plan.noise_multiplier:.4f} → ε={plan.planned_epsilon:.4f} ≤ {plan.target_epsilon} at δ={plan.delta:g} "
            f"(δ·N={plan.delta_times_n:.3g}, {plan.accountant})"
        )
    else:
        log(f"NON-PRIVATE reference run: N={plan.dataset_size:,}, {plan.steps} steps, no clipping, no noise")

    # The model only after the plan: δ < 1/N and the other plan checks need only N.
    with blamed_on("model.name_or_path", cfg.model.name_or_path):
        model = build_model(cfg.model, tokenizer, seed=int(cfg.seed)).to(device)
    # Recorded before any checkpoint is loaded: the starting point of the run, resumed or not.
    initial_weights = weights_fingerprint(model)

    # ---- the mechanism and the optimizer ---------------------------------------------------
    # The mechanism's randomness is secret (never from `seed`); `seed` drives what is public.
    randomness = mechanism_randomness(cfg, device, parallel)
    generators = {"probes": torch.Generator(device=device).manual_seed(int(cfg.seed) * 3 + 3)}
    matrices = hidden_matrices(model)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ledger = open_ledger(cfg, run_dir, plan, data, parallel)
    noise = GaussianNoise(randomness.noise, secure=randomness.secure)
    partition, accountant, release = build_release(cfg, model, named, matrices, plan, noise, parallel, ledger)
    optimizer = build_optimizer(
        cfg.optimizer.kind,
        OptimizerInputs(params=named, hidden_matrices=matrices, release_noise_std=release.release_noise_std(), generator=generators["probes"]),
        OmegaConf.to_container(cfg.optimizer, resolve=True),
    )
    sampling = cfg.privacy.sampling if private else "poisson"
    sampler = build_lot_sampler(sampling, plan.dataset_size, plan.expected_lot_size, randomness.sampler, secure=randomness.secure)
    with blamed_on("optimizer.warmup_steps", cfg.optimizer.warmup_steps):
        scheduler = build_scheduler(optimizer, cfg.optimizer.schedule, plan.steps, int(cfg.optimizer.warmup_steps))
    muon = getattr(optimizer, "parts", {}).get("muon")
    matrix_name = {p: n for n, p in named.items()}
    oracle = build_oracle(cfg, muon, matrix_name, release, parallel)

    # ---- resume ----------------------------------------------------------------------------
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    ckpt_path, mech_path = run_dir / CHECKPOINT_FILE, run_dir / MECHANISM_STATE_FILE
    state = load_checkpoint(ckpt_path)
    start_step, train_seconds, logger_id = 0, 0.0, None
    if state is not None:
        check_resume_compatible(state["plan"], plan)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        rng_restore(state["rng"], generators)
        start_step, train_seconds, logger_id = state["step"], state.get("train_seconds", 0.0), state.get("logger_id")
    if private:
        restore_mechanism(randomness, sampler, release, mech_path, start_step, ledger, parallel)
    if state is not None or (ledger is not None and ledger.releases):
        log(f"resumed from step {start_step} of {plan.steps}" + (f", ε so far {accountant.epsilon():.4f} (from the ledger)" if accountant else ""))
    config = public_config(cfg)
    if parallel.is_main:
        moved = metrics.set_aside_after(start_step)
        if moved:
            log(f"{moved} metrics row(s) past step {start_step} moved to {metrics.superseded_path.name} (superseded, not deleted)")
        logger = build_logger(cfg.logger, run_dir, {**config, "plan": plan.as_dict()}, logger_id, run_dir.name, per_step=diagnostics)
    else:
        logger = NullLogger()

    def save_mechanism(step: int) -> None:
        save_mechanism_state(mech_path, step, {"randomness": randomness.state_dict(), "sampler": sampler.state_dict()})

    def checkpoint(step: int) -> None:
        if not parallel.is_main:
            return
        if private:  # the secret half first: a checkpoint never exists without its mechanism state
            save_mechanism(step)
        save_checkpoint(
            ckpt_path,
            {
                "step": step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng_snapshot(generators),
                "plan": plan.as_dict(),
                **({"train_seconds": train_seconds} if diagnostics else {}),
                "logger_id": logger.run_id,
            },
        )

    if private and start_step == 0 and parallel.is_main:  # a kill before the first checkpoint can still replay
        save_mechanism(0)

    def next_lot() -> list[int]:
        lot = sampler.next_lot()
        if parallel.world_size > 1 and randomness.secure:  # CSPRNG lots differ per rank: rank 0's counts
            lot = parallel.broadcast_object(lot if parallel.is_main else None)
        return lot

    # Under bf16 a kernel's rounding depends on the batch shape: fixed shapes keep each example's
    # clipped contribution independent of the rest of the lot (see training/batching.py).
    fixed_shape = private and fixed_batch_shape(cfg, resolve_precision(cfg.trainer.precision, device))
    fixed_width = min(int(cfg.dataset.max_length), context_length(cfg.model)) if fixed_shape else None

    def lot_batches(lot: list[int]):
        shard = parallel.shard(lot)
        for batch in lot_micro_batches(data.train, shard, int(cfg.trainer.micro_batch_size), pad_id, fixed_width=fixed_width, fixed_rows=fixed_shape):
            yield {k: v.to(device) for k, v in batch.items()}

    def loss_fn(m, batch):
        with autocast():
            return per_example_lm_loss(m, batch)

    def release_step(step: int):
        """Sample a lot and release it; a replay that cannot reproduce its output is redone fresh."""
        try:
            return release.release(lot_batches(next_lot()), loss_fn, step)
        except ReplayMismatchError as err:
            log(f"{err}; redrawing lot and noise from fresh OS entropy (charged as a new release)")
            randomness.reseed_from_os_entropy()
            share_rank0_randomness(randomness, parallel)  # ranks must keep drawing one lot
            release.noise_may_repeat = False
            return release.release(lot_batches(next_lot()), loss_fn, step)

    def validation_nll() -> float:
        return token_nll(model, data.valid, pad_id, int(cfg.eval.batch_size) * 4, device, autocast, progress, "valid nll")

    # ---- training --------------------------------------------------------------------------
    model.train()
    eval_every, ckpt_every = (int(cfg.trainer.eval_every) if validate else 0), int(cfg.trainer.checkpoint_every)
    eps_every = max(1, int(cfg.logging.epsilon_every))
    noise_std = release_noise_std_stats(release, plan) if private else {}
    stop_reason, last_step = None, start_step
    with StopRequest() as stop:
        bar = tqdm(
            range(start_step + 1, plan.steps + 1), desc="train", disable=not (progress and parallel.is_main), initial=start_step, total=plan.steps,
            # Without diagnostics the bar shows no rate or elapsed time: step time reveals the lot size.
            bar_format=None if diagnostics else "{l_bar}{bar}| {n_fmt}/{total_fmt}",
        )
        for step in bar:
            if accountant and not within_budget(accountant, plan):
                stop_reason = f"budget guard: releasing step {step} would exceed ε={plan.target_epsilon} (ε spent {accountant.epsilon():.4f})"
                log(f"{stop_reason}; stopping")
                checkpoint(last_step)
                break
            t0 = time.perf_counter()
            try:
                stats = release_step(step)
            except NonFiniteReleaseError as err:
                raise UserError(f"step {step}: {err}") from None
            oracle_fields = oracle.step() if oracle else {}  # before the optimizer moves the weights
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            broken = [n for n, p in named.items() if not torch.isfinite(p).all()]
            if broken:  # stop before a checkpoint could save the broken weights
                raise UserError(f"step {step}: parameters became non-finite ({broken[0]}, …); lower the learning rate")
            elapsed = time.perf_counter() - t0
            train_seconds += elapsed
            last_step = step

            row: dict[str, Any] = {"step": step, "lr": optimizer.param_groups[0]["lr"]}
            if accountant and (step % eps_every == 0 or step == plan.steps):
                row["epsilon"] = accountant.epsilon()
            if private:
                row.update(noise_std)  # (a replayed, uncharged release is marked in the ledger)
            if muon is not None and private:
                snr = {matrix_name[p]: v for p, v in muon.snr.items()}
                row["snr"] = snr
                row["snr_median"] = statistics.median(snr.values())
            if diagnostics:
                row.update(diagnostic_fields(stats, partition, private), **oracle_fields, step_seconds=elapsed)
            evaluated = bool(eval_every and step % eval_every == 0) or (validate and step == plan.steps)
            if parallel.is_main and evaluated:
                row["val_nll"] = validation_nll()
            logger.log(_finite(row), publish=evaluated or step == plan.steps)
            bar.set_postfix({k: f"{row[k]:.4g}" for k in ("train_loss", "val_nll", "epsilon") if row.get(k) is not None})

            scheduler.step()  # after the row: it logs the rate this step used
            stopping = stop.requested(parallel)
            if (ckpt_every and step % ckpt_every == 0) or step == plan.steps or stopping:
                checkpoint(step)
            if stopping:
                logger.finish()
                log(f"checkpointed at step {step}; resume with: python -m dpmuon.train resume={run_dir}")
                raise SystemExit(128 + (stop.signum or signal.SIGTERM))
        bar.close()
    release.close()
    if not parallel.is_main:  # rank 0 evaluates and writes the artifacts
        return None

    # ---- evaluation ------------------------------------------------------------------------
    if cfg.eval.test:
        log("evaluating on the test set")
        test_nll = token_nll(model, data.test, pad_id, int(cfg.eval.batch_size) * 4, device, autocast, progress, "test nll")
        generations = decode(model, tokenizer, [item.source for item in data.test_items], cfg.eval, device, autocast, progress)
        atomic_write(run_dir / "generations.txt", lambda f: f.write("".join(g.replace("\n", " ") + "\n" for g in generations).encode()))
        scores = score(generations, [item.references for item in data.test_items])
    else:  # e.g. learning-rate tuning on the validation split: the test set stays unseen
        test_nll, scores = None, dict.fromkeys(SCORE_KEYS)
    if cfg.trainer.save_model:
        model.save_pretrained(run_dir / "model")
        tokenizer.save_pretrained(run_dir / "model")

    summary = {
        "dataset": cfg.dataset.name,
        "optimizer": cfg.optimizer.name,
        "model": cfg.model.name,
        "seed": int(cfg.seed),
        "private": private,
        "target_epsilon": plan.target_epsilon,
        "epsilon": accountant.epsilon() if accountant else None,
        "delta": plan.delta,
        "delta_times_n": plan.delta_times_n,
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate,
        "expected_lot_size": plan.expected_lot_size,
        "dataset_size": plan.dataset_size,
        "steps": last_step,
        "planned_steps": plan.steps,
        "releases_charged": accountant.steps if accountant else None,
        "stopped_by_budget_guard": stop_reason is not None,
        "stop_reason": stop_reason,
        "mechanism_randomness": randomness.source if private else None,
        "data_fingerprint": data.train_source,
        "validation_split": validation_split(cfg) if validate else None,
        "accountant": plan.accountant,
        "clip_mode": cfg.privacy.clip_mode if private else None,
        "clip_norm": float(cfg.privacy.clip_norm) if private else None,
        "sampling": sampling,
        "engine": cfg.privacy.engine if private else None,
        "world_size": parallel.world_size,
        "tied_lm_head": lm_head_is_tied(model),
        "initial_weights_sha256": initial_weights,
        "final_weights_sha256": weights_fingerprint(model),
        "test_nll": test_nll,
        "val_nll": _last(metrics.rows(), "val_nll"),
        **{key: scores[key] for key in SCORE_KEYS},
        "test_sources": len(data.test_items) if cfg.eval.test else 0,
        **({"train_seconds": train_seconds} if diagnostics else {}),
        "git_commit": version,
        "command": command,
        "run_dir": str(run_dir),
    }
    atomic_write_json(run_dir / "summary.json", summary)
    logger.summary(summary)
    figures = write_curves([Run(run_dir, summary)], run_dir / "curves")
    logger.images({f"curves/{path.stem}": path for path in figures})
    logger.finish()
    if not cfg.trainer.keep_checkpoint:
        ckpt_path.unlink(missing_ok=True)
    if not cfg.privacy.get("keep_mechanism_state", False):
        mech_path.unlink(missing_ok=True)  # the run is complete: nothing left to replay
    shown = {k: summary[k] for k in ("test_nll", "val_nll", "bleu", "rouge_l", "epsilon") if summary[k] is not None}
    log("done: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()) + f" → {run_dir}")
    return summary


def restore_mechanism(randomness, sampler, release, path: Path, step: int, ledger, parallel: DataParallel) -> None:
    """Continue the mechanism's secret draws from `step`, or start fresh ones if they are gone.

    With the saved state, re-run steps replay their lots and noise (an identical output is
    free). Without it, nothing may be replayed: new secret draws, and every re-run step is a
    new, charged release.
    """
    saved = load_mechanism_state(path, step) if parallel.is_main else None
    if parallel.world_size > 1:
        saved = parallel.broadcast_object(saved)
    if saved is not None:
        randomness.load_state_dict(saved["randomness"])
        sampler.load_state_dict(saved["sampler"])
        return
    resuming = step > 0 or (ledger is not None and ledger.releases)
    if resuming:
        if not randomness.secure:
            log(f"no mechanism state for step {step} in {path.name}: drawing fresh secret randomness; re-run steps are charged")
        randomness.reseed_from_os_entropy()
        share_rank0_randomness(randomness, parallel)
        release.noise_may_repeat = False


def build_oracle(cfg: DictConfig, muon, names: dict, release, parallel: DataParallel) -> OracleAlignment | None:
    """logging.oracle_alignment: the noise-free buffer beside the real one (non-private)."""
    if not cfg.logging.get("oracle_alignment", False):
        return None
    if not cfg.logging.nonprivate_diagnostics:
        raise UserError("logging.oracle_alignment=true needs logging.nonprivate_diagnostics=true: it is computed from the noise-free private signal")
    if muon is None or not cfg.optimizer.private:
        raise UserError(f"logging.oracle_alignment=true needs a private Muon-family optimizer; got optimizer={cfg.optimizer.name}")
    if parallel.world_size > 1:
        raise UserError("logging.oracle_alignment=true runs in one process only (each rank sees only its shard's clipped sum)")
    oracle = OracleAlignment(muon, names, release.release_noise_std(), seed=int(cfg.seed))
    release.observe_noise_free = oracle.observe
    return oracle


def fixed_batch_shape(cfg: DictConfig, precision: str) -> bool:
    """trainer.fixed_batch_shape: auto means on exactly when the forward runs in bf16."""
    setting = cfg.trainer.get("fixed_batch_shape", "auto")
    return precision == "bf16" if setting == "auto" else bool(setting)


def validation_split(cfg: DictConfig) -> str:
    """Whether the validation NLL is covered: a private set's own validation split is not."""
    return "public" if cfg.eval.get("validation_split", "private") == "public" else "private (not covered)"


def public_config(cfg: DictConfig) -> dict:
    """The resolved config as it may be published (W&B): without the mechanism seed's value."""
    config = OmegaConf.to_container(cfg, resolve=True)
    if config.get("privacy", {}).get("mechanism_seed") is not None:
        config["privacy"]["mechanism_seed"] = REDACTED
    return config


def release_noise_std_stats(release: Privatizer, plan) -> dict[str, float]:
    """Per-entry noise std of g̃ that the privatizer uses, over blocks (they differ when
    thresholds differ under proportional allocation)."""
    stds = sorted(s / plan.expected_lot_size for s in release.block_stds)
    return {"noise_std": statistics.median(stds), "noise_std_min": stds[0], "noise_std_max": stds[-1]}


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


def within_budget(accountant: PrivacyAccountant, plan) -> bool:
    """Would one more release keep ε ≤ target?

    While the ledger is the plan's own (σ, q) and stays within its steps, ε is bounded by the
    planned ε, which make_plan verified — no accountant call needed. Anything else (a ledger
    from elsewhere) is checked exactly.
    """
    history = accountant.history
    on_plan = all((s, q) == (plan.noise_multiplier, plan.sample_rate) for s, q, _ in history)
    if on_plan and accountant.steps + 1 <= plan.steps:
        return True
    return accountant.epsilon_with(1, plan.noise_multiplier, plan.sample_rate) <= plan.target_epsilon


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
    values = [r[key] for r in rows if r.get(key) is not None]
    return values[-1] if values else None
