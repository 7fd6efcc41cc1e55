"""The privacy ledger: every release durable before it is used, identical replays free,
different re-releases charged, and a re-run that reuses noise for a new output refused."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from conftest import tiny_gpt2, token_batch

from dpmuon.durable import atomic_write
from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.privacy import (
    GaussianNoise,
    LedgerMismatchError,
    PrivacyAccountant,
    PrivacyLedger,
    Privatizer,
    ReplayMismatchError,
    SecretStream,
    build_partition,
    release_digest,
)
from dpmuon.privacy.ledger import LedgerIntegrityError, ledger_header

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


def written(path, releases: int = 4) -> PrivacyLedger:
    ledger = PrivacyLedger(path, HEADER)
    for step in range(1, releases + 1):
        ledger.record(step, 1.0, 0.1, f"{step:064x}")
    return ledger


def test_each_line_chains_to_the_previous_one_and_head_and_length_name_the_last(tmp_path):
    ledger = written(tmp_path / "privacy_ledger.jsonl")
    raw = (tmp_path / "privacy_ledger.jsonl").read_bytes().split(b"\n")[:-1]
    records = [json.loads(line) for line in raw]
    assert [r["prev"] for r in records[1:]] == [hashlib.sha256(line).hexdigest() for line in raw[:-1]]
    assert ledger.length == 5 and ledger.head == hashlib.sha256(raw[-1]).hexdigest()
    other = written(tmp_path / "other.jsonl")  # same data, same releases: another run's chain
    assert records[0]["run_id"] != json.loads((tmp_path / "other.jsonl").read_text().splitlines()[0])["run_id"]
    assert other.head != ledger.head


def test_a_ledger_longer_than_its_checkpoint_verifies_and_keeps_the_later_releases(tmp_path):
    path = tmp_path / "privacy_ledger.jsonl"
    ledger = written(path, 2)
    head, length = ledger.head, ledger.length  # what a checkpoint records after step 2
    ledger.record(3, 1.0, 0.1, "c")  # released after the checkpoint, before a crash
    reopened = PrivacyLedger(path, HEADER)
    reopened.verify(head, length)
    assert reopened.charged_history() == [(1.0, 0.1, 3)]


def _remove_middle_lines(lines: list[bytes]) -> list[bytes]:
    return lines[:1] + lines[3:]


def _flip_charged(lines: list[bytes]) -> list[bytes]:
    return [lines[0], lines[1].replace(b'"charged": true', b'"charged": false'), *lines[2:]]


def _change_sigma(lines: list[bytes]) -> list[bytes]:
    return [lines[0], lines[1], lines[2].replace(b'"noise_multiplier": 1.0', b'"noise_multiplier": 9.0'), *lines[3:]]


def _garble_a_middle_line(lines: list[bytes]) -> list[bytes]:
    return [lines[0], b'{"kind": "rele', *lines[2:]]


@pytest.mark.parametrize(
    "damage, message",
    [
        (_remove_middle_lines, ":2: 'prev' is not the hash of line 1"),
        (_flip_charged, ":3: 'prev' is not the hash of line 2"),
        (_change_sigma, ":4: 'prev' is not the hash of line 3"),
        (_garble_a_middle_line, ":2: not valid JSON"),
    ],
    ids=["truncated-middle", "charged-flipped", "sigma-changed", "garbled-middle"],
)
def test_a_ledger_with_lines_removed_or_edited_is_refused_and_left_as_it_is(tmp_path, damage, message):
    path = tmp_path / "privacy_ledger.jsonl"
    written(path)
    damaged = b"".join(line + b"\n" for line in damage(path.read_bytes().split(b"\n")[:-1]))
    path.write_bytes(damaged)
    with pytest.raises(LedgerIntegrityError, match=f"privacy_ledger.jsonl{message}"):
        PrivacyLedger(path, HEADER)
    assert path.read_bytes() == damaged  # a refusal, never a truncation or a rewrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["privacy_ledger.jsonl"]


def test_verify_refuses_a_truncated_edited_swapped_or_recreated_ledger(tmp_path):
    path = tmp_path / "privacy_ledger.jsonl"
    head, length = (ledger := written(path)).head, ledger.length
    original = path.read_bytes()

    path.write_bytes(b"".join(line + b"\n" for line in original.split(b"\n")[:-2]))  # the last release removed
    with pytest.raises(LedgerIntegrityError, match="records 5 lines, the ledger has 4"):
        PrivacyLedger(path, HEADER).verify(head, length, "checkpoint.pt")

    start_of_last = original.rindex(b"\n", 0, -1) + 1  # the last line: no later line chains to it
    path.write_bytes(original[:start_of_last] + original[start_of_last:].replace(b'"charged": true', b'"charged": false'))
    with pytest.raises(LedgerIntegrityError, match="privacy_ledger.jsonl:5: this is not the line checkpoint.pt recorded"):
        PrivacyLedger(path, HEADER).verify(head, length, "checkpoint.pt")

    path.unlink()
    written(tmp_path / "other.jsonl").path.replace(path)  # another run's ledger on the same data
    with pytest.raises(LedgerIntegrityError, match="swapped for another run's"):
        PrivacyLedger(path, HEADER).verify(head, length, "checkpoint.pt")

    path.unlink()  # deleted, then recreated by a resume that did not know better
    with pytest.raises(LedgerIntegrityError, match="records 5 lines, the ledger has 1"):
        PrivacyLedger(path, HEADER).verify(head, length, "checkpoint.pt")
    with pytest.raises(LedgerIntegrityError, match="records no ledger head"):
        PrivacyLedger(path, HEADER).verify(None, None, "checkpoint.pt")


def test_a_torn_last_line_is_moved_aside_with_every_byte_and_the_chain_continues(tmp_path):
    path = tmp_path / "privacy_ledger.jsonl"
    head, length = (ledger := written(path, 2)).head, ledger.length
    intact = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"charged": true, "kind": "release", "noise_multiplier": 1.0, "prev": "')  # killed mid-write
    torn = path.read_bytes()
    reopened = PrivacyLedger(path, HEADER)
    reopened.verify(head, length)
    assert path.read_bytes() == intact and (tmp_path / "privacy_ledger.jsonl.damaged-1").read_bytes() == torn
    assert reopened.record(3, 1.0, 0.1, "c") and PrivacyLedger(path, HEADER).length == 4  # chained on, reopens
    with open(path, "ab") as f:
        f.write(b"{")  # torn again: the first copy is kept, the second gets the next number
    PrivacyLedger(path, HEADER)
    assert (tmp_path / "privacy_ledger.jsonl.damaged-1").read_bytes() == torn
    assert (tmp_path / "privacy_ledger.jsonl.damaged-2").read_bytes().endswith(b"\n{")


def test_a_ledger_from_before_the_chain_is_not_continued(tmp_path):
    path = tmp_path / "privacy_ledger.jsonl"
    path.write_text(json.dumps({"kind": "header", "format": 1, **HEADER}) + "\n")
    with pytest.raises(LedgerIntegrityError, match="privacy_ledger.jsonl:1: ledger format 1 has no hash chain"):
        PrivacyLedger(path, HEADER)


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
        noise=GaussianNoise(SecretStream(noise_seed)), ledger=PrivacyLedger(tmp_path / "ledger.jsonl", HEADER),
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


def test_a_torn_header_is_removed_not_kept_and_a_new_ledger_begins(tmp_path):
    path = tmp_path / "privacy_ledger.jsonl"
    path.write_bytes(b'{"accountant": "prv", "length_release": {"counts": [3.2, 1')  # an earlier version, killed mid-header
    ledger = PrivacyLedger(path, HEADER)
    assert ledger.length == 1 and lines(path)[0]["kind"] == "header"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["privacy_ledger.jsonl"]  # no copy of a release nothing charged


def test_the_header_reaches_the_ledger_whole_and_a_killed_creation_is_adopted_or_removed(tmp_path, monkeypatch):
    path = tmp_path / "privacy_ledger.jsonl"
    written = []
    monkeypatch.setattr("dpmuon.privacy.ledger.atomic_write", lambda p, write: written.append(p) or atomic_write(p, write))
    PrivacyLedger(path, {**HEADER, "length_release": {"noise_multiplier": 2.0, "counts": [1.5, 2.5]}})
    assert written == [path]  # through a temp file and a rename: never torn in place
    whole = path.read_bytes()
    # Killed after the temp file was written, before the rename: the next run adopts it, so its release is charged, never drawn again.
    path.unlink()
    (tmp_path / ".privacy_ledger.jsonl.x1.tmp").write_bytes(whole)
    assert ledger_header(path)["length_release"]["counts"] == [1.5, 2.5]
    assert path.read_bytes() == whole and sorted(p.name for p in tmp_path.iterdir()) == ["privacy_ledger.jsonl"]
    # Killed mid-write: the torn temp file reached nothing and is removed; a new ledger begins.
    path.unlink()
    (tmp_path / ".privacy_ledger.jsonl.x2.tmp").write_bytes(whole[:40])
    assert ledger_header(path) is None and not list(tmp_path.iterdir())
    # A leftover beside a ledger that exists is removed, and the ledger is untouched.
    path.write_bytes(whole)
    (tmp_path / ".privacy_ledger.jsonl.x3.tmp").write_bytes(whole)
    assert PrivacyLedger(path, {**HEADER, "length_release": {"noise_multiplier": 2.0, "counts": [1.5, 2.5]}}).length == 1
    assert path.read_bytes() == whole and sorted(p.name for p in tmp_path.iterdir()) == ["privacy_ledger.jsonl"]
