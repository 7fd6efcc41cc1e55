"""The privacy ledger: one durable line per release, written before anything derived from it.

`<run dir>/privacy_ledger.jsonl` starts with a header naming the private training set (dataset,
N, a fingerprint of its examples) and the accounting (δ, accountant), then holds one line per
release: step, σ, q, whether it was charged, and a SHA-256 of the released gradient. The line
is appended and fsynced inside the privatizer, before the gradient reaches the optimizer, a
log, a checkpoint or W&B — so a crash at any instant can lose work but never a release.

ε spent is always the composition of the charged lines. A step re-run after a resume that
releases a bit-identical gradient reveals nothing new and is written uncharged; any other
re-release is a new release and is charged. `python -m dpmuon.privacy.study` composes the
ledgers of several runs on the same data.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

LEDGER_FILE = "privacy_ledger.jsonl"
FORMAT = 1
# Header fields that must agree between a ledger on disk and the run that continues it.
IDENTITY = ("dataset", "dataset_size", "data_fingerprint", "delta", "accountant")


class LedgerMismatchError(ValueError):
    """The ledger on disk belongs to another private dataset or accounting."""


def release_digest(released: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over each released tensor's name, dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for name, tensor in released.items():
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())  # the buffer itself: no copy of the model's size
    return h.hexdigest()


class PrivacyLedger:
    """Append-only record of a run's releases; survives every crash and resume."""

    def __init__(self, path: Path, header: Mapping):
        self.path = Path(path)
        self.header = {"kind": "header", "format": FORMAT, **header}
        self.releases: list[dict] = []
        if self.path.exists() and self.path.stat().st_size:
            self._load()
        else:
            self._append(self.header)

    def _load(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        complete = []
        for line in lines:
            try:
                complete.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line: its release never reached anything downstream
        if len(complete) < len(lines):  # rewrite without the torn tail, atomically
            self._rewrite(complete)
        stored = complete[0]
        for key in IDENTITY:
            if stored.get(key) != self.header.get(key):
                raise LedgerMismatchError(
                    f"{self.path}: the ledger records {key}={stored.get(key)!r}, this run has {self.header.get(key)!r}"
                )
        self.releases = [r for r in complete[1:] if r.get("kind") == "release"]

    def _rewrite(self, records: list[dict]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _append(self, record: Mapping) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

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
        }
        self._append(record)
        self.releases.append(record)
        return charged

    def charged_history(self) -> list[tuple[float, float, int]]:
        """The charged releases as accountant history: (σ, q, consecutive steps)."""
        history: list[tuple[float, float, int]] = []
        for r in self.releases:
            if not r["charged"]:
                continue
            key = (r["noise_multiplier"], r["sample_rate"])
            if history and history[-1][:2] == key:
                history[-1] = (*key, history[-1][2] + 1)
            else:
                history.append((*key, 1))
        return history
