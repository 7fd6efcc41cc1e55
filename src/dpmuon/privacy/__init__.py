"""The private release: sample → clip → noise → account. Nothing else in dpmuon reads data
under the privacy guarantee; everything downstream is post-processing of the release.

The names below load their module on first use (PEP 562), so that a light import such as
`dpmuon.privacy.accountant` (the report scripts', the calibration CLI's) does not load the
per-example engines and the rest of the mechanism.
"""

from __future__ import annotations

from ..lazy import lazy_exports

# name → the submodule that defines it
_EXPORTS = {
    "ACCOUNTANTS": "settings",
    "NullAccountant": "accountant",
    "PrivacyAccountant": "accountant",
    "calibrate_noise_multiplier": "accountant",
    "epsilon_after": "accountant",
    "plan_steps": "accountant",
    "Block": "blocks",
    "BlockPartition": "blocks",
    "build_partition": "blocks",
    "clip_factors": "clipping",
    "per_example_block_norms": "clipping",
    "TruncatedNegativeBinomial": "tuning",
    "tuning_bound": "tuning",
    "composed_epsilon": "composition",
    "DataParallel": "distributed",
    "init_data_parallel": "distributed",
    "ENGINES": "engines",
    "build_engine": "engines",
    "LEDGER_FILE": "ledger",
    "LedgerMismatchError": "ledger",
    "PrivacyLedger": "ledger",
    "release_digest": "ledger",
    "GaussianNoise": "noise",
    "block_noise_stds": "noise",
    "NonFiniteReleaseError": "privatizer",
    "NonPrivateRelease": "privatizer",
    "Privatizer": "privatizer",
    "ReleaseStats": "privatizer",
    "ReplayMismatchError": "privatizer",
    "PRV_MAX_EPSILON": "plan",
    "MechanismRandomness": "randomness",
    "USER_SEED": "randomness",
    "MECHANISM_SEED_ENV": "seed",
    "has_saved_state": "state",
    "SecretStream": "randomness",
    "PoissonLotSampler": "sampling",
    "ShuffleLotSampler": "sampling",
    "build_lot_sampler": "sampling",
    "start_flushing_threads": "subnormals",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
