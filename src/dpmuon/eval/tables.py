"""Result tables per dataset (Markdown, CSV, LaTeX) from run summaries, beside the paper's numbers.

Output is a pure function of the summaries (no timestamps, no absolute paths, fixed float
formats) so that re-running on the same runs reproduces every file byte-for-byte.
"""

from __future__ import annotations

import csv
import io
import shlex
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dpmuon.eval import study
from dpmuon.eval.grouping import RunGroup, format_epsilon, group_runs, runs_by_dataset
from dpmuon.eval.paper import PAPER_CITATION, PAPER_MODEL, paper_result
from dpmuon.eval.runs import Run, RunFormatError

NOT_MEASURED = "not measured"
NOT_APPLICABLE = "—"
NOT_REPORTED = "not reported"
EPSILON_DECIMALS = 2


@dataclass(frozen=True)
class MetricColumn:
    key: str  # summary.json key
    header: str
    decimals: int
    paper_key: str | None  # key in PAPER_RESULTS, None when the paper has no such column
    # A metric added after some runs were made: its column appears only in tables where some
    # run's summary has the key, so tables of older runs stay as they were.
    optional: bool = False


METRIC_COLUMNS = (
    MetricColumn("test_nll", "test NLL", 4, "nll"),
    MetricColumn("bleu", "BLEU", 2, "bleu"),
    MetricColumn("bleu_lowercase", "BLEU (lowercase)", 2, None, optional=True),
    MetricColumn("bleu_single_ref", "BLEU (single ref)", 2, None),
    MetricColumn("rouge_l", "ROUGE-L", 2, "rouge_l"),
)
PAPER_COLUMNS = tuple(column for column in METRIC_COLUMNS if column.paper_key is not None)
_METRIC_NAMES = {column.key: column.header for column in METRIC_COLUMNS}

LEGEND = (
    "Cells are mean ± sample standard deviation over the group's runs (seeds). "
    '"(n=1)": a single run, no spread. "(n=k of m)": only k of the group\'s m runs measured it. '
    f'"{NOT_MEASURED}": no run of the group recorded it. "{NOT_APPLICABLE}": not applicable '
    f'(non-private runs have no ε). "{NOT_REPORTED}": the paper gives no number for this cell. '
    "Empty paper cells: the paper has no row for this optimizer at this target ε."
)


@dataclass(frozen=True)
class MetricStat:
    """The non-null values a group's runs recorded for one quantity."""

    values: tuple[float, ...]
    n_runs: int

    @classmethod
    def of(cls, runs: Sequence[Run], key: str) -> MetricStat:
        values = tuple(float(run.summary[key]) for run in runs if run.summary.get(key) is not None)
        return cls(values, len(runs))

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    def display(self, decimals: int) -> str:
        if not self.values:
            return NOT_MEASURED
        text = f"{self.mean:.{decimals}f}"
        if self.std is not None:
            text += f" ± {self.std:.{decimals}f}"
        if len(self.values) < self.n_runs:
            return f"{text} (n={len(self.values)} of {self.n_runs})"
        return f"{text} (n=1)" if self.n_runs == 1 else text


@dataclass(frozen=True)
class TableRow:
    group: RunGroup
    epsilon_spent: MetricStat | None  # None: the group is non-private
    metrics: dict[str, MetricStat]
    paper: dict[str, float | None] | None  # None: the paper has no comparable row
    columns: tuple[MetricColumn, ...]  # the table's metric columns (shared by all its rows)

    @classmethod
    def of(cls, dataset: str, group: RunGroup, columns: tuple[MetricColumn, ...]) -> TableRow:
        return cls(
            group=group,
            epsilon_spent=MetricStat.of(group.runs, "epsilon") if group.key.private else None,
            metrics={column.key: MetricStat.of(group.runs, column.key) for column in columns},
            paper=paper_result(dataset, group.key.optimizer, group.key.target_epsilon),
            columns=columns,
        )

    @property
    def seeds(self) -> list[int]:
        return sorted(run.seed for run in self.group.runs)

    def display_cells(self) -> list[str]:
        key = self.group.key
        if not key.private:
            target = f"{NOT_APPLICABLE} (non-private)"
        else:
            target = NOT_MEASURED if key.target_epsilon is None else format_epsilon(key.target_epsilon)
        cells = [
            self.group.label,
            key.model,
            target,
            NOT_APPLICABLE if self.epsilon_spent is None else self.epsilon_spent.display(EPSILON_DECIMALS),
            self._seeds_cell(),
        ]
        cells += [self.metrics[column.key].display(column.decimals) for column in self.columns]
        cells += [self._paper_cell(column) for column in PAPER_COLUMNS]
        return cells

    def _seeds_cell(self) -> str:
        seeds = self.seeds
        text = f"{len(seeds)} (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
        repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
        if repeated:  # only with --pool: n counts runs, not independent seeds
            text += "; repeated: " + ", ".join(f"seed {seed} ×{seeds.count(seed)}" for seed in repeated)
        return text + ")"

    def _paper_cell(self, column: MetricColumn) -> str:
        if self.paper is None:
            return ""
        value = self.paper[column.paper_key]
        return NOT_REPORTED if value is None else f"{value:.{column.decimals}f}"


