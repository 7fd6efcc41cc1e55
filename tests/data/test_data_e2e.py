"""E2E readers on small synthetic files: linearization, stripping, and every error case."""

import gzip
from pathlib import Path

import pytest

from dpmuon.data import DataError, Example, read_e2e_csv, read_e2e_prefix

CSV_HEADER = '"mr","ref"\n'


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_linearizes_every_attribute_with_the_prefix_format_names(tmp_path: Path) -> None:
    mr = (
        "name[The Eagle], eatType[coffee shop], food[Japanese], priceRange[less than £20], "
        "customer rating[low], area[riverside], familyFriendly[yes], near[Burger King]"
    )
    path = write(tmp_path / "devset.csv", f'{CSV_HEADER}"{mr}","The Eagle is cheap. "\n')

    assert read_e2e_csv(path) == [
        Example(
            source=(
                "name : The Eagle | Type : coffee shop | food : Japanese | "
                "price : less than £20 | customer rating : low | area : riverside | "
                "family friendly : yes | near : Burger King"
            ),
            target="The Eagle is cheap.",
        )
    ]


def test_csv_accepts_unquoted_header_crlf_and_a_comma_inside_a_value(tmp_path: Path) -> None:
    path = tmp_path / "devset.csv"
    path.write_bytes(b'mr,ref\r\n"name[Bar, The], area[riverside]",Fine.\r\n\r\n')

    assert read_e2e_csv(path) == [Example(source="name : Bar, The | area : riverside", target="Fine.")]


def test_csv_reads_gzip(tmp_path: Path) -> None:
    path = tmp_path / "devset.csv.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(f'{CSV_HEADER}"name[A]","a"\n"name[B]","b"\n')

    assert [example.source for example in read_e2e_csv(path)] == ["name : A", "name : B"]


def test_csv_row_with_wrong_column_count_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "devset.csv", f'{CSV_HEADER}"name[A]","a"\n"name[B]","b","extra"\n')

    with pytest.raises(DataError, match=r"devset\.csv, line 3: expected 2 columns"):
        read_e2e_csv(path)


def test_csv_line_numbers_count_from_the_start_of_a_multiline_row(tmp_path: Path) -> None:
    path = write(tmp_path / "devset.csv", f'{CSV_HEADER}"name[A]","two\nlines"\n"name B","b"\n')

    with pytest.raises(DataError, match=r"devset\.csv, line 4: malformed meaning representation"):
        read_e2e_csv(path)


@pytest.mark.parametrize(
    ("mr", "problem"),
    [
        ("name The Eagle", "malformed meaning representation"),
        ("name[The Eagle] area[riverside]", "expected a comma"),
        ("name[The Eagle", "malformed meaning representation"),
        ("colour[red]", "unknown attribute 'colour'"),
        ("name[]", "empty value"),
    ],
)
def test_malformed_meaning_representation_names_file_and_line(tmp_path: Path, mr: str, problem: str) -> None:
    path = write(tmp_path / "testset_w_refs.csv", f'{CSV_HEADER}"{mr}","text"\n')

    with pytest.raises(DataError, match=r"testset_w_refs\.csv, line 2: ") as raised:
        read_e2e_csv(path)
    assert problem in str(raised.value)


def test_csv_with_broken_quoting_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "devset.csv", f'{CSV_HEADER}"name[A]","a"\n"name[B]"x,"b"\n')

    with pytest.raises(DataError, match=r"devset\.csv, line 3: malformed CSV"):
        read_e2e_csv(path)


def test_csv_with_wrong_header_lists_the_expected_columns(tmp_path: Path) -> None:
    path = write(tmp_path / "testset.csv", 'MR\n"name[A]"\n')

    with pytest.raises(DataError, match=r"testset\.csv, line 1: .*expected the columns mr, ref"):
        read_e2e_csv(path)


@pytest.mark.parametrize("text", ["", CSV_HEADER])
def test_csv_without_rows_is_an_error(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "devset.csv", text)

    with pytest.raises(DataError, match=r"devset\.csv"):
        read_e2e_csv(path)


def test_csv_that_is_not_utf8_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "devset.csv"
    path.write_bytes(CSV_HEADER.encode() + b'"name[\xff]","x"\n')

    with pytest.raises(DataError, match=r"devset\.csv: not UTF-8"):
        read_e2e_csv(path)


def test_prefix_splits_on_separator_and_strips_the_trailing_space(tmp_path: Path) -> None:
    path = write(
        tmp_path / "src1_valid.txt",
        "name : A | Type : pub||A is a pub . \n\nname : B||B | C . \n",
    )

    assert read_e2e_prefix(path) == [
        Example(source="name : A | Type : pub", target="A is a pub ."),
        Example(source="name : B", target="B | C ."),
    ]


def test_prefix_line_without_separator_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "src1_test.txt", "name : A||a \nname : B | b \n")

    with pytest.raises(DataError, match=r"src1_test\.txt, line 2: no `\|\|` separator"):
        read_e2e_prefix(path)


def test_prefix_empty_file_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "src1_train.txt", "\n")

    with pytest.raises(DataError, match=r"src1_train\.txt: the file is empty"):
        read_e2e_prefix(path)


def test_truncated_gzip_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "src1_train.txt.gz"
    path.write_bytes(gzip.compress(b"name : A||a \n" * 1000)[:50])

    with pytest.raises(DataError, match=r"src1_train\.txt\.gz: not a complete gzip file"):
        read_e2e_prefix(path)


def test_reading_a_missing_file_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothing\.txt: cannot open"):
        read_e2e_prefix(tmp_path / "nothing.txt")
