"""Durability below the application: what the ledger, the run files, checkpoints and the
mechanism's secret state share — atomic replacement of whole files (temp file, fsync, rename),
and loading a torch archive only once every entry matches its CRC-32."""

from __future__ import annotations

import errno
import glob
import os
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import UserError, one_line


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file's name durable (where the platform allows opening a directory)."""
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


def published_mode() -> int:
    """0666 less the process umask: what `open()` would create."""
    try:  # Linux shows the umask; elsewhere it is only readable by setting it (briefly, process-wide)
        with open("/proc/self/status", encoding="ascii") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


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


def load_verified(path: Path, remedy: str) -> Any:
    """torch.load of a file this package saved, once every entry matches its recorded CRC-32;
    otherwise one line naming the file, what is wrong with it and `remedy` (what to do)."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # reads every entry: the name of the first that fails its CRC-32
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, zlib.error) as err:
        raise UserError(f"cannot resume from {path}: the file is incomplete or damaged (not a whole torch archive: {one_line(err)}); {remedy}") from None
    except OSError as err:
        raise UserError(f"cannot resume from {path}: cannot read it ({err.strerror or one_line(err)}); {remedy}") from None
    if damaged is not None:
        raise UserError(f"cannot resume from {path}: the file is damaged (its entry {damaged} fails its checksum); {remedy}")
    import torch  # here: the ledger and the run files need none of it

    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # an archive intact entry by entry that still does not unpickle
        raise UserError(f"cannot resume from {path}: torch cannot load it ({type(err).__name__}: {one_line(err)}); {remedy}") from None
