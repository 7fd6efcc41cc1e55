"""What differs between the causal-LM families dpmuon trains: how a random-init model of a given
size is configured, and which config keys hold its dropout probabilities.

GPT-2 (Conv1D projections, LayerNorm, learned positions, `*_pdrop`), and the Llama family
(Llama, Qwen2, SmolLM = Llama: bias-free nn.Linear projections — Qwen2 keeps q/k/v biases —,
RMSNorm, rotary positions without parameters, grouped-query attention, SwiGLU MLP, dropout only
on attention weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from transformers import GPT2Config, LlamaConfig, PretrainedConfig, Qwen2Config


@dataclass(frozen=True)
class Shape:
    """The size of a random-init model (the `model.*` options)."""

    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int
    n_kv_head: int | None = None  # None: as many as query heads (no grouping)
    intermediate_size: int | None = None  # None: 4 × n_embd


def _gpt2_config(shape: Shape, dropout: float, eos: int, tie: bool) -> PretrainedConfig:
    return GPT2Config(
        bos_token_id=eos,
        eos_token_id=eos,
        vocab_size=shape.vocab_size,
        n_positions=shape.n_positions,
        n_embd=shape.n_embd,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_inner=shape.intermediate_size,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=tie,
    )


def _llama_family_config(config_class: type[PretrainedConfig]) -> Callable[..., PretrainedConfig]:
    def build(shape: Shape, dropout: float, eos: int, tie: bool) -> PretrainedConfig:
        return config_class(
            bos_token_id=eos,
            eos_token_id=eos,
            vocab_size=shape.vocab_size,
            hidden_size=shape.n_embd,
            num_hidden_layers=shape.n_layer,
            num_attention_heads=shape.n_head,
            num_key_value_heads=shape.n_kv_head or shape.n_head,
            intermediate_size=shape.intermediate_size or 4 * shape.n_embd,
            max_position_embeddings=shape.n_positions,
            attention_dropout=dropout,
            tie_word_embeddings=tie,
        )

    return build


@dataclass(frozen=True)
class Architecture:
    random_config: Callable[[Shape, float, int, bool], PretrainedConfig]
    dropout_keys: tuple[str, ...]  # every dropout probability of the family's config


ARCHITECTURES: Mapping[str, Architecture] = {
    "gpt2": Architecture(_gpt2_config, ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
    "llama": Architecture(_llama_family_config(LlamaConfig), ("attention_dropout",)),
    "qwen2": Architecture(_llama_family_config(Qwen2Config), ("attention_dropout",)),
}
# Pretrained families whose dropout keys are known (their random init is not offered).
DROPOUT_KEYS: Mapping[str, tuple[str, ...]] = {
    **{name: arch.dropout_keys for name, arch in ARCHITECTURES.items()},
    "mistral": ("attention_dropout",),
    "qwen3": ("attention_dropout",),
}


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model architecture {name!r}; valid: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def dropout_overrides(model_type: str, dropout: float | None) -> dict[str, float]:
    """Config overrides that set every dropout probability of a `model_type` to `dropout`."""
    if dropout is None:
        return {}
    if model_type not in DROPOUT_KEYS:
        raise ValueError(
            f"model.dropout={dropout} for a {model_type!r} model, whose dropout keys dpmuon does not know "
            f"(known: {', '.join(sorted(DROPOUT_KEYS))}); set model.dropout=null to keep the checkpoint's own"
        )
    return {key: dropout for key in DROPOUT_KEYS[model_type]}