def build_rows(dataset: str, runs: Sequence[Run], pool: bool = False) -> list[TableRow]:
    columns = shown_columns(runs)
    return [TableRow.of(dataset, group, columns) for group in group_runs(runs, pool)]


def shown_columns(runs: Sequence[Run]) -> tuple[MetricColumn, ...]:
    """The metric columns of a table: every column, less optional ones that no run recorded."""
    return tuple(c for c in METRIC_COLUMNS if not c.optional or any(c.key in run.summary for run in runs))


def table_columns(rows: Sequence[TableRow]) -> tuple[MetricColumn, ...]:
    return rows[0].columns if rows else shown_columns(())


def table_headers(rows: Sequence[TableRow]) -> tuple[str, ...]:
    return (
        ("optimizer", "model", "target ε", "ε spent (mean)", "n (seeds)")
        + tuple(column.header for column in table_columns(rows))
        + tuple(f"paper: {column.header}" for column in PAPER_COLUMNS)
    )


def write_tables(runs: Sequence[Run], out_dir: Path, pool: bool = False) -> list[Path]:
    """Write table.md/.csv/.tex for every dataset under `out_dir/<dataset>/`; returns the files.

    pool: average runs of one group that differ in a setting or repeat a seed (grouping.py), and
    say so in the notes; without it such runs are refused."""
    written = []
    for dataset, dataset_runs in runs_by_dataset(runs).items():
        rows = build_rows(dataset, dataset_runs, pool)
        folder = Path(out_dir) / dataset
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in (
            ("table.md", render_markdown(dataset, rows, dataset_runs)),
            ("table.csv", render_csv(dataset, rows)),
            ("table.tex", render_latex(dataset, rows)),
        ):
            path = folder / name
            path.write_text(text, encoding="utf-8", newline="\n")
            written.append(path)
    return written


