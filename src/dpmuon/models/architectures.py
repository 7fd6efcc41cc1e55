"""What differs between the causal-LM families dpmuon trains: how a random-init model of a given
size is configured; and, read from any model's own config, its dropout probabilities and its
context length (no table of known families: `dropout_keys`, `config_context_length`).

GPT-2 (Conv1D projections, LayerNorm, learned positions, `*_pdrop`), and the Llama family
(Llama, Qwen2, SmolLM = Llama: bias-free nn.Linear projections — Qwen2 keeps q/k/v biases —,
RMSNorm, rotary positions without parameters, grouped-query attention, SwiGLU MLP, dropout only
on attention weights).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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
    config = GPT2Config(
        bos_token_id=eos,
        eos_token_id=eos,
        vocab_size=shape.vocab_size,
        n_positions=shape.n_positions,
        n_embd=shape.n_embd,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_inner=shape.intermediate_size,
        tie_word_embeddings=tie,
    )
    return with_dropout(config, dropout)


def _llama_family_config(config_class: type[PretrainedConfig]) -> Callable[..., PretrainedConfig]:
    def build(shape: Shape, dropout: float, eos: int, tie: bool) -> PretrainedConfig:
        config = config_class(
            bos_token_id=eos,
            eos_token_id=eos,
            vocab_size=shape.vocab_size,
            hidden_size=shape.n_embd,
            num_hidden_layers=shape.n_layer,
            num_attention_heads=shape.n_head,
            num_key_value_heads=shape.n_kv_head or shape.n_head,
            intermediate_size=shape.intermediate_size or 4 * shape.n_embd,
            max_position_embeddings=shape.n_positions,
            tie_word_embeddings=tie,
        )
        return with_dropout(config, dropout)

    return build


@dataclass(frozen=True)
class Architecture:
    random_config: Callable[[Shape, float, int, bool], PretrainedConfig]


ARCHITECTURES: Mapping[str, Architecture] = {
    "gpt2": Architecture(_gpt2_config),
    "llama": Architecture(_llama_family_config(LlamaConfig)),
    "qwen2": Architecture(_llama_family_config(Qwen2Config)),
}


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model architecture {name!r}; valid: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


# A dropout probability's key: its last word is `dropout` or `pdrop`, optionally followed by
# `_prob`, `_p` or `_rate` (attention_dropout, hidden_dropout_prob, attention_probs_dropout_prob,
# resid_pdrop, dropout_rate, …). Not LayerDrop (`layerdrop`: whole layers skipped for the whole
# batch, a different regularizer) and not `drop_path_rate` (stochastic depth).
DROPOUT_KEY = re.compile(r"(?:[a-z0-9]+_)*(?:dropout|pdrop)(?:_(?:prob|p|rate))?")


def dropout_keys(config: PretrainedConfig) -> tuple[str, ...]:
    """The config's dropout probabilities: top-level keys named by `DROPOUT_KEY` whose value is a
    number (not a bool) in [0, 1]. (A key set to null, e.g. an unused classifier's, is left alone.)"""
    return tuple(
        key
        for key, value in config.to_dict().items()
        if DROPOUT_KEY.fullmatch(key) and isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    )


def dropout_overrides(config: PretrainedConfig, dropout: float | None) -> dict[str, float]:
    """Config overrides that set every dropout probability of `config` to `dropout` (None: none)."""
    if dropout is None:
        return {}
    keys = dropout_keys(config)
    if not keys and dropout > 0:
        raise ValueError(
            f"model.dropout={dropout} for a {config.model_type!r} model whose config has no dropout probability "
            "(no key ending in dropout / pdrop [_prob|_p|_rate] with a value in [0, 1]); set model.dropout=null or 0"
        )
    return {key: dropout for key in keys}


def with_dropout(config: PretrainedConfig, dropout: float) -> PretrainedConfig:
    config.update(dropout_overrides(config, dropout))
    return config


# Where configs keep the positions a model attends over, most standard first (GPT-2's
# `max_position_embeddings` maps to its `n_positions`).
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx", "max_seq_len")


def config_context_length(config: PretrainedConfig) -> int:
    """Positions the model of `config` attends over: the first standard key its (text) config has."""
    text = config.get_text_config()
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ValueError(f"the {config.model_type!r} config names no context length (none of {', '.join(CONTEXT_LENGTH_KEYS)} is a positive integer)")
