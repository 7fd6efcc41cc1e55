"""Crash-safe run files: atomic replacement for whole files, fsync'd appends for logs.

A run killed at any instant leaves either the old or the new version of a file, never a torn
one; metrics rows are durable once `append` returns, and a resume moves rows past the
checkpoint aside (to metrics.superseded.jsonl), so none is duplicated and none is forgotten.
A write that fails (a full disk, a quota, an I/O error) raises `WriteFailed`, one line naming
the file, and leaves the old version in place.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..durable import fsync_dir
from ..errors import UserError, one_line
from ..jsontext import to_json
from ..paths import REPO_ROOT


class WriteFailed(UserError, OSError):
    """A run file that could not be written: `cannot write <file>: <the system's reason> (<ERRNO>)`.

    An OSError still (errno, strerror, filename), and a UserError: the driver prints it as one
    line and records it in train.log.
    """

    def __init__(self, path: Path | str, error: OSError):
        super().__init__(error.errno, error.strerror or one_line(error), str(path))

    def __str__(self) -> str:
        code = errno.errorcode.get(self.errno) if isinstance(self.errno, int) else None
        return f"cannot write {self.filename}: {self.strerror}" + (f" ({code})" if code else "")


class WriteSink:
    """The temp file as `atomic_write`'s `write` sees it: it keeps the OSError a write raised,
    which torch.save turns into a RuntimeError that no longer says what failed (on a full disk:
    `[enforce fail at inline_container.cc] unexpected pos`)."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as err:
            self.error = err
            raise

    def fileno(self) -> int:
        return self.file.fileno()


def atomic_write(path: Path, write: Callable[[WriteSink], None], secret: bool = False) -> None:
    """Write via a temp file in the same directory, fsync, then rename over `path`.

    The file gets the permissions a plain `open` would give (0666 less the umask): mkstemp's
    0600 would hide a run's published record from the colleagues the umask shares it with.
    `secret=True` keeps it owner-only, set before any byte is written. Any OSError on the way
    (creating, writing, syncing, renaming) raises `WriteFailed` naming `path`; the temp file is
    removed (on a full disk, that frees the space it took) and `path` keeps its old content.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise WriteFailed(path, err) from err
    try:
        os.fchmod(fd, 0o600 if secret else published_mode())
        with os.fdopen(fd, "wb") as f:
            sink = WriteSink(f)
            try:
                write(sink)
            except Exception:
                if sink.error is not None:  # the cause, not what a serializer made of it
                    raise sink.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise WriteFailed(path, err) from err
    finally:  # whatever was raised (KeyboardInterrupt too); after the rename there is nothing left
        Path(tmp).unlink(missing_ok=True)
    fsync_dir(path.parent)


def temp_files(path: Path) -> list[Path]:
    """Temp files `atomic_write(path, …)` left behind by a process killed mid-write (kill -9)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))


def atomic_write_json(path: Path, obj: Any) -> None:
    text = to_json(obj, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def published_mode() -> int:
    """0666 less the process umask: what `open()` would create."""
    try:  # Linux shows the umask; elsewhere it is only readable by setting it (briefly, process-wide)
        with open("/proc/self/status", encoding="ascii") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


# The time every file of a constant-time run carries once it ends: a fixed instant (the epoch),
# since any time the run itself produced (its start, its end) would time its steps.
FROZEN_TIME = 0


def freeze_times(directory: Path) -> None:
    """Set the access and modification times of `directory` and everything in it (symlinks
    themselves, not their targets) to FROZEN_TIME."""
    for root, dirs, files in os.walk(directory, topdown=False):  # a folder after its contents: listing one sets its access time
        for name in dirs + files:
            os.utime(os.path.join(root, name), (FROZEN_TIME, FROZEN_TIME), follow_symlinks=False)
    os.utime(directory, (FROZEN_TIME, FROZEN_TIME))


class MetricsLog:
    """metrics.jsonl: one JSON object per line, appended and fsync'd row by row.

    `secret=True` (diagnostics.jsonl: values outside the guarantee) keeps the file and its
    superseded rows owner-only, from their creation on.
    """

    def __init__(self, path: Path, secret: bool = False):
        self.path = Path(path)
        self.secret = secret
        self.superseded_path = self.path.with_name(self.path.stem + ".superseded.jsonl")

    def append(self, row: dict) -> None:
        line = to_json(row, sort_keys=True) + "\n"
        try:
            with self._open_append(self.path) as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise WriteFailed(self.path, err) from err

    def set_aside_after(self, step: int) -> int:
        """Move rows logged after `step` (re-run on resume) and damaged lines to the superseded
        file; return how many rows and lines were moved.

        Re-run rows describe releases that happened, so they are kept, marked `superseded`. A
        damaged line (not one JSON object) is kept there too, as text marked `damaged`, and the
        valid rows after it stay; only a torn last line — a kill mid-write, never durable — is
        dropped.
        """
        if not self.path.exists():
            return 0
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        kept, moved = [], []
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
            except ValueError:
                torn = number == len(lines) and not text.endswith("\n")
                if not torn and line.strip():  # a torn last line is repaired, i.e. dropped
                    moved.append({"damaged": True, "line": number, "text": line})
                continue
            if row.get("step", 0) > step:
                moved.append({**row, "superseded": True})
            else:
                kept.append(row)
        if moved:
            try:
                with self._open_append(self.superseded_path) as f:
                    f.write("".join(to_json(row, sort_keys=True) + "\n" for row in moved))
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as err:
                raise WriteFailed(self.superseded_path, err) from err
        rewritten = "".join(to_json(row, sort_keys=True) + "\n" for row in kept)
        atomic_write(self.path, lambda f: f.write(rewritten.encode()), secret=self.secret)
        return len(moved)

    def _open_append(self, path: Path):
        if not self.secret:
            return open(path, "a", encoding="utf-8")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)  # also when the file existed with a wider mode
        return os.fdopen(fd, "a", encoding="utf-8")

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


def code_version() -> str:
    """Git commit of the code that runs (suffix -dirty when the tree has changes)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def command_line() -> str:
    """The command that started this process (interpreter, script or -m module, args), with paths
    inside the checkout relative to it: a committed record names no machine's folders."""
    return shlex.join([Path(sys.orig_argv[0]).name, *(repo_relative(arg) for arg in sys.orig_argv[1:])])


def repo_relative(text: str) -> str:
    """`text` with the checkout's absolute path (as a prefix or after `key=`) made relative."""
    root = f"{REPO_ROOT}{os.sep}"
    key, sep, value = text.partition("=")
    if sep and value.startswith(root):
        return f"{key}={value[len(root) :]}"
    return text[len(root) :] if text.startswith(root) else text
