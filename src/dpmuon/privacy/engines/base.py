"""What a per-example gradient engine does: Σ_i clip(g_i) for one micro-batch, block by block.

Engines differ only in how they get per-example block norms and the clipped sum (Opacus
instantiates per-example gradients; the fast engine never does). The privatizer owns
everything else — thresholds, noise, accounting — so every engine yields the same mechanism.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from ..blocks import BlockPartition
from ..clipping import ClipStats
from ..settings import default

# loss_fn(model, batch) → per-example losses, shape [B]; the gradient of example i's loss is g_i.
PerExampleLoss = Callable[[nn.Module, Mapping[str, Any]], torch.Tensor]

# Optional batch key: [B] bool, False on rows that only fill a micro-batch up to a fixed shape
# (see training/batching.py). Engines give those rows factor 0 and count neither their losses
# nor their norms, so a filled-up micro-batch releases and reports exactly what its examples do.
EXAMPLE_MASK = "example_mask"

# Elements per add of an fp32 sum into a float64 lot total on the CPU: one mixed-dtype add over a
# whole matrix took 2.5× as long as adds over pieces of this size, with the same values
# (scripts/bench_lot_total.py, GPT-2 small's shapes, 2 threads: 0.27 s against 0.11 s a micro-batch).
LOT_TOTAL_PIECE = 1 << 20


def example_rows(batch: Mapping[str, Any], size: int, device: torch.device) -> torch.Tensor:
    """[B] bool: which rows of the micro-batch are examples of the lot (all, without EXAMPLE_MASK)."""
    mask = batch.get(EXAMPLE_MASK)
    if mask is None:
        return torch.ones(size, dtype=torch.bool, device=device)
    if mask.dtype != torch.bool or tuple(mask.shape) != (size,):
        raise ValueError(f"{EXAMPLE_MASK} must be a bool tensor of shape ({size},), got {mask.dtype} {tuple(mask.shape)}")
    return mask.to(device)


def example_losses(losses: torch.Tensor, examples: torch.Tensor) -> torch.Tensor:
    """[B] the rows' losses, NaN on the rows that only fill the micro-batch up (a mask, not a
    selection: the same shape whatever the lot holds)."""
    return losses.detach().masked_fill(~examples, float("nan"))


def add_to_lot_total(total: dict[str, torch.Tensor], part: Mapping[str, torch.Tensor]) -> None:
    """Add clipped sums (fp32) into the lot's float64 totals, name by name.

    Always float64, whatever the lot: an fp32 total would round by up to 2⁻²⁴ per addition times
    the examples summed so far, and a switch to float64 once that grows would make the step's
    time depend on the lot's size — a timing channel constant-time lots exist to close.
    """
    for name, tensor in part.items():
        if name not in total:
            total[name] = tensor.double()
        elif total[name].device.type == "cpu" and total[name].is_contiguous():
            into, added = total[name].view(-1), tensor.reshape(-1)
            for start in range(0, into.numel(), LOT_TOTAL_PIECE):
                into[start : start + LOT_TOTAL_PIECE] += added[start : start + LOT_TOTAL_PIECE]
        else:
            total[name] += tensor


def full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Backward, norms and sums outside autocast, even when the caller runs the whole release
    under it: autocast would recast the backward's and the engine's own matrix products —
    among them the sum over examples, whose rounding then grows with the lot — to bf16. Only
    the loss function's forward is the caller's to cast."""
    return torch.autocast(device_type=device.type, enabled=False)


@contextlib.contextmanager
def ieee_fp32_matmuls() -> Iterator[None]:
    """fp32 matrix products at IEEE precision inside the block, the caller's choice again after it.

    `torch.set_float32_matmul_precision("high" / "medium")` — a line many training scripts start
    with — lets fp32 products round their inputs to TF32 or bf16 (10 or 8 bits: on a CPU with
    bf16 units as on a GPU). The clip margin covers fp32 rounding only: with bf16 products, the
    fast engine's book-keeping sum of a cancelling example came out 1.5× C_W, its norm being exact
    (tests/privacy/test_sensitivity_fp.py). The engines' norms and clipped sums run inside this;
    the user's forward and backward keep their setting. Per backend, with the API that reads and
    restores each setting exactly, whichever API the caller set it with."""
    backends = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = [backend.fp32_precision for backend in backends]
    try:
        for backend in backends:
            backend.fp32_precision = "ieee"
        yield
    finally:
        for backend, value in zip(backends, saved):
            backend.fp32_precision = value


class PerExampleEngine(ABC):
    # One line for the run log naming the modules whose per-example gradients are formed by the
    # engine's fallback (privacy.engine_fallback=generic) and their share of the parameters; None: none.
    fallback_summary: str | None = None
    # Whether a micro-batch's memory grows with its rows, not only its tokens: the engine forms each
    # row's gradient (Opacus; the fast engine's generic fallback). Rows in narrow widths are then
    # capped at micro_batch_size (privacy/lot_bound.py bucket_micro_batches).
    forms_row_gradients: bool = False

    def __init__(self, model: nn.Module, partition: BlockPartition, constant_time: bool = False):
        self.model = model
        self.partition = partition
        # Constant-time lots: the work may not depend on which rows are real and which are padding.
        self.constant_time = constant_time
        named = dict(model.named_parameters())
        unknown = [n for n in partition.param_names if n not in named]
        if unknown:
            raise ValueError(f"partition names parameters the model does not have: {unknown[:5]}")
        self.params: dict[str, nn.Parameter] = {n: named[n] for n in partition.param_names}
        self.block_of = partition.block_index()
        self.thresholds = partition.thresholds

    @abstractmethod
    def clipped_sum(self, batch: Mapping[str, Any], loss_fn: PerExampleLoss) -> tuple[dict[str, torch.Tensor], torch.Tensor, ClipStats]:
        """Return (Σ_i c_i,W g_i,W per parameter name in fp32, every row's loss, stats).

        Only the rows `example_rows` marks count: the others contribute nothing, their losses are
        NaN (`example_losses`) and the stats leave them out. Must leave no per-example or
        non-private gradient behind on the parameters.
        """

    def add_clipped_sum(self, batch: Mapping[str, Any], loss_fn: PerExampleLoss, total: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ClipStats]:
        """`clipped_sum`, its sums added into the lot's float64 totals (`add_to_lot_total`); returns
        (losses, stats). An engine may add each parameter's sum as soon as it is complete, so that
        the micro-batch's fp32 sums never exist all at once."""
        summed, losses, stats = self.clipped_sum(batch, loss_fn)
        with record_function("dpmuon.lot_total"):
            add_to_lot_total(total, summed)
        return losses, stats

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Remove hooks and buffers from the model."""


ENGINES: dict[str, type[PerExampleEngine]] = {}


def register_engine(name: str):
    def decorator(cls: type[PerExampleEngine]) -> type[PerExampleEngine]:
        ENGINES[name] = cls
        return cls

    return decorator


def build_engine(
    name: str, model: nn.Module, partition: BlockPartition, constant_time: bool = False, fallback: str = default("engine_fallback")
) -> PerExampleEngine:
    """fallback (privacy.engine_fallback): for a trainable module no rule of the engine knows,
    "generic" forms its per-example gradients by torch.func; "error" refuses the model."""
    if name not in ENGINES:
        raise ValueError(f"unknown per-example gradient engine {name!r}; valid: {', '.join(sorted(ENGINES))}")
    return ENGINES[name](model, partition, constant_time=constant_time, fallback=fallback)
