"""Checks against the real E2E / DART files and the real GPT-2 tokenizer.

They need $DPMUON_DATA_DIR (a data root laid out like data/raw) and $DPMUON_TOKENIZER (a
local GPT-2 tokenizer directory). Without them the checks are skipped, except under CI
($CI set), where a missing directory is a failure: CI must never pass by skipping them.
"""

import os
import re
from pathlib import Path

import pytest

from dpmuon.data import (
    encode_for_training,
    encode_prompt,
    group_references,
    load_examples,
    load_tokenizer,
)


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def required_directory(variable: str, purpose: str) -> Path:
    """The directory named by $variable, or skip (fail under CI) saying why it is missing."""
    value = os.environ.get(variable)
    if value and Path(value).is_dir():
        return Path(value)
    found = f"${variable} is not set" if not value else f"${variable}={value} is not a directory"
    reason = f"{found}; point it at {purpose} to run the real-data checks"
    if running_in_ci():
        pytest.fail(f"{reason} (required because $CI is set)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def data_root() -> Path:
    return required_directory("DPMUON_DATA_DIR", "the raw data root (e.g. ../shared/data)")


@pytest.fixture(scope="module")
def tokenizer():
    directory = required_directory("DPMUON_TOKENIZER", "a GPT-2 tokenizer directory")
    return load_tokenizer(str(directory))


@pytest.mark.parametrize(
    ("split", "examples", "sources"),
    [("train", 42061, 4862), ("valid", 4672, 547), ("test", 4693, 630)],
)
def test_e2e_prefix_split_sizes(data_root: Path, split: str, examples: int, sources: int) -> None:
    loaded = load_examples("e2e", split, data_root)

    assert len(loaded) == examples
    assert len(group_references(loaded)) == sources
    assert all(example.target == example.target.strip() for example in loaded)


@pytest.mark.parametrize(("split", "examples", "sources"), [("valid", 4672, 547), ("test", 4693, 630)])
def test_e2e_csv_split_sizes(data_root: Path, split: str, examples: int, sources: int) -> None:
    loaded = load_examples("e2e", split, data_root, fmt="csv")

    assert len(loaded) == examples
    assert len(group_references(loaded)) == sources


# The only differences between CSV-derived and Prefix-Tuning sources: the prefix files
# tokenized three price values. Everything else (names, keys, key order, rows) is identical.
PREFIX_PRICE_TOKENIZATION = {
    "price : less than £20": "price : less than £ 20",
    "price : more than £30": "price : more than £ 30",
    "price : £20-25": "price : £ 20 - 25",
}


@pytest.mark.parametrize("split", ["valid", "test"])
def test_e2e_csv_and_prefix_sources_differ_only_in_price_tokenization(data_root: Path, split: str) -> None:
    csv_sources = [example.source for example in load_examples("e2e", split, data_root, "csv")]
    prefix_sources = [example.source for example in load_examples("e2e", split, data_root)]

    assert set(csv_sources) != set(prefix_sources)
    retokenized = []
    for source in csv_sources:
        for untokenized, tokenized in PREFIX_PRICE_TOKENIZATION.items():
            source = source.replace(untokenized, tokenized)
        retokenized.append(source)
    assert retokenized == prefix_sources


@pytest.mark.parametrize(("split", "annotations"), [("train", 62659), ("valid", 6980), ("test", 12552)])
def test_dart_split_sizes_and_source_shape(data_root: Path, split: str, annotations: int) -> None:
    loaded = load_examples("dart", split, data_root)

    assert len(loaded) == annotations
    triple = r"[^|]+ : [^|]+ : [^|]+"
    assert all(re.fullmatch(rf"{triple}( \| {triple})*", ex.source, re.S) for ex in loaded)


def test_dart_test_keeps_its_empty_reference(data_root: Path) -> None:
    targets = [example.target for example in load_examples("dart", "test", data_root)]
    assert targets.count("") == 1


def test_encoding_masks_exactly_the_prompt(data_root: Path, tokenizer) -> None:
    example = load_examples("e2e", "test", data_root)[0]
    eos = tokenizer.eos_token_id

    [encoded], _ = encode_for_training([example], tokenizer, max_length=10**6)
    prompt = encode_prompt(tokenizer, example.source)

    source_ids = tokenizer.encode(" " + example.source)
    target_ids = tokenizer.encode(" " + example.target)
    assert prompt == source_ids + [eos]
    assert encoded.input_ids == prompt + target_ids + [eos]
    assert encoded.labels == [-100] * len(prompt) + target_ids + [eos]


@pytest.mark.parametrize(("dataset", "max_length", "dropped"), [("e2e", 100, 4), ("dart", 120, 2468)])
def test_length_filter_on_train(data_root: Path, tokenizer, dataset: str, max_length: int, dropped: int) -> None:
    examples = load_examples(dataset, "train", data_root)

    kept, dropped_here = encode_for_training(examples, tokenizer, max_length)

    assert dropped_here == dropped
    assert len(kept) + dropped_here == len(examples)
    assert max(len(example.input_ids) for example in kept) <= max_length


def test_truncated_bpe_is_lossless_and_smaller(data_root: Path, tokenizer) -> None:
    """Keeping GPT-2's first 8000 merges: vocabulary 8258 (with pad), exact round trip."""
    from dpmuon.data import load_tokenizer

    small = load_tokenizer(os.environ["DPMUON_TOKENIZER"], bpe_merges=8000)
    assert len(small) == 8258 and small.eos_token_id == 8256 and small.pad_token_id == 8257
    examples = load_examples("e2e", "test", data_root)[:300] + load_examples("dart", "test", data_root)[:300]
    texts = [" " + e.source for e in examples] + [" " + e.target for e in examples]
    short = tokenizer(texts, add_special_tokens=False)["input_ids"]
    long = small(texts, add_special_tokens=False)["input_ids"]
    assert all(small.decode(ids) == text for ids, text in zip(long, texts))
    assert all(max(ids, default=0) < 8256 for ids in long)
    ratio = sum(map(len, long)) / sum(map(len, short))
    assert 1.0 < ratio < 1.4  # longer sequences, in exchange for a 6x smaller vocabulary
