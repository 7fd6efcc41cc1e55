"""The house's boundaries and sizes, checked on the source: the optimizers only post-process
the release (they never import the privacy package, nor the config package), the mechanism never
reads models, data or training, the mechanism and data import nothing of the application, data
never imports models, and no function is too long to name."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys

import pytest

from dpmuon.paths import REPO_ROOT

SRC = REPO_ROOT / "src" / "dpmuon"
STUDIES = REPO_ROOT / "studies"
SOURCES = [*SRC.rglob("*.py"), *STUDIES.glob("*.py")]  # the library and its studies
MAX_FUNCTION_LINES = 80
APPLICATION = {"training", "eval", "config"}  # what the library packages never import


def imported_packages(package: str) -> set[str]:
    """dpmuon subpackages imported anywhere in `package` (absolute or relative imports)."""
    found = set()
    for path in (SRC / package).rglob("*.py"):
        depth = len(path.relative_to(SRC).parts) - 1  # folders below dpmuon/
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against the file's package
                    base = list(path.relative_to(SRC).parts[:-1])[: depth - node.level + 1]
                    target = base + (node.module.split(".") if node.module else [])
                else:
                    if not (node.module or "").startswith("dpmuon"):
                        continue
                    target = node.module.split(".")[1:]
                if target:
                    found.add(target[0])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("dpmuon.")}
    return found - {package}


@pytest.mark.parametrize(
    "package, forbidden",
    [
        # The optimizer library stands alone: it neither sees the mechanism nor reads the repository's configs.
        ("optim", {"privacy", "training", "data", "config"}),
        ("privacy", {"models", "data", "training", "optim"} | APPLICATION),
        ("data", {"models", "training"} | APPLICATION),
    ],
)
def test_package_boundaries(package, forbidden):
    assert not imported_packages(package) & forbidden, imported_packages(package)


def test_the_integrations_do_not_reach_into_the_driver():
    """The Trainer saves, restores and guards the mechanism as make_private does (privacy/state.py
    through PrivateTraining), not through the driver: of the driver's package it may use only the
    run-file writers."""
    from_training = set()
    for path in (SRC / "integrations").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("training",) and node.level == 2:
                from_training.add(node.module)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpmuon.training"):
                from_training.add(node.module.removeprefix("dpmuon."))
    assert from_training <= {"training.run_files"}, from_training


def test_the_studies_use_only_the_public_api():
    """studies/ is not part of the library: it starts the driver as a command and reads what it
    wrote, and of dpmuon it imports only what a module declares public (its `__all__`), so a
    study cannot come to depend on an internal that changes under it."""
    private = []
    for path in sorted(STUDIES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                private += [f"{path.name}: import {a.name}" for a in node.names if a.name.split(".")[0] == "dpmuon"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dpmuon":
                public = getattr(importlib.import_module(node.module), "__all__", ())
                private += [f"{path.name}: from {node.module} import {a.name}" for a in node.names if a.name not in public]
    assert not private, private


@pytest.mark.parametrize(
    "light, heavy",
    [
        ("dpmuon.privacy.accountant", "dpmuon.privacy.engines"),
        ("dpmuon.privacy", "dpmuon.privacy.privatizer"),
        ("dpmuon.eval.tables", "torch"),
        ("dpmuon.config", "torch"),
        ("dpmuon.config", "datasets"),
    ],
)
def test_a_light_import_does_not_load_what_it_does_not_use(light, heavy):
    """The accountant (the calibration CLI, the study) does not load the per-example engines,
    the report scripts do not load torch, and reading the options (the settings classes) loads
    neither torch nor `datasets`: the packages load their modules on first use."""
    code = f"import {light}; import sys; print({heavy!r} in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_only_the_run_folder_layout_spells_a_run_file_name():
    """Every reader and writer of a run folder takes the names from dpmuon/run_folder.py, so a
    renamed file cannot leave a reader looking for the old name."""
    from dpmuon import run_folder as layout

    names = {layout.SUMMARY, layout.METRICS, layout.DIAGNOSTICS, layout.LEDGER, layout.CHECKPOINT, layout.MECHANISM_STATE,
             layout.GENERATIONS, layout.LOCK, layout.SEED_USE, layout.RUNNER_LOCK, layout.WEIGHTS_FINGERPRINT, layout.STORED_CONFIG}  # fmt: skip
    spelled = [
        f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.value!r}"
        for path in SOURCES
        if path.name != "run_folder.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not spelled, spelled


def test_no_function_is_longer_than_a_screen_unless_it_says_why():
    long = []
    for path in SOURCES:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                said = any("long:" in lines[i] for i in range(max(0, node.lineno - 3), node.lineno))
                if length > MAX_FUNCTION_LINES and not said:
                    long.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long
