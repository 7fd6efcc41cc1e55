"""Evaluation: generation metrics, reading run directories, result tables and curves.

- `metrics`: BLEU (sacrebleu) and ROUGE-L (rouge-score) of generations, multi-reference.
- `paper`: the paper's reported numbers, quoted for comparison.
- `runs`: reading run directories (summary.json, metrics.jsonl: the run-artifact contract).
- `grouping`: runs grouped by (optimizer, model, target ε) for averaging over seeds.
- `tables`, `curves`: the aggregated outputs; `cli` backs scripts/make_tables.py and make_curves.py.

Nothing is imported here, so reading runs does not pull in the scorers or matplotlib.
"""
