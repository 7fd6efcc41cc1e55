"""Per-example gradients by Opacus hooks (GradSampleModule), then per-block clipping.

Materializes every example's full gradient — simple, and the reference the fast engine is
tested against, but memory grows with micro-batch × model size.
"""

from __future__ import annotations

import warnings

import torch
from opacus import GradSampleModule

from ..clipping import ClipStats, clip_factors, mark_nonfinite_losses, per_example_block_norms
from . import opacus_samplers  # noqa: F401  (registers the Conv1D and HF RMSNorm grad samplers)
from .base import PerExampleEngine, example_rows, full_precision, register_engine


@register_engine("opacus")
class OpacusEngine(PerExampleEngine):
    def __init__(self, model, partition, constant_time: bool = False):
        super().__init__(model, partition, constant_time)  # it forms every row's gradient: constant work already
        outside = [n for n, p in model.named_parameters() if p.requires_grad and n not in self.params]
        if outside:
            raise ValueError(f"trainable parameters outside the block partition: {outside[:5]}")
        # strict: refuse modules without a grad sampler instead of silently using functorch.
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
        self.gsm.disable_hooks()

    def per_example_gradients(self, batch, loss_fn) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({name: [B, *shape] fp32 per-example gradients}, per-example losses [B])."""
        self.gsm.enable_hooks()
        try:
            losses = loss_fn(self.model, batch)
            with warnings.catch_warnings(), full_precision(losses.device):
                # Opacus' full backward hook on the embedding (integer inputs) warns every step.
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                losses.sum().backward()
        finally:
            self.gsm.disable_hooks()
        grads = {}
        for name, p in self.params.items():
            gs = p.grad_sample
            grads[name] = torch.zeros((losses.shape[0], *p.shape), device=p.device) if gs is None else gs.float()
        self.gsm.zero_grad(set_to_none=True)  # drop the non-private summed p.grad too
        return grads, losses.detach()

    def clipped_sum(self, batch, loss_fn):
        grads, losses = self.per_example_gradients(batch, loss_fn)
        examples = example_rows(batch, losses.shape[0], losses.device)
        squared = {n: g.flatten(1).pow(2).sum(1) for n, g in grads.items()}
        norms = mark_nonfinite_losses(per_example_block_norms(self.partition, squared), losses)
        factors = clip_factors(norms, self.thresholds).masked_fill(~examples.unsqueeze(1), 0).float()
        summed = {}
        with full_precision(losses.device):  # einsum is a batched matmul, which autocast would cast
            for name, g in grads.items():
                g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)  # 0·NaN would be NaN
                summed[name] = torch.einsum("b,b...->...", factors[:, self.block_of[name]], g)
        return summed, losses[examples], ClipStats.from_norms(norms[examples], self.thresholds)

    def close(self):
        self.gsm._close()
