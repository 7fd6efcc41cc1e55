"""Reading training-run directories (the run-artifact contract: summary.json, metrics.jsonl).

The one reader of run folders (their layout: dpmuon/run_folder.py): the tables, curves, the
study, the job runner and the experiment reports find and read runs here. A run directory holds
`summary.json` (final numbers and the run's identity) and `metrics.jsonl` (one object per logged
step). Anything that breaks the contract raises RunFormatError naming the file, the line and the
key, so a bad run is fixed, not guessed at.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ..run_folder import DIAGNOSTICS, METRICS, SUMMARY, stored_configs

SUMMARY_FILE = SUMMARY  # the names the eval and experiment modules know them by
METRICS_FILE = METRICS
DIAGNOSTICS_FILE = DIAGNOSTICS  # a private run's non-private diagnostics (train loss, lot size, ...), owner-only

REQUIRED_SUMMARY_KEYS = (
    "dataset",
    "optimizer",
    "model",
    "seed",
    "target_epsilon",
    "epsilon",
    "delta",
    "noise_multiplier",
    "sample_rate",
    "steps",
    "accountant",
    "clip_mode",
    "test_nll",
    "bleu",
    "bleu_single_ref",
    "rouge_l",
    "metric_implementations",
    "git_commit",
    "command",
)  # fmt: skip  (train_seconds is absent when non-private diagnostics are off: it times the lots)
TEXT_KEYS = ("dataset", "optimizer", "model")
OPTIONAL_NUMBER_KEYS = (
    "target_epsilon", "epsilon", "noise_multiplier", "test_nll", "bleu", "bleu_single_ref", "bleu_lowercase", "rouge_l",
)  # fmt: skip
# Per-step quantities the curves read; other logged keys are passed through unchecked.
CURVE_KEYS = ("train_loss", "val_nll", "epsilon", "lr")


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """summary.json as the trainer writes it: what was run, what it cost in privacy, what it scored.

    Readers accept records older than a field (REQUIRED_SUMMARY_KEYS is what every record has).
    """

    dataset: str
    # "synthetic": data.fallback's generated stand-in (data/synthetic.py), not the named set; a
    # table or study groups such runs apart (Run.dataset). Absent from older records: "files".
    data_source: str = "files"
    tokenizer_source: str = "loaded"  # or "built locally": a BPE trained on the synthetic set
    optimizer: str
    model: str
    seed: int
    learning_rates: dict[str, float]  # optimizer.lr, and optimizer.adam.lr for the Muon family's other parameters
    private: bool
    target_epsilon: float
    epsilon: float | None  # None: non-private
    delta: float
    delta_times_n: float
    noise_multiplier: float  # 0: non-private
    sample_rate: float
    expected_lot_size: int
    dataset_size: int
    steps: int
    planned_steps: int
    releases_charged: int | None
    # The privacy ledger when the summary was written, as a checkpoint records it: the hash of its
    # last line and its lines (the header included); the study refuses a ledger that differs.
    ledger_head: str | None = None  # None: non-private (no ledger)
    ledger_length: int | None = None
    release_slack: dict | None  # per charged release, beyond the ideal Gaussian (privacy/accountant.py ReleaseSlack)
    stopped_by_budget_guard: bool
    stop_reason: str | None
    mechanism_randomness: str | None
    validation_split: str | None
    accountant: str
    clip_mode: str | None
    clip_norm: float | None
    sampling: str
    engine: str | None
    world_size: int
    strategy: str = "ddp"  # trainer.strategy under torchrun: ddp (whole model on every rank) or fsdp (row shards)
    tied_lm_head: bool
    initial_weights_sha256: str
    final_weights_sha256: str
    test_nll: float | None
    val_nll: float | None
    bleu: float | None
    bleu_lowercase: float | None
    bleu_single_ref: float | None
    rouge_l: float | None
    metric_implementations: dict[str, str]
    test_sources: int
    train_seconds: float | None = None  # only with non-private diagnostics on: it times the lots
    max_lot_size: int | None = None  # constant-time lots: the rows every step processed (None: lots as drawn)
    widths: list[list[int]] | None = None  # ...as [width, rows], widest first, when bucketed by width (None: all max_length wide)
    length_noise_multiplier: float | None = None  # σ of the length histogram's release that chose the widths (charged)
    # Values outside the guarantee in the run's published record (metrics.jsonl, W&B, this file);
    # "oracle_*" stands for the oracle-alignment fields. [] when none were published.
    nonprivate_values_logged: list[str] = field(default_factory=list)
    git_commit: str | None
    command: str
    run_dir: str

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        if record["train_seconds"] is None:
            del record["train_seconds"]
        return record


class RunFormatError(ValueError):
    """A run directory does not follow the artifact contract."""


@dataclass(frozen=True)
class Run:
    path: Path
    summary: dict[str, Any]

    @property
    def dataset(self) -> str:
        """The dataset's name; a run on the synthetic stand-in is "<name>-synthetic", so no
        table, curve or study counts it with runs on the real set."""
        name = self.summary["dataset"]
        return f"{name}-synthetic" if self.summary.get("data_source") == "synthetic" else name

    @property
    def optimizer(self) -> str:
        return self.summary["optimizer"]

    @property
    def model(self) -> str:
        return self.summary["model"]

    @property
    def seed(self) -> int:
        return self.summary["seed"]

    @property
    def is_private(self) -> bool:
        # The contract marks non-private runs with noise_multiplier 0 (and epsilon null).
        return self.summary["noise_multiplier"] != 0

    @property
    def target_epsilon(self) -> float | None:
        """The privacy target; None for non-private runs, whatever their config carried over."""
        target = self.summary["target_epsilon"]
        return float(target) if self.is_private and target is not None else None

    @property
    def learning_rates(self) -> dict[str, float]:
        """The optimizer's rates: from the summary, or, for records older than that field, from
        the run's config (config.yaml as published, .hydra/config.yaml in a run directory)."""
        if "learning_rates" in self.summary:
            return self.summary["learning_rates"]
        for config in stored_configs(self.path):
            if config.exists():
                return learning_rates(OmegaConf.load(config).optimizer)
        raise RunFormatError(f"{self.path / SUMMARY_FILE}: no 'learning_rates', and no config.yaml beside it to read them from")

    def load_metrics(self, diagnostics: bool = False) -> list[dict[str, Any]]:
        """The logged rows in file order; empty when the run logged none. diagnostics=True adds
        to each row the non-private diagnostics of its step from the owner-only diagnostics.jsonl
        (a private run's since that file exists; older runs logged them in metrics.jsonl)."""
        return read_run_rows(self.path, diagnostics)


