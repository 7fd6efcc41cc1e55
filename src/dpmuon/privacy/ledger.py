"""The privacy ledger: one durable line per release, written before anything derived from it.

`<run dir>/privacy_ledger.jsonl` starts with a header naming the private training set (dataset,
N), the accounting (δ, accountant, each release's float slack) and a random run ID, then
holds one line per release: step, σ, q, whether it was charged, and a SHA-256 of the released
gradient. The line is appended and fsynced inside the privatizer, before the gradient reaches
the optimizer, a log, a checkpoint or W&B — so a crash at any instant can lose work but never a
release.

A run whose constant-time lots are bucketed by width released its training set's length
histogram once, before step 1 (privacy/lot_bound.py): the header holds that release
(`length_release`: σ, the released counts) and it is charged before the steps.

ε spent is always the composition of the charged lines (and the header's release). A step re-run after a resume that
releases a bit-identical gradient reveals nothing new and is written uncharged; any other
re-release is a new release and is charged. `python -m dpmuon.eval.study` composes the
ledgers of several runs on the same data.

The ledger is a hash chain, so that a resume cannot silently forget a release: every line after
the header carries `prev`, the SHA-256 of the previous line's bytes, and the header carries a
random `run_id`, so no two runs' chains are alike even on the same data. The checkpoint and the
mechanism state record the chain's head (the hash of the last line) and its length when they
are written; a resume verifies that the ledger still holds exactly those lines (`verify`) and
refuses a ledger that was deleted, truncated, edited or swapped for another run's. The chain is
evidence against accidents and mix-ups, not against an owner who recomputes every hash and
edits the checkpoint too: they hold the data anyway.

Only a crash can damage a ledger legitimately, and only its last line: a line is one write,
fsynced before its release is used, so a line without its newline was torn mid-write and its
release never reached anything. That tail is dropped. Nothing is rewritten in place: the
damaged file keeps its name as `privacy_ledger.jsonl.damaged-<n>` and the intact lines are
written to a new file. Any other damage (a bad or unchained line before the last) is refused.

The header is the exception: it may hold a release (the length histogram), and a torn copy of
it would keep part of that release on disk, charged nowhere, while the next run draws another.
So the ledger comes into being whole (the header written to a temp file, then renamed); a
process killed before the rename leaves the temp file, which the next run adopts if it is
whole and removes if not (`finish_interrupted_create`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..durable import atomic_write, fsync_dir, temp_files
from ..jsontext import to_json
from ..run_folder import LEDGER

if TYPE_CHECKING:
    import torch

LEDGER_FILE = LEDGER  # in the run folder (run_folder.py names every file a run writes)
FORMAT = 2  # 1: before the hash chain (no `prev`, no `run_id`)
# Header fields that must agree between a ledger on disk and the run that continues it.
IDENTITY = ("dataset", "dataset_size", "delta", "accountant", "length_release")
DAMAGED_SUFFIX = ".damaged-"


class LedgerMismatchError(ValueError):
    """The ledger on disk belongs to another private dataset or accounting."""


class LedgerIntegrityError(ValueError):
    """The ledger on disk is not the one this run wrote: lines were removed, edited or replaced."""


def release_digest(released: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over each released tensor's name, dtype, shape and bytes, in order."""
    import torch  # here: the ledger's readers (the study, the tables) never load torch

    h = hashlib.sha256()
    for name, tensor in released.items():
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())  # the buffer itself: no copy of the model's size
    return h.hexdigest()


def header_history(header: Mapping) -> list[tuple[float, float, int]]:
    """The release a ledger header records, as accountant history: the length histogram's, or none."""
    release = header.get("length_release")
    return [(float(release["noise_multiplier"]), 1.0, 1)] if release else []


def ledger_header(path: Path) -> dict | None:
    """The header of the ledger at `path` (None: no ledger, or no header that reached the disk
    whole). Read before the plan, which depends on its length release; the ledger's own checks
    run when it is opened. A header a killed process left in its temp file is adopted first."""
    finish_interrupted_create(path)
    try:
        with open(path, "rb") as f:
            first = f.readline()
    except FileNotFoundError:
        return None
    if not first.endswith(b"\n"):  # torn: the header never reached the disk whole, nor did anything after it
        return None
    return _json_object(first)  # None for damage, which opening the ledger names


