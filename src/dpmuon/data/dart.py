"""Reader for DART (v1.1.1) JSON files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from dpmuon.data.dataset import DatasetSettings, FileReader
from dpmuon.data.errors import DataError
from dpmuon.data.records import Example
from dpmuon.data.textio import open_text
from dpmuon.settings import option, settings


def linearize_tripleset(tripleset: Sequence[Sequence[str]]) -> str:
    """Join triples as `subject : relation : object | subject : relation : object`.

    Values are kept verbatim (a few carry stray spaces in the release): prior work on DART
    linearized them unchanged, and prompts should match theirs.
    """
    return " | ".join(f"{subject} : {relation} : {obj}" for subject, relation, obj in tripleset)


def read_dart_json(path: str | PathLike[str]) -> list[Example]:
    """Read a DART JSON file: one Example per annotation, items and annotations in file order.

    Targets are stripped annotation texts; an empty text is kept because it is a reference
    of the official test set. Optional keys such as `subtree_was_extended` are ignored.
    """
    path = Path(path)
    with open_text(path) as handle:
        text = handle.read()
    if not text.strip():
        raise DataError.in_file(path, "the file is empty; expected a JSON list of DART items")
    try:
        items = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError.in_file(path, f"invalid JSON at column {error.colno}: {error.msg}", line=error.lineno) from error
    if not isinstance(items, list):
        raise DataError.in_file(path, f"expected a JSON list of items at the top level, found a {type(items).__name__}")
    examples: list[Example] = []
    for index, item in enumerate(items):
        examples.extend(_examples_from_item(path, index, item))
    if not examples:
        raise DataError.in_file(path, "the JSON list holds no items")
    return examples


def _examples_from_item(path: Path, index: int, item: Any) -> list[Example]:
    def item_error(problem: str) -> DataError:
        return DataError.in_file(path, f"item {index} (counting from 0): {problem}")

    if not isinstance(item, dict):
        raise item_error(f"expected an object with `tripleset` and `annotations`, found {item!r:.80}")
    tripleset = item.get("tripleset")
    if not isinstance(tripleset, list) or not tripleset:
        raise item_error(f"expected `tripleset` to be a non-empty list of triples, found {tripleset!r:.80}")
    for position, triple in enumerate(tripleset):
        if not (isinstance(triple, list) and len(triple) == 3 and all(isinstance(v, str) for v in triple)):
            raise item_error(f"triple {position} is {triple!r:.80}; expected a list of 3 strings [subject, relation, object]")
    annotations = item.get("annotations")
    if not isinstance(annotations, list) or not annotations:
        raise item_error(f'expected `annotations` to be a non-empty list of {{"text": ...}} objects, found {annotations!r:.80}')
    source = linearize_tripleset(tripleset)
    examples = []
    for position, annotation in enumerate(annotations):
        if not (isinstance(annotation, dict) and isinstance(annotation.get("text"), str)):
            raise item_error(f"annotation {position} is {annotation!r:.80}; expected an object with a string `text`")
        origin = annotation.get("source", "")
        examples.append(Example(source=source, target=annotation["text"].strip(), origin=origin if isinstance(origin, str) else ""))
    return examples


# The formats DART is read in (data/layout.py: where each one's files are).
READERS = {"json": read_dart_json}


@settings("dataset")
@dataclass(kw_only=True)
class DARTSettings(DatasetSettings):
    """DART (data/layout.py: under <data root>/dart/), with the recipe's δ."""

    name: str = option("dart", "the private set's name (run folders, the ledger, tables)")
    format: str = option("json", "file format read (E2E: prefix or csv; DART: json)", choices=tuple(READERS))
    max_length: int = option(120, "drop training sequences longer than this many tokens", ge=1)
    # e.g. [e2e] keeps DART disjoint from E2E; every split of the run is filtered the same way.
    exclude_origins: list = option(factory=list, help="drop examples of these annotation origins (DART's sources, e.g. [e2e])")
    delta: float = option(1.0e-5, "δ of the recipe (privacy.delta defaults to it); must be < 1/N", gt=0, lt=1)

    def reader(self, data_root: Path, tokenizer, progress: bool = True) -> FileReader:
        return FileReader("dart", self.format, READERS[self.format], data_root, tuple(self.exclude_origins), tokenizer)
