"""Tokenizer loading, training/prompt encoding and collation, with a tiny offline tokenizer."""

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dpmuon.data import (
    DataError,
    EncodedExample,
    Example,
    collate,
    collate_prompts,
    encode_for_training,
    encode_prompt,
    load_tokenizer,
)

WORDS = ["<unk>", "<eos>", "name", ":", "A", "|", "Type", "pub", "is", "a", "."]
EOS = WORDS.index("<eos>")


def save_word_tokenizer(directory: Path, **special_tokens: str) -> Path:
    """Save a whitespace word-level tokenizer: ids are predictable and no download is needed."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapper = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>", **special_tokens)
    wrapper.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_word_tokenizer(tmp_path_factory.mktemp("word_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerFast:
    return load_tokenizer(str(tokenizer_dir))


def ids(*words: str) -> list[int]:
    return [WORDS.index(word) for word in words]


def test_load_tokenizer_adds_a_dedicated_pad_token(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.pad_token_id == len(WORDS)
    assert tokenizer.eos_token_id == EOS


def test_load_tokenizer_reads_the_environment_variable(tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPMUON_TOKENIZER", str(tokenizer_dir))
    assert load_tokenizer().eos_token_id == EOS


def test_load_tokenizer_keeps_an_existing_pad_token(tmp_path: Path) -> None:
    directory = save_word_tokenizer(tmp_path, pad_token="<unk>")
    assert load_tokenizer(str(directory)).pad_token == "<unk>"


def test_load_tokenizer_failure_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="DPMUON_TOKENIZER"):
        load_tokenizer(str(tmp_path / "missing"))


def test_training_example_masks_exactly_the_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    [encoded], _ = encode_for_training([Example("name : A", "A is a pub .")], tokenizer, max_length=100)

    target = ids("A", "is", "a", "pub", ".")
    assert encoded.input_ids == ids("name", ":", "A") + [EOS] + target + [EOS]
    assert encoded.labels == [-100] * 4 + target + [EOS]


def test_prompt_is_the_prefix_of_the_training_sequence(tokenizer: PreTrainedTokenizerFast) -> None:
    example = Example("name : A | Type : pub", "A is a pub .")
    prompt = encode_prompt(tokenizer, example.source)

    assert prompt == ids("name", ":", "A", "|", "Type", ":", "pub") + [EOS]
    assert encode_for_training([example], tokenizer, max_length=100)[0][0].input_ids[: len(prompt)] == prompt


def test_encode_for_training_drops_only_examples_over_max_length(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    examples = [
        Example("name : A", "a ."),  # 3 + 1 + 2 + 1 = 7 tokens
        Example("name : A", "A is a pub ."),  # 10 tokens
        Example("name", "."),  # 4 tokens
    ]

    kept, dropped = encode_for_training(examples, tokenizer, max_length=7)

    assert dropped == 1
    assert [e.input_ids for e in kept] == [ids("name", ":", "A") + [EOS] + ids("a", ".") + [EOS], ids("name") + [EOS] + ids(".") + [EOS]]
    assert encode_for_training([], tokenizer, max_length=7) == ([], 0)
    with pytest.raises(ValueError, match="max_length"):
        encode_for_training(examples, tokenizer, max_length=0)


def test_collate_right_pads_ids_mask_and_labels() -> None:
    batch = [EncodedExample([5, 6, 7], [-100, 6, 7]), EncodedExample([8], [8])]

    tensors = collate(batch, pad_id=99)

    assert torch.equal(tensors["input_ids"], torch.tensor([[5, 6, 7], [8, 99, 99]]))
    assert torch.equal(tensors["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert torch.equal(tensors["labels"], torch.tensor([[-100, 6, 7], [8, -100, -100]]))
    assert all(tensor.dtype == torch.long for tensor in tensors.values())


def test_collate_of_an_empty_lot_has_batch_size_zero() -> None:
    # Poisson sampling can draw an empty lot; the privatizer still takes a noise-only step.
    tensors = collate([], pad_id=99)

    assert {name: tuple(tensor.shape) for name, tensor in tensors.items()} == {
        "input_ids": (0, 0),
        "attention_mask": (0, 0),
        "labels": (0, 0),
    }


def test_collate_prompts_left_pads() -> None:
    tensors = collate_prompts([[1, 2, 3], [4]], pad_id=99)

    assert torch.equal(tensors["input_ids"], torch.tensor([[1, 2, 3], [99, 99, 4]]))
    assert torch.equal(tensors["attention_mask"], torch.tensor([[1, 1, 1], [0, 0, 1]]))
    assert tensors["input_ids"].dtype == torch.long
