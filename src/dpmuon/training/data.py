"""Load, subset and encode a dataset's splits for one run."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..data import (
    EncodedExample,
    EvalItem,
    Example,
    default_data_root,
    encode_for_training,
    group_references,
    load_examples,
    locate_split,
)
from ..data.layout import resolve_format


@dataclass
class RunData:
    train: list[EncodedExample]
    valid: list[EncodedExample]
    test_items: list[EvalItem]
    test: list[EncodedExample]  # every (source, reference) pair of test_items, for test NLL
    train_source: str  # which private training set this is; see train_source_fingerprint


def prepare_data(dataset: Mapping, data: Mapping, tokenizer, context_length: int, log: Callable[[str], None]) -> RunData:
    name, fmt, root = dataset["name"], dataset.get("format"), data.get("root")
    exclude = tuple(dataset.get("exclude_origins") or ())

    def load(split: str):
        return load_examples(name, split, root, fmt, exclude_origins=exclude)

    train_raw = _first(load("train"), data.get("max_train_examples"))
    train, dropped = encode_for_training(train_raw, tokenizer, int(dataset["max_length"]))
    log(f"{name} train: {len(train):,} examples ({dropped:,} dropped as longer than {dataset['max_length']} tokens)")

    valid_raw = _first(load("valid"), data.get("max_valid_examples"))
    valid, dropped = encode_for_training(valid_raw, tokenizer, context_length)
    log(f"{name} valid: {len(valid):,} examples for validation NLL ({dropped} beyond the context length)")

    test_items = _first(group_references(load("test")), data.get("max_test_sources"))
    pairs = [Example(item.source, ref) for item in test_items for ref in item.references]
    test, dropped = encode_for_training(pairs, tokenizer, context_length)
    log(f"{name} test: {len(test_items):,} sources, {len(test):,} reference pairs ({dropped} beyond the context length)")
    return RunData(train, valid, test_items, test, train_source_fingerprint(dataset, data))


def train_source_fingerprint(dataset: Mapping, data: Mapping) -> str:
    """SHA-256 naming the private training set by where it comes from, never by its content.

    Dataset, format, excluded origins, subset size and the resolved training file identify the
    examples for study-level accounting. A hash of the examples themselves would be a
    deterministic, non-private function of the data: anyone who knows all but one example
    could test candidates for the last one against it.
    """
    name, fmt = dataset["name"], resolve_format(dataset["name"], dataset.get("format"))
    root = data.get("root") or default_data_root()
    source = {
        "dataset": name,
        "format": fmt,
        "exclude_origins": sorted(dataset.get("exclude_origins") or ()),
        "max_train_examples": data.get("max_train_examples"),
        "train_file": str(Path(locate_split(name, "train", root, fmt)).resolve()),
    }
    return hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()


def _first(items: list, limit) -> list:
    return items if limit is None else items[: int(limit)]
