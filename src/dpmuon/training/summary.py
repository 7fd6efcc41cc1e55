"""A run's summary.json (eval/runs.py's `RunSummary`, the one reader): what was run, what it cost
in privacy, what it scored, and which values outside the guarantee its published record holds;
and `finish`, which writes it with the rest of what a finished run leaves."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from omegaconf import DictConfig

from .. import run_folder
from ..eval.curves import write_curves
from ..eval.metrics import SCORE_KEYS
from ..eval.runs import Run, RunSummary, learning_rates
from ..models import is_lora, lm_head_is_tied, save_adapter, weights_fingerprint
from ..outcomes import NON_FINITE
from ..privacy import MechanismRandomness
from ..privacy.randomness import PUBLISHED_SEED, USER_SEED
from ..privacy.state import ledger_record
from .run_files import atomic_write_json, repo_relative
from .run_parts import Training
from .runtime import log


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
        strategy=t.cfg.trainer.get("strategy", "ddp"),
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
        widths=[list(bucket) for bucket in t.plan.widths] if t.plan.widths else None,
        length_noise_multiplier=t.plan.length_noise_multiplier,
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


def validation_split(cfg: DictConfig) -> str:
    """Whether the validation NLL is covered: a private set's own validation split is not."""
    return "public" if cfg.eval.get("validation_split", "private") == "public" else "private (not covered)"


def nonprivate_values_logged(t: Training) -> list[str]:
    """The names of the values outside the guarantee that the run's published record holds: those
    of `diagnostic_fields`, the step and train times, and the oracle's fields ("oracle_*")."""
    if not t.publish_diagnostics:
        return []
    names = ["train_loss", "lot_size"]
    if t.private:
        names += ["mean_grad_norm", "nonfinite_examples", "clip_fraction", "clip_fraction_by_block"]
    return names + ["step_seconds", "train_seconds"] + (["oracle_*"] if t.oracle is not None else [])


def _last(rows: list[dict], key: str):
    """The last logged value of `key`: None when it was non-finite (logged as null), not an older one."""
    values = [r[key] for r in rows if key in r]
    return values[-1] if values else None
