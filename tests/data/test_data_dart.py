"""DART reader on small synthetic files: linearization, one example per annotation, errors."""

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from dpmuon.data import DataError, Example, read_dart_json


def write_json(path: Path, items: Any) -> Path:
    path.write_text(json.dumps(items, indent=2), encoding="utf-8")
    return path


def item(tripleset: Any, *texts: str, origin: str = "webnlg") -> dict[str, Any]:
    return {"tripleset": tripleset, "annotations": [{"source": origin, "text": t} for t in texts]}


def test_one_example_per_annotation_with_linearized_triples(tmp_path: Path) -> None:
    first = item([["Mars Hill", "JOINED", "1973"], ["Mars Hill", "LOCATION", "NC"]], " A. ", "B.")
    first["subtree_was_extended"] = True  # optional key, absent in many real items
    path = write_json(tmp_path / "dev.json", [first, item([["X", "Y", "Z"]], "")])

    assert read_dart_json(path) == [
        Example("Mars Hill : JOINED : 1973 | Mars Hill : LOCATION : NC", "A.", "webnlg"),
        Example("Mars Hill : JOINED : 1973 | Mars Hill : LOCATION : NC", "B.", "webnlg"),
        # An empty text is a real reference in the official test set, so it is kept.
        Example("X : Y : Z", "", "webnlg"),
    ]


def test_reads_gzip(tmp_path: Path) -> None:
    path = tmp_path / "test.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        json.dump([item([["a", "b", "c"]], "t")], handle)

    assert read_dart_json(path) == [Example("a : b : c", "t", "webnlg")]


def test_origins_can_be_excluded_in_every_split(tmp_path: Path) -> None:
    """DART's E2E-derived annotations can be dropped to keep DART disjoint from E2E."""
    from dpmuon.data import load_examples

    (tmp_path / "dart").mkdir()
    mixed = [item([["a", "b", "c"]], "from e2e", origin="e2e"), item([["d", "e", "f"]], "from webnlg")]
    for split in ("train", "dev", "test"):
        write_json(tmp_path / "dart" / f"dart-v1.1.1-full-{split}.json", mixed)
    for split in ("train", "valid", "test"):
        assert [e.target for e in load_examples("dart", split, tmp_path)] == ["from e2e", "from webnlg"]
        assert [e.target for e in load_examples("dart", split, tmp_path, exclude_origins=["e2e"])] == ["from webnlg"]


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "dev.json"
    path.write_text('[\n  {"tripleset": [],\n  "annotations" []}\n]', encoding="utf-8")

    with pytest.raises(DataError, match=r"dev\.json, line 3: invalid JSON at column 17"):
        read_dart_json(path)


@pytest.mark.parametrize(
    ("bad_item", "problem"),
    [
        ({"annotations": [{"text": "t"}]}, "expected `tripleset` to be a non-empty list"),
        ({"tripleset": [["a", "b", "c"]]}, "expected `annotations` to be a non-empty list"),
        (item([["a", "b"]], "t"), "triple 0 is ['a', 'b']; expected a list of 3 strings"),
        (item([["a", "b", "c"], "a : b : c"], "t"), "triple 1 is 'a : b : c'; expected a list"),
        (item([["a", "b", 3]], "t"), "expected a list of 3 strings"),
        ({"tripleset": [["a", "b", "c"]], "annotations": [{"txt": "t"}]}, "string `text`"),
        (["a", "b", "c"], "expected an object with `tripleset` and `annotations`"),
    ],
)
def test_malformed_item_names_file_index_and_expectation(tmp_path: Path, bad_item: Any, problem: str) -> None:
    path = write_json(tmp_path / "train.json", [item([["a", "b", "c"]], "ok"), bad_item])

    with pytest.raises(DataError, match=r"train\.json: item 1 \(counting from 0\): ") as raised:
        read_dart_json(path)
    assert problem in str(raised.value)


@pytest.mark.parametrize(
    ("text", "problem"),
    [("", "the file is empty"), ("[]", "holds no items"), ('{"a": 1}', "expected a JSON list")],
)
def test_empty_or_non_list_file_is_an_error(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "dev.json"
    path.write_text(text, encoding="utf-8")

    with pytest.raises(DataError, match=r"dev\.json: ") as raised:
        read_dart_json(path)
    assert problem in str(raised.value)
