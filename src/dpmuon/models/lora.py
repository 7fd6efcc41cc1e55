"""LoRA adapters through `peft` (`model.lora.*`): the base model frozen, only the adapters trained.

Each targeted projection y = base(x) gains s · B A dropout(x) (s = alpha / r), with A: r × in
and B: out × r plain nn.Linear modules — so both per-example engines treat them as ordinary
Linear layers (the frozen base layer holds no trainable parameter and is never hooked), each
adapter matrix is its own block under per-matrix clipping, and DP-Muon orthogonalizes it
(`hidden_matrices` lists every trainable Linear). The scaling s multiplies B's output, so the
gradient recorded there already includes it; dropout acts on A's input, which the engines record.

The token embedding and the LM head stay frozen unless `model.lora.train_embeddings` (then
they are trained and saved with the adapters); position embeddings and norms stay frozen.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..errors import ConfigError, one_line

# What `model.lora.target_modules=null` adapts, by the model's `config.model_type`: every
# projection of attention and MLP (module names as peft matches them, by suffix). The families are
# those the engines are tested on with these adapters (tests/privacy/engines/test_coverage.py).
LLAMA_LIKE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS: Mapping[str, tuple[str, ...]] = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),  # HF Conv1D: fan_in_fan_out
    **dict.fromkeys(("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "olmo2"), LLAMA_LIKE_TARGETS),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
}


@dataclass(frozen=True)
class LoraOptions:
    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None  # None: DEFAULT_TARGETS of the model's family
    train_embeddings: bool = False

    @classmethod
    def from_config(cls, model_cfg: Mapping) -> LoraOptions | None:
        """The `model.lora` options, or None for full fine-tuning (no section, or r=null)."""
        lora = model_cfg.get("lora") or {}
        if lora.get("r") is None:
            return None
        targets = lora.get("target_modules")
        return cls(
            r=int(lora["r"]),
            alpha=float(lora.get("alpha") or lora["r"]),
            dropout=float(lora.get("dropout") or 0.0),
            target_modules=None if targets is None else tuple(targets),
            train_embeddings=bool(lora.get("train_embeddings", False)),
        )


TARGETS_KEY = "model.lora.target_modules"
TARGETS_VALID = "null (the defaults of a known model family) or a list of the model's module names, e.g. [q_proj, v_proj]"


def default_targets(model: nn.Module) -> tuple[str, ...]:
    model_type = model.config.model_type
    if model_type not in DEFAULT_TARGETS:
        known = ", ".join(sorted(DEFAULT_TARGETS))
        raise ConfigError(TARGETS_KEY, None, f"no default target modules for a {model_type!r} model (defaults known for {known})", TARGETS_VALID)
    return DEFAULT_TARGETS[model_type]


def add_lora(model: nn.Module, options: LoraOptions, seed: int = 0) -> PeftModel:
    """`model` with LoRA adapters on its targeted projections; only the adapters (and, with
    `train_embeddings`, the token embedding and LM head) require gradients.

    A is initialized from `seed` (public randomness, like the random-init weights), B at zero,
    so the adapted model starts as the base model.
    """
    config = LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=list(options.target_modules or default_targets(model)),
        # GPT-2's projections are HF Conv1D, whose weight is stored (in, out).
        fan_in_fan_out=any(isinstance(module, Conv1D) for module in model.modules()),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft asks transformers a deprecated question (is_gradient_checkpointing): not ours to fix.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        torch.manual_seed(seed)
        try:
            adapted = get_peft_model(model, config)
        except ValueError as err:  # peft's "Target modules {...} not found in the base model"
            raise ConfigError(TARGETS_KEY, sorted(config.target_modules), one_line(str(err)), TARGETS_VALID) from err
    if options.train_embeddings:
        for module in (adapted.get_input_embeddings(), adapted.get_output_embeddings()):
            if module is not None:
                module.weight.requires_grad_(True)
    return adapted


def is_lora(model: nn.Module) -> bool:
    return isinstance(model, PeftModel)


def save_adapter(model: PeftModel, directory: Path) -> None:
    """The adapters (adapter_config.json, adapter_model.safetensors), and the token embedding and
    LM head when they were trained: what `PeftModel.from_pretrained(base, directory)` restores."""
    trained_embeddings = model.get_input_embeddings().weight.requires_grad
    # Explicit: peft's "auto" would look the base model's config up on the hub.
    model.save_pretrained(directory, save_embedding_layers=trained_embeddings)
