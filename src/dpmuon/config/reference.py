"""docs/configuration-reference.md, generated from the schema and conf/ (the page is never edited
by hand): every option with what it accepts, its default and its help, as `--options` prints them.

    python -m dpmuon.config.reference            # rewrite docs/configuration-reference.md
    python -m dpmuon.config.reference --check    # exit 1 if the committed page is stale
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import shown_value
from ..paths import CONFIG_DIR, REPO_ROOT
from .options import GROUPS, SECTIONS, collect_defaults, group_options
from .schema import GROUP_CLASSES, Option, repo_options

PAGE = REPO_ROOT / "docs" / "configuration-reference.md"
REGENERATE = "make docs (or: python -m dpmuon.config.reference)"

INTRO = f"""# Configuration reference

<!-- Generated from config/schema.py, the settings classes and conf/ by `python -m dpmuon.config.reference`; do not edit: {REGENERATE} rewrites it. -->

Every option of `python -m dpmuon.train` (the same as `python -m dpmuon.train --options`). Set one on
the command line as `key=value`, choose a config group's option as `group=option`. *Valid* is what the
check before any data or model is read accepts (`src/dpmuon/config/schema.py`, and for an optimizer's
or a dataset's own options the fields of the class its `_target_` names); *default* is the composed
`conf/` completed with those classes' defaults (shown without `DPMUON_*` environment variables), and
for a config group's keys the value each of its options gives, where they differ. How the options
fit together: [Configuration](configuration.md).
"""


def render(config_dir: str | Path = CONFIG_DIR) -> str:
    """The whole page, as committed."""
    with _without_dpmuon_environment():  # e.g. $DPMUON_TOKENIZER would leak into model.tokenizer
        defaults = collect_defaults(str(config_dir))
    choices = {group: group_options(str(config_dir), group) for group in (*GROUPS, "experiment")}
    parts = [INTRO]
    for section in SECTIONS:
        parts.append(_section(section, choices, defaults))
    experiments = ", ".join(f"`{name}`" for name in choices["experiment"])
    parts.append(f"## experiment\n\n`experiment=NAME` applies `conf/experiment/NAME.yaml` (`# @package _global_` deltas): {experiments}.\n")
    return "\n".join(parts)


@contextmanager
def _without_dpmuon_environment() -> Iterator[None]:
    saved = {key: os.environ.pop(key) for key in list(os.environ) if key.startswith("DPMUON_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def _section(section: str, choices: dict, defaults: dict) -> str:
    if section in GROUPS:
        options = ", ".join(f"`{name}`" for name in choices[section])
        chosen = defaults["__choices__"][section]
        where = f"Choose with `{section}=NAME`, one of {options} (default `{chosen}`; `conf/{section}/NAME.yaml`)."
    else:
        where = "Set in `conf/config.yaml`."
    if section in GROUP_CLASSES:
        cls = GROUP_CLASSES[section]
        where += f" Declared by `{cls.__module__}.{cls.__qualname__}`, whose defaults these are unless the YAML sets its own."
    rows = [_row(option, defaults.get(option.key, {})) for option in repo_options().values() if option.group == section]
    table = "\n".join(["| key | valid | default | description |", "|---|---|---|---|", *rows])
    return f"## {section or 'top level'}\n\n{where}\n\n{table}\n"


def _row(option: Option, values: dict) -> str:
    default = _code(values[""]) if "" in values else "–"
    by_option = {label: value for label, value in values.items() if label}
    differs = len({shown_value(v) for v in by_option.values()}) > 1 or "" not in values
    names_itself = all(str(v) == label for label, v in by_option.items())  # e.g. dataset.name
    if by_option and differs and not names_itself:
        default += "<br>per option: " + ", ".join(f"{_text(label)} {_code(value)}" for label, value in by_option.items())
    return f"| `{option.key}` | {_text(option.valid())} | {default} | {_text(option.help)} |"


def _code(value) -> str:
    """A value as code, unless it holds a character a table cell's code span cannot carry."""
    text = shown_value(value)
    return _text(text) if "|" in text or "`" in text else f"`{text}`"


def _text(text: str) -> str:
    """Plain table-cell text: `<` cannot open an HTML tag, Markdown's special characters are escaped."""
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", text.replace("&", "&amp;").replace("<", "&lt;"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare the committed page with the generated one")
    parser.add_argument("--out", type=Path, default=PAGE, help=f"where the page goes (default: {PAGE.relative_to(REPO_ROOT)})")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = args.out.is_file() and args.out.read_text(encoding="utf-8") == page
        if not current:
            print(f"error: {args.out} is out of date; regenerate it: {REGENERATE}")
        return 0 if current else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
