"""What `python -m dpmuon.train` settles before Hydra creates or writes anything.

Hydra makes the run directory and writes `.hydra/` into it before the driver's code runs, so
what should leave no trace is checked here, on the command line:

- unknown keys (`optimizer.lrr=1`, `+optimizer.lrr=1`): refused with the near matches;
- a new run: its config is composed and validated (values and cross-field rules), its run
  directory pinned (a `${now:…}` in it would resolve again, a second later), locked, and
  checked to hold no other run (training/run_identity.py);
- `resume=DIR`: overrides the stored run cannot honour are refused; DIR is locked and Hydra is
  pointed at DIR itself with no `.hydra/` of its own (the run's stored config stays the
  original, and its train.log goes on in its own folder);
- a folder this command created that holds nothing but Hydra's records when the process ends
  (the run failed before it trained) is removed again.

A multirun is refused in a sweep folder that holds earlier runs; its jobs' folders are checked
and locked by each job (training/loop.py). Hydra's other flags (`--cfg`, `--help`, …) are
Hydra's own.
"""

from __future__ import annotations

import atexit
import contextlib
import re
import shutil
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from .config.roster import CONFIG_DIR
from .config.schema import is_option, unknown_option, validate
from .errors import UserError
from .run_folder import HYDRA_DIR, LOCK, NOT_A_RUN
from .training.run_identity import (
    RESUME_ADJUSTABLE,
    check_new_run_dir,
    check_resumable,
    is_rank0,
    run_files,
    shown_keys,
)
from .training.run_lock import lock_run_dir, unlock_run_dir
from .training.secret import user_mechanism_secret

# Paths Hydra's override grammar takes unquoted; others are single-quoted.
PLAIN_PATH = re.compile(r"[\w/.\-+@:%~]+")


def prepare_launch(args: list[str]) -> list[str]:
    """The arguments to hand Hydra, after the checks above (UserError / ConfigError if refused)."""
    if any(arg.startswith("-") for arg in args):
        if any(arg in ("-m", "--multirun") for arg in args):
            check_multirun(args)
        return args
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except HydraException:
        return args  # Hydra says what it cannot parse
    check_override_keys(overrides)
    resume = next((o for o in reversed(overrides) if o.key_or_group == "resume" and o.value() is not None), None)
    if resume is not None:
        return prepare_resume(args, overrides, resume)
    return prepare_new_run(args)


def check_multirun(args: list[str]) -> None:
    """A sweep starts only in a sweep folder that holds no earlier runs: Hydra would rewrite
    each job folder's `.hydra/` before the job itself could refuse the folder. (Each job's
    folder is checked and locked again by the job, training/loop.py.)"""
    if any(arg.startswith("resume=") for arg in args):
        raise UserError("resume= continues one run: run it without -m/--multirun, once per run directory")
    overrides = [arg for arg in args if arg not in ("-m", "--multirun")]
    if not any(arg.startswith("-") for arg in overrides):  # other flags may take values: Hydra's to read
        with contextlib.suppress(HydraException):  # Hydra says what it cannot parse
            parsed = OverridesParser.create().parse_overrides(overrides)
            check_override_keys(parsed)
            # The settings every job shares carry no seed into Hydra's records (swept values: train.cli).
            refuse_seed_in_composed([o.input_line for o in parsed if not o.is_sweep_override()])
    given = [arg.split("=", 1)[1] for arg in args if arg.startswith("hydra.sweep.dir=")]
    if not given or "$" in given[-1]:
        return  # Hydra's default sweep folder is new each time (a timestamp)
    sweep_dir = Path(given[-1])
    earlier = sorted(job.name for job in sweep_dir.iterdir() if job.is_dir() and run_files(job)) if sweep_dir.is_dir() else []
    if earlier:
        raise UserError(
            f"hydra.sweep.dir={sweep_dir} holds earlier runs ({shown_keys(earlier)}): a new sweep there would take over "
            "their folders; choose another hydra.sweep.dir or remove it (resume a stopped job with resume=<its folder>)"
        )


def check_override_keys(overrides: list[Override]) -> None:
    """Every key set on the command line is an option of the schema (or of Hydra)."""
    for override in overrides:
        key = override.key_or_group
        if override.is_delete() or key.split(".")[0].split("/")[0] == "hydra" or (Path(CONFIG_DIR) / key).is_dir():
            continue  # Hydra's own settings, and config groups (optimizer=dp_sgd), which Hydra checks
        if not is_option(key):
            raise unknown_option(key, override.input_line.split("=", 1)[-1])


