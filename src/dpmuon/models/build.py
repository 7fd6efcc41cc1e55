"""Build the model a config names, sized to the tokenizer (which carries a pad token)."""

from __future__ import annotations

from typing import Mapping

from torch import nn
from transformers import AutoConfig

from .architectures import Shape
from .factory import build_random_lm, load_pretrained, untie_lm_head

DEFAULT_ARCHITECTURE = "gpt2"  # model configs written before `model.architecture` existed


def random_shape(cfg: Mapping, vocab_size: int) -> Shape:
    return Shape(
        vocab_size=vocab_size,
        n_layer=int(cfg["n_layer"]),
        n_embd=int(cfg["n_embd"]),
        n_head=int(cfg["n_head"]),
        n_positions=int(cfg["n_positions"]),
        n_kv_head=cfg.get("n_kv_head"),
        intermediate_size=cfg.get("intermediate_size"),
    )


def build_model(cfg: Mapping, tokenizer, seed: int = 0) -> nn.Module:
    if cfg.get("name_or_path"):
        model = load_pretrained(cfg["name_or_path"], dropout=cfg.get("dropout"))
        if model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
    else:
        model = build_random_lm(
            cfg.get("architecture") or DEFAULT_ARCHITECTURE,
            random_shape(cfg, len(tokenizer)),
            dropout=float(cfg.get("dropout") or 0.0),
            seed=seed,
            eos_token_id=tokenizer.eos_token_id,
        )
    if cfg.get("untie_head"):
        untie_lm_head(model)
    # Explicit, whatever the checkpoint says (SmolLM2's tokenizer pads with <|im_end|>, its eos):
    # padding is masked by attention_mask and labels, never recognized by this id.
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def context_length(cfg: Mapping) -> int:
    """Positions the configured model can attend over (without loading its weights).

    `max_position_embeddings` is the name every family's config answers to (GPT-2's maps it
    to `n_positions`).
    """
    if cfg.get("name_or_path"):
        return int(AutoConfig.from_pretrained(cfg["name_or_path"]).max_position_embeddings)
    return int(cfg["n_positions"])
