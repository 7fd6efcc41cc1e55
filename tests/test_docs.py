"""The documentation builds without a warning (mkdocs --strict: pages, nav, anchors), every link of
README.md and docs/ names a file that exists (and, into a page, a heading it has), and the
configuration reference is the generator's current output."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import markdown
import pytest

from dpmuon.config import reference
from dpmuon.paths import REPO_ROOT

DOCS = REPO_ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def mkdocs_build(config: Path, site_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site_dir)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    built = mkdocs_build(REPO_ROOT / "mkdocs.yml", site_dir)
    output = built.stdout + built.stderr
    assert built.returncode == 0 and "WARNING" not in output, f"mkdocs build --strict failed (run `make docs`):\n{output}"
    return site_dir


def test_documentation_builds_strictly(site):
    built_pages = {path.with_suffix(".md").name for path in site.glob("*.html")}
    assert {path.name for path in DOCS.glob("*.md")} <= built_pages


def test_a_broken_anchor_fails_the_build(tmp_path):
    """The strict build is a real check: mkdocs.yml's validation settings turn a link to a heading
    that does not exist into a failure, not a log line."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the ledger](other.md#no-such-heading).\n")
    (docs / "other.md").write_text("# Other\n\n## The ledger\n")
    config = (REPO_ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^nav:.*?(?=^\S|\Z)", "nav:\n  - index.md\n  - other.md\n", config).replace("docs_dir: docs", f"docs_dir: {docs}")
    (tmp_path / "mkdocs.yml").write_text(config)
    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-heading" in built.stdout + built.stderr


def markdown_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """The ids mkdocs gives the page's headings (its toc extension, as configured in mkdocs.yml)."""
    parsed = markdown.Markdown(extensions=["toc", "tables", "fenced_code"])
    parsed.convert(page.read_text())
    pending, ids = list(parsed.toc_tokens), set()
    while pending:
        token = pending.pop()
        ids.add(token["id"])
        pending.extend(token["children"])
    return ids


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(path):
    """Links out of docs/ (to results/, the README) are no pages to mkdocs, so nothing else checks them."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.parent == DOCS and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{path.relative_to(REPO_ROOT)}: {broken}"


def test_configuration_reference_is_the_generators_output():
    committed = reference.PAGE.read_text(encoding="utf-8") if reference.PAGE.is_file() else ""
    assert committed == reference.render(), f"{reference.PAGE.relative_to(REPO_ROOT)} is out of date: run {reference.REGENERATE}"


def test_configuration_reference_lists_every_option():
    page = reference.PAGE.read_text(encoding="utf-8")
    missing = [key for key in reference.repo_options() if f"| `{key}` |" not in page]
    assert not missing, missing


def test_make_help_lists_every_target_the_makefile_describes():
    """`models/smollm2` (a target with a slash) was missing from `make help`."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    described = re.findall(r"^([^\s:#=]+):[^=\n]*## ", (REPO_ROOT / "Makefile").read_text(), flags=re.M)
    shown = subprocess.run(["make", "-s", "help"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert "models/smollm2" in described and [line.split()[0] for line in shown.splitlines() if line.strip()] == described
