"""Finding splits under a data root, loading them, and grouping references."""

import gzip
from pathlib import Path

import pytest

from dpmuon.data import (
    DATASETS,
    SPLITS,
    DataError,
    EvalItem,
    Example,
    default_data_root,
    group_references,
    load_examples,
    locate_split,
)


def make_file(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_public_constants() -> None:
    assert DATASETS == ("e2e", "dart")
    assert SPLITS == ("train", "valid", "test")


@pytest.mark.parametrize(
    ("dataset", "split", "fmt", "relative"),
    [
        ("e2e", "train", None, "e2e/prefix_tuning_format/src1_train.txt"),
        ("e2e", "valid", "prefix", "e2e/prefix_tuning_format/src1_valid.txt.gz"),
        ("e2e", "train", "csv", "e2e/trainset.csv"),
        ("e2e", "valid", "csv", "e2e/devset.csv"),
        ("e2e", "test", "csv", "e2e/testset_w_refs.csv"),
        ("dart", "valid", None, "dart/dart-v1.1.1-full-dev.json"),
        ("dart", "test", "json", "dart/dart-v1.1.1-full-test.json.gz"),
        ("dart", "train", None, "dart/dart-v1.1.1-full-train.reconstructed.json.gz"),
    ],
)
def test_locate_split_finds_each_layout(tmp_path: Path, dataset: str, split: str, fmt: str | None, relative: str) -> None:
    expected = make_file(tmp_path / relative)

    assert locate_split(dataset, split, tmp_path, fmt) == expected
    assert locate_split(dataset, split, str(tmp_path), fmt) == expected


def test_official_dart_train_is_preferred_over_the_reconstruction(tmp_path: Path) -> None:
    make_file(tmp_path / "dart/dart-v1.1.1-full-train.reconstructed.json")
    official = make_file(tmp_path / "dart/dart-v1.1.1-full-train.json.gz")

    assert locate_split("dart", "train", tmp_path) == official


def test_missing_split_lists_tried_paths_and_says_make_data(tmp_path: Path) -> None:
    with pytest.raises(DataError) as raised:
        locate_split("e2e", "test", tmp_path)
    message = str(raised.value)
    assert "make data" in message
    assert "download_data.py --link DIR" in message
    assert str(tmp_path / "e2e/prefix_tuning_format/src1_test.txt.gz") in message


@pytest.mark.parametrize(
    ("dataset", "split", "fmt", "listed"),
    [
        ("webnlg", "train", None, "e2e, dart"),
        ("e2e", "dev", None, "train, valid, test"),
        ("e2e", "train", "json", "prefix, csv"),
        ("dart", "train", "csv", "json"),
    ],
)
def test_unknown_names_list_the_valid_values(tmp_path: Path, dataset: str, split: str, fmt: str | None, listed: str) -> None:
    with pytest.raises(DataError, match=f"expected one of {listed}"):
        locate_split(dataset, split, tmp_path, fmt)
    with pytest.raises(DataError, match=f"expected one of {listed}"):
        load_examples(dataset, split, tmp_path, fmt)


def test_default_data_root_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPMUON_DATA_DIR", str(tmp_path))
    assert default_data_root() == tmp_path


def test_default_data_root_is_data_raw_in_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DPMUON_DATA_DIR", raising=False)
    root = default_data_root()
    assert root.parts[-2:] == ("data", "raw")
    assert (root.parent.parent / "pyproject.toml").is_file()


def test_load_examples_reads_each_format_from_a_root(tmp_path: Path) -> None:
    make_file(tmp_path / "e2e/prefix_tuning_format/src1_test.txt", "name : A||a . \n")
    make_file(tmp_path / "e2e/testset_w_refs.csv", 'mr,ref\n"name[A]",a.\n')
    make_file(
        tmp_path / "dart/dart-v1.1.1-full-test.json.gz",
        '[{"tripleset": [["s", "r", "o"]], "annotations": [{"text": "t"}]}]',
    )

    assert load_examples("e2e", "test", tmp_path) == [Example("name : A", "a .")]
    assert load_examples("e2e", "test", tmp_path, fmt="csv") == [Example("name : A", "a.")]
    assert load_examples("dart", "test", tmp_path) == [Example("s : r : o", "t")]


def test_load_examples_defaults_to_the_data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_file(tmp_path / "e2e/prefix_tuning_format/src1_valid.txt", "name : A||a \n")
    monkeypatch.setenv("DPMUON_DATA_DIR", str(tmp_path))

    assert load_examples("e2e", "valid") == [Example("name : A", "a")]


def test_group_references_keeps_first_appearance_and_file_order() -> None:
    examples = [Example("b", "b1"), Example("a", "a1"), Example("b", "b2"), Example("a", "")]

    assert group_references(examples) == [
        EvalItem("b", ("b1", "b2")),
        EvalItem("a", ("a1", "")),
    ]
    assert group_references([]) == []


def test_each_dataset_module_parses_exactly_the_formats_the_layout_locates():
    """Two tables, each said once: where a format's files are (layout) and how it is parsed (the
    dataset module's READERS, whose keys are also its settings' `format` choices)."""
    from dpmuon.data import dart, e2e
    from dpmuon.data.layout import FORMATS

    for module, settings, name in ((e2e, e2e.E2ESettings, "e2e"), (dart, dart.DARTSettings, "dart")):
        assert tuple(module.READERS) == FORMATS[name]
        assert next(o for o in declared(settings) if o.key.endswith(".format")).choices == FORMATS[name]
        assert settings().format == FORMATS[name][0]  # the default format is the layout's first


def declared(cls):
    from dpmuon.settings import declared_options

    return declared_options("dataset", cls)
