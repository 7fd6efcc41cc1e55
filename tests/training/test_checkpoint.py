"""A failed write (a full disk, a quota, an I/O error) is one line naming the file, the run stops
before releasing more, and a resume refuses a checkpoint that is incomplete or damaged, or the
initial weights of a run whose budget is spent."""

from __future__ import annotations

import errno
import io
import json
import os

import pytest
import torch
from helpers_train import compose_config, require_real_data

from dpmuon import durable
from dpmuon.durable import WriteFailed, temp_files
from dpmuon.errors import UserError
from dpmuon.privacy.state import load_mechanism_state, save_mechanism_state
from dpmuon.training import loop, run_files
from dpmuon.training.checkpoint import CHECKPOINT_KEYS, load_checkpoint, save_checkpoint
from dpmuon.training.run_files import MetricsLog, atomic_write_json

TINY = [
    "experiment=smoke", "optimizer=dp_muon", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2", "privacy.expected_lot_size=16",
    "trainer.micro_batch_size=16", "trainer.eval_every=0", "eval.validation=false", "eval.test=false",
    "logging.progress=false", "logger=none", "trainer.num_threads=1",
]  # fmt: skip


def a_checkpoint(step: int) -> dict:
    return {key: {"weight": torch.full((64, 64), float(step))} for key in CHECKPOINT_KEYS} | {"step": step}


