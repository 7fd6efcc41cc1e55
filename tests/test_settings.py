"""A settings class checks its own options as it is built: the same one-line message from Python
as from the command line, for top-level, nested and choice options alike."""

from __future__ import annotations

import pytest

from dpmuon.config import compose_config
from dpmuon.config.schema import ConfigError, validate
from dpmuon.data.e2e import E2ESettings
from dpmuon.optim.settings import AdamSettings, MuonBCSettings, MuonSettings

CASES = [  # (settings class, its keyword arguments, the same value on the command line)
    (MuonSettings, {"lr": 1e-3, "ns_steps": 0}, ("optimizer=dp_muon", "optimizer.ns_steps=0")),
    (AdamSettings, {"lr": 1e-3, "weight_decay": -1.0}, ("optimizer=dp_adam", "optimizer.weight_decay=-1.0")),
    (AdamSettings, {"lr": 1e-3, "betas": [0.9, 1.5]}, ("optimizer=dp_adam", "optimizer.betas=[0.9,1.5]")),
    (MuonSettings, {"lr": 1e-3, "schedule": "cosin"}, ("optimizer=dp_muon", "optimizer.schedule=cosin")),
    (MuonBCSettings, {"lr": 1e-3, "bias_correction": {"num_probes": 0}}, ("optimizer=dp_muonbc", "optimizer.bias_correction.num_probes=0")),
    (MuonSettings, {"lr": -1.0}, ("optimizer=dp_muon", "optimizer.lr=-1.0")),
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
