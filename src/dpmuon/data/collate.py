"""Padding encoded sequences into batch tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpmuon.data.encoding import IGNORE_INDEX, EncodedExample


def _padded(rows: Sequence[list[int]], width: int, fill: int, left: bool) -> torch.Tensor:
    padded = [[fill] * (width - len(row)) + row if left else row + [fill] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.long).reshape(len(rows), width)


def collate(batch: Sequence[EncodedExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a training batch into LongTensors of shape [B, T].

    Returns `input_ids` (padded with `pad_id`), `attention_mask` (0 on padding) and `labels`
    (IGNORE_INDEX on padding). An empty batch, which Poisson sampling can draw, gives [0, 0].
    """
    width = max((len(example.input_ids) for example in batch), default=0)
    input_ids = [example.input_ids for example in batch]
    return {
        "input_ids": _padded(input_ids, width, pad_id, left=False),
        "attention_mask": _padded([[1] * len(ids) for ids in input_ids], width, 0, left=False),
        "labels": _padded([example.labels for example in batch], width, IGNORE_INDEX, left=False),
    }


def collate_prompts(prompts: Sequence[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad generation prompts into `input_ids` and `attention_mask` of shape [B, T].

    Left padding puts every prompt's last token in the final column, where decoding continues.
    """
    width = max((len(prompt) for prompt in prompts), default=0)
    return {
        "input_ids": _padded(prompts, width, pad_id, left=True),
        "attention_mask": _padded([[1] * len(prompt) for prompt in prompts], width, 0, left=True),
    }
