"""One torch thread per test, for test modules of tiny models: import `one_thread` into the
module (`from helpers_threads import one_thread  # noqa: F401`) and it applies to every test there."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Models this small gain nothing from a second thread, and two threads on a busy pair of
    cores stall each other (and the driver sets trainer.num_threads for the rest of the process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
