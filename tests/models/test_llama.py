"""Llama-family models (RMSNorm, bias-free Linear, rotary positions, grouped-query attention):
both engines against a naive per-example autograd loop, the model options, and a smoke run of
each DP optimizer on real E2E data."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, fast_squared_norms, token_batch
from helpers_tokenizers import StubTokenizer
from helpers_train import compose_config, require_real_data
from reference import PARTITIONS, assert_close_dicts, assert_close_norms, naive_reference, opacus_reference, partition_for

from dpmuon.config.roster import optimizer_names
from dpmuon.eval.runs import read_run_rows
from dpmuon.models import Shape, build_model, build_random_lm, context_length, hidden_matrices, lm_head_is_tied, per_example_lm_loss
from dpmuon.privacy import build_engine
from dpmuon.privacy.engines.fast import FastEngine

ARCHS = ["llama", "qwen2"]
MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


pytestmark = pytest.mark.usefixtures("single_thread")


def tiny_llama(arch: str = "llama", tie: bool = True, seed: int = 0):
    """2 layers, width 32, 4 query heads sharing 2 key/value heads."""
    shape = Shape(vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=4, n_positions=32, n_kv_head=2, intermediate_size=48)
    return build_random_lm(arch, shape, tie_embeddings=tie, seed=seed)


def test_hidden_matrices_are_the_projections_and_qwen2_keeps_its_biases():
    for arch in ARCHS:
        model = tiny_llama(arch)
        assert set(hidden_matrices(model)) == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in MATRICES}
        assert all(layout == "out_in" for layout in hidden_matrices(model).values())
        biases = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
        expected = {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"} if arch == "qwen2" else set()
        assert biases == expected
        assert lm_head_is_tied(model)
        assert model.config.num_key_value_heads == 2


@pytest.mark.parametrize("partition", ["per_matrix-split-per_tensor", "flat"])
@pytest.mark.parametrize("left_pad", [False, True], ids=["right-pad", "left-pad"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "untied-head"])
@pytest.mark.parametrize("arch", ARCHS)
def test_both_engines_match_the_naive_loop(arch, tie, left_pad, partition):
    model = tiny_llama(arch, tie=tie)
    part = partition_for(model, 0.01, **PARTITIONS[partition])
    batch = token_batch(4, left_pad=left_pad, seed=3)
    ref_squared, ref_summed = naive_reference(model, part, batch, per_example_lm_loss)

    engine = FastEngine(model, part)
    squared, _ = fast_squared_norms(engine, batch, per_example_lm_loss)
    summed, _, stats = engine.clipped_sum(batch, per_example_lm_loss)
    assert_close_norms(squared, ref_squared)
    assert_close_dicts(summed, ref_summed)
    # The threshold binds for most blocks, so the factors matter (Qwen2's k_proj bias has a zero
    # gradient: softmax ignores a shift shared by every key).
    assert stats.clipped.float().mean() > 0.75 * 4

    opacus_squared, opacus_summed, _ = opacus_reference(model, part, batch)
    assert_close_dicts(opacus_squared, ref_squared, atol=1e-8)
    assert_close_dicts(opacus_summed, ref_summed)


@pytest.mark.parametrize("arch", ARCHS)
def test_micro_batches_sum_to_the_lot(arch):
    model = tiny_llama(arch)
    part = partition_for(model, 0.01)
    batch = token_batch(5, seed=4)
    _, expected = naive_reference(model, part, batch, per_example_lm_loss)
    engine = FastEngine(model, part)
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    parts = [engine.clipped_sum(half, per_example_lm_loss)[0] for half in halves]
    assert_close_dicts({n: parts[0][n] + parts[1][n] for n in expected}, expected)


@pytest.mark.parametrize("engine_name", ["fast", "opacus"])
def test_clipped_contributions_stay_within_each_threshold(engine_name):
    model = tiny_llama("qwen2")
    part = partition_for(model, 0.02)
    batch = token_batch(3, seed=10)
    engine = build_engine(engine_name, model, part)
    try:
        for i in range(3):
            summed, _, _ = engine.clipped_sum({k: v[i : i + 1] for k, v in batch.items()}, per_example_lm_loss)
            for block in part.blocks:
                norm = torch.sqrt(sum(summed[n].double().square().sum() for n in block.params))
                assert norm <= block.threshold * (1 + 1e-5), block.name
    finally:
        engine.close()


def test_config_options_build_a_grouped_query_llama_and_its_context_length_comes_from_its_config(tmp_path):
    cfg = {"architecture": "llama", "n_layer": 1, "n_embd": 32, "n_head": 4, "n_kv_head": 2, "intermediate_size": 40, "n_positions": 24, "dropout": 0.1}
    model = build_model(cfg, StubTokenizer(50), seed=1)
    assert type(model).__name__ == "LlamaForCausalLM" and lm_head_is_tied(model)
    assert (model.config.num_key_value_heads, model.config.intermediate_size, model.config.attention_dropout) == (2, 40, 0.1)
    assert model.config.pad_token_id == 49
    model.save_pretrained(tmp_path)
    assert context_length({"name_or_path": str(tmp_path)}) == 24  # max_position_embeddings, not GPT-2's n_positions
    reloaded = build_model({"name_or_path": str(tmp_path), "dropout": 0.0}, StubTokenizer(50))
    assert reloaded.config.attention_dropout == 0.0  # the family's own dropout key


def test_unknown_architecture_is_refused_and_any_checkpoint_dropout_is_read_from_its_config(tmp_path):
    with pytest.raises(ValueError, match="unknown model architecture 'mamba'"):
        build_model({"architecture": "mamba", "n_layer": 1, "n_embd": 8, "n_head": 2, "n_positions": 8}, StubTokenizer(20))
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)).save_pretrained(tmp_path)
    model = build_model({"name_or_path": str(tmp_path), "dropout": 0.25}, StubTokenizer(20))  # a family no table names
    assert (model.config.attention_dropout, model.config.hidden_dropout) == (0.25, 0.25)
    own = build_model({"name_or_path": str(tmp_path), "dropout": None}, StubTokenizer(20))  # the checkpoint's own
    assert own.config.hidden_dropout == GPTNeoXConfig().hidden_dropout


# A smaller llama_tiny than the smoke experiment's, with grouped-query attention.
SMOKE = [
    "model=llama_tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=4", "model.n_kv_head=2",
    "model.intermediate_size=88", "model.n_positions=128",
    "data.max_train_examples=200", "data.max_valid_examples=8", "data.max_test_sources=2",
    "privacy.expected_lot_size=16", "privacy.noise_multiplier=1.0", "trainer.steps=2", "trainer.micro_batch_size=8",
    "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.num_threads=1", "eval.num_beams=1", "eval.max_new_tokens=4",
    "logging.progress=false", "logger=none",
]  # fmt: skip


@pytest.mark.parametrize("optimizer", optimizer_names(private=True))
def test_llama_tiny_smoke_run_of_each_dp_optimizer(tmp_path, optimizer):
    from dpmuon.training.loop import run

    require_real_data()
    summary = run(compose_config("experiment=smoke", "dataset=e2e", f"optimizer={optimizer}", *SMOKE), tmp_path)
    assert summary["model"] == "llama_tiny" and summary["steps"] == 2
    assert 0 < summary["epsilon"] <= summary["target_epsilon"]
    assert summary["initial_weights_sha256"] != summary["final_weights_sha256"]
    rows = [r for r in read_run_rows(tmp_path, diagnostics=True) if r["step"] > 0]  # (step 0: the initial weights' validation NLL)
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in rows)
    if optimizer.startswith("dp_muon"):
        assert len(rows[0]["snr"]) == 7  # one estimate per hidden matrix: q, k, v, o, gate, up, down
