"""The privacy ledger: every release durable before it is used, identical replays free,
different re-releases charged, and a re-run that reuses noise for a new output refused."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_gpt2, token_batch

from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.privacy import (
    GaussianNoise,
    LedgerMismatchError,
    PrivacyAccountant,
    PrivacyLedger,
    Privatizer,
    ReplayMismatchError,
    build_partition,
    release_digest,
)

HEADER = {"dataset": "e2e", "dataset_size": 40, "data_fingerprint": "abc", "delta": 1e-5, "accountant": "prv"}
BATCH = token_batch(6, seed=2)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replays_are_free_and_other_rereleases_are_charged(tmp_path):
    path = tmp_path / "privacy_ledger.jsonl"
    ledger = PrivacyLedger(path, HEADER)
    assert ledger.record(1, 1.0, 0.1, "a") and ledger.record(2, 1.0, 0.1, "b")
    reopened = PrivacyLedger(path, HEADER)  # a resume continues the file
    assert not reopened.record(2, 1.0, 0.1, "b")  # the same output again: nothing new released
    assert reopened.record(2, 1.0, 0.1, "c")  # another output for step 2: a new release
    assert reopened.record(3, 0.5, 0.1, "d")
    assert reopened.charged_history() == [(1.0, 0.1, 3), (0.5, 0.1, 1)]
    records = lines(path)
    assert records[0]["kind"] == "header" and [r["charged"] for r in records[1:]] == [True, True, False, True, True]


def test_a_torn_last_line_is_dropped_and_another_dataset_is_refused(tmp_path):
    path = tmp_path / "privacy_ledger.jsonl"
    PrivacyLedger(path, HEADER).record(1, 1.0, 0.1, "a")
    with open(path, "a") as f:
        f.write('{"kind": "release", "st')  # killed mid-write
    assert PrivacyLedger(path, HEADER).charged_history() == [(1.0, 0.1, 1)]
    assert all(json.loads(line) for line in path.read_text().splitlines())
    with pytest.raises(LedgerMismatchError, match="dataset_size"):
        PrivacyLedger(path, {**HEADER, "dataset_size": 41})


def test_digest_sees_every_bit_of_the_release():
    released = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    nudged = {"w": torch.ones(3, 2), "b": torch.tensor([0.0, 1e-30])}
    assert release_digest(released) == release_digest({k: v.clone() for k, v in released.items()})
    assert release_digest(released) != release_digest(nudged)


def privatizer_with_ledger(tmp_path, noise_seed: int = 5) -> Privatizer:
    torch.manual_seed(0)
    model = tiny_gpt2(tie=True)
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.5, matrix_names=hidden_matrices(model))
    return Privatizer(
        model, partition, noise_multiplier=0.8, expected_lot_size=6, sample_rate=0.15, accountant=PrivacyAccountant(1e-5),
        noise=GaussianNoise(torch.Generator().manual_seed(noise_seed)), ledger=PrivacyLedger(tmp_path / "ledger.jsonl", HEADER),
    )  # fmt: skip


def test_privatizer_writes_the_ledger_before_the_gradient_and_charges_only_new_outputs(tmp_path):
    first = privatizer_with_ledger(tmp_path)
    first.release([BATCH], per_example_lm_loss, step=1)
    assert len(lines(tmp_path / "ledger.jsonl")) == 2 and first.accountant.steps == 1
    digest = lines(tmp_path / "ledger.jsonl")[1]["release_sha256"]
    assert digest == release_digest({n: p.grad for n, p in first.params.items()})

    replay = privatizer_with_ledger(tmp_path)  # same model, same noise stream: the identical release
    stats = replay.release([BATCH], per_example_lm_loss, step=1)
    assert not stats.charged and replay.accountant.steps == 0

    reused_noise = privatizer_with_ledger(tmp_path)
    with pytest.raises(ReplayMismatchError):  # same noise, other lot: publishing it would cancel the noise
        reused_noise.release([token_batch(6, seed=3)], per_example_lm_loss, step=1)
    assert all(p.grad is None for p in reused_noise.params.values())
    assert len(lines(tmp_path / "ledger.jsonl")) == 3  # nothing recorded for the refused release

    fresh = privatizer_with_ledger(tmp_path, noise_seed=99)
    fresh.noise_may_repeat = False  # reseeded from fresh entropy: a new release, charged
    assert fresh.release([token_batch(6, seed=3)], per_example_lm_loss, step=1).charged
    assert fresh.ledger.charged_history() == [(0.8, 0.15, 2)]
