"""Shared fixtures: a tiny random GPT-2, synthetic token batches, and a tree of synthetic run directories.

The one conftest.py: test files import its helpers as `from conftest import ...`, and a second
conftest.py in a subfolder would take the module name `conftest` from this one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_runs import write_runs_tree

from dpmuon.models import IGNORE_INDEX, Shape, build_random_lm
from dpmuon.privacy import start_flushing_threads

# Before any test's torch work, as the driver does: torch's worker threads flush subnormals, so a
# constant-time release in this process runs as in a run's (tests/privacy/test_subnormals.py).
start_flushing_threads()

VOCAB = 97


def random_gpt2(vocab_size: int, n_layer: int, n_embd: int, n_head: int, n_positions: int, tie_embeddings: bool = True, seed: int = 0, eos_token_id=None):
    """A randomly initialized GPT-2 of the given shape (the models package builds it from a config)."""
    shape = Shape(vocab_size=vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions)
    return build_random_lm("gpt2", shape, tie_embeddings, seed=seed, eos_token_id=eos_token_id)


def tiny_gpt2(tie: bool = True, seed: int = 0, n_layer: int = 2, n_embd: int = 32):
    return random_gpt2(vocab_size=VOCAB, n_layer=n_layer, n_embd=n_embd, n_head=2, n_positions=32, tie_embeddings=tie, seed=seed)


def token_batch(batch_size: int, length: int = 12, seed: int = 0, left_pad: bool = False) -> dict:
    """Random sequences with ragged padding and a masked-out prompt, like real lots."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, length), generator=g)
    mask = torch.ones(batch_size, length, dtype=torch.long)
    labels = ids.clone()
    for i in range(batch_size):
        n_pad = int(torch.randint(0, length // 3, (1,), generator=g))
        prompt = int(torch.randint(1, length // 2, (1,), generator=g))
        if left_pad:
            mask[i, :n_pad] = 0
            labels[i, : n_pad + prompt] = IGNORE_INDEX
        else:
            if n_pad:
                mask[i, -n_pad:] = 0
                labels[i, -n_pad:] = IGNORE_INDEX
            labels[i, :prompt] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture
def tied_model():
    return tiny_gpt2(tie=True)


@pytest.fixture
def untied_model():
    return tiny_gpt2(tie=False)


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    """Synthetic run directories under tmp_path/outputs (helpers_runs.write_runs_tree)."""
    return write_runs_tree(tmp_path / "outputs")


@pytest.fixture(scope="module")
def single_thread():
    """One torch thread for a module: small kernels on a busy 2-core machine stall with more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fast_squared_norms(engine, batch, loss_fn):
    """({name: [B] float64 ‖g_i‖²}, losses) from a fast engine's internals: the engine itself
    exposes only clipped sums, but its norms are what the tests compare with a reference."""
    from dpmuon.privacy.engines.base import full_precision

    losses, calls, _ = engine._forward(batch, loss_fn)
    with full_precision(losses.device):
        traces = engine._backward(losses, calls)
        return engine._squared_norms(traces, losses.shape[0], losses.device), losses.detach()
