"""One entry point from (dataset, split, format) to examples."""

from __future__ import annotations

from collections.abc import Collection
from os import PathLike
from pathlib import Path

from dpmuon.data import dart, e2e
from dpmuon.data.dataset import FileReader
from dpmuon.data.layout import default_data_root, resolve_format
from dpmuon.data.records import Example

READERS = {"e2e": e2e.READERS, "dart": dart.READERS}  # each dataset module's formats and their parsers


def load_examples(
    dataset: str,
    split: str,
    root: str | PathLike[str] | None = None,
    fmt: str | None = None,
    exclude_origins: Collection[str] = (),
) -> list[Example]:
    """Read one split as Examples in file order.

    `root` defaults to `default_data_root()`, `fmt` to the dataset's default format
    (E2E: "prefix", DART: "json"). `exclude_origins` drops examples whose `origin` is listed
    (e.g. DART's E2E-derived annotations, to keep DART disjoint from E2E). Raises DataError for
    unknown names, missing or bad files.
    """
    fmt = resolve_format(dataset, fmt)
    root = default_data_root() if root is None else Path(root)
    return FileReader(dataset, fmt, READERS[dataset][fmt], root, tuple(exclude_origins)).examples(split)
