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

from ..data import collate, load_tokenizer
from ..errors import UserError
from ..eval.curves import write_curves
from ..eval.metrics import score
from ..eval.runs import Run
from ..models import build_model, context_length, hidden_matrices, lm_head_is_tied, per_example_lm_loss, weights_fingerprint
from ..optim import OptimizerInputs, build_optimizer
from ..privacy import (
    GaussianNoise,
    NonFiniteReleaseError,
    NonPrivateRelease,
    PrivacyAccountant,
    Privatizer,
    build_lot_sampler,
    build_partition,
)
from ..privacy.blocks import partition_summary
from ..privacy.distributed import DataParallel, init_data_parallel
from .checkpoint import CHECKPOINT_FILE, load_checkpoint, rng_restore, rng_snapshot, save_checkpoint
from .data import prepare_data
from .evaluation import decode, token_nll
from .loggers import NullLogger, build_logger
from .plan import check_resume_compatible, make_plan
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


def autocast_factory(precision: str, device: torch.device):
    """bf16 autocast for the model's forward on GPU; clipping, noise and optimizer stay fp32."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
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


def build_release(cfg: DictConfig, model, named: dict, matrices: dict, plan, noise_generator, parallel: DataParallel):
    """The mechanism of the plan: (partition, accountant, privatizer), or the non-private release."""
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
    privatizer = Privatizer(
        model,
        partition,
        noise_multiplier=plan.noise_multiplier,
        expected_lot_size=plan.expected_lot_size,
        sample_rate=plan.sample_rate,
        accountant=accountant,
        noise=GaussianNoise(noise_generator, secure=bool(cfg.privacy.secure_noise)),
        noise_allocation=cfg.privacy.noise_allocation,
        engine=cfg.privacy.engine,
        parallel=parallel,
    )
    return partition, accountant, privatizer


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Train, evaluate and write the run's artifacts; returns the summary (None on ranks > 0)."""
    version, command = code_version(), command_line()  # of the code that starts the run
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
    progress = bool(cfg.logging.progress)
    diagnostics = bool(cfg.logging.nonprivate_diagnostics)
    private = bool(cfg.optimizer.private)

    # ---- data and model -------------------------------------------------------------------
    # Data first: input errors surface before any model is built or downloaded.
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.get("bpe_merges"))
    data = prepare_data(cfg.dataset, cfg.data, tokenizer, context_length(cfg.model), log)
    model = build_model(cfg.model, tokenizer, seed=int(cfg.seed)).to(device)
    # Recorded before any checkpoint is loaded: the starting point of the run, resumed or not.
    initial_weights = weights_fingerprint(model)
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
            f"σ={plan.noise_multiplier:.4f} → ε={plan.planned_epsilon:.4f} ≤ {plan.target_epsilon} at δ={plan.delta:g} ({plan.accountant})"
        )
    else:
        log(f"NON-PRIVATE reference run: N={plan.dataset_size:,}, {plan.steps} steps, no clipping, no noise")

    # ---- the mechanism and the optimizer ---------------------------------------------------
    generators = {
        "sampler": torch.Generator().manual_seed(int(cfg.seed) * 3 + 1),
        "noise": torch.Generator(device=device).manual_seed(int(cfg.seed) * 3 + 2),
        "probes": torch.Generator(device=device).manual_seed(int(cfg.seed) * 3 + 3),
    }
    matrices = hidden_matrices(model)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    partition, accountant, release = build_release(cfg, model, named, matrices, plan, generators["noise"], parallel)
    noise_std = release.release_noise_std()
    optimizer = build_optimizer(
        cfg.optimizer.kind,
        OptimizerInputs(params=named, hidden_matrices=matrices, release_noise_std=noise_std, generator=generators["probes"]),
        OmegaConf.to_container(cfg.optimizer, resolve=True),
    )
    sampling = cfg.privacy.sampling if private else "poisson"
    sampler = build_lot_sampler(sampling, plan.dataset_size, plan.expected_lot_size, generators["sampler"])
    muon = getattr(optimizer, "parts", {}).get("muon")
    matrix_name = {p: n for n, p in named.items()}

    # ---- resume ----------------------------------------------------------------------------
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    ckpt_path = run_dir / CHECKPOINT_FILE
    state = load_checkpoint(ckpt_path)
    start_step, train_seconds, logger_id = 0, 0.0, None
    if state is not None:
        check_resume_compatible(state["plan"], plan)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        rng_restore(state["rng"], generators)
        if accountant is not None:
            accountant.load_state_dict(state["accountant"])
            if accountant.steps != state["step"]:
                raise UserError(f"checkpoint inconsistent: {accountant.steps} accounted steps at step {state['step']}")
        start_step, train_seconds, logger_id = state["step"], state["train_seconds"], state.get("logger_id")
        log(f"resumed from step {start_step} of {plan.steps}" + (f", ε so far {accountant.epsilon():.4f}" if accountant else ""))
    config = OmegaConf.to_container(cfg, resolve=True)
    if parallel.is_main:
        metrics.truncate_after(start_step)
        logger = build_logger(cfg.logger, run_dir, {**config, "plan": plan.as_dict()}, logger_id, run_dir.name)
    else:
        logger = NullLogger()

    def checkpoint(step: int) -> None:
        if not parallel.is_main:
            return
        save_checkpoint(
            ckpt_path,
            {
                "step": step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "sampler": sampler.state_dict(),
                "rng": rng_snapshot(generators),
                "accountant": accountant.state_dict() if accountant else None,
                "plan": plan.as_dict(),
                "train_seconds": train_seconds,
                "logger_id": logger.run_id,
            },
        )

    def lot_batches(lot: list[int]):
        # Similar lengths together means less padding; the sum over the lot is order-free.
        lot = sorted(parallel.shard(lot), key=lambda i: len(data.train[i].input_ids))
        size = int(cfg.trainer.micro_batch_size)
        for i in range(0, len(lot), size):
            batch = collate([data.train[j] for j in lot[i : i + size]], pad_id)
            yield {k: v.to(device) for k, v in batch.items()}

    def loss_fn(m, batch):
        with autocast():
            return per_example_lm_loss(m, batch)

    def validation_nll() -> float:
        return token_nll(model, data.valid, pad_id, int(cfg.eval.batch_size) * 4, device, autocast, progress, "valid nll")

    # ---- training --------------------------------------------------------------------------
    model.train()
    eval_every, ckpt_every = int(cfg.trainer.eval_every), int(cfg.trainer.checkpoint_every)
    eps_every = max(1, int(cfg.logging.epsilon_every))
    stopped_by_guard = False
    with StopRequest() as stop:
        bar = tqdm(
            range(start_step + 1, plan.steps + 1), desc="train", disable=not (progress and parallel.is_main), initial=start_step, total=plan.steps
        )
        for step in bar:
            if accountant and not within_budget(accountant, plan):
                log(f"budget guard: step {step} would exceed ε={plan.target_epsilon}; stopping")
                stopped_by_guard = True
                break
            t0 = time.perf_counter()
            lot = sampler.next_lot()
            try:
                stats = release.release(lot_batches(lot), loss_fn)
            except NonFiniteReleaseError as err:
                raise UserError(f"step {step}: {err}") from None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            broken = [n for n, p in named.items() if not torch.isfinite(p).all()]
            if broken:  # stop before a checkpoint could save the broken weights
                raise UserError(f"step {step}: parameters became non-finite ({broken[0]}, …); lower the learning rate")
            elapsed = time.perf_counter() - t0
            train_seconds += elapsed

            row: dict[str, Any] = {"step": step, "lr": optimizer.param_groups[0]["lr"]}
            if accountant and (step % eps_every == 0 or step == plan.steps):
                row["epsilon"] = accountant.epsilon()
            if private:
                row["noise_std"] = plan.noise_multiplier * partition.sensitivity / plan.expected_lot_size
            if muon is not None and private:
                snr = {matrix_name[p]: v for p, v in muon.snr.items()}
                row["snr"] = snr
                row["snr_median"] = statistics.median(snr.values())
            if diagnostics:
                row.update(train_loss=stats.train_loss, lot_size=stats.lot_size, step_seconds=elapsed)
                if private:
                    row.update(mean_grad_norm=stats.mean_grad_norm, nonfinite_examples=stats.nonfinite)
                    fractions = stats.clip_fraction()
                    if fractions:
                        row["clip_fraction"] = sum(fractions) / len(fractions)
                        row["clip_fraction_by_block"] = {b.name: f for b, f in zip(partition.blocks, fractions)}
            if parallel.is_main and ((eval_every and step % eval_every == 0) or step == plan.steps):
                row["val_nll"] = validation_nll()
            logger.log(_finite(row))
            bar.set_postfix({k: f"{row[k]:.4g}" for k in ("train_loss", "val_nll", "epsilon") if row.get(k) is not None})

            stopping = stop.requested(parallel)
            if (ckpt_every and step % ckpt_every == 0) or step == plan.steps or stopping:
                checkpoint(step)
            if stopping:
                logger.finish()
                log(f"checkpointed at step {step}; resume with: python -m dpmuon.train resume={run_dir}")
                raise SystemExit(128 + (stop.signum or signal.SIGTERM))
        bar.close()
    release.close()
    final_step = accountant.steps if accountant else plan.steps
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
        test_nll, scores = None, dict.fromkeys(("bleu", "bleu_single_ref", "rouge_l", "metric_implementations"))
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
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate,
        "expected_lot_size": plan.expected_lot_size,
        "dataset_size": plan.dataset_size,
        "steps": final_step,
        "planned_steps": plan.steps,
        "stopped_by_budget_guard": stopped_by_guard,
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
        "bleu": scores["bleu"],
        "bleu_single_ref": scores["bleu_single_ref"],
        "rouge_l": scores["rouge_l"],
        "metric_implementations": scores["metric_implementations"],
        "test_sources": len(data.test_items) if cfg.eval.test else 0,
        "train_seconds": train_seconds,
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
    shown = {k: summary[k] for k in ("test_nll", "val_nll", "bleu", "rouge_l", "epsilon") if summary[k] is not None}
    log("done: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()) + f" → {run_dir}")
    return summary


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
