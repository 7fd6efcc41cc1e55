"""One run per run directory: an advisory lock held while a process works in the folder.

Two processes in one folder would interleave their releases in one privacy ledger and overwrite
each other's files, so the process that runs there holds `run.lock` (`fcntl.flock`, exclusive)
from before Hydra writes its records until it exits; a second process is refused with the
holder's PID. The kernel drops the lock when its holder dies, even by SIGKILL, so a stale
file never blocks a resume. Creating and removing the lock file sets the folder's times, so a
folder whose times were frozen (a finished run, run_files.freeze_times) gets them back when its
lock is released: a later command that locks it (and is refused, or checks it at exit) would
otherwise stamp it with the moment that run ended.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
from pathlib import Path

from .. import run_folder
from ..errors import UserError
from .run_files import FROZEN_TIME

LOCK_FILE = run_folder.LOCK
_HELD: dict[Path, tuple[int, bool]] = {}  # run directory (resolved) → (the descriptor holding its lock, its times were frozen)


def lock_run_dir(run_dir: Path) -> bool:
    """Take the folder's lock (creating the folder); False if this process already holds it."""
    key = Path(run_dir).resolve()
    if key in _HELD:
        return False
    key.mkdir(parents=True, exist_ok=True)
    frozen = os.stat(key).st_mtime == FROZEN_TIME  # before the lock file changes it
    path = key / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(
                f"{run_dir} is in use by another run (PID {holder}, holding {LOCK_FILE}); wait for it to end, or choose another hydra.run.dir"
            ) from None
        # The holder unlinks the file on release: a lock on an unlinked file guards nothing.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _HELD[key] = (fd, frozen)
    return True


def unlock_run_dir(run_dir: Path) -> None:
    """Release the folder's lock (if this process holds it) and remove the lock file."""
    key = Path(run_dir).resolve()
    fd, frozen = _HELD.pop(key, (None, False))
    if fd is None:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(key / LOCK_FILE)  # while still locked: see lock_run_dir
    if frozen:  # (listing it, as a check does, set its access time too)
        os.utime(key, (FROZEN_TIME, FROZEN_TIME))
    os.close(fd)


@contextlib.contextmanager
def run_dir_locked(run_dir: Path):
    """Hold the folder's lock for the block, and release it after: also a lock this process
    took before (train.cli takes it before Hydra writes), so that when the run's last write is
    done its lock file is gone too."""
    lock_run_dir(run_dir)
    try:
        yield
    finally:
        unlock_run_dir(run_dir)


@atexit.register
def _release_all() -> None:
    for run_dir in list(_HELD):
        unlock_run_dir(run_dir)
