"""`python -m dpmuon.train`: compose the config with Hydra and run one training job.

    python -m dpmuon.train experiment=smoke optimizer=dp_muonbc dataset=e2e logger=none
    python -m dpmuon.train resume=outputs/smoke/e2e/dp_muonbc/seed0_...   # continue a killed run
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .config import roster
from .config.schema import one_line, validate
from .data import DataError
from .errors import UserError
from .training.redact import SECRET_KEY, hydra_files, install_log_redaction, scrub_files

CONFIG_DIR = str(roster.CONFIG_DIR)


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
    if given_mechanism_seed(run_dir):
        from .training.mechanism_state import has_saved_state

        if not has_saved_state(run_dir):
            raise UserError(
                f"cannot resume {run_dir}: it was started with privacy.mechanism_seed, whose value is never stored, "
                "and it stopped before saving the mechanism state that carries it on, so a resume would silently "
                "draw other lots and noise. Start it again with its original command, seed included"
            )
    resumed = OmegaConf.load(stored)
    resumed.resume = str(run_dir)
    return resumed, run_dir


def given_mechanism_seed(run_dir: Path) -> bool:
    """Whether the run's recorded overrides set privacy.mechanism_seed (to a value, now redacted)."""
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if not overrides.exists():
        return False
    # Unresolved: the value may be an interpolation of a variable this process does not have.
    recorded = OmegaConf.to_container(OmegaConf.load(overrides), resolve=False)
    parsed = OverridesParser.create().parse_overrides([str(o) for o in recorded])
    return any(o.key_or_group.endswith(SECRET_KEY) and o.value() is not None for o in parsed)


def protect_mechanism_seed(cfg: DictConfig) -> None:
    """Scrub a user mechanism seed from Hydra's records; warn when a multirun's jobs share one."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    sweep_dir = Path(hydra_cfg.sweep.dir) if multirun else None
    if multirun and cfg.privacy.get("mechanism_seed") is not None and hydra_cfg.job.num == 0:
        shared = jobs_per_mechanism_seed(list(hydra_cfg.overrides.task), sweep_dir / "multirun.yaml")
        if shared > 1:
            warnings.warn(
                f"this multirun gives ~{shared:g} jobs each privacy.mechanism_seed value: jobs with the same value "
                "draw the same lots and the same noise, so the difference of two of their releases is noise-free "
                "and their guarantees do not compose (see README, 'Mechanism randomness')",
                stacklevel=2,
            )
    scrub_files(hydra_files(Path(hydra_cfg.runtime.output_dir), sweep_dir))


def jobs_per_mechanism_seed(job_overrides: list[str], multirun_yaml: Path) -> float:
    """Jobs of the sweep per distinct mechanism-seed value (from the sweep's own overrides)."""
    overrides = job_overrides
    if multirun_yaml.exists():
        overrides = list(OmegaConf.load(multirun_yaml).hydra.overrides.task)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # an override this check cannot read: assume the worst, that jobs share seeds
        return math.inf
    jobs, seeds = 1, 1
    for override in parsed:
        values = len(list(override.sweep_string_iterator())) if override.is_sweep_override() else 1
        jobs *= values
        if override.key_or_group.endswith(SECRET_KEY):
            seeds = values
    return jobs / seeds


def show_tracebacks() -> bool:
    """`HYDRA_FULL_ERROR=1` (or `--debug`) shows the traceback behind a one-line error."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def exit_with_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    protect_mechanism_seed(cfg)
    try:
        cfg, run_dir = resolve_run(cfg)
        validate(cfg)  # a bad value fails in a second, before torch is even imported
        from .training.loop import run  # heavy imports after the config is known to be usable

        summary = run(cfg, run_dir)
    except (UserError, DataError) as err:
        if show_tracebacks():
            raise
        exit_with_error(str(err))
    except (ValueError, TypeError, OSError) as err:
        # From a configured value that no check foresaw (the config is validated first).
        if show_tracebacks():
            raise
        exit_with_error(f"{type(err).__name__}: {one_line(err)}; see python -m dpmuon.train --options")
    # Multirun sweepers (e.g. Optuna) minimise the returned value; ranks > 0 return None.
    return summary.get("val_nll") if summary else None


def cli() -> None:
    """`--options` lists the options; `--debug` keeps tracebacks; the rest goes to Hydra."""
    if "--options" in sys.argv[1:]:
        from .config.options import describe_options

        print(describe_options(CONFIG_DIR))
        return
    if "--debug" in sys.argv[1:]:
        sys.argv.remove("--debug")
        os.environ["HYDRA_FULL_ERROR"] = "1"
    install_log_redaction()  # before Hydra logs the overrides of a multirun's jobs
    main()


if __name__ == "__main__":
    cli()