def read_run_rows(run_dir: Path, diagnostics: bool = False) -> list[dict[str, Any]]:
    """metrics.jsonl's rows of a run directory, with diagnostics=True each merged with the
    diagnostics.jsonl row of the same step (train loss, lot size, oracle alignment, ...)."""
    rows = read_metrics(Path(run_dir) / METRICS_FILE)
    if not diagnostics:
        return rows
    by_step = {row["step"]: row for row in read_metrics(Path(run_dir) / DIAGNOSTICS_FILE)}
    return [{**row, **by_step.get(row["step"], {})} for row in rows]


def learning_rates(optimizer_config) -> dict[str, float]:
    """optimizer.lr, and optimizer.adam.lr where the optimizer has an Adam part."""
    rates = {"lr": float(optimizer_config["lr"])}
    if "adam" in optimizer_config:
        rates["adam.lr"] = float(optimizer_config["adam"]["lr"])
    return rates


def find_runs(paths: Sequence[Path]) -> list[Run]:
    """Every finished run directory (one holding summary.json) under `paths`, sorted by path."""
    summary_files: set[Path] = set()
    for root in map(Path, paths):
        if root.is_file() and root.name == SUMMARY_FILE:
            summary_files.add(root.resolve())
        elif root.is_dir():
            summary_files.update((run / SUMMARY_FILE).resolve() for run in run_dirs_below(root, (SUMMARY_FILE,)))
        else:
            raise RunFormatError(f"{root}: no such directory (nor a summary.json file)")
    return [Run(path=file.parent, summary=read_summary(file)) for file in sorted(summary_files)]


