"""Kill a run (SIGKILL before or between checkpoints, or SIGTERM) and resume.

With a user mechanism seed the resumed run replays its lots and noise and ends exactly where an
uninterrupted run ends; in secure mode every re-run step is a fresh release and is charged.
Either way the ledger keeps every release, and ε is its composition.
"""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch
from helpers_resume import (
    BEFORE_FIRST_CHECKPOINT,
    BETWEEN_CHECKPOINTS,
    OVERRIDES,
    SEEDED,
    assert_same_run,
    kill_after,
    launch,
    ledger,
    resume,
    rows,
    wait_for_step,
)
from helpers_train import compose_config, require_real_data

from dpmuon.errors import UserError
from dpmuon.privacy import PrivacyAccountant, PrivacyLedger
from dpmuon.privacy.accountant import ReleaseSlack
from dpmuon.privacy.ledger import header_history
from dpmuon.privacy.plan import check_resume_compatible, make_plan
from dpmuon.training.loop import run
from dpmuon.training.secret import MECHANISM_SEED_ENV

# Secure mode at a calibrated σ: ε after the 8 planned steps is just below the target, so one
# charged re-release more would exceed it and the budget guard must stop the run.
SECURE = ["privacy.secure_noise=true", "privacy.noise_multiplier=null", "privacy.target_epsilon=4"]


def ledger_epsilon(records: list[dict]) -> float:
    header = records[0]
    accountant = PrivacyAccountant(header["delta"], header["accountant"], ReleaseSlack(**header["release_slack"]))
    accountant.history = header_history(header)  # the length histogram's release, before the steps
    for r in records[1:]:
        if r["charged"]:
            accountant.step(r["noise_multiplier"], r["sample_rate"])
    return accountant.epsilon()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    require_real_data()
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    summary = run(compose_config(*OVERRIDES, *SEEDED), run_dir)
    return run_dir, summary


