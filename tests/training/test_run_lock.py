"""The run folder's lock leaves a finished run's frozen times as they were (issue 37.8).

A finished constant-time run's folder carries FROZEN_TIME; the command that ran it checks the
folder again at exit (launch.remove_if_unused: lock, list, unlock), and any later command that
is refused there takes its lock first. Creating and removing run.lock must not stamp the folder
with that moment, the end of the run.
"""

from __future__ import annotations

import os

from dpmuon.launch import remove_if_unused
from dpmuon.run_folder import LOCK, SUMMARY
from dpmuon.training.run_files import FROZEN_TIME, freeze_times
from dpmuon.training.run_lock import lock_run_dir, unlock_run_dir


def times(path) -> tuple[float, float]:
    status = os.stat(path)
    return status.st_mtime, status.st_atime


def test_locking_a_frozen_run_folder_and_releasing_it_leaves_its_times_frozen(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / SUMMARY).write_text("{}\n")
    freeze_times(run_dir)
    remove_if_unused(run_dir, [run_dir])  # the command's check at exit: a run, so the folder stays
    assert (run_dir / SUMMARY).exists() and not (run_dir / LOCK).exists()
    assert times(run_dir) == (FROZEN_TIME, FROZEN_TIME)
    assert lock_run_dir(run_dir) and (run_dir / LOCK).exists()  # a later command, refused there
    unlock_run_dir(run_dir)
    assert times(run_dir) == (FROZEN_TIME, FROZEN_TIME)


def test_a_folder_that_was_not_frozen_keeps_the_times_its_lock_gave_it(tmp_path):
    run_dir = tmp_path / "run"
    assert lock_run_dir(run_dir)
    unlock_run_dir(run_dir)
    assert os.stat(run_dir).st_mtime > FROZEN_TIME
