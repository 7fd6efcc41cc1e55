"""The real pretrained SmolLM2-135M-Instruct (Llama) made by `make models/smollm2`: the fast engine
against the naive loop on its tied head and a few other blocks, and two private DP-Muon steps
on E2E. Skipped, saying why, where the local directory does not exist (CI never needs it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers_train import compose_config, require_real_data
from reference import assert_close_dicts, naive_reference

from dpmuon.data import load_tokenizer
from dpmuon.data.encoding import encode_for_training
from dpmuon.data.records import Example
from dpmuon.models import IGNORE_INDEX, build_model, hidden_matrices, lm_head_is_tied, per_example_lm_loss
from dpmuon.paths import REPO_ROOT
from dpmuon.privacy import build_partition
from dpmuon.privacy.engines.fast import FastEngine

SMOLLM2 = Path(os.environ.get("DPMUON_SMOLLM2", REPO_ROOT / "models" / "smollm2"))
pytestmark = pytest.mark.skipif(
    not (SMOLLM2 / "config.json").is_file(), reason=f"no SmolLM2 directory at {SMOLLM2} (make models/smollm2, or set DPMUON_SMOLLM2)"
)
# The tied embedding/head (the cross term), an attention and an MLP matrix, two RMSNorms.
BLOCKS = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.29.mlp.down_proj.weight",
    "model.norm.weight",
]


@pytest.fixture(scope="module")
def smollm2():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer(str(SMOLLM2))
    model = build_model({"name_or_path": str(SMOLLM2), "dropout": 0.0}, tokenizer)
    yield model, tokenizer
    torch.set_num_threads(threads)


def encoded_lot(tokenizer, size: int) -> dict:
    sentences = [Example(source=f"name : The Eagle {i} | food : French", target=f"The Eagle {i} serves French food.") for i in range(size)]
    examples, _ = encode_for_training(sentences, tokenizer, max_length=10**6)
    width = max(len(e.input_ids) for e in examples)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([e.input_ids + [pad] * (width - len(e.input_ids)) for e in examples]),
        "attention_mask": torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in examples]),
        "labels": torch.tensor([e.labels + [IGNORE_INDEX] * (width - len(e.labels)) for e in examples]),
    }


def test_the_local_model_is_smollm2_with_its_own_tokenizer_and_an_explicit_pad(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == ("llama", 30, 576, 9, 3)
    assert config.vocab_size == len(tokenizer) == 49152 and lm_head_is_tied(model)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=1e-3)
    assert len(hidden_matrices(model)) == 30 * 7
    assert config.pad_token_id == tokenizer.pad_token_id
    # Its pad is its eos (<|im_end|>): the supervised final eos must survive, padding must not.
    lot = encoded_lot(tokenizer, 2)
    for ids, labels in zip(lot["input_ids"], lot["labels"]):
        last = int((labels != IGNORE_INDEX).nonzero().max())
        assert int(labels[last]) == tokenizer.eos_token_id == int(ids[last])
    assert bool((lot["labels"][lot["attention_mask"] == 0] == IGNORE_INDEX).all())


def test_fast_engine_matches_the_naive_loop_on_a_two_example_lot(smollm2):
    model, tokenizer = smollm2
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        for name, p in model.named_parameters():
            p.requires_grad_(name in BLOCKS)
        partition = build_partition(BLOCKS, clip_norm=0.1, matrix_names=[n for n in BLOCKS if n in hidden_matrices(model)])
        lot = encoded_lot(tokenizer, 2)
        _, expected = naive_reference(model, partition, lot, per_example_lm_loss)
        summed, _, stats = FastEngine(model, partition).clipped_sum(lot, per_example_lm_loss)
        assert_close_dicts(summed, expected)
        assert int(stats.clipped.sum()) > 0
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(trainable[name])


@pytest.mark.slow  # minutes on two busy CPU cores: 134.5M parameters, 272 blocks
def test_two_private_dp_muon_steps_on_e2e(tmp_path):
    from dpmuon.training.loop import run

    require_real_data()
    cfg = compose_config(
        "model=smollm2_135m", f"model.name_or_path={SMOLLM2}", "dataset=e2e", "optimizer=dp_muon",
        "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2",
        "privacy.expected_lot_size=8", "privacy.noise_multiplier=1.0", "trainer.steps=2", "trainer.micro_batch_size=4",
        "trainer.eval_every=0", "eval.validation=false", "trainer.checkpoint_every=0", "trainer.num_threads=2",
        "eval.num_beams=1", "eval.max_new_tokens=8", "logging.progress=false", "logger=none",
    )  # fmt: skip
    summary = run(cfg, tmp_path)
    print({k: summary.get(k) for k in ("model", "steps", "epsilon", "target_epsilon", "test_nll", "bleu", "train_seconds")})
    assert summary["steps"] == 2 and 0 < summary["epsilon"] <= summary["target_epsilon"]
    assert summary["initial_weights_sha256"] != summary["final_weights_sha256"]
    assert summary["test_nll"] > 0
