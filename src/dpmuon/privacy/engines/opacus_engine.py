"""Per-example gradients by Opacus hooks (GradSampleModule), then per-block clipping.

Materializes every example's full gradient — simple, and the reference the fast engine is
tested against, but memory grows with micro-batch × model size.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from opacus import GradSampleModule
from opacus.utils.module_utils import has_trainable_params
from torch import nn

from ..clipping import ClipStats, clip_factors, mark_nonfinite_losses, per_example_block_norms
from . import opacus_samplers  # noqa: F401  (registers the Conv1D and HF RMSNorm grad samplers)
from .base import PerExampleEngine, example_losses, example_rows, full_precision, ieee_fp32_matmuls, register_engine


def functorch_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules Opacus gives its functorch fallback: those holding trainable parameters with no
    grad sampler for their exact type (their children's parameters go along with them, as in
    Opacus' own walk)."""
    found = []

    def walk(name: str, module: nn.Module) -> None:
        if has_trainable_params(module) and type(module) not in GradSampleModule.GRAD_SAMPLERS:
            found.append((name, module))
            return
        for child_name, child in module.named_children():
            walk(f"{name}.{child_name}" if name else child_name, child)

    walk("", model)
    return found


def _one_tensor_argument(name: str, recording: Callable[[], bool]):
    """Forward hook: Opacus' functorch replays a module from its first positional argument alone
    and differentiates its output as one tensor; refuse a call it would replay wrongly (while
    Opacus records: evaluation and decoding may call the module as they like)."""

    def check(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if recording() and (len(args) != 1 or kwargs or not isinstance(output, torch.Tensor)):
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) has no Opacus grad sampler, and its call (arguments: "
                f"{len(args)} positional, keywords {sorted(kwargs)}; output {type(output).__name__}) is not one Opacus' "
                "functorch fallback replays exactly (one tensor in, one tensor out); use privacy.engine=fast"
            )

    return check


@register_engine("opacus")
class OpacusEngine(PerExampleEngine):
    forms_row_gradients = True

    def __init__(self, model, partition, constant_time: bool = False, fallback: str = "generic"):
        super().__init__(model, partition, constant_time)  # it forms every row's gradient: constant work already
        outside = [n for n, p in model.named_parameters() if p.requires_grad and n not in self.params]
        if outside:
            raise ValueError(f"trainable parameters outside the block partition: {outside[:5]}")
        unsupported = functorch_modules(model)
        if unsupported and fallback != "generic":
            name, module = unsupported[0]
            raise ValueError(
                f"module {name!r} of type {type(module).__name__} ({type(module).__module__}) has no Opacus grad sampler "
                "and privacy.engine_fallback=error; register one (opacus.grad_sample.register_grad_sampler), freeze its "
                "parameters, or set privacy.engine_fallback=generic (Opacus' functorch per-example gradients)"
            )
        for name, module in unsupported:
            if list(module.buffers()):
                raise ValueError(
                    f"module {name!r} ({type(module).__name__}) has no Opacus grad sampler and has buffers, "
                    "which Opacus' functorch fallback refuses; use privacy.engine=fast"
                )
        # Not strict: strict refuses every trainable module with a buffer, even one with a grad
        # sampler that uses it as a constant (Gemma's embedding scale); the fallback modules were
        # checked above instead.
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=False)
        self.gsm.disable_hooks()
        self._checks = [m.register_forward_hook(_one_tensor_argument(name, self._recording), with_kwargs=True, prepend=True) for name, m in unsupported]
        if unsupported:
            covered = sum(p.numel() for _, m in unsupported for p in m.parameters() if p.requires_grad)
            share = covered / max(1, sum(p.numel() for p in self.params.values()))
            modules = ", ".join(f"{n} ({type(m).__name__})" for n, m in unsupported)
            self.fallback_summary = f"engine fallback (Opacus functorch) for {len(unsupported)} modules, {share:.2%} of trainable parameters: {modules}"

    def _recording(self) -> bool:
        return self.gsm.hooks_enabled

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
            if gs is not None and gs.shape[0] != losses.shape[0]:
                self.gsm.zero_grad(set_to_none=True)
                raise ValueError(
                    f"Opacus formed {gs.shape[0]} per-sample gradients of {name!r} for a micro-batch of {losses.shape[0]} "
                    "examples: its module sees rows that are not examples (OPT's MLP sees token rows [B·T, d]); use privacy.engine=fast"
                )
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
        # einsum is a batched matmul, which autocast (or a TF32 / bf16 fp32 setting) would round coarsely
        with full_precision(losses.device), ieee_fp32_matmuls():
            for name, g in grads.items():
                g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)  # 0·NaN would be NaN
                summed[name] = torch.einsum("b,b...->...", factors[:, self.block_of[name]], g)
        return summed, example_losses(losses, examples), ClipStats.from_norms(norms, self.thresholds, examples)

    def close(self):
        for handle in self._checks:
            handle.remove()
        self.gsm._close()