def run_dirs_below(folder: Path, markers: Sequence[str]) -> list[Path]:
    """`folder` if it holds one of the `markers` files, else the run folders below it, in path
    order. The search stops at a run: a run's own subfolders (a resume's) are its own."""
    if any((folder / marker).is_file() for marker in markers):
        return [folder]
    return [run for child in sorted(folder.iterdir()) if child.is_dir() for run in run_dirs_below(child, markers)]


def read_summary(file: Path) -> dict[str, Any]:
    """summary.json, checked against the artifact contract. A run that scored nothing (eval.test
    =false, or diverged) has no scorers: its `metric_implementations` is {} (null in the files
    such runs wrote before the driver wrote {})."""
    summary = read_json_object(file)
    if "metric_implementations" in summary and summary["metric_implementations"] is None:
        summary["metric_implementations"] = {}
    _check_summary(file, summary)
    return summary


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON object from `file` as it is (readers that need only some keys check those)."""
    try:
        record = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RunFormatError(f"{file}: not valid JSON ({error})") from error
    if not isinstance(record, dict):
        raise RunFormatError(f"{file}: expected a JSON object, got {type(record).__name__}")
    return record


def read_metrics(file: Path) -> list[dict[str, Any]]:
    if not file.exists():
        return []
    rows = []
    for line_number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{line_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise RunFormatError(f"{where}: not valid JSON ({error})") from error
        if not isinstance(row, dict):
            raise RunFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if not _is_int(row.get("step")):
            raise RunFormatError(f"{where}: missing or non-integer 'step'")
        for key in CURVE_KEYS:
            if key in row and not _is_optional_number(row[key]):
                raise RunFormatError(f"{where}: {key!r} must be a number or null, got {row[key]!r}")
        rows.append(row)
    return rows


def _check_summary(file: Path, summary: dict[str, Any]) -> None:
    missing = [key for key in REQUIRED_SUMMARY_KEYS if key not in summary]
    if missing:
        raise RunFormatError(f"{file}: missing required key(s): {', '.join(missing)}")
    for key in TEXT_KEYS:
        if not isinstance(summary[key], str) or not summary[key]:
            raise RunFormatError(f"{file}: {key!r} must be a non-empty string, got {summary[key]!r}")
    # The dataset names an output folder, so it must not escape it.
    if any(separator in summary["dataset"] for separator in ("/", "\\")) or summary["dataset"] in (".", ".."):
        raise RunFormatError(f"{file}: 'dataset' must be a plain name, got {summary['dataset']!r}")
    if not _is_int(summary["seed"]):
        raise RunFormatError(f"{file}: 'seed' must be an integer, got {summary['seed']!r}")
    for key in OPTIONAL_NUMBER_KEYS:  # a key newer than the run (e.g. bleu_lowercase) may be absent
        if not _is_optional_number(summary.get(key)):
            raise RunFormatError(f"{file}: {key!r} must be a number or null, got {summary[key]!r}")
    if not isinstance(summary["metric_implementations"], dict):
        raise RunFormatError(f"{file}: 'metric_implementations' must be an object")
    if not (summary["git_commit"] is None or isinstance(summary["git_commit"], str)):
        raise RunFormatError(f"{file}: 'git_commit' must be a string or null")
    command = summary["command"]
    if not (command is None or isinstance(command, str) or _is_string_list(command)):
        raise RunFormatError(f"{file}: 'command' must be a string, a list of strings or null")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_optional_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _is_string_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)
