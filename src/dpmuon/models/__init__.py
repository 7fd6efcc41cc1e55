"""Models: GPT-2- and Llama-family causal LMs, their LoRA adapters, and their per-example loss.

The names below load their module on first use (PEP 562): the configs read the models'
options (models.settings) without loading torch or `transformers`.
"""

from __future__ import annotations

from ..lazy import lazy_exports

# name → the submodule that defines it
_EXPORTS = {
    "ARCHITECTURES": "architectures",
    "Shape": "architectures",
    "build_model": "build",
    "build_random_lm": "build",
    "context_length": "build",
    "lm_head_is_tied": "build",
    "load_pretrained": "build",
    "untie_lm_head": "build",
    "weights_fingerprint": "build",
    "IGNORE_INDEX": "lm",
    "hidden_matrices": "lm",
    "next_token_labels": "lm",
    "per_example_lm_loss": "lm",
    "position_ids_for": "lm",
    "LoraOptions": "lora",
    "add_lora": "lora",
    "is_lora": "lora",
    "save_adapter": "lora",
    "ModelSettings": "settings",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
