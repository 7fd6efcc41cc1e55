"""Crash-safe run files: atomic replacement for whole files, fsync'd appends for logs.

A run killed at any instant leaves either the old or the new version of a file, never a torn
one; metrics rows are durable once `append` returns, and a resume moves rows past the
checkpoint aside (to metrics.superseded.jsonl), so none is duplicated and none is forgotten.
A write that fails (a full disk, a quota, an I/O error) raises `WriteFailed`, one line naming
the file, and leaves the old version in place.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..durable import WriteFailed, atomic_write
from ..jsontext import to_json
from ..paths import REPO_ROOT


def atomic_write_json(path: Path, obj: Any) -> None:
    text = to_json(obj, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


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
