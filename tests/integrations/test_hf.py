"""`dpmuon.integrations.hf.DPTrainer`: the Hugging Face Trainer whose steps are dpmuon's private releases.

A tiny random GPT-2 learns a counting pattern under the Trainer's own loop (logging, evaluation,
checkpoints); its release equals the façade's for the same lot and seed; ε is the plan's and is
logged and written beside the ledger; every refused setting is refused in one line naming the
argument; a resume verifies and continues the ledger, replaying the steps after the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import accelerate.accelerator
import datasets
import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import dpmuon
from dpmuon.errors import UserError
from dpmuon.integrations.hf import PRIVACY_RECORD, PRIVACY_SPENT, DPTrainer
from dpmuon.models import Shape, build_random_lm, per_example_lm_loss
from dpmuon.privacy import LEDGER_FILE
from dpmuon.privacy.accountant import epsilon_after
from dpmuon.privacy.seed import MECHANISM_SEED_ENV
from dpmuon.run_folder import MECHANISM_STATE

N, LENGTH, VOCAB = 96, 8, 16
SEED = 0x51DE_7A11_0123_4567_89AB_CDEF_0F1E  # ≥ 2^64: no weak-seed warning
PRIVACY = dict(target_epsilon=50.0, delta=1e-3, expected_lot_size=32, clip_norm=1.0, noise_multiplier=0.6, accountant="rdp")


@pytest.fixture(autouse=True)
def no_garbage_sweep(monkeypatch):
    """Trainer.train() sweeps the garbage before training (gc.collect): ~1 s in a test process holding the suite's objects."""
    monkeypatch.setattr(accelerate.accelerator, "release_memory", lambda *objects: list(objects))


def tiny_model():
    return build_random_lm("gpt2", Shape(VOCAB, n_layer=1, n_embd=16, n_head=2, n_positions=LENGTH), seed=0)


