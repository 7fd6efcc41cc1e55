"""Composing driver configs in tests, and the real-data switch (skip locally, fail under CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dpmuon.train import CONFIG_DIR


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def compose_many(override_lists):
    """Compose several configs under one Hydra initialization (much faster than one each)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        for overrides in override_lists:
            yield overrides, compose(config_name="config", overrides=list(overrides))


def require_real_data() -> None:
    """Real E2E/DART and the GPT-2 tokenizer: skip with a reason, or fail when CI is set."""
    missing = [v for v in ("DPMUON_DATA_DIR", "DPMUON_TOKENIZER") if not os.environ.get(v) or not Path(os.environ[v]).is_dir()]
    if not missing:
        return
    message = f"{', '.join(missing)} not set to an existing directory (point them at ../shared/data and ../shared/models/gpt2-tokenizer)"
    if os.environ.get("CI"):
        pytest.fail(f"CI run without real data: {message}")
    pytest.skip(message)
