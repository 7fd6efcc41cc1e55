"""The house's boundaries and sizes, checked on the source: the optimizers only post-process
the release (they never import the privacy package), the mechanism never reads models, data or
training, data never imports models, and no function is too long to name."""

from __future__ import annotations

import ast

import pytest

from dpmuon.paths import REPO_ROOT

SRC = REPO_ROOT / "src" / "dpmuon"
MAX_FUNCTION_LINES = 80


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
    [("optim", {"privacy", "training", "data"}), ("privacy", {"models", "data", "training", "optim"}), ("data", {"models", "training"})],
)
def test_package_boundaries(package, forbidden):
    assert not imported_packages(package) & forbidden, imported_packages(package)


def test_no_function_is_longer_than_a_screen_unless_it_says_why():
    long = []
    for path in SRC.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                said = any("long:" in lines[i] for i in range(max(0, node.lineno - 3), node.lineno))
                if length > MAX_FUNCTION_LINES and not said:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long
