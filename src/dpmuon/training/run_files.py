"""Crash-safe run files: atomic replacement for whole files, fsync'd appends for logs.

A run killed at any instant leaves either the old or the new version of a file, never a torn
one; metrics rows are durable once `append` returns, and a resume moves rows past the
checkpoint aside (to metrics.superseded.jsonl), so none is duplicated and none is forgotten.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..paths import REPO_ROOT


def atomic_write(path: Path, write: Callable[[io.BufferedWriter], None]) -> None:
    """Write via a temp file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _json_default(value):
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


class MetricsLog:
    """metrics.jsonl: one JSON object per line, appended and fsync'd row by row."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.superseded_path = self.path.with_name(self.path.stem + ".superseded.jsonl")

    def append(self, row: dict) -> None:
        line = json.dumps(row, sort_keys=True, default=_json_default) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def set_aside_after(self, step: int) -> int:
        """Move rows logged after `step` (re-run on resume) to the superseded file; return how many.

        They describe releases that happened, so they are kept, marked `superseded`; a torn
        last line from a kill mid-write is dropped (it was never durable).
        """
        if not self.path.exists():
            return 0
        kept, superseded = [], []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            (superseded if row.get("step", 0) > step else kept).append(row)
        if superseded:
            with open(self.superseded_path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps({**row, "superseded": True}, sort_keys=True, default=_json_default) + "\n" for row in superseded))
                f.flush()
                os.fsync(f.fileno())
        text = "".join(json.dumps(row, sort_keys=True, default=_json_default) + "\n" for row in kept)
        atomic_write(self.path, lambda f: f.write(text.encode()))
        return len(superseded)

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
        return f"{key}={value[len(root):]}"
    return text[len(root):] if text.startswith(root) else text
