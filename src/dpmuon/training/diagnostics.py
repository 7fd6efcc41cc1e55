"""The driver's non-private diagnostics: where logging.nonprivate_diagnostics sends them, the raw
lot's quantities each step computes, and the oracle alignment (logging.oracle_alignment) built
from the run's config and restored on resume. The oracle itself reads no config, like the
optimizers and the mechanism: dpmuon/diagnostics/."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from ..diagnostics import OracleAlignment
from ..errors import UserError
from ..privacy.distributed import DataParallel
from .runtime import log


def diagnostics_mode(cfg: DictConfig) -> str:
    """logging.nonprivate_diagnostics as "false", "file" or "publish" (true: publish, as it used to)."""
    setting = cfg.logging.nonprivate_diagnostics
    if setting is True or setting is False:
        return "publish" if setting else "false"
    return str(setting)


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


def restore_oracle(oracle: OracleAlignment, saved: dict | None, step: int) -> None:
    """The noise-free mirrors from the mechanism state restored at `step` (None: none was)."""
    if saved is not None and "oracle" in saved:
        oracle.load_state_dict(saved["oracle"])
    else:
        log(f"no oracle mirrors saved at step {step}: they restart from zero (rows from here on see only the steps since)")
