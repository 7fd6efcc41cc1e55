"""Plain records shared by every reader and by evaluation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One (linearized table, reference text) pair, the unit of training.

    `origin` names the corpus an annotation comes from where a dataset mixes several (DART:
    "e2e", "webnlg", "WikiSQL_lily", …); empty otherwise.
    """

    source: str
    target: str
    origin: str = ""


@dataclass(frozen=True)
class EvalItem:
    """One distinct source with all of its references, the unit of multi-reference scoring."""

    source: str
    references: tuple[str, ...]


def group_references(examples: Sequence[Example]) -> list[EvalItem]:
    """Group examples by identical source.

    Items come in order of each source's first appearance and keep their references in file
    order, so generations written in this order line up with the grouped references.
    """
    references_by_source: dict[str, list[str]] = {}
    for example in examples:
        references_by_source.setdefault(example.source, []).append(example.target)
    return [EvalItem(source, tuple(refs)) for source, refs in references_by_source.items()]
