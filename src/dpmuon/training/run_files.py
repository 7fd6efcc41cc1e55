"""Crash-safe run files: atomic replacement for whole files, fsync'd appends for logs.

A run killed at any instant leaves either the old or the new version of a file, never a torn
one; metrics rows are durable once `append` returns, and a resume trims rows past the
checkpoint so none is lost or duplicated.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable


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

    def append(self, row: dict) -> None:
        line = json.dumps(row, sort_keys=True, default=_json_default) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def truncate_after(self, step: int) -> int:
        """Drop rows logged after `step` (and a torn last line); return the rows kept."""
        if not self.path.exists():
            return 0
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn final line from a kill mid-write
            if row.get("step", 0) > step:
                break
            kept.append(line + "\n")
        atomic_write(self.path, lambda f: f.write("".join(kept).encode()))
        return len(kept)

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


def code_version() -> str:
    """Git commit of the code that runs (suffix -dirty when the tree has changes)."""
    repo = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def command_line() -> str:
    """The command that started this process, as typed (interpreter, script or -m module, args)."""
    return shlex.join([Path(sys.orig_argv[0]).name, *sys.orig_argv[1:]])
