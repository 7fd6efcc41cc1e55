"""Composing driver configs in tests, the config groups and experiments conf/ offers, and the
real-data switch (skip locally, fail under CI)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from dpmuon.config import compose_config  # noqa: F401  (the tests import it from here)
from dpmuon.train import CONFIG_DIR

# The options of the config groups the tests combine, and every experiment (None: no experiment).
GROUPS = {name: sorted(p.stem for p in (Path(CONFIG_DIR) / name).glob("*.yaml")) for name in ("optimizer", "dataset", "model", "privacy", "recipe", "logger")}
EXPERIMENTS = [None] + sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*.yaml"))


def compose_many(override_lists: Iterable[Sequence[str]]) -> Iterator[tuple[Sequence[str], DictConfig]]:
    """Several configs under one Hydra initialization (much faster than one each)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for overrides in override_lists:
            yield overrides, compose(config_name="config", overrides=list(overrides))


def seed_file_override(seed: int) -> str:
    """`privacy.mechanism_seed_file=<an owner-only file holding seed>`: how a run takes a fixed
    mechanism seed from an override (never the seed itself on the command line)."""
    path = Path(tempfile.mkdtemp(prefix="dpmuon-test-seed-")) / "mechanism_seed"
    path.write_text(f"{seed}\n")
    path.chmod(0o600)
    return f"privacy.mechanism_seed_file={path}"


def require_real_data() -> None:
    """Real E2E/DART and the GPT-2 tokenizer: skip with a reason, or fail when CI is set."""
    missing = [v for v in ("DPMUON_DATA_DIR", "DPMUON_TOKENIZER") if not os.environ.get(v) or not Path(os.environ[v]).is_dir()]
    if not missing:
        return
    message = f"{', '.join(missing)} not set to an existing directory (point them at ../shared/data and ../shared/models/gpt2-tokenizer)"
    if os.environ.get("CI"):
        pytest.fail(f"CI run without real data: {message}")
    pytest.skip(message)