def counting(n: int, seed: int) -> list[dict]:
    """Sequences that count up mod VOCAB from a random start: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n,), generator=g)
    return [{"input_ids": (s + torch.arange(LENGTH)) % VOCAB} for s in starts]


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    ids = torch.stack([r["input_ids"] for r in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def arguments(out: Path, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(out), max_steps=6, learning_rate=2e-2, per_device_train_batch_size=16, per_device_eval_batch_size=32,
        logging_steps=2, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, max_grad_norm=0.0, seed=0,
    )  # fmt: skip
    return TrainingArguments(**{**settings, **overrides})


def trainer(out: Path, model=None, optimizer: str = "dp_adam", privacy: dict | None = None, **overrides) -> DPTrainer:
    return DPTrainer(
        model=model or tiny_model(),
        args=arguments(out, **overrides),
        train_dataset=counting(N, seed=1),
        eval_dataset=counting(32, seed=2),
        data_collator=collate,
        privacy={**PRIVACY, **(privacy or {})},
        optimizer=optimizer,
    )


def test_a_tiny_model_trains_with_epsilon_logged_and_written_beside_the_ledger(tmp_path):
    t = trainer(tmp_path / "run", max_steps=12, logging_steps=6, eval_strategy="steps", eval_steps=12)
    before_weights = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    before = t.evaluate()["eval_loss"]
    t.train()
    after = t.evaluate()["eval_loss"]
    assert after < before - 0.3, (before, after)
    assert any(not torch.equal(p, before_weights[n]) for n, p in t.model.named_parameters())
    plan = t.private.plan
    assert t.state.global_step == plan.steps == 12
    logged = [row for row in t.state.log_history if "learning_rate" in row]
    assert len(logged) == 2 and all(row["epsilon"] > 0 for row in logged)
    assert all("loss" not in row for row in logged)  # the raw lots' loss is outside the guarantee
    # The time training took tracks the secret lots' sizes: neither logged nor published.
    assert not any(key in row for row in t.state.log_history for key in ("train_runtime", "train_samples_per_second", "train_steps_per_second"))
    assert logged[-1]["epoch"] == pytest.approx(12 * plan.sample_rate)
    # ε is the plan's: σ and q composed over its steps, as the ledger in output_dir records them.
    expected = epsilon_after(plan.noise_multiplier, plan.sample_rate, plan.steps, plan.delta, "rdp", plan.slack)
    assert t.private.epsilon == pytest.approx(expected, rel=1e-9)
    assert logged[-1]["epsilon"] == pytest.approx(expected, rel=1e-9)
    spent = json.loads((tmp_path / "run" / PRIVACY_SPENT).read_text())
    assert spent["epsilon"] == pytest.approx(expected, rel=1e-9) and spent["ledger"] == LEDGER_FILE
    ledger = (tmp_path / "run" / LEDGER_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in ledger[1:]] == list(range(1, 13))
    with pytest.raises(UserError, match="plan is spent"):
        t.train()
    assert t.private.epsilon == pytest.approx(plan.planned_epsilon, rel=1e-9)


def test_the_release_equals_the_facades_for_the_same_lot_and_seed(tmp_path, monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SEED))
    t = trainer(tmp_path / "hf")
    lot = next(iter(t.get_train_dataloader()))
    t.training_step(t.model, lot)
    private = dpmuon.make_private(
        tiny_model(), counting(N, seed=1), collate, per_example_lm_loss, run_dir=tmp_path / "facade", steps=6, micro_batch_size=16, **PRIVACY
    )
    facade_lot = next(private.lots())
    assert facade_lot.indices == lot.indices and len(lot) > 0
    private.release(facade_lot)
    assert private.plan == t.private.plan
    for name, p in private.params.items():
        assert torch.equal(p.grad, t.private.params[name].grad), name
    assert t.optimizer is None and t.create_optimizer() is not None  # dpmuon's optimizer over the same release


def test_a_datasets_dataset_loses_the_columns_the_model_does_not_take_as_in_trainer(tmp_path):
    ids = [r["input_ids"].tolist() for r in counting(N, seed=1)]
    train = datasets.Dataset.from_dict({"input_ids": ids, "text": ["raw"] * N}).with_format("torch")
    seen = []

    def collate_seen(rows):
        seen.append(set().union(*rows))
        return collate(rows)

    t = DPTrainer(model=tiny_model(), args=arguments(tmp_path / "run"), train_dataset=train, data_collator=collate_seen, privacy=PRIVACY)
    t.training_step(t.model, next(iter(t.get_train_dataloader())))
    assert seen and all(keys == {"input_ids"} for keys in seen)
    assert all(p.grad is not None for p in t.private.params.values())


@pytest.mark.parametrize("name", ["dp_sgd", "dp_adam", "dp_muon", "dp_muonbc"])
def test_each_optimizer_is_dpmuons_and_takes_the_trainers_rate(tmp_path, name):
    t = trainer(tmp_path / "run", optimizer=name, learning_rate=3e-3, privacy={"noise_multiplier": 2.0})
    optimizer = t.create_optimizer()
    assert {g["lr"] for g in optimizer.param_groups} == {3e-3}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in t.private.params.values()}


class CustomSampler(DPTrainer):
    def _get_train_sampler(self, train_dataset=None):
        return None


def set_attr(name, value):
    return lambda args: setattr(args, name, value)


@pytest.mark.parametrize(
    "argument, change, kwargs",
    [
        ("gradient_accumulation_steps", set_attr("gradient_accumulation_steps", 4), {}),
        ("fp16", set_attr("fp16", True), {}),
        ("bf16", set_attr("bf16", True), {}),
        ("n_gpu", set_attr("_n_gpu", 2), {}),
        ("train_sampling_strategy", set_attr("train_sampling_strategy", "group_by_length"), {}),
        ("max_grad_norm", set_attr("max_grad_norm", 0.5), {}),
        ("optim", set_attr("optim", "sgd"), {}),
        ("label_smoothing_factor", set_attr("label_smoothing_factor", 0.1), {}),
        ("include_num_input_tokens_seen", set_attr("include_num_input_tokens_seen", "all"), {}),
        ("auto_find_batch_size", set_attr("auto_find_batch_size", True), {}),
        ("gradient_checkpointing", set_attr("gradient_checkpointing", True), {}),
        ("push_to_hub", set_attr("push_to_hub", True), {}),
        ("_get_train_sampler", None, {"cls": CustomSampler}),
        ("optimizers", None, {"optimizers": (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), None)}),
        ("compute_loss_func", None, {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.loss}),
        ("num_train_epochs", None, {"privacy": {**PRIVACY, "epochs": 3}}),
        ("train_dataset", None, {"train_dataset": None}),
        ("clip_nrom", None, {"privacy": {**PRIVACY, "clip_nrom": 1.0}}),
    ],
)  # fmt: skip
def test_settings_that_would_break_the_guarantee_are_refused_in_one_line(tmp_path, argument, change, kwargs):
    args = arguments(tmp_path / "run")
    if change is not None:
        change(args)
    cls = kwargs.pop("cls", DPTrainer)
    settings = dict(model=tiny_model(), args=args, train_dataset=counting(N, seed=1), data_collator=collate, privacy=PRIVACY) | kwargs
    with pytest.raises(UserError) as refused:
        cls(**settings)
    assert argument in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run" / LEDGER_FILE).exists()  # refused before any mechanism exists


def test_data_parallel_processes_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(UserError, match="world_size=2"):
        trainer(tmp_path / "run")


def test_trainers_default_grad_clipping_is_turned_off_with_a_line(tmp_path, capsys):
    t = trainer(tmp_path / "run", max_grad_norm=1.0)
    assert t.args.max_grad_norm == 0.0
    assert "max_grad_norm=1.0 set to 0" in capsys.readouterr().err
    assert isinstance(t, Trainer)


class StopAt(TrainerCallback):
    """A crash after step `step` (no checkpoint there): training stops where a kill would leave it."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def releases(run: Path) -> list[tuple[int, bool, str]]:
    lines = (run / LEDGER_FILE).read_text().splitlines()[1:]
    return [(r["step"], r["charged"], r["release_sha256"]) for r in map(json.loads, lines)]


