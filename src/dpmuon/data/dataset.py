"""What a dataset is to a run: its settings class (the `_target_` of conf/dataset/<name>.yaml,
options declared once as fields) and the reader it makes.

A new dataset is its reader module — a settings class derived from `DatasetSettings`, stored
with `@settings("dataset")`, whose `reader()` returns something with `examples(split)` and
`encode(examples, max_length)` — and one YAML that lists the class in its defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dpmuon.data.layout import locate_split
from dpmuon.data.records import Example
from dpmuon.settings import Settings, option, settings


class Reader(Protocol):
    """A dataset's splits as Examples, and their token ids."""

    def examples(self, split: str) -> list[Example]:
        """All examples of `split` (train / valid / test), one per reference, in file order."""

    def encode(self, examples: Sequence[Example], max_length: int) -> tuple[list[Any], int]:
        """(EncodedExamples of those no longer than `max_length` tokens, how many were dropped)."""


@dataclass(kw_only=True)
class DatasetSettings(Settings):
    """What every dataset says; a subclass adds its own options and `reader`."""

    name: str = option(help="the private set's name (run folders, the ledger, tables)")
    max_length: int = option(100, "drop training sequences longer than this many tokens", ge=1)
    delta: float = option(help="δ of the recipe (privacy.delta defaults to it); must be < 1/N", gt=0, lt=1)

    def reader(self, data_root: Path, tokenizer, progress: bool = True) -> Reader:
        raise NotImplementedError


@dataclass
class FileReader:
    """A dataset of the standard layout under the data root (data/layout.py): `read` parses one
    split's file (its dataset module's READERS entry for the format); `encode_for_training`
    encodes the examples."""

    dataset: str
    fmt: str
    read: Callable[[Path], list[Example]]
    root: Path
    exclude_origins: tuple[str, ...] = ()
    tokenizer: Any = None

    def examples(self, split: str) -> list[Example]:
        examples = self.read(locate_split(self.dataset, split, self.root, self.fmt))
        excluded = set(self.exclude_origins)
        return [e for e in examples if e.origin not in excluded] if excluded else examples

    def encode(self, examples: Sequence[Example], max_length: int) -> tuple[list[Any], int]:
        from dpmuon.data.encoding import encode_for_training  # here: reading the options needs no tokenizer library

        return encode_for_training(examples, self.tokenizer, max_length)


@settings("data", target=False)
@dataclass(frozen=True, kw_only=True)
class DataSettings(Settings):
    """Where the raw files are, and which part of each split a run uses (data.*)."""

    root: str | None = option(None, "raw-data folder laid out as e2e/…, dart/… (null: $DPMUON_DATA_DIR, else data/raw/)", kind="path")
    max_train_examples: int | None = option(None, "use only the first N training examples, in file order (null: all)", ge=1)
    max_valid_examples: int | None = option(1000, "use only the first N validation examples (null: all)", ge=1)
    max_test_sources: int | None = option(None, "score only the first N test sources (null: all)", ge=1)
    # Only the smoke experiment turns it on: a real experiment must stop on missing data, never
    # run on a stand-in. data/synthetic.py says what is written where; summary.json records it.
    fallback: str = option(
        "none",
        "synthetic: with no E2E files under the data root, read a generated synthetic E2E-format set (not E2E), "
        "and if the default gpt2 tokenizer cannot be loaded, a byte-level BPE trained on that set (none: stop instead)",
        choices=("none", "synthetic"),
    )