@pytest.mark.parametrize("killed_at", [BEFORE_FIRST_CHECKPOINT, BETWEEN_CHECKPOINTS])
def test_seeded_kill_then_resume_replays_for_free_and_equals_uninterrupted_run(tmp_path, reference, killed_at):
    run_dir = tmp_path / "run"
    before = kill_after(run_dir, killed_at, *SEEDED)
    assert not (run_dir / "checkpoint.pt").exists() or killed_at == BETWEEN_CHECKPOINTS
    done = resume(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from step" in done.stderr
    assert_same_run(run_dir, reference)
    after = ledger(run_dir)
    assert after[: len(before)] == before  # nothing released is ever forgotten
    charged = [r for r in after[1:] if r["charged"]]
    assert [r["step"] for r in charged] == list(range(1, 9))  # re-run steps matched: free
    assert [r["release_sha256"] for r in charged] == [r["release_sha256"] for r in ledger(reference[0])[1:]]
    replays = [r for r in after[1:] if not r["charged"]]
    assert all(r["release_sha256"] in {c["release_sha256"] for c in charged if c["step"] == r["step"]} for r in replays)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(ledger_epsilon(after), rel=1e-12)
    assert not (run_dir / "mechanism_state.pt").exists()  # deleted once the run completed


@pytest.mark.parametrize("killed_at", [pytest.param(BEFORE_FIRST_CHECKPOINT, marks=pytest.mark.slow), BETWEEN_CHECKPOINTS])
def test_secure_kill_then_resume_charges_every_rerelease_and_stops_at_the_budget(tmp_path, killed_at):
    require_real_data()
    run_dir = tmp_path / "run"
    before = kill_after(run_dir, killed_at, *SECURE)
    logged_before = rows(run_dir)
    done = resume(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    after = ledger(run_dir)
    assert after[: len(before)] == before
    charged = [r for r in after[1:] if r["charged"]]
    steps = [r["step"] for r in charged]
    assert len(steps) > len(set(steps))  # some step was released twice, and both are charged
    assert all(r["charged"] for r in after[1:])  # fresh noise never reproduces a release
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(ledger_epsilon(after), rel=1e-12)
    assert summary["epsilon"] <= 4.0
    assert summary["releases_charged"] == len(charged)
    assert summary["stopped_by_budget_guard"] and "budget" in summary["stop_reason"]
    assert summary["steps"] < 8
    # Rows of re-run steps were moved aside, not deleted.
    superseded = [json.loads(line) for line in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    redone = [r for r in logged_before if r["step"] > (0 if killed_at == BEFORE_FIRST_CHECKPOINT else 4)]
    assert [r["step"] for r in superseded] == [r["step"] for r in redone] and all(r["superseded"] for r in superseded)


def test_sigterm_checkpoints_and_says_how_to_resume(tmp_path, reference):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, *SEEDED)
    wait_for_step(run_dir, proc, 1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM
    assert f"resume={run_dir}" in stderr and "Traceback" not in stderr
    stopped_at = torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"]
    assert stopped_at == rows(run_dir)[-1]["step"]  # checkpoint and log agree
    done = resume(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(run_dir, reference)


def test_finished_run_cannot_be_resumed(reference):
    done = resume(reference[0])
    assert done.returncode == 2 and "already finished" in done.stderr


def test_a_seeded_run_that_stopped_in_setup_is_not_resumed_with_other_randomness(tmp_path, monkeypatch):
    """No file holds the environment's seed and no mechanism state carries it on yet: a resume
    without it would silently draw OS entropy (an unpaired run labelled as the paired one)."""
    monkeypatch.setenv("DPMUON_DATA_DIR", str(tmp_path / "no-data"))  # setup fails: no train file
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(11 << 100))
    for folder in ("run", "unseeded"):  # made beforehand, as a kill in setup leaves them: a failed
        (tmp_path / folder).mkdir()  # command removes the new folder it made (launch.remove_if_unused)
    failed = launch(tmp_path / "run")
    assert failed.wait(timeout=120) == 2 and "no e2e train file" in failed.stderr.read()
    assert (tmp_path / "run" / ".hydra" / "config.yaml").exists()
    monkeypatch.delenv(MECHANISM_SEED_ENV)  # (given again, it would get past the check: tests/training/test_secret.py)
    done = resume(tmp_path / "run")
    assert done.returncode == 2 and f"resume it with {MECHANISM_SEED_ENV} set" in done.stderr and done.stderr.count("\n") == 1
    unseeded = launch(tmp_path / "unseeded")
    assert unseeded.wait(timeout=120) == 2
    resumed = resume(tmp_path / "unseeded")  # gets past the check to setup (OS entropy, as it would have drawn)
    assert "cannot resume" not in resumed.stderr and "no e2e train file" in resumed.stderr


def test_resume_refuses_a_changed_mechanism():
    kwargs = dict(private=True, dataset_size=1000, expected_lot_size=50, epochs=None, steps=20, target_epsilon=8.0, delta=1e-5, accountant="prv")
    stored = make_plan(**kwargs, noise_multiplier=1.0).as_dict()
    check_resume_compatible(stored, make_plan(**kwargs, noise_multiplier=1.0))
    with pytest.raises(UserError, match="noise_multiplier"):
        check_resume_compatible(stored, make_plan(**kwargs, noise_multiplier=1.5))
    with pytest.raises(UserError, match="dataset_size"):
        check_resume_compatible(stored, make_plan(**(kwargs | {"dataset_size": 999}), noise_multiplier=1.0))


def test_a_seeded_replay_that_computes_another_gradient_is_redrawn_and_charged(tmp_path):
    """Same noise, different model state (as on another machine): publishing the re-run would
    cancel the noise, so it is withheld and the step redrawn from fresh entropy, charged."""
    require_real_data()
    run_dir = tmp_path / "run"
    before = kill_after(run_dir, BETWEEN_CHECKPOINTS, *SEEDED)
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    name = "transformer.ln_f.weight"  # not the tied embedding, whose head copy would overwrite it on load
    # The release is rounded onto the noise's grid (privacy/grid.py), so a change must move the
    # clipped sum by more than a grid step to change the release: doubling the final norm's gain does.
    state["model"][name] = state["model"][name] * 2
    torch.save(state, run_dir / "checkpoint.pt")
    done = resume(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "redrawing lot and noise" in done.stderr
    after = ledger(run_dir)
    assert after[: len(before)] == before
    fifth = [r for r in after[1:] if r["step"] == 5]
    assert len(fifth) == 2 and all(r["charged"] for r in fifth) and fifth[0]["release_sha256"] != fifth[1]["release_sha256"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(ledger_epsilon(after), rel=1e-12)
    assert summary["mechanism_randomness"].startswith("os entropy")


@pytest.mark.slow  # the mirrors' state_dict round trip is tested in seconds by tests/diagnostics
def test_a_resumed_run_continues_its_oracle_mirrors_where_they_stood(tmp_path):
    """The noise-free mirrors M₀ resume from the secret mechanism state: the oracle rows after a
    kill between checkpoints are those of an uninterrupted run (they restarted from zero before)."""
    require_real_data()
    oracle = ("logging.oracle_alignment=true",)
    torch.set_num_threads(1)
    run(compose_config(*OVERRIDES, *SEEDED, *oracle), tmp_path / "uninterrupted")
    killed = tmp_path / "killed"
    kill_after(killed, BETWEEN_CHECKPOINTS, *SEEDED, *oracle)
    done = resume(killed)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restart from zero" not in done.stderr
    resumed, uninterrupted = rows(killed), rows(tmp_path / "uninterrupted")
    assert [r["oracle_snr"] for r in resumed] == [r["oracle_snr"] for r in uninterrupted]
    assert resumed == uninterrupted
    assert "oracle" not in torch.load(killed / "checkpoint.pt", weights_only=False)  # M₀ never enters the shareable checkpoint


# ---- the ledger a resume continues must be the one the run wrote -------------------------------


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run SIGKILLed after step 5: checkpoint and mechanism state at step 4, ledger through step 5."""
    require_real_data()
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    kill_after(run_dir, BETWEEN_CHECKPOINTS)
    return run_dir


def _lines(run_dir) -> list[bytes]:
    return (run_dir / "privacy_ledger.jsonl").read_bytes().split(b"\n")[:-1]


def _write_lines(run_dir, lines: list[bytes]) -> None:
    (run_dir / "privacy_ledger.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))


def _another_runs_ledger(run_dir) -> None:
    """The same data, the same releases, but another run's chain (its own run ID)."""
    records = ledger(run_dir)
    identity = {k: v for k, v in records[0].items() if k not in ("kind", "format", "run_id")}
    (run_dir / "privacy_ledger.jsonl").unlink()
    other = PrivacyLedger(run_dir / "privacy_ledger.jsonl", identity)
    for r in records[1:]:
        other.record(r["step"], r["noise_multiplier"], r["sample_rate"], r["release_sha256"])


def _before_the_first_checkpoint(damage):
    def tamper(run_dir) -> None:  # what a kill before the first checkpoint leaves: the state saved at step 0
        (run_dir / "checkpoint.pt").unlink()
        damage(run_dir)

    return tamper


def _uncharge_the_first_release(run_dir) -> None:
    lines = _lines(run_dir)
    _write_lines(run_dir, [lines[0], lines[1].replace(b'"charged": true', b'"charged": false'), *lines[2:]])


def _delete(run_dir) -> None:
    (run_dir / "privacy_ledger.jsonl").unlink()


@pytest.mark.parametrize(
    "tamper, message",
    [
        (_delete, "privacy_ledger.jsonl is missing but checkpoint.pt records 5 lines: the ledger was deleted"),
        (lambda d: _write_lines(d, _lines(d)[:1] + _lines(d)[3:]), "privacy_ledger.jsonl:2: 'prev' is not the hash of line 1"),
        (lambda d: _write_lines(d, _lines(d)[:4]), "checkpoint.pt records 5 lines, the ledger has 4"),
        (_uncharge_the_first_release, "privacy_ledger.jsonl:3: 'prev' is not the hash of line 2"),
        (_another_runs_ledger, "privacy_ledger.jsonl:5: this is not the line checkpoint.pt recorded"),
        (_before_the_first_checkpoint(_delete), "privacy_ledger.jsonl is missing but mechanism_state.pt records 5 lines"),
        (_before_the_first_checkpoint(_another_runs_ledger), "privacy_ledger.jsonl:1: this is not the line mechanism_state.pt recorded"),
    ],
    ids=["deleted", "middle-removed", "tail-removed", "charged-flipped", "swapped", "deleted-before-checkpoint", "swapped-before-checkpoint"],
)
def test_a_resume_refuses_a_ledger_that_was_deleted_truncated_edited_or_swapped(tmp_path, killed, tamper, message):
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    tamper(run_dir)
    left = (run_dir / "privacy_ledger.jsonl").read_bytes() if (run_dir / "privacy_ledger.jsonl").exists() else None
    torch.set_num_threads(1)
    with pytest.raises(UserError, match=message):
        run(compose_config(*OVERRIDES, f"resume={run_dir}"), run_dir)
    if left is None:
        assert not (run_dir / "privacy_ledger.jsonl").exists()  # no new ledger started under the old releases
    else:
        assert (run_dir / "privacy_ledger.jsonl").read_bytes() == left  # refused, never truncated or rewritten
    assert not list(run_dir.glob("privacy_ledger.jsonl.damaged-*"))


def test_a_torn_last_line_is_set_aside_whole_and_the_resumed_run_completes(tmp_path, killed):
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    intact = (run_dir / "privacy_ledger.jsonl").read_bytes()
    with open(run_dir / "privacy_ledger.jsonl", "ab") as f:
        f.write(b'{"charged": true, "kind": "release", "noise_mul')  # the kill cut the next line short
    torn = (run_dir / "privacy_ledger.jsonl").read_bytes()
    torch.set_num_threads(1)
    summary = run(compose_config(*OVERRIDES, f"resume={run_dir}"), run_dir)
    assert (run_dir / "privacy_ledger.jsonl.damaged-1").read_bytes() == torn  # every byte kept
    after = (run_dir / "privacy_ledger.jsonl").read_bytes()
    assert after.startswith(intact) and after.count(b"\n") > intact.count(b"\n")  # continued, chained on
    assert summary["releases_charged"] == sum(r["charged"] for r in ledger(run_dir)[1:])  # ε is the ledger's