CHECKPOINTS = dict(save_strategy="steps", save_steps=4, logging_steps=100)


def crashed_run(run: Path) -> Path:
    """A run of 6 steps that stopped after step 5, its last checkpoint at step 4."""
    crashed = trainer(run, **CHECKPOINTS)
    crashed.add_callback(StopAt(5))
    crashed.train()
    assert [(s, c) for s, c, _ in releases(run)] == [(s, True) for s in range(1, 6)]
    return run


def test_resume_verifies_the_ledger_and_replays_the_steps_after_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SEED))
    checkpoints = CHECKPOINTS
    straight = trainer(tmp_path / "straight", **checkpoints)
    straight.train()
    run = crashed_run(tmp_path / "run")
    assert (run / MECHANISM_STATE).stat().st_mode & 0o077 == 0  # the secret half is owner-only, outside checkpoint-N/

    with pytest.raises(UserError, match="resume_from_checkpoint"):
        trainer(run, **checkpoints).train()  # a ledger with releases is never restarted or silently continued
    ledger = (run / LEDGER_FILE).read_bytes()
    (run / LEDGER_FILE).write_bytes(b"".join(ledger.splitlines(keepends=True)[:4]))
    with pytest.raises(UserError, match="releases were removed"):
        trainer(run, **checkpoints).train(resume_from_checkpoint=str(run / "checkpoint-4"))
    (run / LEDGER_FILE).write_bytes(ledger)
    record = run / "checkpoint-4" / PRIVACY_RECORD
    record.rename(run / "aside.json")
    with pytest.raises(UserError, match=f"resume_from_checkpoint=.*no {PRIVACY_RECORD}"):
        trainer(run, **checkpoints).train(resume_from_checkpoint=str(run / "checkpoint-4"))
    (run / "aside.json").rename(record)

    resumed = trainer(run, **checkpoints)
    resumed.train(resume_from_checkpoint=True)  # the last checkpoint: 4
    # Step 5 replays its lot and noise bit for bit (free), step 6 is new: the ledger continues the chain.
    assert [(s, c) for s, c, _ in releases(run)] == [(s, True) for s in range(1, 6)] + [(5, False), (6, True)]
    assert [(s, d) for s, c, d in releases(run) if c] == [(s, d) for s, _, d in releases(tmp_path / "straight")]
    assert resumed.epsilon_spent() == pytest.approx(straight.epsilon_spent(), rel=1e-12)
    for (name, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(p, q), name
    assert not (run / MECHANISM_STATE).exists()  # the plan is done: no step is left to replay


@pytest.mark.slow
def test_resume_without_the_secret_state_draws_fresh_lots_and_noise_and_charges_them(tmp_path):
    run = crashed_run(tmp_path / "run")
    (run / MECHANISM_STATE).unlink()
    fresh = trainer(run, **CHECKPOINTS)
    fresh.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    assert [(s, c) for s, c, _ in releases(run)] == [(s, True) for s in range(1, 6)] + [(5, True), (6, True)]
    plan = fresh.private.plan
    assert fresh.epsilon_spent() == pytest.approx(epsilon_after(plan.noise_multiplier, plan.sample_rate, 7, plan.delta, "rdp", plan.slack), rel=1e-9)
