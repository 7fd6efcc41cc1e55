"""Flush-to-zero while a constant-time lot is computed on the CPU (privacy/subnormals.py): every
thread of torch's pool and the calling thread read subnormal floats as zero there, so their
microcode assists cannot make a step's time depend on the lot's values; the caller does not flush
outside it (the release and the accounting assume gradual underflow). Each state is read by
behaviour. A fresh process is needed wherever the pool's creation matters: the flag is taken by a
thread when it is created, and this process's pool was started by conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_gpt2, token_batch

from dpmuon.models import per_example_lm_loss
from dpmuon.privacy import PrivacyAccountant, Privatizer, build_partition
from dpmuon.privacy.subnormals import caller_flushes, flush_supported, workers_flush

pytestmark = pytest.mark.skipif(not flush_supported(), reason="no flush-to-zero on this CPU (x86 with SSE3 has it)")


def in_fresh_process(code: str) -> list[str]:
    """Run code in a new interpreter with two torch threads, every warning shown: its printed words,
    then "warned" once for each time it was told to start its threads flushing."""
    tests = str(Path(__file__).parents[1])
    command = [sys.executable, "-W", "always", "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": tests, "OMP_NUM_THREADS": "2"})
    return done.stdout.split() + ["warned"] * done.stderr.count("start_flushing_threads() first thing")


def test_threads_started_by_start_flushing_threads_flush_and_the_caller_is_left_as_it_was():
    words = in_fresh_process(
        "from dpmuon.privacy import start_flushing_threads\n"
        "from dpmuon.privacy.subnormals import caller_flushes, workers_flush\n"
        "import torch\n"
        "started = start_flushing_threads(2)\n"
        "torch.ones(1 << 18).sum()  # parallel work of a caller that does not flush: the pool exists already\n"
        "print(started, workers_flush(), caller_flushes())\n"
    )
    assert words == ["True", "True", "False"]


def test_threads_started_before_do_not_flush_and_a_constant_time_release_warns_once():
    """Two releases, one warning; start_flushing_threads cannot mend a pool that already exists."""
    words = in_fresh_process(
        "import torch\n"
        "torch.set_num_threads(2)\n"
        "torch.ones(1 << 18).sum()  # the user's torch work starts the pool first\n"
        "from conftest import tiny_gpt2, token_batch\n"
        "from dpmuon.models import per_example_lm_loss\n"
        "from dpmuon.privacy import PrivacyAccountant, Privatizer, build_partition, start_flushing_threads\n"
        "model = tiny_gpt2()\n"
        "partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.1)\n"
        "privatizer = Privatizer(model, partition, 1.0, 4.0, 0.1, PrivacyAccountant(1e-5), constant_time=True)\n"
        "for _ in range(2):\n"
        "    privatizer.release([token_batch(4)], per_example_lm_loss)\n"
        "privatizer.close()\n"
        "print(start_flushing_threads())\n"
    )
    assert words == ["False", "warned"]


def test_the_driver_starts_its_threads_flushing(tmp_path):
    words = in_fresh_process(
        "from dpmuon.config import compose_config\n"
        "from dpmuon.privacy.subnormals import caller_flushes, workers_flush\n"
        "from dpmuon.training.loop import setup_process\n"
        f"setup_process(compose_config('trainer.num_threads=2'), __import__('pathlib').Path({str(tmp_path / 'run')!r}))\n"
        "import torch\n"
        "torch.ones(1 << 18).sum()  # the model's initialization, say: parallel work of a caller that does not flush\n"
        "print(workers_flush(), caller_flushes())\n"
    )
    assert words == ["True", "False"]


@pytest.mark.parametrize("constant_time", [True, False])
def test_the_caller_flushes_exactly_while_a_constant_time_lot_is_computed(constant_time):
    assert workers_flush()  # conftest.py started this process's pool from a flushing thread
    model = tiny_gpt2()
    seen = []
    model.register_forward_hook(lambda *_: seen.append(caller_flushes()))
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.1)
    privatizer = Privatizer(model, partition, 1.0, 4.0, 0.1, PrivacyAccountant(1e-5), constant_time=constant_time)
    privatizer.release([token_batch(4), token_batch(4, seed=1)], per_example_lm_loss)
    privatizer.close()
    assert seen and set(seen) == {constant_time}
    assert not caller_flushes()
