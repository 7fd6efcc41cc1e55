"""The driver's configuration outside the driver: conf/config.yaml composed with Hydra overrides,
as `python -m dpmuon.train` composes it (for scripts, benches and tests)."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ..paths import CONFIG_DIR
from ..settings import check_settings_stored


def compose_config(*overrides: str, config_dir: str = str(CONFIG_DIR)) -> DictConfig:
    check_settings_stored(config_dir)
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))
