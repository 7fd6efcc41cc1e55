"""Evaluation: generation metrics, reading run directories, result tables and curves.

- `metrics`: BLEU (sacrebleu) and ROUGE-L (rouge-score) of generations, multi-reference.
- `paper`: the paper's reported numbers, quoted for comparison.
- `runs`: reading run directories (summary.json, metrics.jsonl: the run-artifact contract), the
  one reader of the folders whose layout dpmuon/run_folder.py names.
- `grouping`: runs grouped by (optimizer, model, target ε) for averaging over seeds.
- `tables`, `curves`: the aggregated outputs; `cli` backs scripts/make_tables.py and make_curves.py.
- `study`: what releasing several runs on one private dataset costs (`dpmuon-study`); the
  composition itself is dpmuon.privacy.composition's.

The names below load their module on first use (PEP 562), so reading runs does not pull in
the scorers or matplotlib.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "tables_main": "cli",
    "METRICS_FILE": "runs",
    "SUMMARY_FILE": "runs",
    "Run": "runs",
    "RunFormatError": "runs",
    "find_runs": "runs",
    "read_json_object": "runs",
    "read_metrics": "runs",
    "read_run_rows": "runs",
    "read_summary": "runs",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
