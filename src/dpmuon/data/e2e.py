"""Readers for the E2E NLG dataset in its two raw formats.

* the original CSV release (`mr,ref`, untokenized text), and
* the Prefix-Tuning text format (`source||target`, tokenized text) on which prior DP work
  trained and evaluated.

Both produce sources in the same linearization, `name : X | Type : Y | ...`, so a model's
prompt looks alike whichever format it was read from (values still differ in tokenization).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

from dpmuon.data.dataset import DatasetSettings, FileReader
from dpmuon.data.errors import DataError
from dpmuon.data.records import Example
from dpmuon.data.textio import open_text
from dpmuon.settings import option, settings

CSV_COLUMNS = ("mr", "ref")

# The attribute names the Prefix-Tuning format uses, keyed by the names in the original
# CSV meaning representations; reusing them keeps CSV-derived prompts in the same shape.
LINEARIZED_ATTRIBUTE_NAMES = {
    "name": "name",
    "eatType": "Type",
    "priceRange": "price",
    "customer rating": "customer rating",
    "familyFriendly": "family friendly",
    "food": "food",
    "area": "area",
    "near": "near",
}

# One `attribute[value]` pair. Values are matched up to the closing bracket rather than
# split on commas, so a value containing a comma would survive (none occur in the release).
_MR_PAIR = re.compile(r"\s*([^\[\],]+?)\s*\[([^\[\]]*)\]\s*")
_MR_EXAMPLE = "name[The Eagle], eatType[pub], near[Burger King]"


def linearize_meaning_representation(mr: str) -> str:
    """Turn `name[The Eagle], eatType[pub]` into `name : The Eagle | Type : pub`.

    Raises ValueError (without a location; callers add it) when `mr` is malformed.
    """
    pairs: list[str] = []
    position = 0
    while True:
        match = _MR_PAIR.match(mr, position)
        if match is None:
            raise ValueError(
                f"malformed meaning representation {mr!r} at character {position + 1}: "
                f"expected attribute[value] pairs separated by commas, like {_MR_EXAMPLE!r}"
            )
        attribute, value = match.group(1), match.group(2).strip()
        if attribute not in LINEARIZED_ATTRIBUTE_NAMES:
            raise ValueError(f"unknown attribute {attribute!r} in meaning representation {mr!r}; expected one of {', '.join(LINEARIZED_ATTRIBUTE_NAMES)}")
        if not value:
            raise ValueError(f"attribute {attribute!r} has an empty value in {mr!r}")
        pairs.append(f"{LINEARIZED_ATTRIBUTE_NAMES[attribute]} : {value}")
        position = match.end()
        if position == len(mr):
            return " | ".join(pairs)
        if mr[position] != ",":
            raise ValueError(
                f"malformed meaning representation {mr!r} at character {position + 1}: expected a comma between attribute[value] pairs, like {_MR_EXAMPLE!r}"
            )
        position += 1


def read_e2e_csv(path: str | PathLike[str]) -> list[Example]:
    """Read an original E2E CSV file (header `mr,ref`), one Example per row, in file order.

    Line numbers in errors are 1-based and count the header line; a row whose quoted text
    spans several lines is reported at the line where it starts.
    """
    path = Path(path)
    examples: list[Example] = []
    with open_text(path, newline="") as handle:
        reader = csv.reader(handle, strict=True)
        try:
            header = next(reader, None)
            if header is None:
                raise DataError.in_file(path, "the file is empty; expected a header line `mr,ref`")
            _check_csv_header(path, header)
            row_start_line = reader.line_num + 1
            for row in reader:
                line, row_start_line = row_start_line, reader.line_num + 1
                if row:  # the csv module yields [] for blank lines, which carry no example
                    examples.append(_example_from_csv_row(path, line, row))
        except csv.Error as error:
            raise DataError.in_file(path, f"malformed CSV ({error})", line=reader.line_num) from error
    if not examples:
        raise DataError.in_file(path, "no data rows after the header; expected `mr,ref` rows")
    return examples


def _check_csv_header(path: Path, header: list[str]) -> None:
    # A byte-order mark from spreadsheet exports would otherwise hide the first column name.
    names = [name.strip().lstrip("\ufeff").lower() for name in header]
    if tuple(names) != CSV_COLUMNS:
        raise DataError.in_file(
            path,
            f"unexpected columns {header!r}; expected the columns {', '.join(CSV_COLUMNS)} "
            "(an E2E file with references, e.g. devset.csv or testset_w_refs.csv)",
            line=1,
        )


def _example_from_csv_row(path: Path, line: int, row: list[str]) -> Example:
    if len(row) != len(CSV_COLUMNS):
        raise DataError.in_file(
            path,
            f"expected {len(CSV_COLUMNS)} columns ({', '.join(CSV_COLUMNS)}), found {len(row)}: {row!r}",
            line=line,
        )
    mr, reference = row
    try:
        source = linearize_meaning_representation(mr)
    except ValueError as error:
        raise DataError.in_file(path, str(error), line=line) from error
    return Example(source=source, target=reference.strip())


def read_e2e_prefix(path: str | PathLike[str]) -> list[Example]:
    """Read the Prefix-Tuning text format, lines `source||target `, one Example per line.

    Both sides are stripped: every target in the released files ends with a space that is not
    part of the reference. Blank lines are skipped.
    """
    path = Path(path)
    examples: list[Example] = []
    with open_text(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            # Sources are `key : value | key : value`, so the first `||` ends the source.
            source, separator, target = line.rstrip("\r\n").partition("||")
            if not separator:
                raise DataError.in_file(
                    path,
                    f"no `||` separator in {line.rstrip()!r}; expected `source||target`",
                    line=line_number,
                )
            if not source.strip():
                raise DataError.in_file(path, "empty source before `||`", line=line_number)
            examples.append(Example(source=source.strip(), target=target.strip()))
    if not examples:
        raise DataError.in_file(path, "the file is empty; expected lines `source||target`")
    return examples


# The formats E2E is read in (data/layout.py: where each one's files are); the first is the default.
READERS = {"prefix": read_e2e_prefix, "csv": read_e2e_csv}


@settings("dataset")
@dataclass(kw_only=True)
class E2ESettings(DatasetSettings):
    """E2E (data/layout.py: under <data root>/e2e/), with the recipe's δ. Formats: `prefix`, the
    Prefix-Tuning text files (prior DP work's), or `csv`, the original mr,ref release."""

    name: str = option("e2e", "the private set's name (run folders, the ledger, tables)")
    format: str = option("prefix", "file format read (E2E: prefix or csv; DART: json)", choices=tuple(READERS))
    delta: float = option(8.0e-6, "δ of the recipe (privacy.delta defaults to it); must be < 1/N", gt=0, lt=1)

    def reader(self, data_root: Path, tokenizer, progress: bool = True) -> FileReader:
        return FileReader("e2e", self.format, READERS[self.format], data_root, tokenizer=tokenizer)