def prepare_new_run(args: list[str]) -> list[str]:
    """Validate the config, then pin, lock and check its run directory."""
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            composed = compose(config_name="config", overrides=args, return_hydra_config=True)
        run_dir = str(OmegaConf.select(composed, "hydra.run.dir"))
    except (HydraException, OmegaConfBaseException):
        return args  # Hydra reports its own composition errors (e.g. an unknown optimizer=)
    user_mechanism_secret(composed)  # Hydra's section too: the folder's name and .hydra/hydra.yaml come next
    with open_dict(composed):
        del composed["hydra"]
    validate(composed)
    take_run_dir(Path(run_dir), composed)
    if any(char in run_dir for char in "'\\$"):
        return args  # not quotable as an override: Hydra resolves it again (a literal path, to the same)
    return [arg for arg in args if not arg.startswith("hydra.run.dir=")] + [f"hydra.run.dir={quoted(run_dir)}"]


def refuse_seed_in_composed(args: list[str]) -> None:
    """The config these arguments compose, Hydra's section included, holds no mechanism seed."""
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            composed = compose(config_name="config", overrides=args, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException):
        return  # Hydra reports its own composition errors
    user_mechanism_secret(composed)


def take_run_dir(run_dir: Path, cfg: DictConfig) -> None:
    """Rank 0 locks the folder (creating it); every rank checks that it holds no other run."""
    if is_rank0():
        created = [folder for folder in (run_dir, *run_dir.parents) if not folder.exists()]
        lock_run_dir(run_dir)
        if created:
            atexit.register(remove_if_unused, run_dir, created)
    check_new_run_dir(run_dir, cfg)


def prepare_resume(args: list[str], overrides: list[Override], resume: Override) -> list[str]:
    """Refuse what the stored run cannot honour; lock its folder; have Hydra write into it."""
    refused = [o.key_or_group for o in overrides if o is not resume and o.key_or_group not in RESUME_ADJUSTABLE]
    if refused:
        raise UserError(
            f"resume= continues the stored run as it was configured, so {', '.join(refused)} cannot be given with it "
            f"(only {', '.join(RESUME_ADJUSTABLE)} can); start a new run for other settings"
        )
    run_dir = Path(str(resume.value()))
    check_resumable(run_dir)
    if is_rank0():
        lock_run_dir(run_dir)
    given = resume.input_line.split("=", 1)[1]  # as typed: it parsed, so it parses as the run dir too
    return [*args, f"hydra.run.dir={given}", "hydra.output_subdir=null"]


def carry_adjustments(stored: DictConfig, composed: DictConfig, task_overrides: list[str]) -> None:
    """Set on a resumed run's stored config the RESUME_ADJUSTABLE values this command gives."""
    for override in OverridesParser.create().parse_overrides(task_overrides):
        if override.key_or_group in RESUME_ADJUSTABLE:  # (Hydra's own, hydra.verbose, are not task overrides)
            OmegaConf.update(stored, override.key_or_group, OmegaConf.select(composed, override.key_or_group))


def quoted(path: str) -> str:
    return path if PLAIN_PATH.fullmatch(path) else f"'{path}'"


def remove_if_unused(run_dir: Path, created: list[Path]) -> None:
    """At exit: remove the run folder (and the parents) this command created if it holds only
    what a run leaves that stopped before it trained (run_folder.NOT_A_RUN)."""
    if not run_dir.is_dir():
        return
    try:  # (the run released its lock when it ended: another process may hold the folder now)
        lock_run_dir(run_dir)
    except UserError:
        return
    if not {entry.name for entry in run_dir.iterdir()} <= set(NOT_A_RUN):
        unlock_run_dir(run_dir)
        return
    shutil.rmtree(run_dir / HYDRA_DIR, ignore_errors=True)
    for name in NOT_A_RUN:
        if name not in (HYDRA_DIR, LOCK):
            (run_dir / name).unlink(missing_ok=True)
    unlock_run_dir(run_dir)  # removes the lock file, while still holding it
    with contextlib.suppress(OSError):  # a folder with anything else in it (or taken meanwhile) stays
        for folder in created:
            folder.rmdir()
