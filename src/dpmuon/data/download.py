"""Fetching the raw E2E and DART files, or linking a local copy, into a data root.

Used by `scripts/download_data.py` (and `make data`). Files come from commit-pinned raw
GitHub URLs of the official releases, so a download is reproducible; each file is written
to a temporary name and renamed into place, so an interrupted run leaves no partial file.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from dpmuon.data.layout import DATASETS, default_data_root

_E2E_RELEASE = "https://raw.githubusercontent.com/tuetschek/e2e-dataset/ab0d967dd5729ce455ef14ba9ffafc456a335264"
_PREFIX_TUNING = "https://raw.githubusercontent.com/XiangLi1999/PrefixTuning/6519d30e69b15a180f23e2cd41b766d3f62b8e82/data/e2e_data"
_DART_RELEASE = "https://raw.githubusercontent.com/Yale-LILY/dart/bb644b12ec1d0264f96a31145534b9a94f6ff5f5/data/v1.1.1"
_TIMEOUT_SECONDS = 60
_CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class RemoteFile:
    """A file to fetch and where it goes, relative to `<root>/<dataset>/`."""

    url: str
    relative_path: str


REMOTE_FILES: dict[str, tuple[RemoteFile, ...]] = {
    "e2e": (
        *(RemoteFile(f"{_E2E_RELEASE}/{name}", name) for name in ("trainset.csv", "devset.csv", "testset_w_refs.csv")),
        *(RemoteFile(f"{_PREFIX_TUNING}/src1_{split}.txt", f"prefix_tuning_format/src1_{split}.txt") for split in ("train", "valid", "test")),
    ),
    "dart": tuple(RemoteFile(f"{_DART_RELEASE}/dart-v1.1.1-full-{split}.json", f"dart-v1.1.1-full-{split}.json") for split in ("train", "dev", "test")),
}


class SetupError(RuntimeError):
    """A failure reported to the user as a plain message, without a traceback."""


def download_file(url: str, destination: Path) -> None:
    """Download `url` to `destination` with a progress bar, atomically."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary_name = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".part")
    temporary = Path(temporary_name)
    try:
        with (
            os.fdopen(handle, "wb") as output,
            urllib.request.urlopen(url, timeout=_TIMEOUT_SECONDS) as response,
        ):
            size = response.headers.get("Content-Length")
            with tqdm(
                total=int(size) if size else None,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=destination.name,
            ) as progress:
                while chunk := response.read(_CHUNK_BYTES):
                    output.write(chunk)
                    progress.update(len(chunk))
        os.replace(temporary, destination)
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", None) or error
        raise SetupError(
            f"could not download {url}: {reason}\nCheck the internet connection, or use a local copy: python scripts/download_data.py --link DIR"
        ) from error
    finally:
        temporary.unlink(missing_ok=True)


def download_dataset(dataset: str, root: Path, force: bool) -> None:
    """Fetch every file of `dataset` into `<root>/<dataset>/`, skipping files already there."""
    dataset_dir = root / dataset
    if dataset_dir.is_symlink():
        # Writing through the link would modify the linked local copy.
        print(f"{dataset_dir} links to a local copy ({os.readlink(dataset_dir)}); not downloading {dataset}.")
        return
    for remote in REMOTE_FILES[dataset]:
        destination = dataset_dir / remote.relative_path
        if destination.exists() and not force:
            print(f"{destination} exists; skipping (use --force to fetch again).")
            continue
        download_file(remote.url, destination)


def link_dataset(dataset: str, local_copy: Path, root: Path) -> None:
    """Make `<root>/<dataset>` a symlink to `<local_copy>/<dataset>`."""
    source = (local_copy / dataset).resolve()
    if not source.is_dir():
        raise SetupError(f"{local_copy / dataset} is not a directory; expected a local copy laid out as DIR/{dataset}/...")
    link = root / dataset
    if link.resolve() == source:
        print(f"{link} already is {source}.")
        return
    if link.is_dir() and not link.is_symlink() and not any(link.iterdir()):
        link.rmdir()  # an empty folder, e.g. left by a failed download, holds nothing to keep
    if link.exists() and not link.is_symlink():
        raise SetupError(f"{link} exists and is not a symlink; move it away or choose another --root")
    root.mkdir(parents=True, exist_ok=True)
    # Building the new link beside the old one and renaming it over replaces it atomically.
    temporary = root / f".{dataset}.link"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(source, target_is_directory=True)
    os.replace(temporary, link)
    print(f"{link} -> {source}")


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line (`argv` None: sys.argv)."""
    parser = argparse.ArgumentParser(description="Fetch the raw E2E and DART files (or link a local copy) into the data root.")
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="data root to fill (default: $DPMUON_DATA_DIR, else <repo>/data/raw)",
    )
    parser.add_argument(
        "--datasets",
        nargs="+",
        choices=DATASETS,
        default=list(DATASETS),
        help="datasets to set up (default: all)",
    )
    parser.add_argument(
        "--link",
        type=Path,
        metavar="DIR",
        help="instead of downloading, symlink DIR/e2e and DIR/dart (a local copy) into the root",
    )
    parser.add_argument("--force", action="store_true", help="download files again even if present")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    arguments = parse_arguments(argv)
    root = arguments.root or default_data_root()
    try:
        for dataset in arguments.datasets:
            if arguments.link is not None:
                link_dataset(dataset, arguments.link, root)
            else:
                download_dataset(dataset, root, arguments.force)
    except SetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
