"""The privacy options (the driver's privacy.* keys, `make_private`'s keywords): declared once, here.

Each field is one option — type, default, allowed values, help — checked as the class is built,
with the same one-line message from Python as from the command line:

    PrivacySettings(delta=1e-5, clip_norm=-1)  →  privacy.clip_norm=-1: must be > 0; valid: a number > 0

`@settings("privacy")` offers the defaults to conf/privacy/*.yaml, which set only what differs.
The choices are the names the mechanism's modules accept, and `default(name)` is what their own
functions default to; this module imports nothing heavy (nothing of the mechanism), so that
reading the options (validation, --options, the reference) loads no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..settings import REQUIRED, Settings, option, settings

ACCOUNTANTS = ("prv", "rdp")
CLIP_MODES = ("per_matrix", "flat")
THRESHOLD_RULES = ("split", "scalar", "by_size")
OTHER_BLOCKS = ("per_tensor", "group")
SAMPLINGS = ("poisson", "shuffle")
NOISE_ALLOCATIONS = ("uniform", "proportional")
ENGINE_NAMES = ("fast", "opacus")  # the registered engines (privacy/engines), named without importing them
ENGINE_FALLBACKS = ("generic", "error")


@settings("privacy", target=False)
@dataclass(frozen=True, kw_only=True)
class PrivacySettings(Settings):
    """The private release's options: the guarantee, how lots are drawn, how examples are clipped
    and noised, and what of the mechanism's secret state is kept."""

    target_epsilon: float = option(8.0, "ε of the (ε, δ) guarantee", gt=0)
    delta: float = option(REQUIRED, "δ of the guarantee; must be < 1/N (the driver: the dataset's δ)", gt=0, lt=1)
    accountant: str = option("prv", "privacy accountant (prv: numerically tight; rdp: the classic bound)", choices=ACCOUNTANTS)
    noise_multiplier: float | None = option(None, "σ (null: calibrated from ε, δ, q and the steps before step 1)", gt=0)
    expected_lot_size: int = option(1024, "expected lot size (q = lot / N)", ge=1)
    sampling: str = option("poisson", "lot sampling (shuffle: fixed-size lots the accountant does not cover, refused for private runs)", choices=SAMPLINGS)
    clip_mode: str = option("per_matrix", "per-matrix thresholds (per_matrix) or one global threshold (flat)", choices=CLIP_MODES)
    clip_norm: float = option(0.1, "total clipping threshold C", gt=0)
    threshold_rule: str = option(
        "split", "how C is split over blocks: split (C_W = C/√K) | scalar (C_W = C) | by_size (C_W = C√(n_W/n))", choices=THRESHOLD_RULES
    )
    other_blocks: str = option("per_tensor", "blocks of the non-matrix tensors (group: one block for all of them)", choices=OTHER_BLOCKS)
    noise_allocation: str = option("uniform", "noise over blocks", choices=NOISE_ALLOCATIONS)
    engine: str = option("fast", "per-example gradient engine (fast: ghost norms + book-keeping; opacus: per-example gradients)", choices=ENGINE_NAMES)
    engine_fallback: str = option(
        "generic", "a trainable module without an engine rule: its per-example gradients by torch.func (generic), or refuse (error)", choices=ENGINE_FALLBACKS
    )
    secure_noise: bool = option(False, "lots and noise from the OS CSPRNG (nothing seeded; slower)")
    constant_time: bool = option(
        True,
        "pad every lot to a fixed bound (B_max ≈ lot + 8√lot; a larger Poisson lot is truncated and the chance charged) in fixed "
        "shapes, so step times reveal nothing (costs the padding)",
    )
    width_buckets: int = option(
        8,
        "constant-time lots in up to this many fixed widths, chosen from the training set's length histogram released once "
        "before step 1 (charged; 1: every row max_length wide, nothing released). make_private and DPTrainer cut collate_fn's rows to "
        "the widths where its batches carry an attention_mask (docs/privacy.md)",
        ge=1,
    )
    length_noise_multiplier: float = option(20.0, "σ of the length histogram's one Gaussian release (sensitivity 1; ≈ +0.003 ε at ε = 8)", gt=0)
    mechanism_seed_file: str | None = option(
        None, "owner-only file holding the secret seed of lots and noise (null: $DPMUON_MECHANISM_SEED, else fresh OS entropy)"
    )
    published_seed: bool = option(False, "the mechanism seed is published (a measurement): the summary says its ε is no guarantee")
    keep_mechanism_state: bool = option(False, "keep <run>/mechanism_state.pt (owner-only) after the run completes")


def default(name: str) -> Any:
    """The default of privacy option `name`: what the mechanism's own functions default to as well."""
    return next(f.default for f in dataclasses.fields(PrivacySettings) if f.name == name)
