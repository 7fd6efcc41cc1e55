"""The causal-LM pieces the privatizer needs: per-example losses and the hidden matrices."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..data.encoding import IGNORE_INDEX  # labels the loss skips: the data layer marks them


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Batch-shaped, contiguous position ids that skip left padding.

    GPT-2 otherwise builds ids of shape [1, T]; per-example gradients of the position embedding
    need one row per example. Llama-family models take them for their rotary embedding, so a
    left-padded example is rotated exactly as unpadded.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0).contiguous()


def per_example_lm_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """[B] mean next-token NLL over each example's supervised (label ≠ -100) tokens.

    Per-example rather than per-lot mean so that example i's gradient is ∇ℓ_i — the object
    the privatizer clips. Examples without supervised tokens get loss 0.
    """
    attention_mask = batch["attention_mask"]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=attention_mask,
        position_ids=position_ids_for(attention_mask),
    ).logits
    labels = next_token_labels(batch["labels"])
    token_nll = TokenNLL.apply(logits.flatten(0, 1).float(), labels.flatten()).view(labels.shape)
    counts = (labels != IGNORE_INDEX).sum(1)
    return token_nll.sum(1) / counts.clamp_min(1)


class TokenNLL(torch.autograd.Function):
    """[N] −log softmax(logits)[label] of fp32 logits [N, vocab], 0 where the label is IGNORE_INDEX:
    F.cross_entropy's values to float rounding, with one exponential per logit instead of two.

    The forward keeps e = exp(logits − max) and its row sums s, and the backward is then a single
    product, w·e/s − w·onehot. F.cross_entropy writes log-probabilities, and its backward zero-fills
    a [N, vocab] gradient of them, scatters the weights into it and exponentiates the saved
    log-probabilities again. At a 50k vocabulary, dropping that made a tiny-model step 6–9% faster
    (docs/performance.md, "The loss: one exponential per logit"). An ignored position's
    gradient row is exactly 0 (finite e times w = 0), which the engines' skipping of inactive
    positions relies on."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        peak = logits.amax(dim=1, keepdim=True)
        shifted = torch.sub(logits, peak).exp_()
        sums = shifted.sum(1)
        supervised = labels != IGNORE_INDEX
        index = labels.clamp_min(0).unsqueeze(1)  # any valid column where ignored: masked below
        ctx.save_for_backward(shifted, sums, index, supervised)
        return (peak.squeeze(1) + sums.log() - logits.gather(1, index).squeeze(1)).masked_fill_(~supervised, 0)

    @staticmethod
    def backward(ctx, grad_nll: torch.Tensor) -> tuple[torch.Tensor, None]:
        shifted, sums, index, supervised = ctx.saved_tensors
        weight = grad_nll.masked_fill(~supervised, 0).unsqueeze(1)
        grad = torch.mul(shifted, weight / sums.unsqueeze(1))
        return grad.scatter_add_(1, index, -weight), None


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] the label each position predicts: the next one's, and none (IGNORE_INDEX) at the last.

    The labels are shifted rather than the logits: slicing off the last position's logits copies
    a [B, T, vocab] tensor, and its backward zero-fills and copies another — at a 50k vocabulary
    the largest memory traffic of a step. The gradients are the same bit for bit."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def hidden_matrices(model: nn.Module) -> dict[str, str]:
    """Trainable weight matrices of the Linear / Conv1D layers inside the network body.

    GPT-2: c_attn, c_proj, c_fc, mlp.c_proj; Llama / Qwen2 / SmolLM: q/k/v/o_proj and
    gate/up/down_proj. Excludes the input and output embeddings (token embedding, LM head),
    tied or not. Values give the storage layout: nn.Linear stores (out, in), HF Conv1D (in, out).
    """
    excluded = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None:
            excluded.add(id(module.weight))
    found = {}
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)) and module.weight.requires_grad and id(module.weight) not in excluded:
            prefix = f"{module_name}." if module_name else ""
            found[f"{prefix}weight"] = "in_out" if isinstance(module, Conv1D) else "out_in"
    return found
