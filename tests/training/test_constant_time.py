"""Constant-time lots and private-by-default files: two runs of the default configuration whose
lots differ as much as they can (16 every step, or alternately 1 and the bound) emit the same
things — the same files with the same modes and times, the same public rows, log lines and W&B
calls — and run the same micro-batches. Only the owner-only diagnostics.jsonl sees the lots.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import types
from pathlib import Path

import torch
from helpers_train import compose_config, require_real_data, seed_file_override
from test_published_values import RELEASE_DERIVED, TINY, fake_wandb

from dpmuon.privacy import mechanism
from dpmuon.privacy.engines import ENGINES
from dpmuon.privacy.engines.base import EXAMPLE_MASK
from dpmuon.training.loggers import WandbLogger
from dpmuon.training.loop import run
from dpmuon.training.run_files import FROZEN_TIME, MetricsLog

# Quantities of the raw lot: none may appear in any file but diagnostics.jsonl.
LOT_KEYS = ("lot_size", "train_loss", "step_seconds", "train_seconds", "clip_fraction", "mean_grad_norm", "nonfinite_examples")
ADD_CLIPPED_SUM = ENGINES["fast"].add_clipped_sum  # the engine's own (what the privatizer calls), whichever run spies on it


class PatternLots:
    """Lots of prescribed sizes, truncated to the constant-time bound as the real sampler does."""

    def __init__(self, sizes, max_lot_size):
        self.sizes, self.max_lot_size, self.step = sizes, max_lot_size, 0

    def next_lot(self):
        size = self.sizes[self.step % len(self.sizes)]
        self.step += 1
        return list(range(min(size, self.max_lot_size)))

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def run_with_lots(tmp_path, monkeypatch, capsys, name: str, sizes: list[int]):
    calls, batches = [], []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, max_lot_size=None, **k: PatternLots(sizes, max_lot_size))

    def spy(self, batch, loss_fn, total):
        batches.append({k: tuple(v.shape) for k, v in batch.items()} | {"examples": int(batch[EXAMPLE_MASK].sum())})
        return ADD_CLIPPED_SUM(self, batch, loss_fn, total)

    monkeypatch.setattr(ENGINES["fast"], "add_clipped_sum", spy)
    run_dir = tmp_path / name
    summary = run(compose_config(*TINY, "logger=wandb", "logging.progress=true"), run_dir)
    files = {  # before anything reads a file (a read may update its access time; listing a folder does)
        str(path.relative_to(run_dir)): (stat.S_IMODE(os.lstat(path).st_mode), os.lstat(path).st_mtime, None if path.is_dir() else os.lstat(path).st_atime)
        for path in [run_dir, *run_dir.rglob("*")]
    }
    return types.SimpleNamespace(dir=run_dir, summary=summary, calls=calls, batches=batches, files=files, stderr=capsys.readouterr().err)


def test_two_lot_patterns_emit_the_same_files_times_rows_and_micro_batches(tmp_path, monkeypatch, capsys):
    require_real_data()
    steady = run_with_lots(tmp_path, monkeypatch, capsys, "steady", [16])
    swinging = run_with_lots(tmp_path, monkeypatch, capsys, "swinging", [1, 1000])  # 1000: truncated to the bound
    bound = steady.summary["max_lot_size"]
    assert bound == swinging.summary["max_lot_size"] and 16 < bound < 200

    # The same files, modes and times: every time is the fixed one, none the run's.
    assert steady.files.keys() == swinging.files.keys()
    assert {k: v[0] for k, v in steady.files.items()} == {k: v[0] for k, v in swinging.files.items()}
    assert {t for r in (steady, swinging) for _, mtime, atime in r.files.values() for t in (mtime, atime)} == {FROZEN_TIME, None}
    assert steady.files["diagnostics.jsonl"][0] == 0o600

    # The engine ran the same micro-batches, all of one shape, ⌈B_max/m⌉ per step, whatever the lot.
    shapes = lambda r: [{k: v for k, v in b.items() if k != "examples"} for b in r.batches]  # noqa: E731
    micro = int(compose_config(*TINY).trainer.micro_batch_size)
    assert shapes(steady) == shapes(swinging) and len(steady.batches) == 6 * -(-bound // micro)
    assert len({tuple(sorted(b.items())) for b in shapes(steady)}) == 1
    per_step = lambda r: [sum(b["examples"] for b in r.batches[i : i + -(-bound // micro)]) for i in range(0, len(r.batches), -(-bound // micro))]  # noqa: E731
    assert per_step(steady) == [16] * 6 and per_step(swinging) == [1, bound] * 3  # the lots did differ

    # Only diagnostics.jsonl knows them, and it counts real rows, not the padding.
    for r, sizes in ((steady, [16] * 6), (swinging, [1, bound] * 3)):
        diagnostics = [json.loads(line) for line in (r.dir / "diagnostics.jsonl").read_text().splitlines()]
        assert [row["lot_size"] for row in diagnostics] == sizes
        for path in r.dir.rglob("*"):
            if path.is_file() and path.name != "diagnostics.jsonl" and path.suffix in (".json", ".jsonl", ".txt", ".yaml", ".log"):
                assert not any(re.search(rf"\b{key}\b", path.read_text()) for key in LOT_KEYS), path
        assert "train_seconds" not in torch.load(r.dir / "checkpoint.pt", weights_only=False)

    # The published rows, summary and W&B calls differ only in functions of the releases.
    rows = lambda r: [json.loads(line) for line in (r.dir / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    public = lambda row: {k: v for k, v in row.items() if k.split("/")[0] not in RELEASE_DERIVED}  # noqa: E731
    assert [public(row) for row in rows(steady)] == [public(row) for row in rows(swinging)]
    assert [set(row) for row in rows(steady)] == [set(row) for row in rows(swinging)]
    s1, s2 = steady.summary, swinging.summary
    assert set(s1) == set(s2) and {k for k in s1 if s1[k] != s2[k]} <= RELEASE_DERIVED

    def logged(r):  # each W&B row, the images named relative to their run folder
        return [(c[1], {k: str(v).replace(str(r.dir), "RUN") for k, v in public(c[2]).items()}) for c in r.calls if c[0] == "log"]

    assert logged(steady) == logged(swinging) and [step for step, _ in logged(steady) if step is not None][-2:] == [3, 6]
    figures = lambda r: sorted(p.relative_to(r.dir).as_posix() for p in (r.dir / "curves").rglob("*.png"))  # noqa: E731
    assert figures(steady) == figures(swinging) and "curves/e2e/epsilon.png" in figures(steady)
    assert (steady.dir / "curves/e2e/epsilon.png").read_bytes() == (swinging.dir / "curves/e2e/epsilon.png").read_bytes()

    # The console: the same log lines (release values and the folder masked) and train-bar frames.
    def console(r):
        lines = [re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", line.replace(str(r.dir), "RUN")) for line in r.stderr.splitlines() if line.startswith("[dpmuon]")]
        bar = [part for part in re.split(r"[\r\n]", r.stderr) if part.startswith("train:")]
        return lines, bar

    assert console(steady) == console(swinging)
    assert len(console(steady)[1]) >= 6 and not any(re.search(r"\d+:\d+|it/s|s/it", frame) for frame in console(steady)[1])


class LengthLots:
    """The same lot, these indices, every step."""

    def __init__(self, indices):
        self.indices = indices

    def next_lot(self):
        return list(self.indices)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_lots_of_the_longest_and_of_the_shortest_examples_run_the_same_width_buckets(tmp_path, monkeypatch, capsys):
    """Bucketed by width (one mechanism seed: one length-histogram release for both runs, σ = 2 so
    that 200 examples make several widths), lots of the 16 longest and of the 16 shortest examples
    run the same micro-batches, print the same lines and publish the same rows."""
    require_real_data()
    from dpmuon.data.tokenizer import load_tokenizer
    from dpmuon.training.data import prepare_data

    overrides = [*TINY, "privacy.length_noise_multiplier=2", seed_file_override(5 << 90)]
    cfg = compose_config(*overrides)
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.get("bpe_merges"))
    train = prepare_data(cfg.dataset, cfg.data, tokenizer, 128, lambda message: None, progress=False).train
    by_length = sorted(range(len(train)), key=lambda i: len(train[i].input_ids))
    runs = {}
    for name, lot in (("short", by_length[:16]), ("long", by_length[-16:])):
        batches = []
        monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, lot=lot, **k: LengthLots(lot))

        def spy(self, batch, loss_fn, total, batches=batches):
            batches.append(({k: tuple(v.shape) for k, v in batch.items()}, int(batch[EXAMPLE_MASK].sum())))
            return ADD_CLIPPED_SUM(self, batch, loss_fn, total)

        monkeypatch.setattr(ENGINES["fast"], "add_clipped_sum", spy)
        summary = run(compose_config(*overrides), tmp_path / name)
        lines = [line.replace(str(tmp_path / name), "RUN") for line in capsys.readouterr().err.splitlines() if line.startswith("[dpmuon]")]
        console = [re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", line) for line in lines]
        runs[name] = summary, batches, console
    (short, short_batches, short_console), (long, long_batches, long_console) = runs["short"], runs["long"]
    assert short["widths"] == long["widths"] and len(short["widths"]) > 1 and short["length_noise_multiplier"] == 2.0
    assert [shape for shape, _ in short_batches] == [shape for shape, _ in long_batches]
    assert len({shape["input_ids"][1] for shape, _ in short_batches}) == len(short["widths"])
    lengths = [len(train[i].input_ids) for i in by_length]
    assert lengths[15] < short["widths"][-1][0] < lengths[-16]  # the long lot cannot use the narrowest rows
    assert sum(n for _, n in short_batches) == sum(n for _, n in long_batches) == 16 * 6  # every example placed
    assert short_console == long_console
    assert {k for k in short if short[k] != long[k]} <= RELEASE_DERIVED


def test_train_log_lines_carry_no_wall_clock_time():
    from hydra import compose, initialize_config_dir

    from dpmuon.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        hydra = compose(config_name="config", return_hydra_config=True).hydra
    formats = [f.format for f in hydra.job_logging.formatters.values()]
    assert formats and not any("asctime" in f for f in formats)


def test_wandb_debug_logs_are_removed_unless_diagnostics_are_published(tmp_path, monkeypatch):
    for per_step in (False, True):
        wandb_dir = tmp_path / str(per_step) / "wandb"
        logs = wandb_dir / "offline-run-x" / "logs"
        logs.mkdir(parents=True)
        (logs / "debug.log").write_text("2026-12-02 04:05:02 INFO started\n")
        (logs / "debug-core.log").symlink_to(tmp_path / "elsewhere.log")  # W&B's link out of the run folder
        (wandb_dir / "debug.log").symlink_to(logs / "debug.log")
        paths = {"log_symlink_user": wandb_dir / "debug.log", "log_symlink_internal": wandb_dir / "debug-internal.log", "log_dir": logs}
        fake_run = types.SimpleNamespace(id="fake", summary={}, settings=types.SimpleNamespace(**{k: str(v) for k, v in paths.items()}))
        module = fake_wandb([])
        module.init = lambda fake_run=fake_run, **kwargs: fake_run
        monkeypatch.setitem(sys.modules, "wandb", module)
        WandbLogger(wandb_dir.parent, {"mode": "offline"}, {}, None, "run", per_step=per_step).finish()
        remaining = sorted(str(p.relative_to(wandb_dir)) for p in wandb_dir.rglob("*"))
        kept = ["debug.log", "offline-run-x", "offline-run-x/logs", "offline-run-x/logs/debug-core.log", "offline-run-x/logs/debug.log"]
        assert remaining == (kept if per_step else ["offline-run-x"])


def test_real_wandb_offline_run_names_its_debug_logs_where_the_logger_looks(tmp_path):
    """The installed W&B's settings give the paths the logger removes (no network: offline)."""
    logger = WandbLogger(tmp_path, {"mode": "offline", "project": "test"}, {"a": 1}, None, "run", per_step=False)
    assert logger._debug_logs and all(Path(p).exists() or Path(p).is_symlink() for p in logger._debug_logs)
    logger.log({"step": 1, "val_nll": 1.0}, publish=True)
    logger.finish()
    assert not any(p.name.startswith("debug") for p in tmp_path.rglob("*")), sorted(tmp_path.rglob("*"))
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))  # what `wandb sync` uploads stays


def test_diagnostics_and_their_superseded_rows_stay_owner_only_through_a_resume(tmp_path):
    log = MetricsLog(tmp_path / "diagnostics.jsonl", secret=True)
    for step in (1, 2, 3):
        log.append({"step": step, "lot_size": 16})
    assert log.set_aside_after(1) == 2  # a resume from step 1 re-runs steps 2 and 3
    assert [r["step"] for r in log.rows()] == [1]
    for path in (log.path, log.superseded_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
