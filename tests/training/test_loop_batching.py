"""The driver feeds private bf16 runs fixed-shape micro-batches (and, without constant-time lots,
fp32 runs dynamic ones; constant-time lots, the default, are tested in test_constant_time.py)."""

from __future__ import annotations

import pytest
from helpers_train import compose_config, require_real_data

from dpmuon.training import loop
from dpmuon.training.batching import lot_micro_batches
from dpmuon.training.loop import run

TINY = [
    "experiment=smoke", "optimizer=dp_adam", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=100", "data.max_valid_examples=4", "data.max_test_sources=1", "privacy.expected_lot_size=8",
    "privacy.noise_multiplier=1.0", "trainer.steps=2", "trainer.micro_batch_size=4", "eval.test=false",
    "logging.progress=false", "logger=none", "trainer.num_threads=1",
]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "fixed"),
    [
        (["trainer.precision=bf16", "privacy.constant_time=false"], True),
        (["trainer.precision=fp32", "privacy.constant_time=false"], False),
        (["trainer.precision=bf16", "trainer.fixed_batch_shape=false", "privacy.constant_time=false"], False),
    ],
)
def test_private_bf16_runs_use_fixed_shapes(tmp_path, monkeypatch, overrides, fixed):
    require_real_data()
    shapes = []

    def recording(*args, **kwargs):
        for batch in lot_micro_batches(*args, **kwargs):
            shapes.append(tuple(batch["input_ids"].shape))
            yield batch

    monkeypatch.setattr(loop, "lot_micro_batches", recording)
    cfg = compose_config(*TINY, *overrides)
    run(cfg, tmp_path)
    width = min(int(cfg.dataset.max_length), int(cfg.model.n_positions))
    if fixed:
        assert shapes and set(shapes) == {(4, width)}  # every micro-batch the same shape
    else:
        assert all(w < width for _, w in shapes)  # padded only to its own longest example
