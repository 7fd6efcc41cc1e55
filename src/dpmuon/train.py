"""`python -m dpmuon.train`: compose the config with Hydra and run one training job.

python -m dpmuon.train experiment=smoke optimizer=dp_muonbc dataset=e2e logger=none
python -m dpmuon.train resume=outputs/smoke/e2e/dp_muonbc/seed0_...   # continue a killed run
"""

from __future__ import annotations

import errno
import logging
import math
import os
import sys
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
from .launch import carry_adjustments, prepare_launch
from .outcomes import (
    NON_FINITE,
    RUN_LOG,
    ExitWithError,
    Interrupted,
    also_log_to,
    continue_multirun,
    end_distributed_process,
    failed_jobs_summary,
    install_interrupt_handlers,
    output_folder_problem,
    say,
)
from .run_folder import NOT_A_RUN, STORED_CONFIG, is_finished
from .settings import check_settings_stored
from .training.secret import (
    MECHANISM_SEED_ENV,
    SEED_FILE_KEY,
    recorded_seed_use,
    refusal,
    seed_on_command_line,
    user_mechanism_secret,
)

CONFIG_DIR = str(roster.CONFIG_DIR)
# OSErrors that mean "this folder cannot be written", not a bad configured value.
WRITE_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.ENOTDIR, errno.EISDIR}


def resolve_run(cfg: DictConfig) -> tuple[DictConfig, Path]:
    """The config and directory to run in: a fresh Hydra run, or the stored run to resume."""
    if cfg.resume is None:
        return cfg, Path(HydraConfig.get().runtime.output_dir)
    run_dir = Path(cfg.resume)
    stored = run_dir / STORED_CONFIG
    if is_finished(run_dir):
        raise UserError(f"{run_dir} already finished (summary.json exists); nothing to resume")
    if not stored.exists():
        raise UserError(f"cannot resume {run_dir}: {stored} not found (is this a dpmuon run directory?)")
    resumed = OmegaConf.load(stored)
    if HydraConfig.initialized():  # the few settings a resume may change (launch.prepare_resume refused others)
        carry_adjustments(resumed, cfg, list(HydraConfig.get().overrides.task))
    resumed.resume = str(run_dir)
    check_resume_seed(resumed, run_dir)
    return resumed, run_dir


def check_resume_seed(cfg: DictConfig, run_dir: Path) -> None:
    """A resume draws from the run's own kind of randomness: a user seed or OS entropy.

    No file of the run holds a user seed: its saved mechanism state carries the draws on, and
    before that state exists (a stop during setup) only the seed given again can.
    """
    from .privacy.state import has_saved_state

    started_with_seed, given = recorded_seed_use(run_dir), user_mechanism_secret(cfg) is not None
    if started_with_seed is False and given:
        raise UserError(f"cannot resume {run_dir}: it was started without a user mechanism seed; unset {MECHANISM_SEED_ENV} to resume it")
    if started_with_seed and not given and not has_saved_state(run_dir):
        raise UserError(
            f"cannot resume {run_dir}: it was started with a user mechanism seed and stopped before saving the mechanism "
            f"state that carries it on, so a resume would silently draw other lots and noise; resume it with "
            f"{MECHANISM_SEED_ENV} set to that seed, or start it again with it"
        )


def warn_of_shared_seed(cfg: DictConfig) -> None:
    """Once per multirun: jobs given one user seed draw the same lots and the same noise."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or hydra_cfg.job.num != 0:
        return
    from_env = MECHANISM_SEED_ENV in os.environ
    if not from_env and cfg.privacy.get("mechanism_seed_file") is None:
        return
    shared = jobs_per_mechanism_seed(list(hydra_cfg.overrides.task), Path(hydra_cfg.sweep.dir) / "multirun.yaml", from_env)
    if shared > 1:
        given = MECHANISM_SEED_ENV if from_env else SEED_FILE_KEY
        print(
            f"[dpmuon] warning: ~{shared:g} jobs of this multirun share each mechanism seed ({given}): they draw the same "
            "lots and the same noise, so the difference of two of their releases is noise-free and their guarantees do "
            "not compose (see docs/privacy.md, 'Mechanism randomness is secret')",
            file=sys.stderr,
        )


def jobs_per_mechanism_seed(job_overrides: list[str], multirun_yaml: Path, from_env: bool) -> float:
    """Jobs of the sweep per distinct mechanism seed: all of them share the environment's seed,
    and each value of a swept privacy.mechanism_seed_file is one seed."""
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
        if override.key_or_group == SEED_FILE_KEY and not from_env:
            seeds = values
    return jobs / seeds


def show_tracebacks() -> bool:
    """`HYDRA_FULL_ERROR=1` (or `--debug`) shows the traceback behind a one-line error."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def exit_with_error(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    RUN_LOG.error(f"error: {message}")  # a failed run's train.log says why
    raise ExitWithError(message, code)


