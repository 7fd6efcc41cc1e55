"""Composing driver configs in tests, the config groups and experiments conf/ offers, and the
real-data switch (skip locally, fail under CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dpmuon.config import compose_config, compose_many  # noqa: F401  (the tests import them from here)
from dpmuon.train import CONFIG_DIR

# The options of the config groups the tests combine, and every experiment (None: no experiment).
GROUPS = {name: sorted(p.stem for p in (Path(CONFIG_DIR) / name).glob("*.yaml")) for name in ("optimizer", "dataset", "model", "privacy", "logger")}
EXPERIMENTS = [None] + sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*.yaml"))


def require_real_data() -> None:
    """Real E2E/DART and the GPT-2 tokenizer: skip with a reason, or fail when CI is set."""
    missing = [v for v in ("DPMUON_DATA_DIR", "DPMUON_TOKENIZER") if not os.environ.get(v) or not Path(os.environ[v]).is_dir()]
    if not missing:
        return
    message = f"{', '.join(missing)} not set to an existing directory (point them at ../shared/data and ../shared/models/gpt2-tokenizer)"
    if os.environ.get("CI"):
        pytest.fail(f"CI run without real data: {message}")
    pytest.skip(message)
