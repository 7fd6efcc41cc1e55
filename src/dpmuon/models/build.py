"""Model construction: the model a config names (`build_model`, sized to the tokenizer, which
carries a pad token) — a hub / local checkpoint of any causal LM, or a random-init GPT-2 or
Llama-family architecture — with LoRA adapters when `model.lora.r` is set."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from ..hub import local_files_only
from .architectures import Shape, architecture, config_context_length, dropout_overrides
from .lora import LoraOptions, add_lora


def build_random_lm(
    arch: str,
    shape: Shape,
    tie_embeddings: bool = True,
    dropout: float = 0.0,
    seed: int = 0,
    eos_token_id: int | None = None,
) -> nn.Module:
    """A randomly initialized causal LM of the `arch` family (the offline stand-in for pretrained weights)."""
    eos = shape.vocab_size - 1 if eos_token_id is None else eos_token_id
    config = architecture(arch).random_config(shape, dropout, eos, tie_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def load_pretrained(name_or_path: str, dropout: float | None = None) -> nn.Module:
    """A causal LM from a hub id or a local directory; `dropout` sets the family's own dropout keys.
    With the hub unreachable, a hub id is looked up in the local cache only (see dpmuon/hub.py)."""
    offline = local_files_only(name_or_path)
    config = AutoConfig.from_pretrained(name_or_path, local_files_only=offline)
    return AutoModelForCausalLM.from_pretrained(name_or_path, local_files_only=offline, **dropout_overrides(config, dropout))


def untie_lm_head(model: nn.Module) -> None:
    """Give the LM head its own copy of the token embedding (a separate block and parameter)."""
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    if head is None or head.weight is not embedding.weight:
        return
    head.weight = nn.Parameter(embedding.weight.detach().clone())
    model.config.tie_word_embeddings = False


def lm_head_is_tied(model: nn.Module) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def weights_fingerprint(model: nn.Module, frozen_only: bool = False) -> str:
    """SHA-256 of every parameter's (frozen_only: every frozen one's) name, dtype, shape and
    bytes: which weights a run started from.

    A tied tensor counts once (named_parameters deduplicates it), so a model saved with
    `save_pretrained` and loaded again has the fingerprint it had when it was saved.
    """
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if frozen_only and param.requires_grad:
            continue
        tensor = param.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
    lora = LoraOptions.from_config(cfg)
    return model if lora is None else add_lora(model, lora, seed=seed)


def context_length(cfg: Mapping) -> int:
    """Positions the configured model can attend over (without loading its weights).

    A checkpoint's from its config's standard keys (`architectures.config_context_length`).
    """
    if cfg.get("name_or_path"):
        return config_context_length(AutoConfig.from_pretrained(cfg["name_or_path"], local_files_only=local_files_only(cfg["name_or_path"])))
    return int(cfg["n_positions"])
