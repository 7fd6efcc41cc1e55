"""Where the repository's own files are, for code that runs from a checkout (configs, the
committed results, the git version): one definition of the repository root."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "conf"
