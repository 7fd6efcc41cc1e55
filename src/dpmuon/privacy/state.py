"""The mechanism's secret state across processes: `<run dir>/mechanism_state.pt`, and the checks
that a resume continues the releases it made.

Resuming must replay the lots and noise the interrupted run would have drawn (so that a re-run
step releases exactly what it released before, at no privacy cost), which needs the lot
sampler's and the noise generator's states. Those states regenerate the mechanism's draws, so
they live apart from any checkpoint (which people copy, share and publish), in a file only the
owner can read, that is deleted when the run completes (`privacy.keep_mechanism_state=true`
keeps it). It holds the states at the last two checkpoints: a kill between writing this file
and the checkpoint still finds the state that matches the checkpoint.

A resume also checks that the ledger still holds every line the saved state (or a checkpoint)
recorded: without that, ε would be composed from whatever file is there, and a deleted,
truncated, edited or swapped ledger would forget releases the run made. The driver
(training/loop.py, checkpoint.py), `make_private` (facade.py) and `DPTrainer`
(integrations/hf.py) all save and restore through here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import run_folder
from ..durable import atomic_write, load_verified, temp_files
from ..errors import UserError
from .ledger import LEDGER_FILE, LedgerIntegrityError, PrivacyLedger
from .mechanism import Mechanism
from .sampling import ShuffleLotSampler

CHECKPOINT_FILE = run_folder.CHECKPOINT

MECHANISM_STATE_FILE = run_folder.MECHANISM_STATE
KEPT_STATES = 2
RESTORE_STATE = f"restore {MECHANISM_STATE_FILE} from an intact copy (or delete it: re-run steps then draw fresh randomness and are charged)"


def save_mechanism_state(path: Path, step: int, state: dict[str, Any]) -> None:
    """Record the mechanism's state at `step` (owner read/write only, atomically)."""
    states = _read(path)
    states[int(step)] = state
    states = {s: states[s] for s in sorted(states)[-KEPT_STATES:]}

    atomic_write(path, lambda f: torch.save(states, f), secret=True)  # 0600 before any secret byte is written


def load_mechanism_state(path: Path, step: int) -> dict[str, Any] | None:
    """The state saved at `step`, or None when there is none (file missing or other steps)."""
    return _read(path).get(int(step))


def saved_mechanism_states(path: Path) -> dict[int, dict[str, Any]]:
    """Every state the file holds, by step (empty when there is no file)."""
    return _read(path)


def has_saved_state(run_dir: Path) -> bool:
    """Whether the run saved anything a resume continues from: its mechanism state or a checkpoint.

    A run given a user mechanism seed that has neither stopped during setup: no file of the
    run holds the seed, so a resume needs it given again (see training/secret.py).
    """
    return any((Path(run_dir) / name).exists() for name in (MECHANISM_STATE_FILE, CHECKPOINT_FILE))


def remove_left_temp_files(run_dir: Path) -> None:
    """Delete the mechanism-state temp files of writes killed midway: they hold generator states."""
    for tmp in temp_files(Path(run_dir) / MECHANISM_STATE_FILE):
        tmp.unlink(missing_ok=True)


def discard_mechanism_state(run_dir: Path, keep: bool) -> None:
    """Training is over: no step is left to replay, so the secret state goes (unless `keep`)."""
    if not keep:
        (Path(run_dir) / MECHANISM_STATE_FILE).unlink(missing_ok=True)
    remove_left_temp_files(run_dir)


def _read(path: Path) -> dict[int, dict[str, Any]]:
    if not Path(path).exists():
        return {}
    return load_verified(path, RESTORE_STATE)


def secret_state(mechanism: Mechanism) -> dict[str, Any]:
    """What a resume needs to replay the mechanism's draws: its generators' states, and the ledger it had written."""
    return {"randomness": mechanism.randomness.state_dict(), "sampler": mechanism.sampler.state_dict(), **ledger_record(mechanism.ledger)}