def resume_advice(run_dir: Path) -> str:
    """The resume command for `run_dir`, or why there is none (the checks a resume would make)."""
    if run_dir.is_dir() and {entry.name for entry in run_dir.iterdir()} <= set(NOT_A_RUN):
        return "it stopped before it trained: run the same command again"  # (a folder it created is removed at exit)
    try:
        resolve_run(OmegaConf.create({"resume": str(run_dir)}))
    except UserError as err:
        return f"no resume: {err}"
    return f"resume with: python -m dpmuon.train resume={run_dir}"


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
@continue_multirun
def main(cfg: DictConfig) -> float | None:
    given = cfg
    try:
        warn_of_shared_seed(cfg)
        cfg, run_dir = resolve_run(cfg)
        if run_dir.resolve() != Path(HydraConfig.get().runtime.output_dir).resolve():
            also_log_to(run_dir)
        validate(cfg)  # a bad value fails in a second, before torch is even imported
        from .training.loop import run  # heavy imports after the config is known to be usable
        from .training.runtime import ranks_from_slurm_tasks

        ranks_from_slurm_tasks()

        summary = run(cfg, run_dir)
    except Interrupted as stop:
        if not stop.said:  # (the training loop says it itself, after checkpointing)
            stopped = Path(given.resume) if given.resume else Path(HydraConfig.get().runtime.output_dir)
            say(f"interrupted by {stop.name}; {resume_advice(stopped)}", logging.WARNING)
            stop.said = True
        raise
    except (UserError, DataError) as err:
        if show_tracebacks():
            raise
        exit_with_error(str(err))
    except OSError as err:
        if show_tracebacks():
            raise
        if err.errno in WRITE_ERRORS:  # a read-only or full run folder, a file where a folder should be
            exit_with_error(f"cannot write {err.filename or 'the run folder'}: {err.strerror}")
        exit_with_error(f"{type(err).__name__}: {one_line(err)} (--debug shows where it came from)")
    except (ValueError, TypeError) as err:
        # From a configured value that no check foresaw (the config is validated first).
        if show_tracebacks():
            raise
        exit_with_error(f"{type(err).__name__}: {one_line(err)} (--debug shows where it came from)")
    if summary and str(summary.get("stop_reason") or "").startswith(NON_FINITE):
        exit_with_error(f"{summary['stop_reason']}; its summary (non-finite values as null) is in {run_dir}", code=1)
    # Multirun sweepers (e.g. Optuna) minimise the returned value; ranks > 0 return None.
    return summary.get("val_nll") if summary else None


def cli() -> None:
    """`--options` lists the options; `--debug` keeps tracebacks; the rest goes to Hydra."""
    if "--options" in sys.argv[1:]:
        from .config.options import describe_options

        try:
            print(describe_options(CONFIG_DIR))
        except UserError as err:
            exit_with_error(str(err))
        return
    if "--debug" in sys.argv[1:]:
        sys.argv.remove("--debug")
        os.environ["HYDRA_FULL_ERROR"] = "1"
    seed_given = seed_on_command_line(sys.argv[1:])
    if seed_given:  # before Hydra records the overrides (.hydra/, multirun.yaml)
        exit_with_error(refusal(seed_given))
    install_interrupt_handlers()
    problem = output_folder_problem(sys.argv[1:])
    if problem:
        exit_with_error(problem)
    try:  # config errors, a busy or taken run folder: refused before Hydra creates or writes anything
        check_settings_stored(CONFIG_DIR)
        sys.argv[1:] = prepare_launch(sys.argv[1:])
    except UserError as err:
        exit_with_error(str(err))
    try:
        main()
    except Interrupted as stop:
        if not stop.said:  # outside a job: while Hydra composes the config or launches
            say(f"interrupted by {stop.name}", logging.WARNING)
        sys.exit(stop.exit_code)
    failures = failed_jobs_summary()
    if failures:
        print(failures, file=sys.stderr)
        sys.exit(1)
    from .privacy.distributed import launched_by_torchrun  # (imports torch, as a run has already)

    if launched_by_torchrun():
        end_distributed_process()


if __name__ == "__main__":
    cli()
