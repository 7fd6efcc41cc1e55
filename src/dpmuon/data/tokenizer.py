"""Loading the GPT-2 tokenizer with the pad token training and generation need."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dpmuon.data.errors import DataError

TOKENIZER_VARIABLE = "DPMUON_TOKENIZER"
DEFAULT_TOKENIZER = "gpt2"
PAD_TOKEN = "<|pad|>"


def load_tokenizer(name_or_path: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer by hub id or local directory and make sure it has a pad token.

    None means $DPMUON_TOKENIZER when set, else the hub id "gpt2". GPT-2 ships without a pad
    token; a dedicated "<|pad|>" is added rather than reusing eos, because eos is a real
    training target here. The model's embedding must then be resized to `len(tokenizer)`.
    """
    name = name_or_path or os.environ.get(TOKENIZER_VARIABLE) or DEFAULT_TOKENIZER
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as error:
        raise DataError(
            f"cannot load the tokenizer {name!r} ({error}); without internet access, set "
            f"${TOKENIZER_VARIABLE} to a local tokenizer directory"
        ) from error
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return tokenizer
