"""A new optimizer is its settings class and one YAML; a new dataset is its reader and one YAML.

Both are added here as a user would, in a copy of conf/ in a temporary directory, without
touching dpmuon: the classes live in this file, the YAMLs list them in their defaults. Each is
composed, validated (its own options included) and trained at smoke size.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dpmuon.config import compose_config, validate
from dpmuon.config.options import describe_options
from dpmuon.config.schema import ConfigError
from dpmuon.data import DatasetSettings, Example, encode_for_training
from dpmuon.errors import UserError
from dpmuon.optim import OptimizerSettings
from dpmuon.paths import CONFIG_DIR
from dpmuon.settings import option, settings
from dpmuon.training.loop import run


@settings("optimizer", name="dp_scaled_sgd")
@dataclass(kw_only=True)
class ScaledSGDSettings(OptimizerSettings):
    """SGD whose step is `scale` times the learning rate: an option of its own."""

    scale: float = option(1.0, "multiplies the learning rate", gt=0)

    def build(self, inputs):
        return torch.optim.SGD(list(inputs.params.values()), lr=self.lr * self.scale, weight_decay=self.weight_decay)


@dataclass
class CountingReader:
    """Sources `n : k` with the reference `k`, for k in a range per split."""

    tokenizer: object
    sizes: dict

    def examples(self, split: str) -> list[Example]:
        return [Example(f"n : {k}", f"{k}") for k in range(self.sizes[split])]

    def encode(self, examples, max_length: int):
        return encode_for_training(examples, self.tokenizer, max_length)


@settings("dataset")
@dataclass(kw_only=True)
class CountingSettings(DatasetSettings):
    name: str = option("counting", "the private set's name")
    train_size: int = option(400, "training examples", ge=1)
    delta: float = option(1e-4, "δ; must be < 1/N", gt=0, lt=1)

    def reader(self, data_root, tokenizer, progress=True):
        return CountingReader(tokenizer, {"train": self.train_size, "valid": 8, "test": 4})


SMOKE = (
    "experiment=smoke", "logger=none", "logging.progress=false", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
    "privacy.expected_lot_size=8", "privacy.noise_multiplier=1.0", "trainer.steps=2", "trainer.eval_every=0",
    "trainer.checkpoint_every=0", "eval.decoding=greedy", "eval.max_new_tokens=4",
)  # fmt: skip


@pytest.fixture
def config_dir(tmp_path):
    if not Path(os.environ.get("DPMUON_TOKENIZER") or "/nonexistent").is_dir():
        pytest.skip("DPMUON_TOKENIZER not set to a local tokenizer directory")
    conf = tmp_path / "conf"
    shutil.copytree(CONFIG_DIR, conf)
    (conf / "optimizer" / "dp_scaled_sgd.yaml").write_text("defaults:\n  - /settings/optimizer/ScaledSGDSettings@_here_\n  - _self_\nscale: 0.5\n")
    (conf / "dataset" / "counting.yaml").write_text("defaults:\n  - /settings/dataset/CountingSettings@_here_\n  - _self_\ntrain_size: 300\n")
    return str(conf)


def test_a_new_optimizer_and_a_new_dataset_compose_validate_and_train(config_dir, tmp_path):
    cfg = compose_config(*SMOKE, "optimizer=dp_scaled_sgd", "optimizer.lr=0.5", "dataset=counting", config_dir=config_dir)
    assert OmegaConf.to_container(cfg.optimizer)["_target_"] == f"{__name__}.ScaledSGDSettings"
    assert (cfg.optimizer.scale, cfg.optimizer.weight_decay, cfg.dataset.train_size, cfg.privacy.delta) == (0.5, 0.0, 300, 1e-4)
    validate(cfg)
    summary = run(cfg, tmp_path / "run")
    assert (summary["optimizer"], summary["dataset"], summary["steps"]) == ("dp_scaled_sgd", "counting", 2)
    assert summary["sample_rate"] == pytest.approx(8 / 300) and 0 < summary["epsilon"]
    assert summary["learning_rates"] == {"lr": 0.5}


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.scale=-1", r"^optimizer.scale=-1: must be > 0; valid: a number > 0$"),
        ("dataset.train_size=many", r"^dataset.train_size=many: not an integer; valid: an integer >= 1$"),
        ("optimizer.lr=null", r"^optimizer.lr=null: must be set; valid: a number > 0$"),  # the recipe has no rate for it
    ],
)
def test_their_own_options_are_checked_in_one_line(config_dir, override, message):
    cfg = compose_config(*SMOKE, "optimizer=dp_scaled_sgd", "optimizer.lr=0.5", "dataset=counting", override, config_dir=config_dir)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_a_new_optimizer_trains_through_optim_build_and_dp_trainer(tmp_path):
    """No list to extend: `dpmuon.optim.build` finds the class by the name it registered,
    `DPTrainer(optimizer=...)` takes the class itself, and the Trainer's rate and weight decay
    reach its options."""
    import dpmuon
    from dpmuon.integrations.hf import DPTrainer, DPTrainingArguments
    from dpmuon.models import Shape, build_random_lm, per_example_lm_loss

    def model():
        return build_random_lm("gpt2", Shape(16, n_layer=1, n_embd=16, n_head=2, n_positions=8), seed=0)

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 16, (8,), generator=g)} for _ in range(64)]

    def collate(batch):
        ids = torch.stack([r["input_ids"] for r in batch])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    privacy = dict(target_epsilon=50.0, delta=1e-3, expected_lot_size=16, noise_multiplier=0.6, accountant="rdp")
    net = model()
    private = dpmuon.make_private(net, rows, collate, per_example_lm_loss, run_dir=tmp_path / "facade", steps=2, micro_batch_size=8, **privacy)
    optimizer = dpmuon.optim.build("dp_scaled_sgd", net, private, lr=0.4, scale=0.5)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for lot in private.lots():
        private.release(lot)
        optimizer.step()
    assert any(not torch.equal(p, before[n]) for n, p in net.named_parameters())

    args = DPTrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=2, learning_rate=0.4, weight_decay=0.01, per_device_train_batch_size=8,
        report_to=[], disable_tqdm=True, use_cpu=True, max_grad_norm=0.0, save_strategy="no", lr_scheduler_type="constant", **privacy,
    )  # fmt: skip
    trainer = DPTrainer(model=model(), args=args, train_dataset=rows, data_collator=collate, optimizer=ScaledSGDSettings)
    trainer.train()
    group = trainer.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], trainer.state.global_step) == (pytest.approx(0.4), 0.01, 2)


@pytest.fixture
def conf_copy(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONFIG_DIR, conf)
    return conf


def test_a_yaml_whose_settings_class_no_module_stored_is_one_line_naming_it(conf_copy):
    """Before, Hydra failed every run (even one that never selected the YAML) with a traceback."""
    (conf_copy / "optimizer" / "dp_lion.yaml").write_text("defaults:\n  - /settings/optimizer/LionSettings@_here_\n  - _self_\n")
    message = r"^conf/optimizer/dp_lion.yaml: lists the settings class LionSettings, which no imported module stored with "
    message += r"@settings\('optimizer'\) \(stored: .*AdamSettings"
    with pytest.raises(UserError, match=message):
        compose_config("optimizer=dp_adam", config_dir=str(conf_copy))
    with pytest.raises(UserError, match=message):
        describe_options(str(conf_copy))


def test_a_roster_yaml_named_unlike_its_optimizer_is_refused(conf_copy, monkeypatch):
    """A copy of dp_adam.yaml under another file name inherits the name dp_adam: two roster rows
    would claim one name (and tables would merge their runs)."""
    from dpmuon.config import roster

    (conf_copy / "optimizer" / "dp_adam_wd.yaml").write_text("defaults:\n  - dp_adam\n  - _self_\nweight_decay: 0.1\n")
    monkeypatch.setattr(roster, "OPTIMIZER_DIR", conf_copy / "optimizer")
    monkeypatch.setattr(roster, "CONFIG_DIR", conf_copy)
    roster.optimizer_roster.cache_clear()
    try:
        with pytest.raises(UserError, match=r"^conf/optimizer/dp_adam_wd.yaml: name: dp_adam \(inherited\), not the file's name; set name: dp_adam_wd in it$"):
            roster.optimizer_roster()
    finally:
        roster.optimizer_roster.cache_clear()
