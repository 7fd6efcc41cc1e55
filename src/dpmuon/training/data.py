"""Load, subset and encode a dataset's splits for one run."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hydra.utils import instantiate

from ..data import DataError, E2ESettings, EncodedExample, EvalItem, Example, default_data_root, group_references
from ..data.synthetic import data_root_or_synthetic


@dataclass
class RunData:
    train: list[EncodedExample]
    valid: list[EncodedExample]
    test_items: list[EvalItem]
    test: list[EncodedExample]  # every (source, reference) pair of test_items, for test NLL
    train_source: str  # which private training set this is; see train_fingerprint
    data_source: str = "files"  # or "synthetic": data.fallback's stand-in for missing E2E files (summary.json)


def prepare_data(
    dataset: Mapping, data: Mapping, tokenizer, context_length: int, log: Callable[[str], None], progress: bool = True, publish_counts: bool = False
) -> RunData:
    """`dataset` is the config section: its `_target_` class makes the reader.

    How many training examples the length filter dropped is a count of the private set's
    contents outside the guarantee (it tells whether a long example is in it, which N does not),
    so it is logged — train.log is published — only with `publish_counts` (the driver's
    logging.nonprivate_diagnostics=publish). N itself is public: docs/privacy.md, threat model."""
    settings, root = instantiate(dataset, _convert_="all"), data.get("root")
    root, source = Path(default_data_root() if root is None else root), "files"
    if data.get("fallback", "none") == "synthetic" and isinstance(settings, E2ESettings):  # runs stored before the option had none
        root, source = data_root_or_synthetic(root, settings.format, log)
    reader = settings.reader(root, tokenizer, progress=progress)
    name, load, encode = settings.name, reader.examples, reader.encode

    train_raw = _first(load("train"), data.get("max_train_examples"))
    train, dropped = encode(train_raw, settings.max_length)
    dropped_note = f"{dropped:,} dropped" if publish_counts else "those dropped, not counted here,"
    log(f"{name} train: {len(train):,} examples ({dropped_note} as longer than {settings.max_length} tokens)")
    _refuse_emptied(f"{name} train", dropped, train, f"dataset.max_length={settings.max_length} tokens; raise dataset.max_length")

    beyond_context = f"the model's context of {context_length} tokens; raise model.n_positions (or use a model with a longer context)"
    valid_raw = _first(load("valid"), data.get("max_valid_examples"))
    valid, dropped = encode(valid_raw, context_length)
    log(f"{name} valid: {len(valid):,} examples for validation NLL ({dropped} beyond the context length)")
    _refuse_emptied(f"{name} valid", dropped, valid, beyond_context)

    test_items = _first(group_references(load("test")), data.get("max_test_sources"))
    pairs = [Example(item.source, ref) for item in test_items for ref in item.references]
    test, dropped = encode(pairs, context_length)
    log(f"{name} test: {len(test_items):,} sources, {len(test):,} reference pairs ({dropped} beyond the context length)")
    _refuse_emptied(f"{name} test", dropped, test, beyond_context)
    return RunData(train, valid, test_items, test, train_fingerprint(train), source)


def train_fingerprint(train: Sequence[EncodedExample]) -> str:
    """SHA-256 of the training examples the run samples from: each one's token ids and labels, in order.

    The content, not where it was read from: the same examples under another path, format
    directory or data root are the same private set (and a resume on other examples is
    refused). Study-level accounting does not rely on it: `dpmuon.eval.study` composes every
    run on a dataset, whatever subset it used.

    A hash of the examples is a deterministic function of the private data outside the DP
    guarantee — someone who knows all examples but one can test candidates for the last one
    against it — so it is kept only in the owner-only mechanism state (to refuse a resume on
    other examples), never in the ledger, the summary or anything else a run publishes.
    """
    h = hashlib.sha256()
    for example in train:
        for ids in (example.input_ids, example.labels):
            h.update(len(ids).to_bytes(8, "little"))  # lengths delimit: no two lists hash alike
            h.update(np.asarray(ids, dtype="<i8").tobytes())
    return h.hexdigest()


def _refuse_emptied(split: str, dropped: int, kept: Sequence[EncodedExample], limit: str) -> None:
    """A split the length filter left empty: its NLL would be 0/0 and its plan N = 0."""
    if dropped and not kept:
        raise DataError(f"{split}: all {dropped:,} examples are longer than {limit}")


def _first(items: list, limit) -> list:
    return items if limit is None else items[: int(limit)]