def _json_object(line: bytes) -> dict | None:
    """The JSON object a line holds (None: not JSON, or not an object)."""
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def finish_interrupted_create(path: Path) -> None:
    """Complete or undo the creation of the ledger at `path` that a killed process left as a temp
    file (`_create`): where no ledger holds a line yet, a temp file holding one whole header line
    becomes the ledger (its length release, if any, is then charged and never drawn again); every
    other leftover is removed (a torn header reached nothing but that file)."""
    leftovers = temp_files(path)
    if not leftovers:
        return
    if not (path.exists() and path.stat().st_size):
        for tmp in leftovers:
            data = tmp.read_bytes()
            if data.endswith(b"\n") and data.count(b"\n") == 1 and (_json_object(data) or {}).get("kind") == "header":
                os.replace(tmp, path)
                break
    for tmp in temp_files(path):
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def identity_value(key: str, value: object) -> str:
    """A header's identity value as a refusal names it: a length release by its σ alone (a release
    drawn for a run that is then refused is never charged, so its counts are never printed)."""
    if key == "length_release":
        return f"a length histogram release (σ={value['noise_multiplier']:g})" if isinstance(value, dict) else "no length histogram release"
    return repr(value)


def line_hash(line: bytes) -> str:
    """The chain's link: SHA-256 of one line's bytes as stored, without its newline."""
    return hashlib.sha256(line).hexdigest()


def read_chain(path: Path, lines: list[bytes]) -> tuple[list[dict], str | None]:
    """The parsed lines up to the first bad one, and why it is bad ("<file>:<line>: …"), or None.

    `lines` are complete lines (each had its newline). A header of format 1 (before the chain)
    has no links to check. Shared with the study, which reads ledgers it did not write.
    """
    records: list[dict] = []
    for number, raw in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return records, f"{where}: not valid JSON"
        if not isinstance(record, dict):
            return records, f"{where}: not a JSON object"
        if number == 1:
            if record.get("kind") != "header":
                return records, f"{where}: the first line must be the ledger header"
        elif record.get("kind") != "release":
            return records, f"{where}: expected a release line"
        elif records[0].get("format", 1) != 1 and record.get("prev") != line_hash(lines[number - 2]):
            return records, f"{where}: 'prev' is not the hash of line {number - 1}: lines were removed or edited (a ledger is append-only)"
        records.append(record)
    return records, None