class FullDisk(io.RawIOBase):
    """A file on a disk with `room` bytes left: the write that would pass it fails with ENOSPC."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()
        super().close()


def fill_the_disk_at(monkeypatch, name: str, nth: int, room: int = 1000) -> None:
    """The `nth` atomic write of `name` (1-based) meets a full disk; every other write has room."""
    mkstemp, fdopen, temps, calls = durable.tempfile.mkstemp, durable.os.fdopen, {}, []

    def made(*args, **kwargs):
        fd, tmp = mkstemp(*args, **kwargs)
        temps[fd] = os.path.basename(tmp)
        return fd, tmp

    def opened(fd, *args, **kwargs):
        file = fdopen(fd, *args, **kwargs)
        if temps.pop(fd, "").startswith(f".{name}."):
            calls.append(fd)
            if len(calls) == nth:
                return io.BufferedWriter(FullDisk(file, room))
        return file

    monkeypatch.setattr(durable.tempfile, "mkstemp", made)
    monkeypatch.setattr(run_files.os, "fdopen", opened)


# ---- writes ---------------------------------------------------------------------------------------


def test_a_checkpoint_onto_a_full_disk_names_the_file_and_keeps_the_one_before(tmp_path, monkeypatch):
    """torch.save turned the ENOSPC into `RuntimeError: [enforce fail at inline_container.cc] unexpected pos`."""
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, a_checkpoint(1))
    fill_the_disk_at(monkeypatch, "checkpoint.pt", nth=1)
    with pytest.raises(WriteFailed) as failed:
        save_checkpoint(path, a_checkpoint(2))
    assert str(failed.value) == f"cannot write {path}: No space left on device (ENOSPC)"
    assert isinstance(failed.value, OSError) and failed.value.errno == errno.ENOSPC
    assert temp_files(path) == [] and load_checkpoint(path)["step"] == 1  # the space it took is freed, the old one intact


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_the_summary_and_a_metrics_row_that_cannot_be_synced_name_their_file(tmp_path, monkeypatch, code):
    def fsync(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(run_files.os, "fsync", fsync)
    writes = [
        (lambda p: atomic_write_json(p, {"epsilon": 1.0}), tmp_path / "summary.json"),
        (lambda p: MetricsLog(p).append({"step": 1}), tmp_path / "metrics.jsonl"),
    ]
    for write, path in writes:
        with pytest.raises(WriteFailed, match=rf"^cannot write {path}: {os.strerror(code)} \({errno.errorcode[code]}\)$"):
            write(path)
    assert not (tmp_path / "summary.json").exists() and temp_files(tmp_path / "summary.json") == []


# ---- loads ----------------------------------------------------------------------------------------


def damaged_copies(path):
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # inside the weights: torch.load would load it as a changed weight
    return {
        "cut short": (data[: len(data) // 2], "the file is incomplete or damaged"),
        "empty": (b"", "the file is incomplete or damaged"),
        "one byte flipped": (bytes(flipped), r"the file is damaged \(its entry .* fails its checksum\)"),
    }


def test_a_checkpoint_cut_short_emptied_or_altered_is_refused_in_one_line(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, a_checkpoint(3))
    assert load_checkpoint(path)["step"] == 3
    for damage, (content, problem) in damaged_copies(path).items():
        copy = tmp_path / damage / "checkpoint.pt"
        copy.parent.mkdir()
        copy.write_bytes(content)
        with pytest.raises(UserError, match=rf"^cannot resume from {copy}: {problem}.*; restore checkpoint.pt from an intact copy") as refused:
            load_checkpoint(copy)
        assert "\n" not in str(refused.value), damage


def test_a_file_that_is_no_checkpoint_is_refused_and_a_damaged_mechanism_state_too(tmp_path):
    other = tmp_path / "checkpoint.pt"
    torch.save({"model": {}}, other)  # a torch file, but not a checkpoint the loop wrote
    with pytest.raises(UserError, match=r"it is no complete checkpoint \(no 'step' entry\)"):
        load_checkpoint(other)
    state = tmp_path / "mechanism_state.pt"
    save_mechanism_state(state, 4, {"randomness": {}, "sampler": {}})
    state.write_bytes(state.read_bytes()[:-100])
    with pytest.raises(UserError, match=rf"^cannot resume from {state}: the file is incomplete or damaged .*restore mechanism_state.pt"):
        load_mechanism_state(state, 4)


# ---- runs -----------------------------------------------------------------------------------------


def ledger_steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "privacy_ledger.jsonl").read_text().splitlines()[1:]]


def test_a_full_disk_at_a_checkpoint_stops_the_run_before_its_next_release(tmp_path, monkeypatch):
    require_real_data()
    run_dir = tmp_path / "run"
    fill_the_disk_at(monkeypatch, "checkpoint.pt", nth=2)
    with pytest.raises(UserError) as stopped:
        loop.run(compose_config(*TINY, "privacy.noise_multiplier=1.0", "trainer.steps=4", "trainer.checkpoint_every=1"), run_dir)
    line = str(stopped.value)
    assert line.startswith(f"cannot write {run_dir / 'checkpoint.pt'}: No space left on device (ENOSPC); the run stopped after step 2 of 4, releasing nothing")
    assert line.endswith(f"resume with: python -m dpmuon.train resume={run_dir}") and "\n" not in line
    assert ledger_steps(run_dir) == [1, 2]  # no lot drawn after the failed write
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == 1 and not (run_dir / "summary.json").exists()


def test_a_resume_with_the_budget_spent_and_no_checkpoint_is_refused_rather_than_reporting_the_initial_weights(tmp_path, monkeypatch):
    """Before, the resumed run stopped at its budget guard on step 1, evaluated the untrained
    weights and wrote them up as the result ("done", exit 0)."""
    require_real_data()
    run_dir = tmp_path / "run"
    spent = [*TINY, "privacy.noise_multiplier=1.0", "trainer.steps=2", "trainer.checkpoint_every=0"]
    fill_the_disk_at(monkeypatch, "checkpoint.pt", nth=1)  # the only checkpoint, after the last step
    with pytest.raises(UserError, match="stopped after step 2 of 2"):
        loop.run(compose_config(*spent), run_dir)
    monkeypatch.undo()
    assert ledger_steps(run_dir) == [1, 2] and not (run_dir / "checkpoint.pt").exists()
    # The budget spent (as at a calibrated σ, whose planned steps use all of it; calibrating takes long).
    monkeypatch.setattr(loop.Mechanism, "within_budget", lambda mechanism: False)
    with pytest.raises(UserError) as refused:
        loop.run(compose_config(*spent, f"resume={run_dir}"), run_dir)
    assert str(refused.value).startswith(f"cannot resume {run_dir}: its ledger charges 2 releases (ε ")
    assert "no checkpoint.pt holds the weights they trained" in str(refused.value) and "\n" not in str(refused.value)
    assert ledger_steps(run_dir) == [1, 2] and not (run_dir / "summary.json").exists()
