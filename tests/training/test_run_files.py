"""Run records name no machine's folders: paths inside the checkout are recorded relative to it."""

from __future__ import annotations

import sys

from dpmuon.paths import REPO_ROOT
from dpmuon.training.run_files import command_line, repo_relative


def test_paths_inside_the_checkout_are_recorded_relative_and_others_unchanged(monkeypatch):
    assert repo_relative(f"hydra.run.dir={REPO_ROOT}/outputs/a") == "hydra.run.dir=outputs/a"
    assert repo_relative(f"{REPO_ROOT}/models/public-for-e2e") == "models/public-for-e2e"
    assert repo_relative("hydra.run.dir=/elsewhere/outputs/a") == "hydra.run.dir=/elsewhere/outputs/a"
    assert repo_relative(f"{REPO_ROOT}-other/x") == f"{REPO_ROOT}-other/x"  # a sibling folder is not inside
    monkeypatch.setattr(sys, "orig_argv", ["/usr/bin/python3", "-m", "dpmuon.train", f"resume={REPO_ROOT}/outputs/r", "seed=1"])
    assert command_line() == "python3 -m dpmuon.train resume=outputs/r seed=1"
