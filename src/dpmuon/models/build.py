"""Build the model a config names, sized to the tokenizer (which carries an added pad token)."""

from __future__ import annotations

from typing import Mapping

from torch import nn
from transformers import AutoConfig

from .factory import build_random_gpt2, load_pretrained, untie_lm_head


def build_model(cfg: Mapping, tokenizer, seed: int = 0) -> nn.Module:
    if cfg.get("name_or_path"):
        model = load_pretrained(cfg["name_or_path"], dropout=cfg.get("dropout"))
        if model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
    else:
        model = build_random_gpt2(
            vocab_size=len(tokenizer),
            n_layer=int(cfg["n_layer"]),
            n_embd=int(cfg["n_embd"]),
            n_head=int(cfg["n_head"]),
            n_positions=int(cfg["n_positions"]),
            dropout=float(cfg.get("dropout", 0.0)),
            seed=seed,
            eos_token_id=tokenizer.eos_token_id,
        )
    if cfg.get("untie_head"):
        untie_lm_head(model)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def context_length(cfg: Mapping) -> int:
    """Positions the configured model can attend over (without loading its weights)."""
    if cfg.get("name_or_path"):
        return int(AutoConfig.from_pretrained(cfg["name_or_path"]).n_positions)
    return int(cfg["n_positions"])
