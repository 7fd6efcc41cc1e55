"""Where the repository's own files are, for code that runs from a checkout (configs, the
committed results, the git version, the default data folder): one definition of the repository
root. Imports nothing but pathlib: every package, the data package included, may use it."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # src/dpmuon/paths.py → the checkout
CONFIG_DIR = REPO_ROOT / "conf"


def in_checkout() -> bool:
    """Whether this code runs from a checkout (an editable install) rather than an installed
    package, whose REPO_ROOT is just a folder above site-packages."""
    return (REPO_ROOT / "pyproject.toml").is_file()
