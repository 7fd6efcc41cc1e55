"""Models: GPT-2- and Llama-family causal LMs, their LoRA adapters, and their per-example loss."""

from .architectures import ARCHITECTURES, Shape
from .build import (
    build_model,
    build_random_lm,
    context_length,
    lm_head_is_tied,
    load_pretrained,
    untie_lm_head,
    weights_fingerprint,
)
from .lm import IGNORE_INDEX, hidden_matrices, per_example_lm_loss, position_ids_for
from .lora import LoraOptions, add_lora, is_lora, save_adapter

__all__ = [
    "ARCHITECTURES",
    "IGNORE_INDEX",
    "LoraOptions",
    "Shape",
    "add_lora",
    "build_model",
    "context_length",
    "build_random_lm",
    "hidden_matrices",
    "is_lora",
    "lm_head_is_tied",
    "load_pretrained",
    "per_example_lm_loss",
    "position_ids_for",
    "save_adapter",
    "untie_lm_head",
    "weights_fingerprint",
]
