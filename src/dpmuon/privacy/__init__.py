"""The private release: sample → clip → noise → account. Nothing else in dpmuon reads data
under the privacy guarantee; everything downstream is post-processing of the release."""

from .accountant import (
    ACCOUNTANTS,
    NullAccountant,
    PrivacyAccountant,
    calibrate_noise_multiplier,
    epsilon_after,
    plan_steps,
)
from .blocks import Block, BlockPartition, build_partition
from .clipping import clip_factors, per_example_block_norms
from .distributed import DataParallel, init_data_parallel
from .engines import ENGINES, build_engine
from .ledger import LEDGER_FILE, LedgerMismatchError, PrivacyLedger, release_digest
from .noise import GaussianNoise, block_noise_stds, effective_noise_multiplier
from .privatizer import NonFiniteReleaseError, NonPrivateRelease, Privatizer, ReleaseStats, ReplayMismatchError
from .randomness import MechanismRandomness, SecretStream
from .sampling import PoissonLotSampler, ShuffleLotSampler, build_lot_sampler

__all__ = [
    "ACCOUNTANTS",
    "Block",
    "BlockPartition",
    "DataParallel",
    "ENGINES",
    "GaussianNoise",
    "LEDGER_FILE",
    "LedgerMismatchError",
    "MechanismRandomness",
    "NonFiniteReleaseError",
    "NonPrivateRelease",
    "NullAccountant",
    "PoissonLotSampler",
    "PrivacyAccountant",
    "PrivacyLedger",
    "Privatizer",
    "ReleaseStats",
    "ReplayMismatchError",
    "SecretStream",
    "ShuffleLotSampler",
    "block_noise_stds",
    "build_engine",
    "build_lot_sampler",
    "build_partition",
    "calibrate_noise_multiplier",
    "clip_factors",
    "effective_noise_multiplier",
    "epsilon_after",
    "init_data_parallel",
    "per_example_block_norms",
    "plan_steps",
    "release_digest",
]
