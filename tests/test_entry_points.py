"""Every console script in pyproject.toml names a callable that exists, and each six-line
wrapper under scripts/ calls the same function as its entry point."""

from __future__ import annotations

import importlib
import re

import pytest
import tomllib

from dpmuon.paths import REPO_ROOT

SCRIPTS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_entry_point_resolves_to_a_callable(name):
    module, _, attribute = SCRIPTS[name].partition(":")
    assert callable(getattr(importlib.import_module(module), attribute)), SCRIPTS[name]


def test_wrappers_in_scripts_call_an_entry_point():
    targets = {tuple(t.split(":")) for t in SCRIPTS.values()}
    wrappers = {}
    for path in REPO_ROOT.glob("scripts/*.py"):
        text = path.read_text()
        found = re.search(r"^from (dpmuon[\w.]*) import (\w+)$", text, re.M)
        if found and re.search(rf"exit\({found[2]}\(\)\)", text, re.I):  # a wrapper: it only calls what it imports
            wrappers[path.name] = (found[1], found[2])
    assert len(wrappers) >= 7, wrappers
    assert all(target in targets for target in wrappers.values()), {k: v for k, v in wrappers.items() if v not in targets}
