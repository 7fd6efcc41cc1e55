"""Where each dataset split lives under a data root, and which formats exist.

The layout mirrors the public releases (a local copy laid out the same way works too):

    <root>/e2e/prefix_tuning_format/src1_{train,valid,test}.txt[.gz]   E2E, format "prefix"
    <root>/e2e/{trainset,devset,testset_w_refs}.csv[.gz]               E2E, format "csv"
    <root>/dart/dart-v1.1.1-full-{train,dev,test}.json[.gz]            DART, format "json"
"""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path

from dpmuon.data.errors import DataError
from dpmuon.paths import REPO_ROOT, in_checkout

DATASETS = ("e2e", "dart")
SPLITS = ("train", "valid", "test")

DATA_DIR_VARIABLE = "DPMUON_DATA_DIR"

# Candidate file names, in order of preference, relative to <root>/<dataset>/.
_FILE_NAMES: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {
    ("e2e", "prefix"): {split: (f"prefix_tuning_format/src1_{split}.txt",) for split in SPLITS},
    ("e2e", "csv"): {
        "train": ("trainset.csv",),
        "valid": ("devset.csv",),
        "test": ("testset_w_refs.csv",),
    },
    ("dart", "json"): {
        # The official train file is preferred; a reconstructed one (a data provider's stand-in,
        # where the original could not be obtained) is used only in its absence.
        "train": ("dart-v1.1.1-full-train.json", "dart-v1.1.1-full-train.reconstructed.json"),
        "valid": ("dart-v1.1.1-full-dev.json",),
        "test": ("dart-v1.1.1-full-test.json",),
    },
}

# Each dataset's formats, from the table above; the first is its default. E2E defaults to the
# Prefix-Tuning format: prior DP work trained and evaluated on it, and its train split is the one
# commonly at hand. (The dataset modules' READERS parse each format: tests check they agree.)
FORMATS = {dataset: tuple(fmt for known, fmt in _FILE_NAMES if known == dataset) for dataset in DATASETS}

FETCH_HINT = (
    "Run `make data` to download the raw data, or "
    "`python scripts/download_data.py --link DIR` to use a local copy laid out like "
    "DIR/e2e and DIR/dart; or point $DPMUON_DATA_DIR at such a directory."
)


def default_data_root() -> Path:
    """$DPMUON_DATA_DIR if set, else `<repo root>/data/raw`, else `./data/raw`.

    The repo root is dpmuon.paths's (an editable checkout); an installed package has none and
    falls back to the working directory.
    """
    configured = os.environ.get(DATA_DIR_VARIABLE)
    if configured:
        return Path(configured).expanduser()
    return (REPO_ROOT if in_checkout() else Path.cwd()) / "data" / "raw"


def resolve_format(dataset: str, fmt: str | None) -> str:
    """Validate `dataset` and `fmt` and return the format to use (the default when None)."""
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset {dataset!r}; expected one of {', '.join(DATASETS)}")
    formats = FORMATS[dataset]
    if fmt is None:
        return formats[0]
    if fmt not in formats:
        raise DataError(f"unknown format {fmt!r} for dataset {dataset!r}; expected one of {', '.join(formats)}")
    return fmt


def candidate_paths(dataset: str, split: str, root: str | PathLike[str], fmt: str | None = None) -> list[Path]:
    """Every path `locate_split` would accept for this split, in order of preference."""
    fmt = resolve_format(dataset, fmt)
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    dataset_dir = Path(root) / dataset
    return [dataset_dir / f"{name}{compression}" for name in _FILE_NAMES[dataset, fmt][split] for compression in ("", ".gz")]


def locate_split(dataset: str, split: str, root: str | PathLike[str], fmt: str | None = None) -> Path:
    """Return the file holding `split` of `dataset` under `root` in format `fmt`.

    Raises DataError listing the paths tried when none exists.
    """
    fmt = resolve_format(dataset, fmt)
    candidates = candidate_paths(dataset, split, root, fmt)
    for path in candidates:
        if path.is_file():
            return path
    tried = "\n  ".join(str(path) for path in candidates)
    other_formats = [other for other in FORMATS[dataset] if other != fmt]
    # Not every copy holds every format (the original E2E trainset.csv is often missing).
    alternative = f"\nOther formats of {dataset}: {', '.join(other_formats)}." if other_formats else ""
    raise DataError(f"no {dataset} {split} file ({fmt} format) under {root}; tried:\n  {tried}\n{FETCH_HINT}{alternative}")
