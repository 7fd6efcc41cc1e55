"""`dpmuon.integrations.hf.DPTrainer`: the Hugging Face Trainer whose steps are dpmuon's private releases.

A tiny random GPT-2 learns a counting pattern under the Trainer's own loop (logging, evaluation,
checkpoints); its release equals the façade's for the same lot and seed; ε is the plan's and is
logged and written beside the ledger; every refused setting is refused in one line naming the
argument; a resume verifies and continues the ledger, replaying the steps after the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import accelerate.accelerator
import datasets
import pytest
import torch
from test_facade import WIDE, ListedLots, PatternLots, padded, short_and_long, spy_on_the_engine, wide_model
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.integrations import TensorBoardCallback

import dpmuon
from dpmuon.config.roster import optimizer_names
from dpmuon.errors import UserError
from dpmuon.facade import Lot
from dpmuon.integrations.hf import PRIVACY_RECORD, PRIVACY_SPENT, WITHHELD, DPTrainer, PrivateLogs, rotate_checkpoints_by_step
from dpmuon.models import Shape, build_random_lm, per_example_lm_loss
from dpmuon.privacy import LEDGER_FILE, mechanism
from dpmuon.privacy.accountant import epsilon_after
from dpmuon.privacy.seed import MECHANISM_SEED_ENV
from dpmuon.run_folder import MECHANISM_STATE
from dpmuon.training.run_files import FROZEN_TIME, freeze_times

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
    expected = epsilon_after(plan.noise_multiplier, plan.sample_rate, plan.steps, plan.delta, "rdp", plan.slack, plan.prior)
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


@pytest.mark.parametrize("name", optimizer_names(private=True))
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
    charged = epsilon_after(plan.noise_multiplier, plan.sample_rate, 7, plan.delta, "rdp", plan.slack, plan.prior)
    assert fresh.epsilon_spent() == pytest.approx(charged, rel=1e-9)


# ---- times: step times track the secret lots, so nothing written, logged or returned dates a step ------------


def all_times(run: Path) -> set[float]:
    return {os.lstat(path).st_mtime for path in [run, *run.rglob("*")]}


class TimesAtSave(TrainerCallback):
    """The modification times under output_dir right after each checkpoint is written."""

    def __init__(self, run: Path):
        self.run, self.seen = run, []

    def on_save(self, args, state, control, **kwargs):
        self.seen.append(all_times(self.run))


def test_every_file_and_folder_under_output_dir_has_the_frozen_time_after_each_checkpoint_and_at_the_end(tmp_path):
    run = tmp_path / "run"
    t = trainer(run, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=1)
    at_save = TimesAtSave(run)
    t.add_callback(at_save)
    t.train()
    assert len(at_save.seen) == 2 and all(seen == {FROZEN_TIME} for seen in at_save.seen)
    assert [p.name for p in run.glob("checkpoint-*")] == ["checkpoint-4"]
    assert (run / PRIVACY_SPENT).is_file() and (run / LEDGER_FILE).is_file() and (run / "checkpoint-4" / PRIVACY_RECORD).is_file()
    assert all_times(run) == {FROZEN_TIME}  # output_dir itself, checkpoint-N/ and their files, the ledger, privacy_spent.json
    t.save_model()  # the usual next line of a script
    assert (run / "model.safetensors").is_file() and all_times(run) == {FROZEN_TIME}


def test_checkpoints_are_rotated_by_step_number_since_their_times_are_all_frozen(tmp_path):
    for step in (8, 9, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    freeze_times(tmp_path)  # by mtime, then name, Trainer's rotation would keep checkpoint-9 and drop checkpoint-10
    rotate_checkpoints_by_step(tmp_path, 2, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-9"]
    rotate_checkpoints_by_step(tmp_path, 1, str(tmp_path / "checkpoint-9"))  # the best is kept, and the last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-9"]


TIME_OR_MACHINE = re.compile(r"time|runtime|per_second|seconds|_mem_")


def keys(obj) -> set[str]:
    if isinstance(obj, dict):
        return set(obj).union(*map(keys, obj.values())) if obj else set()
    return set().union(*map(keys, obj)) if isinstance(obj, list) and obj else set()


def test_no_time_speed_or_memory_is_logged_written_or_returned_and_the_train_loss_is_withheld(tmp_path, capsys):
    run = tmp_path / "run"
    t = trainer(run, max_steps=2, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, disable_tqdm=False)
    assert t.args.disable_tqdm and "disable_tqdm set to True" in capsys.readouterr().err  # the bar shows elapsed times and it/s
    result = t.train()
    evaluated = t.evaluate()
    state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    published = keys(t.state.log_history) | keys(state) | set(result.metrics) | set(evaluated)
    assert "epsilon" in published and "eval_loss" in published
    assert not {key for key in published if TIME_OR_MACHINE.search(key)}
    # Trainer's training_loss would be the mean of training_step's zeros: NaN, said "withheld".
    assert math.isnan(result.training_loss) and result.metrics["train_loss"] == WITHHELD


def test_a_users_callback_sees_only_the_scrubbed_row_and_removing_the_scrubber_is_refused(tmp_path):
    """The rows are scrubbed by a callback that runs first: a reporter or callback of the user's
    (here one that records what on_log hands it) sees ε and no timing, and train() refuses to run
    once that callback is gone."""
    seen = []

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    args = arguments(tmp_path / "run", max_steps=2, logging_steps=1)
    t = DPTrainer(model=tiny_model(), args=args, train_dataset=counting(N, seed=1), data_collator=collate, privacy=PRIVACY, callbacks=[Recorder()])
    t.train()
    assert len(seen) == 3 and all("epsilon" in row for row in seen)  # two steps, then train()'s summary row
    assert not {key for row in seen for key in row if TIME_OR_MACHINE.search(key)} and not any("loss" in row for row in seen)
    assert [row["epsilon"] for row in seen] == [row["epsilon"] for row in t.state.log_history]
    t = trainer(tmp_path / "other", max_steps=2)
    t.remove_callback(PrivateLogs)
    with pytest.raises(UserError, match="PrivateLogs callback must stay first"):
        t.train()


def test_with_publish_timing_trainers_speed_metrics_are_kept(tmp_path):
    t = DPTrainer(
        model=tiny_model(), args=arguments(tmp_path / "run", max_steps=2), train_dataset=counting(N, seed=1), data_collator=collate,
        privacy=PRIVACY, publish_timing=True,
    )  # fmt: skip
    result = t.train()
    assert result.metrics["train_runtime"] > 0 and os.lstat(tmp_path / "run").st_mtime != FROZEN_TIME


@pytest.mark.parametrize(
    "report_to, callbacks",
    [(["wandb"], None), (["tensorboard", "mlflow"], None), ([], [TensorBoardCallback])],
)  # fmt: skip
def test_reporting_integrations_are_refused_unless_timing_is_published(tmp_path, report_to, callbacks):
    args = arguments(tmp_path / "run", report_to=report_to)
    with pytest.raises(UserError) as refused:
        DPTrainer(model=tiny_model(), args=args, train_dataset=counting(N, seed=1), data_collator=collate, privacy=PRIVACY, callbacks=callbacks)
    message = str(refused.value)
    assert "report_to=[" in message and "wall time" in message and "publish_timing=True" in message and "\n" not in message
    assert not (tmp_path / "run" / LEDGER_FILE).exists()


def test_memory_metrics_are_refused_unless_timing_is_published(tmp_path):
    with pytest.raises(UserError, match=r"^DPTrainer: skip_memory_metrics=False: the memory a step takes tracks its secret lot.*publish_timing=True$"):
        trainer(tmp_path / "run", skip_memory_metrics=False)


def test_wandb_with_published_timing_collects_no_system_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB__DISABLE_STATS", "")  # recorded, so that the value the trainer sets is undone after the test
    monkeypatch.delenv("WANDB__DISABLE_STATS")
    args = arguments(tmp_path / "run", report_to=["wandb"])
    DPTrainer(model=tiny_model(), args=args, train_dataset=counting(N, seed=1), data_collator=collate, privacy=PRIVACY, publish_timing=True)
    assert os.environ["WANDB__DISABLE_STATS"] == "true"  # W&B's x_disable_stats, read when its run starts


def test_a_collator_without_labels_is_refused_in_one_line_naming_it(tmp_path):
    def collate_without_labels(rows):
        return {k: v for k, v in collate(rows).items() if k != "labels"}

    with pytest.raises(UserError) as refused:  # at construction: make_private runs the loss on the first examples
        DPTrainer(
            model=tiny_model(), args=arguments(tmp_path / "run"), train_dataset=counting(N, seed=1), data_collator=collate_without_labels, privacy=PRIVACY
        )
    message = str(refused.value)
    assert "data_collator=" in message and "collate_without_labels returned ['attention_mask', 'input_ids'] without 'labels'" in message
    assert "\n" not in message and "DataCollatorForLanguageModeling" in message
    assert not (tmp_path / "run" / LEDGER_FILE).exists()  # no mechanism yet: nothing released, nothing charged


def test_constant_time_steps_run_the_same_micro_batches_whatever_the_lot(tmp_path, monkeypatch):
    monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, max_lot_size=None, **k: PatternLots([1, 1000, 0], max_lot_size))
    seen = spy_on_the_engine(monkeypatch)
    t = trainer(tmp_path / "run", max_steps=3)
    t.train()
    bound, micro = t.private.plan.max_lot_size, t.args.per_device_train_batch_size
    per_step = -(-bound // micro)
    assert len(seen) == 3 * per_step and len({tuple(sorted((k, v) for k, v in b.items() if k != "examples")) for b in seen}) == 1
    assert [sum(b["examples"] for b in seen[i : i + per_step]) for i in range(0, len(seen), per_step)] == [1, bound, 0]
    assert [s for s, _, _ in releases(tmp_path / "run")] == [1, 2, 3]


def test_a_collator_padding_to_a_fixed_width_gets_rows_in_the_plans_widths(tmp_path, monkeypatch):
    data = [{"input_ids": ids} for ids in short_and_long()]
    by_length = sorted(range(len(data)), key=lambda i: len(data[i]["input_ids"]))
    lots = [by_length[-8:], by_length[:8], by_length]  # the longest, the shortest, all (cut to B_max)
    monkeypatch.setattr(mechanism, "build_lot_sampler", lambda *a, max_lot_size=None, **k: ListedLots(lots, max_lot_size))
    seen = spy_on_the_engine(monkeypatch)
    t = DPTrainer(
        model=wide_model(),
        args=arguments(tmp_path / "run", max_steps=3, per_device_train_batch_size=8),
        train_dataset=data,
        data_collator=lambda rows: padded([r["input_ids"] for r in rows], width=WIDE),
        privacy={**PRIVACY, "expected_lot_size": 16, "length_noise_multiplier": 1.0},
    )
    t.train()
    plan = t.private.plan
    assert len(plan.widths) >= 2 and plan.prior == ((1.0, 1.0, 1),)  # the length histogram's release, charged first
    steps = [seen[i : i + len(seen) // 3] for i in range(0, len(seen), len(seen) // 3)]
    shapes = [[tuple(sorted((k, v) for k, v in b.items() if k != "examples")) for b in step] for step in steps]
    assert shapes[0] == shapes[1] == shapes[2] and {b[0][1][1] for b in shapes[0]} == {width for width, _ in plan.widths}
    assert [sum(b["examples"] for b in step) for step in steps] == [8, 8, plan.max_lot_size]


def test_a_collator_padding_to_each_batchs_longest_example_is_refused_and_a_hand_built_lot_too(tmp_path):
    def longest(rows):
        return padded([r["input_ids"] for r in rows], width=None)

    varied = [{"input_ids": r["input_ids"][: 1 + i % LENGTH]} for i, r in enumerate(counting(N, seed=1))]
    settings = dict(model=tiny_model(), args=arguments(tmp_path / "run"), train_dataset=varied, data_collator=longest, privacy=PRIVACY)
    with pytest.raises(UserError, match=r"^make_private: constant_time=True needs one shape .*data_collator.*padding='max_length'") as refused:
        DPTrainer(**settings)
    assert "\n" not in str(refused.value)
    t = DPTrainer(**{**settings, "model": tiny_model(), "privacy": {**PRIVACY, "constant_time": False}})
    lot = next(iter(t.get_train_dataloader()))
    with pytest.raises(UserError, match=r"^release\(\): lot 1 was not drawn"):
        t.training_step(t.model, Lot(1, list(lot.indices), lot.micro_batch_size, lot.micro_batches))
    t.training_step(t.model, lot)


def test_dp_training_arguments_carry_the_privacy_options_declared_once(tmp_path):
    """DPTrainingArguments are TrainingArguments plus PrivacySettings' options (same defaults, help
    and checks; the guarantee and its lot required): the Trainer built from them plans as privacy=
    does, HfArgumentParser reads them from a command line, and giving the options twice is refused."""
    from transformers import HfArgumentParser

    from dpmuon.integrations.hf import DPTrainingArguments
    from dpmuon.privacy.settings import PrivacySettings

    settings = vars(arguments(tmp_path / "a"))
    args = DPTrainingArguments(**{k: v for k, v in settings.items() if k in {f.name for f in dataclasses.fields(TrainingArguments) if f.init}}, **PRIVACY)
    built = DPTrainer(model=tiny_model(), args=args, train_dataset=counting(N, seed=1), data_collator=collate, optimizer="dp_adam")
    assert built.private.plan.as_dict() == trainer(tmp_path / "b").private.plan.as_dict()
    help_of = {f.name: f.metadata.get("help") for f in dataclasses.fields(DPTrainingArguments)}
    assert help_of["clip_norm"] == next(f.metadata["help"] for f in dataclasses.fields(PrivacySettings) if f.name == "clip_norm")
    (parsed,) = HfArgumentParser(DPTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "c"), "--target_epsilon", "4", "--delta", "1e-5", "--expected_lot_size", "32", "--no_constant_time"]
    )
    assert (parsed.target_epsilon, parsed.constant_time, parsed.clip_norm) == (4.0, False, 0.1)
    with pytest.raises(TypeError, match="expected_lot_size"):  # stated, never defaulted
        DPTrainingArguments(output_dir=str(tmp_path / "d"), target_epsilon=8.0, delta=1e-5)
    with pytest.raises(UserError, match=r"^DPTrainer: privacy= and DPTrainingArguments both give the privacy options"):
        DPTrainer(model=tiny_model(), args=args, train_dataset=counting(N, seed=1), data_collator=collate, privacy=PRIVACY)
    with pytest.raises(UserError, match=r"^DPTrainer: no privacy options: use args=DPTrainingArguments"):
        DPTrainer(model=tiny_model(), args=arguments(tmp_path / "e"), train_dataset=counting(N, seed=1), data_collator=collate)
    with pytest.raises(UserError, match=r"^privacy\.clip_norm=-1\.0: must be > 0"):  # the command line's message
        DPTrainer(model=tiny_model(), args=dataclasses.replace(args, clip_norm=-1.0), train_dataset=counting(N, seed=1), data_collator=collate)
