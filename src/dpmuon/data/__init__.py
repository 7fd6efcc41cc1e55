"""The data layer: raw E2E / DART files (or your own through `datasets`) → Examples → token ids → padded batches.

Readers are pure functions of their input file (no caches; the `datasets` reader caches only
its tokenization, keyed by the file's content), and every problem a user can fix is raised as
`DataError` with the file, the line (or row) and what was expected.
"""

from dpmuon.data.collate import collate, collate_prompts
from dpmuon.data.dart import read_dart_json
from dpmuon.data.e2e import read_e2e_csv, read_e2e_prefix
from dpmuon.data.encoding import (
    EncodedExample,
    encode_for_training,
    encode_prompt,
)
from dpmuon.data.errors import DataError
from dpmuon.data.hf import HFReader, HFSettings
from dpmuon.data.layout import DATASETS, SPLITS, default_data_root, locate_split
from dpmuon.data.loading import load_examples
from dpmuon.data.records import EvalItem, Example, group_references
from dpmuon.data.tokenizer import load_tokenizer

__all__ = [
    "DATASETS",
    "SPLITS",
    "DataError",
    "EncodedExample",
    "EvalItem",
    "Example",
    "HFReader",
    "HFSettings",
    "collate",
    "collate_prompts",
    "default_data_root",
    "encode_for_training",
    "encode_prompt",
    "group_references",
    "load_examples",
    "load_tokenizer",
    "locate_split",
    "read_dart_json",
    "read_e2e_csv",
    "read_e2e_prefix",
]
