"""Every causal-LM family docs/models.md lists, in both engines: tiny random models of each, their
clipped sums against the naive one-example-at-a-time loop, and each example's clipped
contribution within its block's threshold. The fast engine runs with fallback=error: every
family's layers have fast rules, so a transformers release that renames a class fails here
rather than slowing down through the generic rule unnoticed.

Variants (`VARIANTS`: how the tiny model becomes the trained one): full fine-tuning, and LoRA
adapters (peft, `model.lora`) on each family's projections.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import VOCAB, token_batch
from reference import RTOL, assert_close_dicts, naive_reference, partition_for
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from dpmuon.models import LoraOptions, add_lora, per_example_lm_loss
from dpmuon.models.architectures import with_dropout
from dpmuon.privacy import build_engine

pytestmark = pytest.mark.usefixtures("single_thread")

HIDDEN = 16
# Ids inside the vocabulary (OPT, Gemma and Phi-3 pad with a row of their embedding).
IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
ROTARY = {"hidden_size": HIDDEN, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 24, "max_position_embeddings": 32}

FAMILIES: dict[str, Callable[[], object]] = {
    "llama": lambda: LlamaConfig(num_hidden_layers=2, **ROTARY),
    "qwen2": lambda: Qwen2Config(num_hidden_layers=1, **ROTARY),
    "qwen3": lambda: Qwen3Config(num_hidden_layers=1, head_dim=8, **ROTARY),
    "mistral": lambda: MistralConfig(num_hidden_layers=1, **ROTARY),
    "gemma": lambda: GemmaConfig(num_hidden_layers=1, head_dim=8, **ROTARY),
    "gemma2": lambda: Gemma2Config(num_hidden_layers=2, head_dim=8, sliding_window=4, **ROTARY),
    "olmo2": lambda: Olmo2Config(num_hidden_layers=1, **ROTARY),
    "phi3": lambda: Phi3Config(num_hidden_layers=1, **ROTARY),
    "opt": lambda: OPTConfig(
        num_hidden_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_dim=24, word_embed_proj_dim=HIDDEN, max_position_embeddings=32
    ),
    "gpt_neox": lambda: GPTNeoXConfig(num_hidden_layers=1, hidden_size=HIDDEN, num_attention_heads=2, intermediate_size=24, max_position_embeddings=32),
    "gpt2": lambda: GPT2Config(n_layer=1, n_embd=HIDDEN, n_head=2, n_positions=32),
}
# The Opacus engine cannot take OPT, and refuses it cleanly: its learned positions are called
# with keyword arguments, which Opacus' hooks never see, and its MLP sees token rows [B·T, d],
# which Opacus takes for B·T samples.
OPACUS_REFUSES = {"opt": "(OPTLearnedPositionalEmbedding|rows that are not examples)"}


def with_lora(model: nn.Module) -> nn.Module:
    adapted = add_lora(model, LoraOptions(r=2, alpha=4.0))  # the family's default targets
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero, where A's gradient vanishes: give both a gradient
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return adapted.train()


VARIANTS: dict[str, Callable[[nn.Module], nn.Module]] = {"full": lambda model: model, "lora": with_lora}

C = 0.01  # binds for nearly every block, so the clip factors matter


def tiny_model(family: str, seed: int = 0) -> nn.Module:
    config = with_dropout(FAMILIES[family](), 0.0)  # dropout would make two passes differ
    config.update({"vocab_size": VOCAB, **IDS})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms initialized to exactly 1 (or Gemma's 0) would hide a rule that ignores γ
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model.train()


def contribution_norms(summed: dict[str, torch.Tensor], partition) -> list[tuple[str, float, float]]:
    return [(b.name, float(torch.sqrt(sum(summed[n].double().square().sum() for n in b.params))), b.threshold) for b in partition.blocks]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_both_engines_match_the_naive_loop_and_bound_each_contribution(family, variant):
    model = VARIANTS[variant](tiny_model(family))
    partition = partition_for(model, C)
    batch = token_batch(3, length=10, seed=5)
    _, ref_summed = naive_reference(model, partition, batch, per_example_lm_loss)
    for name in ("fast", "opacus"):
        engine = build_engine(name, model, partition, fallback="error" if name == "fast" else "generic")  # fast: every module has a rule
        try:
            if name == "opacus" and family in OPACUS_REFUSES:
                with pytest.raises(ValueError, match=f"{OPACUS_REFUSES[family]}.*use privacy.engine=fast"):
                    engine.clipped_sum(batch, per_example_lm_loss)
                continue
            assert engine.fallback_summary is None, engine.fallback_summary
            summed, _, stats = engine.clipped_sum(batch, per_example_lm_loss)
            assert_close_dicts(summed, ref_summed, rtol=RTOL)
            assert stats.clipped.sum() > 0
            for i in range(batch["input_ids"].shape[0]):
                single, _, _ = engine.clipped_sum({k: v[i : i + 1] for k, v in batch.items()}, per_example_lm_loss)
                for block, norm, threshold in contribution_norms(single, partition):
                    assert norm <= threshold * (1 + 1e-4), (name, i, block)
        finally:
            engine.close()


def test_default_lora_targets_are_every_projection_of_every_tested_family():
    from transformers.pytorch_utils import Conv1D

    from dpmuon.models.lora import DEFAULT_TARGETS

    assert set(DEFAULT_TARGETS) == set(FAMILIES)  # a family gets defaults once the engines are tested on it
    for family in FAMILIES:
        model = tiny_model(family)
        projections = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and m is not model.get_output_embeddings()}
        adapted = add_lora(model, LoraOptions(r=2, alpha=4.0))
        wrapped = {n.removeprefix("base_model.model.") for n, m in adapted.named_modules() if hasattr(m, "lora_A")}
        assert wrapped == projections, family
