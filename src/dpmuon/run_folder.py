"""The layout of a run folder: the name of every file a training run writes, in one place.

Training writes these names, and everything that reads a run folder — eval (`eval/runs.py`, the
one reader), the study, the job runner, the report scripts, a resume — finds them here. Plain
names only (no torch, no config): the mechanism package names its ledger from here too.

    <run dir>/
      .hydra/config.yaml           the resolved config (Hydra's own record; the run's identity)
      train.log                    the driver's log lines (Hydra's job logging)
      run.lock                     held (flock) by the process that runs there
      mechanism_seed_used.json     whether the run took a user's mechanism seed (never the seed)
      privacy_ledger.jsonl         one line per release, hash-chained (privacy/ledger.py); a damaged
                                   one is kept aside as privacy_ledger.jsonl.damaged-<n>
      checkpoint.pt                the public half of a resume point (training/checkpoint.py)
      mechanism_state.pt           its secret half: lot sampler and noise states, owner-only
      metrics.jsonl                one row per logged step (published values only)
      metrics.superseded.jsonl     rows a resume re-ran, and damaged lines, moved aside (and
                                   diagnostics.superseded.jsonl for diagnostics.jsonl's)
      diagnostics.jsonl            the non-private diagnostics, owner-only
      generations.txt              one decoded output per test source
      summary.json                 the final record; its presence marks a finished run
      curves/                      the run's own curves, from metrics.jsonl alone
      model/                       the final model and tokenizer, when saved
      adapter/                     a LoRA run's adapters (peft's save_pretrained), always

A published run folder (studies/jobs.py) keeps the public part under the same names, with the
resolved config as `config.yaml` beside them (and, for a public pretraining run, the fingerprint of
the model it built as `weights_sha256.txt`). The job runner holds `runner.lock` in a job's folder.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "ADAPTER", "CHECKPOINT", "CURVES", "DIAGNOSTICS", "GENERATIONS", "HYDRA_DIR", "LEDGER", "LOCK", "MECHANISM_STATE",
    "METRICS", "MODEL", "NOT_A_RUN", "PUBLISHED", "PUBLISHED_CONFIG", "RUNNER_LOCK", "RUN_STATE", "SEED_USE",
    "STORED_CONFIG", "SUMMARY", "TRAIN_LOG", "WEIGHTS_FINGERPRINT", "is_finished", "stored_configs",
]  # fmt: skip

HYDRA_DIR = ".hydra"
STORED_CONFIG = f"{HYDRA_DIR}/config.yaml"
TRAIN_LOG = "train.log"
LOCK = "run.lock"
SEED_USE = "mechanism_seed_used.json"
LEDGER = "privacy_ledger.jsonl"
CHECKPOINT = "checkpoint.pt"
MECHANISM_STATE = "mechanism_state.pt"
METRICS = "metrics.jsonl"
DIAGNOSTICS = "diagnostics.jsonl"
GENERATIONS = "generations.txt"
SUMMARY = "summary.json"
CURVES = "curves"
MODEL = "model"
ADAPTER = "adapter"

PUBLISHED_CONFIG = "config.yaml"
RUNNER_LOCK = "runner.lock"
WEIGHTS_FINGERPRINT = "weights_sha256.txt"  # beside a published public-pretraining run: the model it built

# The files that make a folder a run's: what a run reads back when it continues (checkpoint,
# mechanism state, ledger, metrics and diagnostics rows) or what marks it finished. A folder
# without them holds nothing a new run could take over: no release was made there.
RUN_STATE = (SUMMARY, CHECKPOINT, MECHANISM_STATE, LEDGER, METRICS, DIAGNOSTICS)
# What a run that stopped before it trained leaves: Hydra's records, its log, the lock, whether
# it had a user seed. A failed command removes the folder it made if nothing else is there.
NOT_A_RUN = (HYDRA_DIR, TRAIN_LOG, LOCK, SEED_USE)
# What a published run folder holds: the run folder's name → the published name.
PUBLISHED = {SUMMARY: SUMMARY, METRICS: METRICS, STORED_CONFIG: PUBLISHED_CONFIG, GENERATIONS: GENERATIONS}


def is_finished(run_dir: str | Path) -> bool:
    """Whether the run in `run_dir` completed (it writes summary.json last)."""
    return (Path(run_dir) / SUMMARY).is_file()


def stored_configs(run_dir: str | Path) -> tuple[Path, Path]:
    """Where a run's resolved config may be: published beside its summary, or Hydra's record."""
    return Path(run_dir) / PUBLISHED_CONFIG, Path(run_dir) / STORED_CONFIG