def ledger_record(ledger: PrivacyLedger | None) -> dict[str, Any]:
    """What a checkpoint or mechanism state records of the ledger: a resume checks it is still there."""
    return {} if ledger is None else {"ledger_head": ledger.head, "ledger_length": ledger.length}


def verify_ledger(ledger: PrivacyLedger | None, saved: dict[str, Any], saved_in: str) -> None:
    """Refuse to continue unless the ledger still holds every line `saved_in` recorded, unchanged.

    Without that, a resume would compose ε from whatever file is there: a deleted, truncated,
    edited or swapped ledger would forget releases the run made.
    """
    if ledger is None:  # non-private, or a rank > 0 (rank 0 holds the ledger and checks it)
        return
    try:
        ledger.verify(saved.get("ledger_head"), saved.get("ledger_length"), saved_in)
    except LedgerIntegrityError as err:
        raise UserError(f"cannot continue this run directory: {err}") from None


def check_ledger_kept(run_dir: Path, checkpoint: bool = True) -> None:
    """Never start a new ledger under a run that released: its releases would be lost to ε.
    `checkpoint=False`: only the mechanism state says so (make_private's run_dir may hold the
    user's own files, a checkpoint.pt among them)."""
    path = run_dir / LEDGER_FILE
    saved = has_saved_state(run_dir) if checkpoint else (run_dir / MECHANISM_STATE_FILE).exists()
    if saved and not (path.is_file() and path.stat().st_size):
        raise UserError(missing_ledger(run_dir, checkpoint))


def missing_ledger(run_dir: Path, checkpoint: bool = True) -> str:
    """Why a run with a checkpoint or mechanism state but no ledger is not continued."""
    if checkpoint and (run_dir / CHECKPOINT_FILE).exists():
        saved_in, lengths = CHECKPOINT_FILE, [load_verified(run_dir / CHECKPOINT_FILE, f"restore {CHECKPOINT_FILE} from an intact copy").get("ledger_length")]
    else:
        saved_in = MECHANISM_STATE_FILE
        lengths = [state.get("ledger_length") for state in saved_mechanism_states(run_dir / MECHANISM_STATE_FILE).values()]
    recorded = max((n for n in lengths if isinstance(n, int)), default=None)
    records = "exists" if recorded is None else f"records {recorded} lines"
    return (
        f"{LEDGER_FILE} is missing but {saved_in} {records}: the ledger was deleted; the run's ε cannot be recovered — "
        f"its releases are lost to the accounting. Start a new run in a new directory (not {run_dir}), and count this "
        "run's releases against its data by hand"
    )


def restore_mechanism(mechanism: Mechanism, path: Path, step: int, log: Callable[[str], None] = print) -> dict | None:
    """Continue the mechanism's secret draws from `step`, or start fresh ones if they are gone;
    return the saved state restored (None: there was none).

    With the saved state, re-run steps replay their lots and noise (an identical output is
    free). Without it, nothing may be replayed: new secret draws, and every re-run step is a
    new, charged release.
    """
    randomness, sampler, ledger, parallel = mechanism.randomness, mechanism.sampler, mechanism.ledger, mechanism.parallel

    def load_and_verify() -> dict | None:
        saved = load_mechanism_state(path, step)
        if saved is not None:
            verify_ledger(ledger, saved, path.name)
        return saved

    saved = parallel.on_main(load_and_verify)
    if saved is not None:
        if set(saved["sampler"]) != set(sampler.state_dict()):  # saved by the other lot sampler
            kind = "shuffle" if isinstance(sampler, ShuffleLotSampler) else "poisson"
            raise UserError(
                f"cannot resume from {path}: its lot-sampler state was saved under another privacy.sampling than this "
                f"config's {kind}; resume with the sampling the run started with"
            )
        randomness.load_state_dict(saved["randomness"])
        sampler.load_state_dict(saved["sampler"])
        return saved
    resuming = step > 0 or (ledger is not None and ledger.releases)
    if resuming:
        if not randomness.secure:
            log(f"no mechanism state for step {step} in {path.name}: drawing fresh secret randomness; re-run steps are charged")
        mechanism.redraw_fresh()
    return None
