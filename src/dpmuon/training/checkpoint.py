"""Checkpoints: the public half of what a resume continues from.

Model, optimizer (momentum buffers and their public noise variance) and scheduler, the public
random streams (DP-MuonBC probes, torch's global RNG for dropout), the privacy plan and the
config identity (a resume may never change the mechanism), and the head and length of the
privacy ledger (a resume refuses a ledger that lost lines). The lot sampler's and the noise's
states are secret and live in the mechanism state (privacy/state.py); ε is not stored at all:
it is recomposed from the ledger's charged lines.

A checkpoint is written atomically (temp file, fsync, rename: run_files.atomic_write) and
checked before it is loaded (`load_verified`): torch.save writes a zip archive whose central
directory comes last and whose every entry carries a CRC-32, so a file cut short (a copy onto
a full disk) lacks the directory and an altered byte fails its entry's checksum. torch.load
checks neither: it loads a flipped byte as a changed weight, and fails deep inside on a torn
file.

A run writes both halves with `checkpoint` (the secret one first: a checkpoint never exists
without its mechanism state) and reads its weights back with `restore_weights`; a run file that
cannot be written ends the run at a point it can resume from (`failed_writes_stop`).
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path
from typing import Any

import torch

from .. import run_folder
from ..durable import WriteFailed, atomic_write, load_verified
from ..errors import UserError
from ..privacy.state import ledger_record, save_mechanism_state, secret_state
from .fsdp import as_shards, whole
from .run_identity import config_identity
from .run_parts import Training

CHECKPOINT_FILE = run_folder.CHECKPOINT
# What every checkpoint the loop writes holds; one without them was written by something else.
CHECKPOINT_KEYS = ("step", "model", "optimizer", "scheduler", "rng", "plan")
RESTORE_CHECKPOINT = (
    f"restore {CHECKPOINT_FILE} from an intact copy (or delete it: the run then continues from step 0, and every release it made stays charged)"
)


def rng_snapshot(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    states = {name: g.get_state() for name, g in generators.items()}
    states["torch_global"] = torch.get_rng_state()
    if torch.cuda.is_available():
        states["cuda_global"] = torch.cuda.get_rng_state_all()
    return states


def rng_restore(states: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    for name, g in generators.items():
        g.set_state(states[name])
    torch.set_rng_state(states["torch_global"])
    if "cuda_global" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda_global"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at `path` (None: there is none); refuses one that is incomplete or damaged."""
    if not Path(path).exists():
        return None
    state = load_verified(path, RESTORE_CHECKPOINT)
    missing = [key for key in CHECKPOINT_KEYS if key not in state] if isinstance(state, dict) else list(CHECKPOINT_KEYS)
    if missing:
        raise UserError(f"cannot resume from {path}: it is no complete checkpoint (no {missing[0]!r} entry); {RESTORE_CHECKPOINT}")
    return state


def checkpoint(t: Training, step: int) -> None:
    weights, optimizer = checkpoint_weights(t), t.optimizer.state_dict()
    if t.sharded:  # every rank gathers its rows, rank 0 keeps the whole tensors (training/fsdp.py)
        weights, optimizer = whole(weights, keep=t.parallel.is_main), whole(optimizer, keep=t.parallel.is_main)
    if not t.parallel.is_main:
        return
    if t.private:  # the secret half first: a checkpoint never exists without its mechanism state
        save_mechanism(t, step)
    save_checkpoint(
        t.checkpoint_path,
        {
            "step": step,
            "model": weights,
            **({"frozen_weights_sha256": t.frozen_weights} if t.frozen_weights else {}),
            "optimizer": optimizer,
            "scheduler": t.scheduler.state_dict(),
            "rng": rng_snapshot(t.generators),
            "plan": t.plan.as_dict(),
            "config_identity": config_identity(t.cfg),  # what a resume must configure alike (run_identity.py)
            **({"train_seconds": t.train_seconds} if t.publish_diagnostics else {}),
            "logger_id": t.logger.run_id,
            **ledger_record(t.mechanism.ledger),
        },
    )


def save_mechanism(t: Training, step: int) -> None:
    # The examples' content hash checks that a resume trains on the same data; it is owner-only
    # here, since a hash of the private set is a membership oracle (training/data.py).
    state = {**secret_state(t.mechanism), "data_fingerprint": t.data.train_source}
    if t.oracle is not None:  # the noise-free mirrors are as secret as the noise
        state["oracle"] = t.oracle.state_dict()
    save_mechanism_state(t.mechanism_state_path, step, state)


def checkpoint_weights(t: Training) -> dict[str, torch.Tensor]:
    """The model's weights a checkpoint keeps: all of them, or a LoRA run's trained ones only (its
    frozen base is rebuilt from the config on resume, and checked against its fingerprint)."""
    if t.frozen_weights is None:
        return t.model.state_dict()
    return {name: value for name, value in t.model.state_dict().items() if name in t.named}


def restore_weights(t: Training, state: dict[str, Any]) -> None:
    saved_base = state.get("frozen_weights_sha256")
    weights = as_shards(state["model"], t.model.state_dict()) if t.sharded else state["model"]
    if saved_base is None:  # every weight saved (full fine-tuning, or a LoRA checkpoint written before)
        t.model.load_state_dict(weights)
        return
    if saved_base != t.frozen_weights:
        raise UserError(
            f"cannot resume {t.run_dir}: the frozen base model built from model.name_or_path={t.cfg.model.name_or_path} is not the "
            f"one the run started from (weights fingerprint {str(t.frozen_weights)[:12]}…, {CHECKPOINT_FILE} records {saved_base[:12]}…); "
            "resume with the base model it began with"
        )
    if set(state["model"]) != set(t.named):
        raise UserError(f"cannot resume {t.run_dir}: {CHECKPOINT_FILE} holds other trained weights than this model's adapters")
    t.model.load_state_dict(weights, strict=False)


def spent_without_checkpoint(t: Training) -> str:
    """Why a resume with no checkpoint is refused once the budget allows no further release."""
    accountant = t.mechanism.release.accountant
    return (
        f"cannot resume {t.run_dir}: its ledger charges {accountant.steps} releases (ε {accountant.epsilon():.4g} of "
        f"privacy.target_epsilon={t.plan.target_epsilon:g}) and the budget allows no more, but no {CHECKPOINT_FILE} holds the "
        f"weights they trained, so the resumed run would report the initial weights; restore {CHECKPOINT_FILE} from a copy, "
        "or start a new run in a new directory (these releases stay spent)"
    )


# OSErrors a write raises where the run folder cannot take it (the privacy ledger's own, a model's
# save_pretrained): full, over quota, failing, read-only, or taken away.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


@contextlib.contextmanager
def failed_writes_stop(t: Training):
    """A run file that cannot be written (a full disk, a quota, an I/O error) ends the run where
    it is, before another release, in one line that says how far it got and how to go on."""
    try:
        yield
    except OSError as err:
        if not isinstance(err, WriteFailed) and err.errno not in WRITE_ERRNOS:
            raise
        failed = err if isinstance(err, WriteFailed) else WriteFailed(err.filename or t.run_dir, err)
        raise UserError(
            f"{failed}; the run stopped after step {t.last_step} of {t.plan.steps}, releasing nothing more; "
            f"free space (or fix the folder), then resume with: python -m dpmuon.train resume={t.run_dir}"
        ) from err
