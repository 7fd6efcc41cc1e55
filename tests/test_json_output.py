"""Every JSON file and line dpmuon writes is strict JSON: a non-finite number is `null`, never
the bare `NaN`/`Infinity` that Python's json writes and strict parsers (jq, JavaScript) reject."""

from __future__ import annotations

import json
import math
import re

import pytest

from dpmuon.jsontext import to_json
from dpmuon.paths import REPO_ROOT
from dpmuon.privacy.__main__ import main as privacy_main


def strict_loads(text: str):
    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_at_any_depth():
    obj = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (2.0,), "e": "NaN"}
    assert strict_loads(to_json(obj)) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2.0], "e": "NaN"}


def test_every_json_writer_of_the_project_goes_through_the_strict_one():
    """json.dump(s) anywhere else could write NaN again; hashing a canonical form writes nothing."""
    allowed = {"src/dpmuon/jsontext.py", "src/dpmuon/training/data.py"}  # data.py: a fingerprint's hash input
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for folder in ("src", "scripts")
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        if str(path.relative_to(REPO_ROOT)) not in allowed
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bjson\.dumps?\(", line)
    ]
    assert not offenders, f"write JSON with dpmuon.jsontext.to_json: {offenders}"


@pytest.mark.parametrize("sigma", ["-1", "0"])
def test_the_privacy_cli_prints_strict_json_or_refuses(sigma, capsys):
    code = privacy_main(["--noise-multiplier", sigma, "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "10"])
    out = capsys.readouterr().out
    if code == 0:
        strict_loads(out)
    else:
        assert out == ""
