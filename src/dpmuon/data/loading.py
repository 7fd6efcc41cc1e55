"""One entry point from (dataset, split, format) to examples."""

from __future__ import annotations

from collections.abc import Callable, Collection
from os import PathLike
from pathlib import Path

from dpmuon.data.dart import read_dart_json
from dpmuon.data.e2e import read_e2e_csv, read_e2e_prefix
from dpmuon.data.layout import default_data_root, locate_split, resolve_format
from dpmuon.data.records import Example

_READERS: dict[tuple[str, str], Callable[[Path], list[Example]]] = {
    ("e2e", "prefix"): read_e2e_prefix,
    ("e2e", "csv"): read_e2e_csv,
    ("dart", "json"): read_dart_json,
}


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
    path = locate_split(dataset, split, default_data_root() if root is None else root, fmt)
    examples = _READERS[dataset, fmt](path)
    excluded = set(exclude_origins)
    return [e for e in examples if e.origin not in excluded] if excluded else examples
