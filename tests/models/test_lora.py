"""LoRA through peft: only the adapters are trainable, released and clipped (each adapter matrix
its own block), both engines' clipped sums equal the naive one-example-at-a-time loop on GPT-2
(Conv1D, fan_in_fan_out) and Llama (nn.Linear), and a private run trains every adapter — not the
base — saves the adapters, evaluates and decodes with them, and resumes with them (the guard
against Opacus #820's silent failure: loss and ε normal, adapters not updated)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, tiny_gpt2, token_batch
from helpers_train import compose_config, require_real_data, seed_file_override
from peft import PeftModel
from reference import SMALL_C, assert_close_dicts, naive_reference, partition_for
from safetensors.torch import load_file

from dpmuon import run_folder
from dpmuon.data import load_tokenizer
from dpmuon.errors import ConfigError, UserError
from dpmuon.models import (
    LoraOptions,
    Shape,
    add_lora,
    build_model,
    build_random_lm,
    hidden_matrices,
    per_example_lm_loss,
    save_adapter,
    weights_fingerprint,
)
from dpmuon.privacy import build_engine
from dpmuon.privacy.engines.fast import FastEngine
from dpmuon.training.data import prepare_data
from dpmuon.training.evaluation import decode, token_nll
from dpmuon.training.loop import resume as resume_training
from dpmuon.training.loop import run, setup
from dpmuon.training.runtime import autocast_factory

pytestmark = pytest.mark.usefixtures("single_thread")

GPT2_TARGETS = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
LLAMA_TARGETS = {f"self_attn.{p}_proj" for p in "qkvo"} | {f"mlp.{p}_proj" for p in ("gate", "up", "down")}


def tiny_llama(seed: int = 0):
    shape = Shape(vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=4, n_positions=32, n_kv_head=2, intermediate_size=48)
    return build_random_lm("llama", shape, seed=seed)


BASES = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def adapted(arch: str, dropout: float = 0.0, **options):
    """A LoRA-wrapped tiny model whose B matrices are nonzero (at init B = 0, so A's gradient would be 0)."""
    model = add_lora(BASES[arch](), LoraOptions(r=4, alpha=8.0, dropout=dropout, **options), seed=1)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=generator)
    return model


def adapter_modules(model) -> set[str]:
    """The adapted projections, as `layer-relative` module names (…h.0.attn.c_attn → attn.c_attn)."""
    names = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    return {".".join(n.split(".")[-2:]) for n in names}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_only_adapters_train_and_each_is_a_hidden_matrix(arch):
    model = adapted(arch)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert adapter_modules(model) == (GPT2_TARGETS if arch == "gpt2" else LLAMA_TARGETS)
    # A: r × in and B: out × r, nn.Linear (out, in) layout, each DP-Muon's matrix and its own block.
    assert hidden_matrices(model) == dict.fromkeys(trainable, "out_in")
    assert all(min(p.shape) == 4 for p in trainable.values())
    partition = partition_for(model, 1.0)
    assert sorted(b.params for b in partition.blocks) == sorted((n,) for n in trainable)
    # The fast engine hooks the adapters alone: a frozen base layer costs it nothing.
    hooked = FastEngine(model, partition).layers
    assert {id(m) for m in hooked} == {id(m) for n, m in model.named_modules() if n.split(".")[-2:-1] in (["lora_A"], ["lora_B"])}


