"""Opacus per-example gradient samplers for Hugging Face layers Opacus does not know.

- Conv1D (GPT-2; y = x W + b, W stored (in, out)): without it Opacus falls back to functorch
  for every GPT-2 projection, which is slower and heavier.
- the HF RMSNorm classes (`norms.HF_RMS_NORMS`, `norms.HF_OFFSET_RMS_NORMS`): each architecture
  has its own class, and Opacus' sampler is registered for torch's `nn.RMSNorm` only; the others
  would fall back to functorch too.
- nn.Embedding, replacing Opacus' own, which scatters gradient into the `padding_idx` row that
  PyTorch leaves without one (OPT and Gemma pad with an id the data may contain); and Gemma's
  scaled embeddings (y = W[x] · s), whose buffer `embed_scale` Opacus' functorch path refuses.

Registered once on import.
"""

from __future__ import annotations

import torch
from opacus.grad_sample import register_grad_sampler
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding
from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding
from transformers.pytorch_utils import Conv1D

from .norms import HF_OFFSET_RMS_NORMS, HF_RMS_NORMS, rms_normalized


@register_grad_sampler(Conv1D)
def conv1d_grad_sample(layer: Conv1D, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    x = activations[0].to(backprops.dtype)
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = torch.einsum("n...i,n...j->nij", x, backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = torch.einsum("n...j->nj", backprops)
    return grads


@register_grad_sampler([nn.Embedding, GemmaTextScaledWordEmbedding, Gemma2TextScaledWordEmbedding])
def embedding_grad_sample(layer: nn.Embedding, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """Example i's gradient scatters its output gradients (× the scale of a scaled embedding)
    into the rows it looked up, except the padding row."""
    if not layer.weight.requires_grad:
        return {}
    ids = activations[0].reshape(backprops.shape[0], -1)
    b = backprops.reshape(ids.shape[0], -1, layer.embedding_dim)
    if hasattr(layer, "embed_scale"):
        b = b * layer.embed_scale.to(layer.weight.dtype).to(b.dtype)
    if layer.padding_idx is not None:
        b = b.masked_fill((ids == layer.padding_idx).unsqueeze(-1), 0)
    per_example = torch.zeros(ids.shape[0], *layer.weight.shape, dtype=b.dtype, device=b.device)
    per_example.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, layer.embedding_dim), b)
    return {layer.weight: per_example}


def rms_norm_grad_sample(layer: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """γ's per-example gradient Σ_t b_t ⊙ x̂_t (x̂: the normalized input)."""
    if not layer.weight.requires_grad:
        return {}
    features = layer.weight.numel()
    x = activations[0].reshape(backprops.shape[0], -1, features)
    b = backprops.reshape(backprops.shape[0], -1, features).float()
    per_example = (rms_normalized(layer, x) * b).sum(1)
    return {layer.weight: per_example.view(-1, *layer.weight.shape)}


def register_rms_norm_sampler(*module_types: type[nn.Module]) -> None:
    register_grad_sampler(list(module_types))(rms_norm_grad_sample)


register_rms_norm_sampler(*HF_RMS_NORMS, *HF_OFFSET_RMS_NORMS)
