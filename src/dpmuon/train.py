"""`python -m dpmuon.train`: compose the config with Hydra and run one training job.

    python -m dpmuon.train experiment=smoke optimizer=dp_muonbc dataset=e2e logger=none
    python -m dpmuon.train resume=outputs/smoke/e2e/dp_muonbc/seed0_...   # continue a killed run
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .data import DataError
from .errors import UserError

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def resolve_run(cfg: DictConfig) -> tuple[DictConfig, Path]:
    """The config and directory to run in: a fresh Hydra run, or the stored run to resume."""
    if cfg.resume is None:
        return cfg, Path(HydraConfig.get().runtime.output_dir)
    run_dir = Path(cfg.resume)
    stored = run_dir / ".hydra" / "config.yaml"
    if (run_dir / "summary.json").exists():
        raise UserError(f"{run_dir} already finished (summary.json exists); nothing to resume")
    if not stored.exists():
        raise UserError(f"cannot resume {run_dir}: {stored} not found (is this a dpmuon run directory?)")
    resumed = OmegaConf.load(stored)
    resumed.resume = str(run_dir)
    return resumed, run_dir


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    from .training.loop import run  # heavy imports after Hydra has parsed the command line

    try:
        cfg, run_dir = resolve_run(cfg)
        summary = run(cfg, run_dir)
    except (UserError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    # Multirun sweepers (e.g. Optuna) minimise the returned value; ranks > 0 return None.
    return summary.get("val_nll") if summary else None


if __name__ == "__main__":
    main()
