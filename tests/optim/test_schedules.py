"""Learning-rate schedules: HybridOptimizer is a torch optimizer, the schedules follow their
formulas, and a run killed mid-schedule resumes onto the same weights."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import tiny_gpt2
from helpers_resume import BETWEEN_CHECKPOINTS, OVERRIDES, SEEDED, assert_same_run, kill_after, resume, rows
from helpers_train import compose_config, require_real_data
from torch.optim.lr_scheduler import LambdaLR

from dpmuon.models import hidden_matrices
from dpmuon.optim import HybridOptimizer, MuonSettings, OptimizerInputs
from dpmuon.optim.schedules import build_scheduler, lr_factor
from dpmuon.training.loop import run

MUON_CFG = {
    "lr": 0.02, "momentum": 0.95, "momentum_kind": "heavy_ball", "nesterov": False, "ns_steps": 5,
    "ns_coefficients": "quintic", "ns_normalize": "frobenius", "ns_dtype": None, "update_scale": "adam_rms",
    "weight_decay": 0.0, "adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
}  # fmt: skip


def hybrid(seed: int = 0):
    model = tiny_gpt2()
    opt = MuonSettings(**MUON_CFG).build(OptimizerInputs(params=dict(model.named_parameters()), hidden_matrices=hidden_matrices(model)))
    return model, opt


def take_step(model, opt, seed: int) -> None:
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad()


def test_lambda_lr_drives_both_parts_of_the_hybrid_optimizer():
    model, opt = hybrid()
    assert isinstance(opt, HybridOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert {g["part"] for g in opt.param_groups} == {"muon", "adam"}
    scheduler = LambdaLR(opt, lambda t: 0.5**t)
    for seed in range(2):
        take_step(model, opt, seed)
        scheduler.step()
    assert opt.parts["muon"].param_groups[0]["lr"] == pytest.approx(0.02 * 0.25)
    assert opt.parts["adam"].param_groups[0]["lr"] == pytest.approx(1e-3 * 0.25)


def test_state_dict_round_trip_continues_identically():
    model, opt = hybrid()
    take_step(model, opt, 0)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())  # as a checkpoint file holds them
    take_step(model, opt, 1)
    model2, opt2 = hybrid()
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    scheduler = LambdaLR(opt2, lambda t: 1.0)  # a scheduler sees the loaded groups
    take_step(model2, opt2, 1)
    scheduler.step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert opt2.param_groups[0] is opt2.parts["muon"].param_groups[0]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedules_with_warmup_match_their_formulas(schedule):
    total, warmup, lr = 10, 3, 0.1
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_scheduler(opt, schedule, total, warmup)
    used = []
    for _ in range(total):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    warm = [lr * (t + 1) / (warmup + 1) for t in range(warmup)]
    progress = [(t - warmup) / (total - warmup) for t in range(warmup, total)]
    decay = {
        "constant": [lr for _ in progress],
        "linear": [lr * (1 - p) for p in progress],
        "cosine": [lr * 0.5 * (1 + math.cos(math.pi * p)) for p in progress],
    }[schedule]
    assert used == pytest.approx(warm + decay)
    assert used[warmup] == pytest.approx(lr)  # the peak right after warmup


def test_warmup_must_end_before_the_run_does():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="warmup"):
        build_scheduler(opt, "linear", 5, 5)
    assert lr_factor(0, "linear", 5, 0) == 1.0


def test_schedule_is_configured_once_for_every_optimizer():
    for name in ("dp_sgd", "dp_adam", "dp_muonbc", "adam"):
        cfg = compose_config(f"optimizer={name}")
        assert (cfg.optimizer.schedule, cfg.optimizer.warmup_steps) == ("constant", 0)
    assert compose_config("optimizer=dp_muon", "optimizer.schedule=cosine").optimizer.schedule == "cosine"


@pytest.mark.slow  # a full driver kill and resume; the scheduler's state round trip is tested above
def test_kill_and_resume_mid_schedule_ends_on_the_same_weights(tmp_path):
    """SIGKILL after step 5 (checkpoint at 4, inside the cosine decay): the resumed run
    replays lots and noise (seeded) and must continue the schedule, not restart it."""
    require_real_data()
    torch.set_num_threads(1)
    scheduled = [*SEEDED, "optimizer.schedule=cosine", "optimizer.warmup_steps=2"]
    reference = run(compose_config(*OVERRIDES, *scheduled), tmp_path / "uninterrupted")
    killed = tmp_path / "killed"
    kill_after(killed, BETWEEN_CHECKPOINTS, *scheduled)
    done = resume(killed)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(killed, (tmp_path / "uninterrupted", reference))
    used = [row["lr"] for row in rows(killed)]
    assert used[1] > used[0] and used[-1] < used[2]  # warmup, then decay: the schedule ran
