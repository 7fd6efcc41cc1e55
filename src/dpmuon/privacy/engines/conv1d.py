"""Opacus per-example gradient sampler for Hugging Face's Conv1D (y = x W + b, W stored (in, out)).

Without it Opacus falls back to functorch for every GPT-2 projection, which is slower and
heavier; registering it once on import is enough.
"""

from __future__ import annotations

import torch
from opacus.grad_sample import register_grad_sampler
from transformers.pytorch_utils import Conv1D


@register_grad_sampler(Conv1D)
def conv1d_grad_sample(layer: Conv1D, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    x = activations[0].to(backprops.dtype)
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = torch.einsum("n...i,n...j->nij", x, backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = torch.einsum("n...j->nj", backprops)
    return grads