class PrivacyLedger:
    """Append-only, hash-chained record of a run's releases; survives every crash and resume."""

    def __init__(self, path: Path, header: Mapping):
        self.path = Path(path)
        self.releases: list[dict] = []
        self._hashes: list[str] = []  # line_hash of each line, in order: the chain's links
        finish_interrupted_create(self.path)
        if self.path.exists() and self.path.stat().st_size:
            self._load(header)
        else:
            self._create(header)

    def _create(self, header: Mapping) -> None:
        # The run ID starts the chain: two runs on the same data never write the same lines.
        self.header = {"kind": "header", "format": FORMAT, "run_id": secrets.token_hex(16), **header}
        line = to_json(self.header, sort_keys=True).encode()
        # Whole or not at all (atomic_write: temp file, fsync, rename, the directory fsynced):
        # the header may hold the length histogram's release.
        atomic_write(self.path, lambda f: f.write(line + b"\n"))
        self._hashes.append(line_hash(line))

    @property
    def head(self) -> str:
        """The hash of the last line: with `length`, what a checkpoint records of the ledger."""
        return self._hashes[-1]

    @property
    def length(self) -> int:
        """Lines in the ledger, the header included."""
        return len(self._hashes)

    def _load(self, header: Mapping) -> None:
        data = self.path.read_bytes()
        *lines, torn = data.split(b"\n")  # `torn` is empty unless the last write was cut short
        if not lines:  # a header torn by a version that appended it: no release line followed it
            # Removed, not set aside: it may hold part of a length release that nothing charged.
            self.path.unlink()
            self._create(header)
            return
        records, error = read_chain(self.path, lines)
        if error is not None:
            raise LedgerIntegrityError(f"{error}; refusing to continue (the file is left as it is)")
        stored = records[0]
        if stored.get("format") != FORMAT:
            raise LedgerIntegrityError(
                f"{self.path}:1: ledger format {stored.get('format')!r} has no hash chain; this version continues "
                f"only format {FORMAT}: finish the run with the code that started it, or start a new run"
            )
        for key in IDENTITY:
            if stored.get(key) != header.get(key):
                raise LedgerMismatchError(
                    f"{self.path}: the ledger records {key}={identity_value(key, stored.get(key))}, this run has {identity_value(key, header.get(key))}"
                )
        if torn:  # a release never used: set the whole file aside and keep its intact lines
            self._set_aside_torn_tail(data[: len(data) - len(torn)])
        self.header = stored
        self._hashes = [line_hash(line) for line in lines]
        self.releases = records[1:]

    def _set_aside_torn_tail(self, intact: bytes) -> None:
        """Keep the damaged file under a new name and write its intact lines as the ledger."""
        number = 1
        while self.path.with_name(f"{self.path.name}{DAMAGED_SUFFIX}{number}").exists():
            number += 1
        damaged = self.path.with_name(f"{self.path.name}{DAMAGED_SUFFIX}{number}")
        tmp = self.path.with_name(f".{self.path.name}.repair.tmp")
        with open(tmp, "wb") as f:
            f.write(intact)
            f.flush()
            os.fsync(f.fileno())
        try:  # a second name for the same bytes: at every instant a complete ledger is on disk
            os.link(self.path, damaged)
        except OSError:  # a file system without hard links: a copy, durable before the swap
            shutil.copy2(self.path, damaged)
            with open(damaged, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

    def verify(self, head: str | None, length: int | None, recorded_by: str = "the checkpoint") -> None:
        """Refuse unless line `length` hashes to `head`: the ledger still holds every line that
        `recorded_by` saw, unchanged. Lines after it (releases made after that save) are kept."""
        if not isinstance(head, str) or not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise LedgerIntegrityError(
                f"{recorded_by} records no ledger head (ledger_head={head!r}, ledger_length={length!r}): it was not "
                f"written with {self.path.name} format {FORMAT}, so the ledger cannot be checked against it"
            )
        if length > self.length:
            raise LedgerIntegrityError(
                f"{self.path}: {recorded_by} records {length} lines, the ledger has {self.length}: "
                "releases were removed (the ledger was truncated or replaced); the run's ε cannot be recovered"
            )
        if self._hashes[length - 1] != head:
            raise LedgerIntegrityError(
                f"{self.path}:{length}: this is not the line {recorded_by} recorded (its hash differs): the ledger was "
                "edited or swapped for another run's; the run's ε cannot be recovered"
            )

    def _append(self, record: Mapping) -> None:
        line = to_json(record, sort_keys=True).encode()
        with open(self.path, "ab") as f:
            f.write(line + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self._hashes.append(line_hash(line))

    def earlier_digests(self, step: int) -> set[str]:
        """Digests of releases already recorded for `step` (by an earlier attempt at it)."""
        return {r["release_sha256"] for r in self.releases if r["step"] == step}

    def record(self, step: int, noise_multiplier: float, sample_rate: float, digest: str) -> bool:
        """Append one release; returns whether it is charged (False: an identical replay)."""
        charged = digest not in self.earlier_digests(step)
        record = {
            "kind": "release",
            "step": int(step),
            "noise_multiplier": float(noise_multiplier),
            "sample_rate": float(sample_rate),
            "release_sha256": digest,
            "charged": charged,
            "prev": self.head,
        }
        self._append(record)
        self.releases.append(record)
        return charged

    def charged_history(self) -> list[tuple[float, float, int]]:
        """The charged releases as accountant history: (σ, q, consecutive steps), the header's
        length histogram (sensitivity 1, every example: q = 1) first."""
        history: list[tuple[float, float, int]] = header_history(self.header)
        for r in self.releases:
            if not r["charged"]:
                continue
            key = (r["noise_multiplier"], r["sample_rate"])
            if history and history[-1][:2] == key:
                history[-1] = (*key, history[-1][2] + 1)
            else:
                history.append((*key, 1))
        return history
