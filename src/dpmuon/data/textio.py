"""Opening raw text files that may be gzip-compressed."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from dpmuon.data.errors import DataError


@contextmanager
def open_text(path: Path, newline: str | None = None) -> Iterator[TextIO]:
    """Open `path` for reading UTF-8 text, decompressing transparently when it ends in `.gz`.

    `newline` is passed through so CSV files can be read with `newline=""`, as the csv
    module requires for quoted fields that contain line breaks. Failures to find, decompress
    or decode the file (also those surfacing mid-read) become `DataError`s naming the file.
    """
    try:
        if path.suffix == ".gz":
            handle = gzip.open(path, "rt", encoding="utf-8", newline=newline)
        else:
            handle = path.open("r", encoding="utf-8", newline=newline)
    except (FileNotFoundError, IsADirectoryError) as error:
        raise DataError.in_file(path, f"cannot open the file ({error.strerror})") from error
    try:
        with handle:
            yield handle
    except (gzip.BadGzipFile, EOFError) as error:
        raise DataError.in_file(path, f"not a complete gzip file ({error})") from error
    except UnicodeDecodeError as error:
        raise DataError.in_file(path, f"not UTF-8 text ({error})") from error
