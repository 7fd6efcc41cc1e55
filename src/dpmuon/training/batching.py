"""Splitting a lot into the physical micro-batches the privatizer consumes.

Dynamic shapes (the default) sort the lot by length and pad each micro-batch only to its own
longest sequence: the least padding, the least compute.

Fixed shapes exist for private runs under bf16 autocast. There the model's kernels round
differently for different tensor shapes, so with dynamic shapes adding one example to a lot
re-pads and regroups the others and changes *their* clipped contributions (by ~1% of C on CPU
bf16) — the released sum of neighbouring lots then differs by more than the sensitivity the
noise is calibrated for. With every micro-batch of the same width and the same number of rows,
each example's forward and backward see the same shapes whatever else is in the lot, and the
per-row kernels give it the same contribution bit for bit. Rows that only fill a micro-batch
up are marked False in `EXAMPLE_MASK`: no supervised labels (zero gradient), and the engines
give them factor 0 and leave them out of every count.

Constant-time lots (privacy.constant_time) go one step further: `pad_to` fills the lot up with
such rows to a fixed row count, so every step runs the same number of same-shaped micro-batches
whatever the lot's size, and its duration says nothing about it. Bucketed by width
(privacy.width_buckets, privacy/lot_bound.py), the rows come in a few fixed widths instead of
all at max_length: `bucketed_micro_batches` places the lot's examples in them, longest first,
and each width's rows run in equal micro-batches of at most the token count of a full-width one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from omegaconf import DictConfig

from ..data import EncodedExample, collate
from ..data.encoding import IGNORE_INDEX
from ..errors import UserError
from ..privacy.engines.base import EXAMPLE_MASK
from ..privacy.lot_bound import Buckets, bucket_micro_batches, micro_batch_members
from .runtime import log


def lot_micro_batches(
    examples: Sequence[EncodedExample],
    lot: Sequence[int],
    micro_batch_size: int,
    pad_id: int,
    *,
    fixed_width: int | None = None,
    fixed_rows: bool = False,
    pad_to: int | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the lot's examples (indices into `examples`) as collated CPU micro-batches.

    Examples are sorted by length first (similar lengths together means less padding; the sum
    over the lot is order-free). fixed_width: right-pad every micro-batch to this many tokens
    (the dataset's max_length or the model's context); an example longer than it is an error.
    fixed_rows: give every micro-batch `micro_batch_size` rows, the last one filled up with
    label-free rows, and add the `EXAMPLE_MASK` key ([B] bool, True on the lot's examples).
    An empty lot yields nothing. pad_to (with fixed_rows): fill the lot up to this many rows,
    i.e. always yield ⌈pad_to / micro_batch_size⌉ micro-batches; a larger lot is an error.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if pad_to is not None and not fixed_rows:
        raise ValueError("pad_to needs fixed_rows: filler rows are told apart by the example mask")
    if pad_to is not None and len(lot) > pad_to:
        raise ValueError(f"a lot of {len(lot)} examples exceeds the constant-time bound of {pad_to} rows")
    ordered = sorted(lot, key=lambda i: len(examples[i].input_ids))
    longest = len(examples[ordered[-1]].input_ids) if ordered else 0
    if fixed_width is not None and longest > fixed_width:
        raise ValueError(f"an example of {longest} tokens does not fit the fixed width of {fixed_width}")
    rows = len(ordered) if pad_to is None else pad_to
    for start in range(0, rows, micro_batch_size):
        chosen = [examples[i] for i in ordered[start : start + micro_batch_size]]
        filler = micro_batch_size - len(chosen) if fixed_rows else 0
        batch = collate(chosen + [_filler_row(pad_id)] * filler, pad_id)
        if fixed_width is not None:
            batch = _right_pad(batch, fixed_width, pad_id)
        if fixed_rows:
            batch[EXAMPLE_MASK] = torch.arange(micro_batch_size) < len(chosen)
        yield batch


def bucketed_micro_batches(
    examples: Sequence[EncodedExample], lot: Sequence[int], buckets: Buckets, tokens: int, pad_id: int, max_rows: int | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The lot's examples in the fixed shapes of `buckets` ((width, rows), widest first): each
    width's rows in equal micro-batches of at most `tokens` tokens and `max_rows` rows
    (privacy/lot_bound.py `bucket_micro_batches`), filled up with label-free rows and carrying
    `EXAMPLE_MASK`. The same micro-batches whatever the lot; an example that fits no row left (the
    charged bad event) is left out."""
    shapes = bucket_micro_batches(buckets, tokens, max_rows)
    for width, rows, members in micro_batch_members([len(examples[i].input_ids) for i in lot], shapes):
        chosen = [examples[lot[j]] for j in members]
        batch = _right_pad(collate(chosen + [_filler_row(pad_id)] * (rows - len(chosen)), pad_id), width, pad_id)
        batch[EXAMPLE_MASK] = torch.arange(rows) < len(chosen)
        yield batch


def rank_share(buckets: Buckets, world: int) -> Buckets:
    """One rank's buckets when a lot, longest first, is dealt out over `world` ranks in turn: the
    slots at least as wide as each width are ⌈(the lot's) / world⌉, so if the lot fits the buckets
    every rank's share fits its own (rank 0 holds the most)."""
    share, wider, slots = [], 0, 0
    for width, rows in buckets:
        slots += rows
        mine = -(-slots // world)
        if mine > wider:
            share.append((width, mine - wider))
        wider = mine
    return tuple(share)


def _filler_row(pad_id: int) -> EncodedExample:
    # One attended token rather than an all-zero attention mask, whose softmax over no keys
    # attention implementations treat differently; with every label ignored its loss is 0 and
    # its gradient exactly 0.
    return EncodedExample(input_ids=[pad_id], labels=[IGNORE_INDEX])


def _right_pad(batch: dict[str, torch.Tensor], width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Widen collate's right-padded batch to `width` columns with the same fill values."""
    fills = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}
    out = {}
    for key, tensor in batch.items():
        extra = width - tensor.shape[1]
        out[key] = torch.nn.functional.pad(tensor, (0, extra), value=fills[key]) if extra else tensor
    return out


def fixed_batch_shape(cfg: DictConfig, precision: str) -> bool:
    """trainer.fixed_batch_shape: auto means on exactly when the forward runs in bf16 (off there:
    warned, and refused where privacy.secure_noise=true promises an exact mechanism)."""
    setting = cfg.trainer.get("fixed_batch_shape", "auto")
    fixed = precision == "bf16" if setting == "auto" else bool(setting)
    if precision == "bf16" and not fixed:
        inexact = "under bf16 the rest of the lot moves each clipped contribution by up to ~0.7% of C, so the sensitivity bound is not exact"
        if cfg.privacy.get("secure_noise", False):
            raise UserError(f"trainer.fixed_batch_shape=false: {inexact}; valid with privacy.secure_noise=true: auto or true")
        log(f"warning: trainer.fixed_batch_shape=false: {inexact}")
    return fixed
