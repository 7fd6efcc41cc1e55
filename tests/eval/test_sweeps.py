"""Sweeps: a real multirun over two ε values, sweep configs, and the sweep plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_runs import PNG_SIGNATURE, write_run
from helpers_train import require_real_data
from hydra import compose, initialize_config_dir

from dpmuon.eval.cli import sweep_plots_main
from dpmuon.eval.runs import find_runs
from dpmuon.eval.sweeps import sweep_lines
from dpmuon.train import CONFIG_DIR

TINY = [
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128", "data.max_train_examples=300",
    "data.max_valid_examples=8", "data.max_test_sources=2", "privacy.expected_lot_size=16", "trainer.steps=3",
    "trainer.micro_batch_size=8", "eval.num_beams=1", "eval.max_new_tokens=4", "logging.progress=false", "logger=none",
]  # fmt: skip


def test_multirun_over_two_epsilons_calibrates_each(tmp_path):
    require_real_data()
    out = subprocess.run(
        [sys.executable, "-m", "dpmuon.train", "-m", "experiment=smoke", "optimizer=dp_muon", *TINY,
         "privacy.target_epsilon=2,8", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summaries = sorted((json.loads(p.read_text()) for p in tmp_path.rglob("summary.json")), key=lambda s: s["target_epsilon"])
    assert [s["target_epsilon"] for s in summaries] == [2.0, 8.0]
    assert summaries[0]["noise_multiplier"] > summaries[1]["noise_multiplier"]  # a tighter budget needs more noise
    for s in summaries:
        assert s["epsilon"] <= s["target_epsilon"] and s["epsilon"] == pytest.approx(s["target_epsilon"], abs=0.02)
    # Each job is a normal run with its own artifacts.
    assert len({s["run_dir"] for s in summaries}) == 2
    assert all((Path(s["run_dir"]) / "metrics.jsonl").exists() for s in summaries)


@pytest.mark.parametrize(
    "name,expected", [("sweep_eps", {"optimizer": 4, "privacy.target_epsilon": 3}), ("sweep_clip", {"optimizer": 4, "privacy": 2, "privacy.clip_norm": 3})]
)
def test_sweep_configs_define_the_grid(name, expected):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment=[smoke,{name}]"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert {k: len(str(v).split(",")) for k, v in params.items()} == expected
    assert cfg.experiment_name == name  # names the multirun folder and, with logger=wandb, the W&B group


@pytest.mark.parametrize("launcher,target", [("local", "JoblibLauncher"), ("slurm", "SlurmLauncher")])
def test_launcher_configs_compose(launcher, target):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher" if launcher == "local" else "hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(target)


def fixture_sweep(root: Path) -> None:
    for opt, bleus in (("dp_adam", (10.0, 20.0, 30.0)), ("dp_muon", (15.0, 25.0, 35.0))):
        for eps, bleu in zip((1.0, 3.0, 8.0), bleus):
            for seed in (0, 1):
                write_run(root, f"{opt}-{eps}-{seed}", optimizer=opt, target_epsilon=eps, seed=seed, clip_norm=0.1, bleu=bleu + seed, test_nll=1.0 / eps)
    write_run(root, "adam", optimizer="adam", noise_multiplier=0, epsilon=None, target_epsilon=None, bleu=50.0)


def test_sweep_lines_average_seeds_per_setting(tmp_path):
    fixture_sweep(tmp_path)
    lines = sweep_lines(find_runs([tmp_path]), "target_epsilon", "bleu")
    assert [line.label for line in lines] == ["dp_adam", "dp_muon"]
    assert lines[1].x.tolist() == [1.0, 3.0, 8.0]
    assert lines[1].mean.tolist() == [15.5, 25.5, 35.5] and lines[1].low.tolist() == [15.0, 25.0, 35.0]
    assert lines[0].seeds.tolist() == [2, 2, 2]


def test_sweep_plots_script_writes_the_epsilon_figure_only(tmp_path, capsys):
    fixture_sweep(tmp_path / "runs")
    assert sweep_plots_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    figure = tmp_path / "out" / "e2e" / "utility_vs_epsilon.png"
    assert figure.read_bytes().startswith(PNG_SIGNATURE)
    assert not (tmp_path / "out" / "e2e" / "utility_vs_clip.png").exists()  # one clip value: nothing to plot
    assert str(figure) in capsys.readouterr().out
