"""How a `python -m dpmuon.train` process ends when it does not simply succeed: interrupted
(one line, the resume command where there is one, exit 128 + signal), refused before Hydra
makes an output folder it cannot make, or a multirun whose jobs failed (all jobs still run,
then one summary and a non-zero exit), or a finished process that took part in a process group (`end_distributed_process`)."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .jsontext import to_json
from .run_folder import TRAIN_LOG

# The driver's [dpmuon] lines; Hydra's job logging (conf/config.yaml) sends it to train.log only.
RUN_LOG = logging.getLogger("dpmuon")
# Until Hydra configures it (and in library use), no handler: not logging's last resort, which
# would print each warning and error a second time on stderr.
RUN_LOG.addHandler(logging.NullHandler())
# Where Hydra puts runs when no hydra.run.dir / hydra.sweep.dir is given (conf/config.yaml).
DEFAULT_OUTPUT = {"hydra.run.dir": "outputs", "hydra.sweep.dir": "multirun"}
FAILED_JOBS_FILE = "failed_jobs.jsonl"
# How a run's stop_reason starts when its loss or metrics stopped being finite numbers.
NON_FINITE = "non-finite"


def say(message: str, level: int = logging.INFO) -> None:
    """A [dpmuon] line on stderr and in train.log, for the driver outside a run's loop."""
    print(f"[dpmuon] {message}", file=sys.stderr)
    RUN_LOG.log(level, message)


def also_log_to(run_dir: Path) -> None:
    """Append the [dpmuon] lines to `run_dir`/train.log too: a resumed run's own log, beside the
    new Hydra folder the resume command gets."""
    handler = logging.FileHandler(run_dir / TRAIN_LOG, mode="a", encoding="utf-8")
    for existing in RUN_LOG.handlers:  # the same line format as Hydra's file handler
        handler.setFormatter(existing.formatter)
    RUN_LOG.addHandler(handler)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException, like KeyboardInterrupt: no `except Exception`
    on the way up may swallow it, and a multirun stops rather than going on to its next job.
    `said`: the resume line was already logged (the training loop checkpointed first)."""

    def __init__(self, signum: int, said: bool = False):
        super().__init__(signum)
        self.signum, self.said = signum, said

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def install_interrupt_handlers() -> None:
    """SIGINT and SIGTERM raise `Interrupted` wherever the process is (setup, data loading,
    decoding, writing); the training loop's StopRequest takes them over while it steps."""

    def interrupt(signum, frame):
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


class ExitWithError(SystemExit):
    """A job's one-line error, already printed; `message` lets a multirun's summary repeat it."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(code)
        self.message = message


def output_folder_problem(args: list[str]) -> str | None:
    """Why Hydra could not make its output folder (a file in the way, a read-only folder), or
    None. Checked before Hydra starts, which would fail with a traceback; nothing is created
    here, so a refused command leaves no folder behind."""
    multirun = any(a in ("-m", "--multirun") for a in args)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = next((a.split("=", 1)[1] for a in args if a.startswith(f"{key}=")), None)
    # Only the part before any interpolation is known before Hydra resolves it.
    folder = Path((given if given is not None else DEFAULT_OUTPUT[key]).split("$", 1)[0] or ".")
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    shown = f"{key}={given}" if given is not None else f"the default output folder {folder}/"
    if not existing.is_dir():
        return f"{shown}: {existing} is a file, not a folder; pass {key}=<a writable folder>"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{shown}: {existing} is not writable; pass {key}=<a writable folder>"
    return None


@dataclass
class FailedJob:
    number: int
    overrides: str
    reason: str


# Jobs of this process's multirun that failed (Hydra's basic launcher runs them in-process).
FAILED: list[FailedJob] = []


def continue_multirun(task: Callable) -> Callable:
    """In a multirun, a failed job is recorded (here and in <sweep dir>/failed_jobs.jsonl) and the
    sweep goes on: Hydra's launcher would stop at the first job that raised or exited. An
    interrupt still stops the whole sweep. A single run fails as before."""

    @functools.wraps(task)
    def run_or_record(cfg):
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            return task(cfg)
        try:
            return task(cfg)
        except SystemExit as stop:
            if not stop.code:
                return None
            reason = getattr(stop, "message", None) or f"exit {stop.code}"
        except Exception as err:  # any failure of one job: Hydra would re-raise it after the batch, traceback and all
            reason = f"{type(err).__name__}: {err}"
            print(f"error: {reason}", file=sys.stderr)
        failed = FailedJob(int(hydra_cfg.job.num), " ".join(hydra_cfg.overrides.task), reason.splitlines()[0] if reason else "")
        FAILED.append(failed)
        with open(Path(hydra_cfg.sweep.dir) / FAILED_JOBS_FILE, "a", encoding="utf-8") as f:
            f.write(to_json(failed.__dict__) + "\n")
        return None

    return run_or_record


def failed_jobs_summary() -> str | None:
    """One line per failed job of this process's multirun, or None when none failed."""
    if not FAILED:
        return None
    lines = [f"  job {f.number} ({f.overrides}): {f.reason}" for f in FAILED]
    return f"error: {len(FAILED)} job(s) of the multirun failed:\n" + "\n".join(lines)


def end_distributed_process() -> None:
    """End a process that took part in a gloo process group, its work done, skipping the
    interpreter's finalization (a torchrun worker of the driver; the tests' spawned ranks).

    FSDP2's collectives keep gloo's worker threads alive after `destroy_process_group` (torch
    2.13, measured: `pt_gloo_runloop` and `gloo_tcp_loop` threads still run at exit, held from
    C++ after every Python object is gone; DDP's plain collectives leave none). A process
    finalized beside them can abort ("terminate called without an active exception", SIGABRT)
    after its run has written everything, and torchrun then reports the finished run as failed
    (seen in CI: rank 1 of a resumed FSDP run, a spawned rank after DTensor work). The atexit handlers (logging's flush,
    W&B's) still run, while the interpreter is whole; then the process ends with status 0."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
