"""Every console script in pyproject.toml names a callable that exists; each one-line wrapper
under scripts/ calls a callable that exists; and no command is both (one way to run each)."""

from __future__ import annotations

import importlib
import re

import pytest
import tomllib

from dpmuon.paths import REPO_ROOT

SCRIPTS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def wrappers() -> dict[str, tuple[str, str]]:
    """scripts/<name>.py that only call a function they import: name → (module, function)."""
    found = {}
    for path in sorted(REPO_ROOT.glob("scripts/*.py")):
        text = path.read_text()
        target = re.search(r"^from (dpmuon[\w.]*) import (\w+)$", text, re.M)
        if target and re.search(rf"exit\({target[2]}\(\)\)", text, re.I):
            found[path.name] = (target[1], target[2])
    return found


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_entry_point_resolves_to_a_callable(name):
    module, _, attribute = SCRIPTS[name].partition(":")
    assert callable(getattr(importlib.import_module(module), attribute)), SCRIPTS[name]


WRAPPERS = wrappers()


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrapper_in_scripts_calls_a_callable(name):
    module, function = WRAPPERS[name]
    assert callable(getattr(importlib.import_module(module), function)), WRAPPERS[name]


def test_no_command_is_both_a_wrapper_and_an_entry_point():
    assert len(WRAPPERS) >= 7, WRAPPERS
    entry_points = {tuple(target.split(":")) for target in SCRIPTS.values()}
    assert not {name: target for name, target in WRAPPERS.items() if target in entry_points}
