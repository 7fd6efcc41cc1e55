"""The driver's own options — recipe.*, trainer.*, logging.*, logger.* — declared once, as fields (type,
default, checks, help; `dpmuon.settings.option`). `@settings(group)` offers their defaults to
conf/config.yaml, conf/recipe/*.yaml and conf/logger/wandb.yaml, which set only what differs; the schema validates a
composed config against them, and each class checks its values when built from Python too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import REQUIRED, Settings, option, settings

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")
FIXED_BATCH_SHAPES = ("auto", True, False)
DIAGNOSTICS = (False, "file", "publish", True)
LOGGERS = ("none", "wandb")
WANDB_MODES = ("online", "offline", "disabled")
STRATEGIES = ("ddp", "fsdp")


@settings("recipe", target=False)
@dataclass(frozen=True, kw_only=True)
class RecipeSettings(Settings):
    """A task's training recipe (conf/recipe/: e2e, dart): each optimizer's rate and the epochs."""

    lr: dict = option(factory=dict, help="learning rate per optimizer name (optimizer.lr, and a Muon's adam.lr, default to its entry)")
    epochs: float = option(REQUIRED, "epochs of the recipe (trainer.epochs defaults to them)", gt=0)


@settings("trainer", target=False)
@dataclass(frozen=True, kw_only=True)
class TrainerSettings(Settings):
    """Where and how long the driver trains, and what it keeps."""

    device: str = option("auto", "where to train", choices=DEVICES)
    precision: str = option("auto", "forward precision (auto: bf16 autocast on cuda, fp32 on cpu)", choices=PRECISIONS)
    epochs: float | None = option(None, "epochs (steps = ⌈epochs/q⌉) unless trainer.steps is set (the driver's config: the recipe's)", gt=0)
    steps: int | None = option(None, "planned steps (null: from the epochs)", ge=1)
    micro_batch_size: int = option(32, "physical batch; the lot is split into these without changing the mechanism", ge=1)
    fixed_batch_shape: str | bool = option(
        "auto",
        "private runs: pad every micro-batch to one width and row count, so that under bf16 each example's clipped contribution does "
        "not depend on the rest of the lot (auto: on under bf16)",
        choices=FIXED_BATCH_SHAPES,
    )
    strategy: str = option(
        "ddp",
        "under torchrun: ddp (every rank holds the whole model) | fsdp (FSDP2 row shards of weights, released gradients and "
        "optimizer state, for a model that outgrows one device; private runs with constant-time lots; docs/runs.md)",
        choices=STRATEGIES,
    )
    eval_every: int = option(50, "validation NLL every N steps (0: only at the end)", ge=0)
    checkpoint_every: int = option(50, "atomic checkpoint every N steps (0: only at the end)", ge=0)
    keep_checkpoint: bool = option(True, "keep the final checkpoint (model + optimizer) in the run directory")
    save_model: bool = option(False, "also save the final model + tokenizer (run_dir/model)")
    num_threads: int | None = option(None, "torch CPU threads (null: torch's default)", ge=1)
    keep_freed_memory: bool = option(
        False,
        "on the CPU, keep freed memory for the next step instead of giving it back to the OS (glibc): 1.4-1.5x faster steps, "
        "peak RSS 1.4-1.8x (docs/performance.md)",
    )


@settings("logging", target=False)
@dataclass(frozen=True, kw_only=True)
class LoggingSettings(Settings):
    """What the driver logs beyond the released values, and how often."""

    nonprivate_diagnostics: bool | str = option(
        "file",
        "train loss, lot size, clip fractions, gradient norms, step times — computed from the private data and NOT covered by the "
        "guarantee: file (only the run's owner-only diagnostics.jsonl) | publish (metrics.jsonl, W&B and the console too; true) | false (nowhere)",
        choices=DIAGNOSTICS,
    )
    oracle_alignment: bool = option(
        False, "Muon: track the noise-free momentum buffer and log true SNR and F(M)/F_BC(M) alignment with it (not covered; needs diagnostics)"
    )
    epsilon_every: int = option(1, "compute ε spent (PRV, ~0.1–0.4 s) every N steps and at the last", ge=1)
    per_matrix_every: int = option(1, "Muon's per-matrix SNR and step-length ratio every N steps and at the last (0: the last only; medians every step)", ge=0)
    progress: bool = option(True, "progress bars")


@settings("logger", target=False)
@dataclass(frozen=True, kw_only=True)
class LoggerSettings(Settings):
    """Where metrics go besides the run directory (conf/logger/: none, wandb)."""

    name: str = option("none", "where metrics go besides the run directory", choices=LOGGERS)
    project: str = option("dpmuon", "W&B project")
    entity: str | None = option(None, "W&B entity")
    group: str = option("default", "W&B group (conf/logger/wandb.yaml: the experiment's name)")
    tags: list = option(factory=list, help="W&B tags")
    mode: str | None = option(None, "W&B mode (null: online with an API key, else offline)", choices=WANDB_MODES)