def render_markdown(dataset: str, rows: Sequence[TableRow], runs: Sequence[Run]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    headers = table_headers(rows)
    lines = [f"# {dataset}: test-set results", "", line(headers), line(["---"] * len(headers))]
    lines += [line(row.display_cells()) for row in rows]
    lines += ["", LEGEND, "", "## Notes", ""]
    lines += _pooled_notes(rows) + _paper_notes(rows) + _study_privacy_notes(runs) + _scorer_notes(runs) + _provenance_notes(runs)
    return "\n".join(lines) + "\n"


def render_csv(dataset: str, rows: Sequence[TableRow]) -> str:
    """Machine-readable numbers: an empty cell is a missing value (its `_n` column says 0)."""
    header = ["dataset", "label", "optimizer", "model", "target_epsilon", "private", "epsilon_spent_mean", "n_runs", "seeds"]
    columns = table_columns(rows)
    for column in columns:
        header += [f"{column.key}_mean", f"{column.key}_std", f"{column.key}_n"]
    header += [f"paper_{column.paper_key}" for column in PAPER_COLUMNS]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        key = row.group.key
        cells = [
            dataset, row.group.label, key.optimizer, key.model, _number(key.target_epsilon),
            str(key.private).lower(),
            _number(row.epsilon_spent.mean if row.epsilon_spent else None),
            len(row.group.runs), " ".join(map(str, row.seeds)),
        ]  # fmt: skip
        for column in columns:
            stat = row.metrics[column.key]
            cells += [_number(stat.mean), _number(stat.std), len(stat.values)]
        cells += [_number(row.paper[column.paper_key] if row.paper else None) for column in PAPER_COLUMNS]
        writer.writerow(cells)
    return buffer.getvalue()


def render_latex(dataset: str, rows: Sequence[TableRow]) -> str:
    headers = table_headers(rows)
    lines = [
        f"% {_tex(dataset)}: test-set results, generated by scripts/make_tables.py (needs booktabs).",
        f"% {_tex(LEGEND)}",
        f"% Paper columns quoted from {_tex(PAPER_CITATION)}, {_tex(PAPER_MODEL)}; not reproduced here.",
        "% Scorers, commits and commands: see table.md next to this file.",
        r"\begin{tabular}{" + "l" * len(headers) + "}",
        r"\toprule",
        " & ".join(map(_tex, headers)) + r" \\",
        r"\midrule",
    ]
    lines += [" & ".join(map(_tex, row.display_cells())) + r" \\" for row in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def _pooled_notes(rows: Sequence[TableRow]) -> list[str]:
    return [
        f"- **Pooled (--pool): {row.group.label} averages runs that differ in {', '.join(row.group.pooled)}.**"
        for row in rows if row.group.pooled
    ]  # fmt: skip


def _paper_notes(rows: Sequence[TableRow]) -> list[str]:
    if not any(row.paper for row in rows):
        return ["- The paper reports no numbers for these optimizers at these privacy targets."]
    return [
        f"- Paper columns are quoted from {PAPER_CITATION}, not reproduced here. The paper fine-tuned "
        f"{PAPER_MODEL}; rows of other models, or of randomly initialised weights, are not directly "
        "comparable to them.",
    ]


def _scorer_notes(runs: Sequence[Run]) -> list[str]:
    """Which implementation produced each metric, counted over the runs that measured it."""
    order = list(_METRIC_NAMES)
    keys = sorted(
        {key for run in runs for key in run.summary["metric_implementations"]},
        key=lambda key: (order.index(key) if key in order else len(order), key),
    )
    lines = ["- Scorers (from each run's `metric_implementations`):"]
    for key in keys:
        # A run that left a metric null, or predates it, has no say in how it was measured; keys
        # that are not summary metrics (e.g. a decoding note) count for every run.
        measuring = [
            run for run in runs
            if run.summary.get(key) is not None or (key not in run.summary and key not in _METRIC_NAMES)
        ]  # fmt: skip
        used = Counter(str(run.summary["metric_implementations"].get(key, "not recorded")) for run in measuring)
        if not used:
            continue
        name = _METRIC_NAMES.get(key, key)
        if len(used) == 1:
            ((implementation, count),) = used.items()
            lines.append(f"  - {name}: `{implementation}` ({_runs(count)})")
        else:
            variants = "; ".join(f"`{impl}` ({_runs(count)})" for impl, count in sorted(used.items()))
            lines.append(f"  - {name}: runs disagree: {variants}")
    return lines


def _provenance_notes(runs: Sequence[Run]) -> list[str]:
    commits = Counter(run.summary["git_commit"] or "unknown" for run in runs)
    commit_text = ", ".join(f"`{commit}` ({_runs(count)})" for commit, count in sorted(commits.items()))
    commands = sorted({_command_text(run.summary["command"]) for run in runs})
    return [f"- Runs: {len(runs)}. Git commits: {commit_text}.", *_initial_weights_note(runs), "- Commands:", "", "```", *commands, "```"]


def _initial_weights_note(runs: Sequence[Run]) -> list[str]:
    """Which starting weights the runs share (e.g. two builds of one public model), once recorded."""
    if not any(run.summary.get("initial_weights_sha256") for run in runs):
        return []
    starts = Counter((run.summary.get("initial_weights_sha256") or "")[:12] or "not recorded" for run in runs)
    text = ", ".join(f"`{start}` ({_runs(count)})" for start, count in sorted(starts.items()))
    return [f"- Initial weights (`initial_weights_sha256`, first 12 hex digits): {text}."]


def _study_privacy_notes(runs: Sequence[Run]) -> list[str]:
    """What publishing the table's runs, and the tuning runs that chose their rates, costs together.

    Each run's ε holds for that run alone; runs on the same private examples compose
    (dpmuon.eval.study). The tuning runs are reproduce_cpu's layout: `tuning/` beside `runs/`.
    """
    try:
        table = [study.read_run(run.path) for run in runs]
        tuning_dirs = _tuning_dirs(runs)
        tuning = [study.read_run(path) for path in study.find_run_dirs(tuning_dirs)] if tuning_dirs else []
        return [line for group in study.group_runs(table + tuning) for line in _study_group_note(group, set(tuning))]
    except RunFormatError as error:  # the study's StudyError among them
        raise RunFormatError(f"study-level privacy: {error}") from error


def _tuning_dirs(runs: Sequence[Run]) -> list[Path]:
    siblings = {run.path.parent.parent / "tuning" for run in runs if run.path.parent.name == "runs"}
    return sorted(folder for folder in siblings if folder.is_dir())


def _study_group_note(group: study.StudyGroup, tuning: set[study.RunRecord]) -> list[str]:
    delta = group.delta(None)
    private = group.private_runs
    from_table = [run for run in private if run not in tuning]
    from_tuning = [run for run in private if run in tuning]
    parts = []
    if from_table:
        parts.append((f"the {_dp_runs(len(from_table))} of this table", from_table))
    if from_tuning:
        parts.append((f"the {_dp_runs(len(from_tuning))} in `tuning/` beside `runs/` (the learning-rate search)", from_tuning))
    if from_table and from_tuning:
        parts.append((f"all {len(private)} together", private))
    costs = "; ".join(f"{label}: {_study_cost(study.study_epsilon(members, delta))}" for label, members in parts)
    at_delta = "" if delta is None else f", δ = {delta:g}"
    alone = "" if group.runs_without_secret_randomness else "; the ε spent column holds for each run alone"
    lines = [f"- Study-level privacy on {group.label()}{at_delta}: {costs or 'no DP runs'}. PRV composition of "
             f"every charged release (`python -m dpmuon.eval.study`){alone}."]  # fmt: skip
    if any(run.source == study.RECONSTRUCTED for run in group.private_runs):  # a non-private run has no releases
        lines.append("  Releases are reconstructed from each run's summary.json (no privacy_ledger.jsonl beside it).")
    if group.non_private_runs:
        optimizers = ", ".join(sorted({run.optimizer or "unknown" for run in group.non_private_runs}))
        lines.append(f"  **{_runs(len(group.non_private_runs))} ({optimizers}) trained on these examples without noise: "
                     "a study that publishes them gives this data no privacy guarantee (ε = ∞); the figures "
                     "above count the DP runs only.**")  # fmt: skip
    if group.runs_without_secret_randomness:
        lines.append(f"  **{_dp_runs(len(group.runs_without_secret_randomness))} record no secret mechanism randomness: their "
                     "lots and noise follow from the published seed, so no ε covers them, alone or together; their ε spent "
                     "is what they would cost had the noise been secret.**")  # fmt: skip
    return lines


def _study_cost(epsilon: float | str) -> str:
    if epsilon == study.INFINITE:  # private runs whose bad events fit no split of δ (the study's warning says why)
        return "ε = inf"
    return f"ε = {epsilon:.2f}" if isinstance(epsilon, float) else str(epsilon)


def _dp_runs(count: int) -> str:
    return f"{count} DP run" if count == 1 else f"{count} DP runs"


def _command_text(command: str | list[str] | None) -> str:
    if command is None:
        return "(not recorded)"
    return command if isinstance(command, str) else shlex.join(command)


def _runs(count: int) -> str:
    return f"{count} run" if count == 1 else f"{count} runs"


def _number(value: float | None) -> str:
    return "" if value is None else repr(value)


_TEX_REPLACEMENTS = str.maketrans({
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "±": r"$\pm$", "—": "---", "–": "--", "ε": r"$\varepsilon$", "≈": r"$\approx$",
})  # fmt: skip


def _tex(text: str) -> str:
    return text.translate(_TEX_REPLACEMENTS)
