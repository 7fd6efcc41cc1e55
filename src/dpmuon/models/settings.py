"""A model's options (the `_target_` of conf/model/<name>.yaml), declared once: a pretrained
checkpoint (hub id or local directory) or a random-init shape, and LoRA adapters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..settings import Settings, option, settings

ARCHITECTURE_NAMES = ("gpt2", "llama", "qwen2")  # models.architectures.ARCHITECTURES (a test ties them)


@dataclass(kw_only=True)
class LoraSettings:
    r: int | None = option(None, "LoRA rank: train adapters on the frozen model (null: full fine-tuning)", ge=1)
    alpha: float | None = option(16.0, "LoRA: adapters add (alpha / r) · B A x (null: alpha = r)", gt=0)
    dropout: float = option(0.0, "LoRA: dropout probability on the adapters' input (public randomness)", ge=0, lt=1)
    target_modules: list | None = option(None, "LoRA: module names to adapt (null: every attention and MLP projection, for gpt2, Llama-like, Gemma, Phi-3, OPT and GPT-NeoX models)")
    train_embeddings: bool = option(False, "LoRA: also train the token embedding and LM head (position embeddings, norms stay frozen)")


@settings("model")
@dataclass(kw_only=True)
class ModelSettings(Settings):
    name: str = option(help="model label in summaries and tables")
    name_or_path: str | None = option(None, "pretrained weights: hub id or local directory (null: random init)", kind="model_source")
    # The GPT-2 tokenizer ($DPMUON_TOKENIZER where set: a local copy); a hub model sets its own.
    tokenizer: str = option("${oc.env:DPMUON_TOKENIZER,gpt2}", "tokenizer: hub id or local directory (default: $DPMUON_TOKENIZER, else gpt2)", kind="model_source")
    # The first K merges of GPT-2's BPE (vocabulary 256 + K + eos): lossless, chosen without
    # looking at any data, and a much smaller embedding/softmax for CPU work.
    bpe_merges: int | None = option(None, "keep the first K merges of GPT-2's BPE (null: all)", ge=1)
    n_layer: int = option(4, "transformer layers (random init)", ge=1)
    n_embd: int = option(128, "embedding width (random init); a multiple of n_head", ge=1)
    n_head: int = option(4, "attention heads (random init)", ge=1)
    n_positions: int = option(256, "context length (random init)", ge=1)
    architecture: str | None = option(None, "random-init architecture family (null: gpt2)", choices=ARCHITECTURE_NAMES)
    n_kv_head: int | None = option(None, "key/value heads, dividing n_head (random-init llama/qwen2: grouped-query attention; null: n_head)", ge=1)
    intermediate_size: int | None = option(None, "MLP width (random init; null: 4 × n_embd)", ge=1)
    # Both engines clip a tied LM head exactly (the token embedding's one gradient sums both
    # uses); untie to give the head its own block and parameter, as earlier DP work on these sets did.
    untie_head: bool = option(False, "give the LM head its own parameter instead of the token embedding")
    dropout: float | None = option(0.0, "dropout probability (public randomness; null: a pretrained checkpoint's own)", ge=0, lt=1)
    lora: LoraSettings = option(factory=LoraSettings, help="LoRA adapters (peft)")

    def build(self, tokenizer, seed: int = 0):
        """The model (LoRA-wrapped where lora.r is set), its random init drawn from `seed`."""
        from .build import build_model

        return build_model(dataclasses.asdict(self), tokenizer, seed=seed)

    def context_length(self) -> int:
        from .build import context_length

        return context_length(dataclasses.asdict(self))
