"""`scripts/download_data.py --link` on temporary directories (downloads are never tried)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpmuon.data import DATASETS, SPLITS, load_examples, locate_split
from dpmuon.data.download import REMOTE_FILES, main
from dpmuon.data.layout import FORMATS
from dpmuon.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "download_data.py"


@pytest.fixture
def local_copy(tmp_path: Path) -> Path:
    """A local copy laid out like the shared data directory, with one tiny file per dataset."""
    copy = tmp_path / "copy"
    prefix_dir = copy / "e2e" / "prefix_tuning_format"
    prefix_dir.mkdir(parents=True)
    (prefix_dir / "src1_test.txt").write_text("name : A||a . \n", encoding="utf-8")
    (copy / "dart").mkdir()
    (copy / "dart" / "dart-v1.1.1-full-dev.json").write_text('[{"tripleset": [["s", "r", "o"]], "annotations": [{"text": "t"}]}]', encoding="utf-8")
    return copy


def test_link_makes_each_dataset_folder_a_symlink(tmp_path: Path, local_copy: Path) -> None:
    root = tmp_path / "raw"

    assert main(["--root", str(root), "--link", str(local_copy)]) == 0

    for dataset in ("e2e", "dart"):
        assert (root / dataset).is_symlink()
        assert (root / dataset).resolve() == (local_copy / dataset).resolve()
    assert len(load_examples("e2e", "test", root)) == 1
    assert len(load_examples("dart", "valid", root)) == 1


def test_link_selects_datasets_and_is_repeatable(tmp_path: Path, local_copy: Path) -> None:
    root = tmp_path / "raw"

    assert main(["--root", str(root), "--link", str(local_copy), "--datasets", "dart"]) == 0
    assert main(["--root", str(root), "--link", str(local_copy), "--datasets", "dart"]) == 0

    assert sorted(os.listdir(root)) == ["dart"]


def test_link_replaces_an_empty_folder_but_never_real_data(tmp_path: Path, local_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "raw"
    (root / "e2e").mkdir(parents=True)
    (root / "dart").mkdir()
    (root / "dart" / "downloaded.json").write_text("[]", encoding="utf-8")

    assert main(["--root", str(root), "--link", str(local_copy)]) == 1

    assert (root / "e2e").is_symlink()
    assert (root / "dart" / "downloaded.json").is_file()
    assert "exists and is not a symlink" in capsys.readouterr().err


def test_link_to_a_folder_without_the_dataset_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(tmp_path / "raw"), "--link", str(tmp_path / "nowhere")]) == 1

    error = capsys.readouterr().err
    assert error.startswith("error: ") and "is not a directory" in error
    assert "Traceback" not in error


def test_script_entry_point_links(tmp_path: Path, local_copy: Path) -> None:
    root = tmp_path / "raw"
    command = [sys.executable, str(SCRIPT), "--root", str(root), "--link", str(local_copy)]

    result = subprocess.run(command, capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    assert (root / "e2e").is_symlink() and (root / "dart").is_symlink()


def test_downloaded_files_are_where_the_loaders_look(tmp_path: Path) -> None:
    for dataset, remotes in REMOTE_FILES.items():
        for remote in remotes:
            assert remote.url.startswith("https://")
            destination = tmp_path / dataset / remote.relative_path
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.touch()

    for dataset in DATASETS:
        for fmt in FORMATS[dataset]:
            for split in SPLITS:
                assert locate_split(dataset, split, tmp_path, fmt).is_file()
