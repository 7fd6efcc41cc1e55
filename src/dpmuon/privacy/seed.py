"""The user's mechanism seed: from the environment or an owner-only file, never anywhere public.

A user seed regenerates every lot and every noise draw of a run, so it is as secret as the noise.
Without one, a run draws its keys from OS entropy (privacy/randomness.py). With one, it comes from
`DPMUON_MECHANISM_SEED` (a process's environment is readable only by its owner) or from a file
that only its owner can read; its value is never shown in a message. (The driver's refusal of a
seed on the command line lives in training/secret.py.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import UserError

MECHANISM_SEED_ENV = "DPMUON_MECHANISM_SEED"
SEED_FILE_KEY = "privacy.mechanism_seed_file"
MAKE_ONE = "python -c 'import secrets; print(secrets.randbits(128))'"
# A seed is searched for like a password: below 2^64 a search over seeds that reproduces the
# released lots or noise is within reach.
STRONG_SEED = 2**64
WEAK_SEED_WARNING = f"warning: a mechanism seed below 2^64 can be found by search; make one with `{MAKE_ONE}`"
HOW_TO_SEED = f"give it as {MECHANISM_SEED_ENV}=<int> in the environment or {SEED_FILE_KEY}=<owner-only file> (make one with `{MAKE_ONE}`)"


def user_seed(seed_file: str | Path | None, seed_file_key: str = SEED_FILE_KEY) -> int | None:
    """The user's mechanism seed from the environment or `seed_file` (None: neither gives one, the
    mechanism draws OS entropy). `seed_file_key` names the setting in messages."""
    text, source = os.environ.get(MECHANISM_SEED_ENV), MECHANISM_SEED_ENV
    if text is not None and seed_file is not None:
        raise UserError(f"both {MECHANISM_SEED_ENV} and {seed_file_key}={seed_file} give a mechanism seed; keep one")
    if seed_file is not None:
        text, source = read_seed_file(Path(seed_file).expanduser(), seed_file_key), f"{seed_file_key}={seed_file}"
    if text is None:
        return None
    try:
        secret = int(text.strip())
    except ValueError:
        raise UserError(f"{source}: the mechanism seed is not an integer (value not shown); valid: an integer >= 0") from None
    if secret < 0:
        raise UserError(f"{source}: the mechanism seed is negative (value not shown); valid: an integer >= 0")
    return secret


def read_seed_file(path: Path, seed_file_key: str = SEED_FILE_KEY) -> str:
    """The file's text, if it is a regular file that only its owner, this user, can read (it holds the secret)."""
    try:
        # Looked at before it is opened: opening a FIFO waits for a writer, a device may act on
        # open; and opened non-blocking, so that one swapped in after the look cannot hang either.
        _require_regular(os.stat(path).st_mode, path, seed_file_key)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as err:
        raise UserError(f"{seed_file_key}={path}: cannot open ({err.strerror}); valid: an existing file holding one integer") from None
    with os.fdopen(fd, encoding="utf-8") as f:
        info = os.fstat(f.fileno())  # of the file opened, not of whatever the path names later
        _require_regular(info.st_mode, path, seed_file_key)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise UserError(f"{seed_file_key}={path}: others may read or change it; it must be yours and owner-only: chmod 600 {path}")
        try:
            return f.read()
        except UnicodeDecodeError:  # (its message would quote the bytes)
            raise UserError(f"{seed_file_key}={path}: not text (content not shown); valid: a file holding one integer") from None


def _require_regular(mode: int, path: Path, seed_file_key: str) -> None:
    if stat.S_ISREG(mode):
        return
    kinds = {stat.S_ISDIR: "directory", stat.S_ISFIFO: "FIFO", stat.S_ISSOCK: "socket", stat.S_ISCHR: "character device", stat.S_ISBLK: "block device"}
    kind = next((name for test, name in kinds.items() if test(mode)), "special file")
    raise UserError(f"{seed_file_key}={path}: not a regular file (a {kind}); valid: a file holding one integer")
