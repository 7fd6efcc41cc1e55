"""Loading the GPT-2 tokenizer with the pad token training and generation need."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dpmuon.data.errors import DataError
from dpmuon.hub import local_files_only
from dpmuon.jsontext import to_json

TOKENIZER_VARIABLE = "DPMUON_TOKENIZER"
DEFAULT_TOKENIZER = "gpt2"
PAD_TOKEN = "<|pad|>"
LOADED, STAND_IN = "loaded", "built locally"  # a run's tokenizer_source (summary.json)


def load_tokenizer(name_or_path: str | None = None, bpe_merges: int | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer by hub id or local directory and make sure it has a pad token.

    None means $DPMUON_TOKENIZER when set, else the hub id "gpt2". GPT-2 ships without a pad
    token; a dedicated "<|pad|>" is added rather than reusing eos, because eos is a real
    training target here. The model's embedding must then be resized to `len(tokenizer)`.
    `bpe_merges=K` keeps only the first K merges of the byte-level BPE (see `truncate_bpe`).
    """
    return _prepared(_from_pretrained(name_or_path or os.environ.get(TOKENIZER_VARIABLE) or DEFAULT_TOKENIZER), bpe_merges)


def load_tokenizer_or_stand_in(
    name_or_path: str | None, bpe_merges: int | None, fallback: str, log: Callable[[str], None]
) -> tuple[PreTrainedTokenizerBase, str]:
    """`load_tokenizer`, and where it cannot load the default "gpt2" and `fallback` is "synthetic"
    (data.fallback), the byte-level BPE data/synthetic.py trains on its public synthetic set.
    Returns (tokenizer, "loaded" or "built locally"). A tokenizer named otherwise (a directory,
    $DPMUON_TOKENIZER) that fails to load fails the run: only the default stands in."""
    name = name_or_path or os.environ.get(TOKENIZER_VARIABLE) or DEFAULT_TOKENIZER
    try:
        tokenizer = _from_pretrained(name)
    except DataError:
        if fallback != "synthetic" or name != DEFAULT_TOKENIZER:
            raise
        from dpmuon.data import synthetic  # here: only a run that falls back needs `tokenizers`' trainer

        directory = synthetic.build_tokenizer()
        tokenizer = _from_pretrained(str(directory))
        merges = synthetic.merges_of(tokenizer)
        # model.bpe_merges sizes GPT-2's 50k merges; this BPE has a few hundred: above that, keep them all.
        keep = bpe_merges if bpe_merges is not None and bpe_merges < merges else None
        kept = "" if bpe_merges is None else f"; keeping its first {keep} of {merges} merges" if keep else f"; it has {merges} merges, keeping all of them"
        log(
            f"data.fallback=synthetic: the tokenizer {name!r} is not available offline, so this run uses a byte-level BPE "
            f"built from the synthetic set in {directory}{kept}; {synthetic.REAL_SOURCES_HINT}"
        )
        return _prepared(tokenizer, keep), STAND_IN
    return _prepared(tokenizer, bpe_merges), LOADED


def _from_pretrained(name: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=local_files_only(name))  # offline: fails in seconds, not a minute
    except OSError as error:
        raise DataError(
            f"cannot load the tokenizer {name!r} ({error}); without internet access, set ${TOKENIZER_VARIABLE} to a local tokenizer directory"
        ) from error


def _prepared(tokenizer: PreTrainedTokenizerBase, bpe_merges: int | None) -> PreTrainedTokenizerBase:
    if bpe_merges is not None:
        tokenizer = truncate_bpe(tokenizer, int(bpe_merges))
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return tokenizer


def truncate_bpe(tokenizer: PreTrainedTokenizerBase, merges: int) -> PreTrainedTokenizerBase:
    """The same byte-level BPE with only its first `merges` merges: vocabulary 256 + K + eos.

    GPT-2's vocabulary is the 256 byte symbols followed by one token per merge, in merge order,
    so dropping later merges leaves a valid tokenizer that still encodes every text (falling
    back to shorter pieces, ultimately bytes) and decodes it exactly. The choice depends on the
    tokenizer alone — no data is looked at — so it leaks nothing about any private set. Used for
    CPU-scale models, whose cost is dominated by the vocabulary.
    """
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        spec_file = Path(tmp) / "tokenizer.json"
        spec = json.loads(spec_file.read_text(encoding="utf-8"))
        model = spec["model"]
        if model.get("type") != "BPE" or not 0 < merges <= len(model["merges"]):
            raise DataError(f"cannot keep {merges} BPE merges of a {model.get('type')} tokenizer with {len(model.get('merges', []))}")
        kept = {token: i for token, i in model["vocab"].items() if i < 256 + merges}
        if len(kept) != 256 + merges:
            raise DataError("tokenizer vocabulary is not laid out as 256 bytes + one token per merge (not GPT-2 BPE?)")
        eos_id = 256 + merges
        kept[tokenizer.eos_token] = eos_id
        model["vocab"], model["merges"] = kept, model["merges"][:merges]
        spec["added_tokens"] = [dict(t, id=eos_id) for t in spec["added_tokens"] if t["content"] == tokenizer.eos_token]
        spec_file.write_text(to_json(spec), encoding="utf-8")
        return AutoTokenizer.from_pretrained(tmp)