@pytest.mark.parametrize("engine", ["fast", "opacus"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_clipped_sums_equal_the_naive_loop(arch, engine):
    model = adapted(arch)
    partition = partition_for(model, SMALL_C)
    batch = token_batch(4, seed=3)
    _, expected = naive_reference(model, partition, batch, per_example_lm_loss)
    per_example = build_engine(engine, model, partition)
    try:
        summed, _, _ = per_example.clipped_sum(batch, per_example_lm_loss)
    finally:
        per_example.close()
    assert_close_dicts(summed, expected)
    assert all(float((summed[n] - expected[n]).norm() / expected[n].norm()) < 1e-4 for n in expected)
    assert all(p.grad is None for p in model.parameters())


def test_adapter_dropout_is_seen_by_both_engines_alike():
    """Dropout acts on A's input, which the engines record: with the same masks (same seed), the
    fast engine's clipped sums equal Opacus' materialized ones."""
    model = adapted("llama", dropout=0.3)
    model.train()
    partition = partition_for(model, SMALL_C)
    batch = token_batch(4, seed=4)
    sums = []
    for engine in ("fast", "opacus"):
        per_example = build_engine(engine, model, partition)
        torch.manual_seed(5)
        sums.append(per_example.clipped_sum(batch, per_example_lm_loss)[0])
        per_example.close()
    assert_close_dicts(*sums)
    torch.manual_seed(6)  # another mask: another result, so the masks did apply
    per_example = build_engine("fast", model, partition)
    other = per_example.clipped_sum(batch, per_example_lm_loss)[0]
    per_example.close()
    assert any(not torch.allclose(other[n], sums[0][n]) for n in other)


def test_train_embeddings_adds_the_tied_embedding_and_targets_are_checked():
    model = adapted("gpt2", train_embeddings=True)
    assert {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n} == {"base_model.model.transformer.wte.weight"}
    partition = partition_for(model, SMALL_C)
    batch = token_batch(3, seed=5)
    _, expected = naive_reference(model, partition, batch, per_example_lm_loss)
    per_example = build_engine("fast", model, partition)  # the tied head's cross term included
    assert_close_dicts(per_example.clipped_sum(batch, per_example_lm_loss)[0], expected)
    per_example.close()
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        add_lora(tiny_gpt2(), LoraOptions(r=2, alpha=2.0, target_modules=("q_proj",)))


def test_config_without_r_is_full_fine_tuning():
    assert LoraOptions.from_config({"lora": {"r": None, "alpha": 16}}) is None
    assert LoraOptions.from_config({}) is None
    assert LoraOptions.from_config({"lora": {"r": 8, "alpha": None}}) == LoraOptions(r=8, alpha=8.0)


# ---- a private LoRA run end to end -----------------------------------------------------------

RUN = [
    "experiment=smoke", "model=llama_tiny", "model.lora.r=4", "model.lora.alpha=16", "optimizer=dp_muon",
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1", "model.intermediate_size=64",
    "model.n_positions=192", "model.bpe_merges=1000", "dataset.max_length=190",
    "data.max_train_examples=32", "data.max_valid_examples=8", "data.max_test_sources=2",
    "privacy.expected_lot_size=32", "privacy.noise_multiplier=0.5", "privacy.accountant=rdp",
    "privacy.target_epsilon=1e9", "privacy.clip_norm=1.0",
    "optimizer.lr=0.1", "trainer.steps=6", "trainer.micro_batch_size=32", "trainer.eval_every=0", "trainer.checkpoint_every=0",
    "eval.num_beams=1", "eval.max_new_tokens=4", "logging.progress=false", "logger=none", "trainer.num_threads=1",
    seed_file_override(7 << 100),  # fixed lots and noise: the loss's fall below is reproducible
]  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A six-step private DP-Muon LoRA run on 32 E2E examples, every example in every lot, at a
    small noise (σ = 0.5, about the smallest the accountant takes at q = 1)."""
    require_real_data()
    run_dir = tmp_path_factory.mktemp("lora_run")
    summary = run(compose_config(*RUN), run_dir)
    return run_dir, summary


def trained_state(run_dir):
    return torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]


def initial_model(run_dir, *overrides: str):
    cfg = compose_config(*RUN, *overrides)
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.get("bpe_merges"))
    return build_model(cfg.model, tokenizer, seed=int(cfg.seed)), tokenizer


def test_a_private_run_trains_every_adapter_and_not_the_base(lora_run):
    run_dir, summary = lora_run
    start, _ = initial_model(run_dir)
    trained = trained_state(run_dir)
    before = start.state_dict()
    adapters = [k for k in before if ".lora_" in k]
    assert adapters and set(trained) == set(adapters)  # the checkpoint leaves the frozen base out
    for key in adapters:
        assert not torch.equal(trained[key], before[key]), f"{key} did not change"
    # The base did not move: the start with the trained adapters is the run's final model.
    start.load_state_dict(trained, strict=False)
    assert weights_fingerprint(start) == summary["final_weights_sha256"]
    checkpoint = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert checkpoint["frozen_weights_sha256"] == weights_fingerprint(start, frozen_only=True)
    losses = [json.loads(line)["train_loss"] for line in (run_dir / "diagnostics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.02, losses  # a random-init base: small but clear
    assert summary["initial_weights_sha256"] != summary["final_weights_sha256"]
    # The plan's σ slack counts the released coordinates: the adapters' alone.
    plan = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["plan"]
    assert plan["released_coordinates"] == sum(before[k].numel() for k in adapters)


def test_the_run_saves_its_adapters_and_evaluates_with_them(lora_run):
    run_dir, summary = lora_run
    base, _ = initial_model(run_dir, "model.lora.r=null")
    reloaded = PeftModel.from_pretrained(base, run_dir / run_folder.ADAPTER)
    saved = load_file(run_dir / run_folder.ADAPTER / "adapter_model.safetensors")
    assert saved and all(".lora_" in k for k in saved)
    trained = trained_state(run_dir)
    assert {k for k in reloaded.state_dict() if ".lora_" in k} == set(trained)
    for key, value in trained.items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    # The summary's test NLL is the adapted model's (the base model's differs).
    cfg = compose_config(*RUN)
    _, tokenizer = initial_model(run_dir)
    data = prepare_data(cfg.dataset, cfg.data, tokenizer, 128, lambda *_: None)
    device = torch.device("cpu")

    def nll(model):
        return token_nll(model, data.test, tokenizer.pad_token_id, 8, device, autocast_factory("fp32", device), False, "test nll")

    assert nll(reloaded) == pytest.approx(summary["test_nll"], rel=1e-5)
    with reloaded.disable_adapter():
        assert abs(nll(reloaded) - summary["test_nll"]) > 1e-3
    generations = decode(reloaded, tokenizer, [item.source for item in data.test_items], cfg.eval, device, autocast_factory("fp32", device), False)
    assert (run_dir / "generations.txt").read_text().splitlines() == [g.replace("\n", " ") for g in generations]


def test_a_resume_restores_the_adapters(lora_run, tmp_path):
    run_dir, _ = lora_run
    t = setup(compose_config(*RUN), run_dir)
    try:
        fresh = {k: v.clone() for k, v in t.model.state_dict().items() if ".lora_" in k}
        resume_training(t)
        restored = t.model.state_dict()
        trained = trained_state(run_dir)
        assert t.start_step == 6
        assert all(not torch.equal(fresh[k], trained[k]) for k in fresh if "lora_B" in k)
        assert all(torch.equal(restored[k], trained[k]) for k in trained)
    finally:
        t.mechanism.release.close()


def test_a_resume_refuses_a_base_model_other_than_the_one_the_run_began_with(lora_run):
    run_dir, _ = lora_run
    t = setup(compose_config(*RUN), run_dir)
    try:
        with torch.no_grad():  # as if model.name_or_path now held other weights
            next(p for p in t.model.parameters() if not p.requires_grad).add_(1e-3)
        t.frozen_weights = weights_fingerprint(t.model, frozen_only=True)
        with pytest.raises(UserError, match="frozen base model .* is not the one the run started from"):
            resume_training(t)
    finally:
        t.mechanism.release.close()


def test_saved_adapters_restore_trained_embeddings(tmp_path):
    model = adapted("gpt2", train_embeddings=True)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(0.5)  # as if trained: no longer the base's
    save_adapter(model, tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), tmp_path)
    saved, restored = model.state_dict(), reloaded.state_dict()
    assert set(saved) == set(restored) and all(torch.equal(saved[k], restored[k]) for k in saved)
