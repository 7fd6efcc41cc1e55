"""What a run publishes is right, and says nothing the guarantee does not cover.

With non-private diagnostics off, nothing written, logged or sent to W&B may reveal per-step
time or lot size; the logged noise std is what the privatizer used; δ·N and the status of the
validation split are recorded. (The default — diagnostics in their own file, constant-time
lots — is tested in test_constant_time.py.)
"""

from __future__ import annotations

import json
import math
import re
import sys
import types

import pytest
from helpers_train import compose_config, require_real_data

from dpmuon.privacy import mechanism
from dpmuon.training.loop import run

TINY = [
    "experiment=smoke", "optimizer=dp_muon", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2",
    "privacy.expected_lot_size=16", "privacy.noise_multiplier=1.0", "trainer.steps=6", "trainer.micro_batch_size=16",
    "trainer.eval_every=3", "trainer.checkpoint_every=3", "eval.num_beams=1", "eval.max_new_tokens=4",
    "logger=none", "trainer.num_threads=1",
]  # fmt: skip
# Functions of the released gradients (covered by the guarantee): they may differ between lots.
RELEASE_DERIVED = {"snr", "snr_median", "val_nll", "test_nll", "bleu", "bleu_single_ref", "rouge_l", "final_weights_sha256", "ledger_head", "run_dir"}


class FixedSizeLots:
    """Lots of prescribed sizes, so two runs differ in nothing but how many examples step t saw."""

    def __init__(self, sizes):
        self.sizes, self.step = sizes, 0

    def next_lot(self):
        size = self.sizes[self.step % len(self.sizes)]
        self.step += 1
        return list(range(size))

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def fake_wandb(calls: list):
    module = types.ModuleType("wandb")
    module.Settings = lambda **kw: ("settings", kw)
    module.Image = lambda path: path

    def init(**kwargs):
        calls.append(("init", kwargs))
        return types.SimpleNamespace(id="fake", summary={})

    module.init = init
    module.log = lambda row, step=None: calls.append(("log", step, dict(row)))
    module.finish = lambda: calls.append(("finish",))
    return module


def run_with_lots(tmp_path, monkeypatch, capsys, name: str, sizes: list[int]):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, **k: FixedSizeLots(sizes))
    # Without constant-time lots (tests/training/test_constant_time.py covers the default): the
    # lots of 150 are not truncated, and nothing but the time steps take may tell them apart.
    cfg = compose_config(*TINY, "logger=wandb", "logging.nonprivate_diagnostics=false", "logging.progress=true", "privacy.constant_time=false")
    summary = run(cfg, tmp_path / name)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, calls, capsys.readouterr().err


def test_without_diagnostics_nothing_emitted_depends_on_the_lot_sizes(tmp_path, monkeypatch, capsys):
    require_real_data()
    steady = run_with_lots(tmp_path, monkeypatch, capsys, "steady", [16])
    swinging = run_with_lots(tmp_path, monkeypatch, capsys, "swinging", [1, 150])  # step time swings ~100×
    for summary, rows, calls, stderr in (steady, swinging):
        assert "train_seconds" not in summary and "lot_size" not in summary
        assert not any(key in row for row in rows for key in ("lot_size", "step_seconds", "train_loss", "clip_fraction"))
        init = next(c[1] for c in calls if c[0] == "init")
        assert init["settings"] == ("settings", {"x_disable_stats": True, "x_disable_meta": True, "console": "off"})
        assert [c[1] for c in calls if c[0] == "log" and c[1] is not None] == [0, 3, 6]  # evaluation points only (0: before training)
        train_bar = [part for part in re.split(r"[\r\n]", stderr) if part.startswith("train:")]
        assert train_bar and not any("it/s" in part or "s/it" in part or "<" in part for part in train_bar)
    (s1, rows1, calls1, _), (s2, rows2, calls2, _) = steady, swinging
    public = lambda row: {k: v for k, v in row.items() if k.split("/")[0] not in RELEASE_DERIVED}  # noqa: E731
    assert [public(r) for r in rows1] == [public(r) for r in rows2]
    assert [set(r) for r in rows1] == [set(r) for r in rows2]
    assert set(s1) == set(s2) and {k for k in s1 if s1[k] != s2[k]} <= RELEASE_DERIVED
    logged = lambda calls: [public(c[2]) for c in calls if c[0] == "log" and c[1] is not None]  # noqa: E731
    assert logged(calls1) == logged(calls2)


def test_logged_noise_std_is_what_each_block_gets_under_proportional_allocation(tmp_path):
    require_real_data()
    cfg = compose_config(*TINY, "privacy.noise_allocation=proportional", "privacy.threshold_rule=by_size", "logging.progress=false")
    run(cfg, tmp_path)
    row = next(r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["step"] == 1)
    # by_size: C_W ∝ √n_W, and proportional allocation gives block W std σ√K·C_W.
    sizes = sorted(p["numel"] for p in block_sizes(cfg))
    assert row["noise_std_max"] / row["noise_std_min"] == pytest.approx(math.sqrt(sizes[-1] / sizes[0]), rel=1e-6)
    assert row["noise_std_min"] < row["noise_std"] < row["noise_std_max"]


def block_sizes(cfg):
    """One entry per clipping block (per tensor, tied head counted once) of the run's model."""
    from dpmuon.data import load_tokenizer
    from dpmuon.models import build_model

    model = build_model(cfg.model, load_tokenizer(cfg.model.tokenizer, cfg.model.get("bpe_merges")), seed=0)
    return [{"numel": p.numel()} for p in model.parameters() if p.requires_grad]


def test_summary_records_delta_times_n_and_that_validation_is_not_covered(tmp_path):
    require_real_data()
    summary = run(compose_config(*TINY, "logging.progress=false"), tmp_path / "a")
    assert summary["delta_times_n"] == pytest.approx(summary["delta"] * summary["dataset_size"])
    assert summary["validation_split"] == "private (not covered)" and summary["val_nll"] is not None
    quiet = run(compose_config(*TINY, "logging.progress=false", "trainer.eval_every=0", "eval.validation=false"), tmp_path / "b")
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert quiet["validation_split"] is None and quiet["val_nll"] is None
    assert not any("val_nll" in row for row in rows)
    public = run(compose_config(*TINY, "logging.progress=false", "eval.validation_split=public"), tmp_path / "c")
    assert public["validation_split"] == "public"
