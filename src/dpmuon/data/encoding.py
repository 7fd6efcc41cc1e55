"""Turning Examples into token ids and loss labels (the paper's table-to-text format).

A training sequence is ` {source} {eos} {target} {eos}`; the loss covers only the target
tokens and the final eos, so labels are IGNORE_INDEX on the prompt (source + separator eos).
Labels are not shifted: the model's loss function shifts them itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from dpmuon.data.records import Example

IGNORE_INDEX = -100  # the label the loss skips (PyTorch cross-entropy's default ignore_index)


@dataclass
class EncodedExample:
    """Token ids of one training sequence and its per-token labels (same length)."""

    input_ids: list[int]
    labels: list[int]


def _tokenize(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    # Each text gets a leading space so its first word is tokenized as it is mid-sentence,
    # matching the ` {source} {eos} {target} {eos}` format. One batch call keeps the fast
    # tokenizer's parallel path: tens of thousands of examples take seconds.
    if not texts:
        return []  # Hugging Face's batch call fails on an empty list
    return tokenizer([" " + text for text in texts], add_special_tokens=False)["input_ids"]


def _assemble(source_ids: list[int], target_ids: list[int], eos_id: int) -> EncodedExample:
    prompt = source_ids + [eos_id]
    completion = target_ids + [eos_id]
    return EncodedExample(
        input_ids=prompt + completion,
        labels=[IGNORE_INDEX] * len(prompt) + completion,
    )


def encode_for_training(examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase, max_length: int) -> tuple[list[EncodedExample], int]:
    """Encode all examples, dropping those longer than `max_length` tokens in total.

    Returns the kept examples in input order and the number dropped (for the caller to log).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    # Sources repeat across references (E2E: ~9 per source), so each is tokenized once.
    unique_sources = list(dict.fromkeys(example.source for example in examples))
    ids_by_source = dict(zip(unique_sources, _tokenize(tokenizer, unique_sources), strict=True))
    target_ids = _tokenize(tokenizer, [example.target for example in examples])
    encoded = (_assemble(ids_by_source[example.source], target, tokenizer.eos_token_id) for example, target in zip(examples, target_ids, strict=True))
    kept = [example for example in encoded if len(example.input_ids) <= max_length]
    return kept, len(examples) - len(kept)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, source: str) -> list[int]:
    """Encode the generation prompt ` {source} {eos}`, the prefix of a training sequence."""
    (source_ids,) = _tokenize(tokenizer, [source])
    return source_ids + [tokenizer.eos_token_id]
