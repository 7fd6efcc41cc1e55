"""The schema (the driver's options, and the fields of the classes the groups name) declares
every option of conf/ exactly once, and `--options` is generated from it."""

from __future__ import annotations

import re
import sys

import pytest
from helpers_train import EXPERIMENTS, GROUPS, compose_many
from omegaconf import OmegaConf

from dpmuon import train
from dpmuon.config.schema import FIXED, ConfigError, repo_options, validate

BY_KEY = repo_options()


def every_group_option():
    """One override list per option of every group, and one per experiment."""
    yield from ([f"{group}={name}"] for group, names in GROUPS.items() for name in names)
    yield from ([f"experiment={name}"] for name in EXPERIMENTS[1:])


def leaf_keys(node, prefix: str = ""):
    """Dotted keys down to the schema's granularity (a declared mapping is one option)."""
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in BY_KEY:
            yield from leaf_keys(value, dotted + ".")
        else:
            yield dotted


@pytest.fixture(scope="module")
def composed():
    configs = []
    for _, cfg in compose_many(every_group_option()):
        configs.append(cfg)
    return configs


def test_every_option_in_conf_is_declared_once_and_every_declared_one_is_used(composed):
    assert len({option.key for option in FIXED}) == len(FIXED)  # no key declared twice
    seen = set()
    for cfg in composed:
        container = OmegaConf.to_container(cfg, resolve=False)
        container.pop("hydra", None)
        seen |= set(leaf_keys(container))
    assert seen - set(BY_KEY) == set(), "options in conf/ without a schema declaration"
    assert set(BY_KEY) - seen == set(), "declared options that no config sets"


def test_every_config_of_conf_is_valid(composed):
    for cfg in composed:
        validate(cfg)


def test_a_mistyped_override_of_any_group_option_is_caught(composed):
    cfg = composed[0].copy()
    cfg.privacy.expected_lot_size = "1024x"
    with pytest.raises(ConfigError, match=r"^privacy.expected_lot_size=1024x: not an integer; valid: an integer >= 1$"):
        validate(cfg)


def test_options_lists_every_option_with_type_default_and_help(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dpmuon.train", "--options"])
    train.cli()
    text = capsys.readouterr().out
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and not line.startswith("      ")}
    assert set(lines) == set(BY_KEY)
    assert re.search(r"privacy\.clip_norm\s+a number > 0\s+0\.1\s+total clipping threshold C", lines["privacy.clip_norm"])
    assert re.search(r"optimizer\.schedule\s+constant \| linear \| cosine\s+constant\s", lines["optimizer.schedule"])
    # grouped as conf/ is: a group's header names its options and default, per-option values follow
    assert "[optimizer]  optimizer=  adam | dp_adam | dp_muon | dp_muonbc | dp_sgd | muon  (default dp_adam; conf/optimizer/)" in text
    # its YAMLs have no name key; its options are one class's
    assert "[privacy]  privacy=  flat | per_matrix  (default per_matrix; conf/privacy/; declared by dpmuon.privacy.settings.PrivacySettings)" in text
    assert "per option: dp_muon 0.95, dp_muonbc 0.95, dp_sgd 0.0, muon 0.95" in text
    assert text.index("[data]") < text.index("data.root") < text.index("[dataset]")
