"""The data layer: raw E2E / DART files (or your own through `datasets`) → Examples → token ids → padded batches.

Readers are pure functions of their input file (no caches; the `datasets` reader caches only
its tokenization, keyed by the file's content), and every problem a user can fix is raised as
`DataError` with the file, the line (or row) and what was expected.

The names below load their module on first use (PEP 562): the configs read the datasets'
options (their settings classes) without loading torch, `transformers` or `datasets`.
"""

from __future__ import annotations

from dpmuon.lazy import lazy_exports

# name → the submodule that defines it
_EXPORTS = {
    "collate": "collate",
    "collate_prompts": "collate",
    "read_dart_json": "dart",
    "DARTSettings": "dart",
    "DatasetSettings": "dataset",
    "read_e2e_csv": "e2e",
    "read_e2e_prefix": "e2e",
    "E2ESettings": "e2e",
    "EncodedExample": "encoding",
    "encode_for_training": "encoding",
    "encode_prompt": "encoding",
    "DataError": "errors",
    "HFDataset": "hf",
    "HFReader": "hf",
    "HFSettings": "hf",
    "DATASETS": "layout",
    "SPLITS": "layout",
    "default_data_root": "layout",
    "locate_split": "layout",
    "load_examples": "loading",
    "EvalItem": "records",
    "Example": "records",
    "group_references": "records",
    "load_tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
