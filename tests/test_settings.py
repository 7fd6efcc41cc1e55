"""A settings class checks its own options as it is built: the same one-line message from Python
as from the command line, for top-level, nested and choice options alike."""

from __future__ import annotations

import pytest

from dpmuon.config import compose_config
from dpmuon.config.schema import ConfigError, validate
from dpmuon.data.dataset import DataSettings
from dpmuon.data.e2e import E2ESettings
from dpmuon.eval.settings import EvalSettings
from dpmuon.optim.settings import AdamSettings, MuonBCSettings, MuonSettings
from dpmuon.privacy.settings import PrivacySettings
from dpmuon.training.settings import LoggerSettings, LoggingSettings, RecipeSettings, TrainerSettings

CASES = [  # (settings class, its keyword arguments, the same value on the command line)
    (MuonSettings, {"lr": 1e-3, "ns_steps": 0}, ("optimizer=dp_muon", "optimizer.ns_steps=0")),
    (AdamSettings, {"lr": 1e-3, "weight_decay": -1.0}, ("optimizer=dp_adam", "optimizer.weight_decay=-1.0")),
    (AdamSettings, {"lr": 1e-3, "betas": [0.9, 1.5]}, ("optimizer=dp_adam", "optimizer.betas=[0.9,1.5]")),
    (MuonSettings, {"lr": 1e-3, "schedule": "cosin"}, ("optimizer=dp_muon", "optimizer.schedule=cosin")),
    (MuonBCSettings, {"lr": 1e-3, "bias_correction": {"num_probes": 0}}, ("optimizer=dp_muonbc", "optimizer.bias_correction.num_probes=0")),
    (MuonSettings, {"lr": -1.0}, ("optimizer=dp_muon", "optimizer.lr=-1.0")),
    (PrivacySettings, {"delta": 1e-5, "clip_norm": -1.0}, ("privacy.clip_norm=-1.0",)),
    (PrivacySettings, {"delta": 1.5}, ("privacy.delta=1.5",)),
    (PrivacySettings, {"delta": 1e-5, "accountant": "gdp"}, ("privacy.accountant=gdp",)),
    (PrivacySettings, {"delta": 1e-5, "expected_lot_size": 0}, ("privacy.expected_lot_size=0",)),
    (PrivacySettings, {"delta": 1e-5, "constant_time": "yes"}, ("privacy.constant_time=yes",)),
    (TrainerSettings, {"micro_batch_size": 0}, ("trainer.micro_batch_size=0",)),
    (TrainerSettings, {"fixed_batch_shape": "always"}, ("trainer.fixed_batch_shape=always",)),
    (TrainerSettings, {"device": "tpu"}, ("trainer.device=tpu",)),
    (EvalSettings, {"num_beams": 0}, ("eval.num_beams=0",)),
    (EvalSettings, {"validation_split": "secret"}, ("eval.validation_split=secret",)),
    (LoggingSettings, {"nonprivate_diagnostics": "console"}, ("logging.nonprivate_diagnostics=console",)),
    (LoggingSettings, {"epsilon_every": 0}, ("logging.epsilon_every=0",)),
    (LoggerSettings, {"mode": "sometimes"}, ("logger=wandb", "logger.mode=sometimes")),
    (DataSettings, {"max_train_examples": 0}, ("data.max_train_examples=0",)),
    (RecipeSettings, {"epochs": -1.0}, ("recipe.epochs=-1.0",)),
]


@pytest.mark.parametrize("cls, kwargs, overrides", CASES, ids=lambda case: str(case) if isinstance(case, tuple) else "")
def test_a_bad_value_from_python_gives_the_command_lines_message(cls, kwargs, overrides):
    with pytest.raises(ConfigError) as from_python:
        cls(**kwargs)
    with pytest.raises(ConfigError) as from_command_line:
        validate(compose_config(*overrides))
    assert str(from_python.value) == str(from_command_line.value)
    assert str(from_python.value).startswith(overrides[-1].split("=")[0] + "=")  # names the key as the YAML does


def test_good_values_build_and_a_dataset_class_checks_itself_too():
    assert MuonBCSettings(lr=1e-3, bias_correction={"num_probes": 2}).bias_correction.num_probes == 2
    with pytest.raises(ConfigError, match=r"^dataset\.format="):
        E2ESettings(format="json")


GROUPS = {"data": DataSettings, "privacy": PrivacySettings, "trainer": TrainerSettings, "eval": EvalSettings, "logging": LoggingSettings}


@pytest.mark.parametrize("group", GROUPS)
def test_the_composed_defaults_are_the_classs(group):
    """conf/ sets only what differs from the class (trainer.epochs: the recipe's; privacy.delta: the dataset's)."""
    import dataclasses

    composed, overridden = compose_config(), {"trainer": {"epochs"}, "privacy": {"delta"}}.get(group, set())
    for field in dataclasses.fields(GROUPS[group]):
        if field.name not in overridden:
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            assert composed[group][field.name] == default, f"{group}.{field.name}"


def test_the_privacy_defaults_are_the_classs_in_every_entry_point():
    """One declaration: the driver's composed config, the class and make_private's keywords agree
    (constant_time was true in the YAML, false in the mechanism's settings and absent from the façade)."""
    from dpmuon.facade import make_private_keywords, privacy_keywords

    assert PrivacySettings(delta=1e-5).constant_time is True
    assert set(privacy_keywords()) <= set(make_private_keywords())
    assert {"clip_norm", "constant_time", "mechanism_seed_file"} <= set(privacy_keywords())


def test_the_engine_choices_are_the_registered_engines():
    """privacy.engine's choices are named without importing the engines: they must be the registry's."""
    from dpmuon.privacy.engines import ENGINES
    from dpmuon.privacy.settings import ENGINE_NAMES

    assert set(ENGINE_NAMES) == set(ENGINES)


def test_the_mechanisms_own_defaults_are_the_privacy_options():
    """build_partition, the accountant, the privatizer and the engines default to the options'
    declared defaults, not to copies of them."""
    import inspect

    from dpmuon.privacy.accountant import PrivacyAccountant
    from dpmuon.privacy.blocks import build_partition
    from dpmuon.privacy.engines.base import build_engine
    from dpmuon.privacy.mechanism import build_privatizer
    from dpmuon.privacy.settings import default

    def defaults(function) -> dict:
        return {name: p.default for name, p in inspect.signature(function).parameters.items()}

    for name in ("clip_mode", "clip_norm", "threshold_rule", "other_blocks"):
        assert defaults(build_partition)[name] == default(name)
    assert defaults(PrivacyAccountant)["accountant"] == default("accountant")
    assert defaults(build_engine)["fallback"] == default("engine_fallback")
    assert {k: defaults(build_privatizer)[k] for k in ("engine", "engine_fallback", "noise_allocation")} == {
        k: default(k) for k in ("engine", "engine_fallback", "noise_allocation")
    }
