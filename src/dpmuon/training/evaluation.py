"""Held-out evaluation: NLL per target token and decoding of test sources, and a run's own
(`validation_nll` during training, `evaluate` on the test set after it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import run_folder
from ..data import EncodedExample, collate, collate_prompts, encode_prompt
from ..data.encoding import IGNORE_INDEX
from ..durable import atomic_write
from ..eval.metrics import SCORE_KEYS, score
from ..models import next_token_labels, position_ids_for
from .run_parts import Training
from .runtime import log


@torch.no_grad()
def token_nll(
    model,
    examples: Sequence[EncodedExample],
    pad_id: int,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
    progress: bool = False,
    desc: str = "nll",
) -> float:
    """Σ token NLL / Σ supervised tokens: the NLL per target token over the whole set."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    for idx in tqdm(batches, desc=desc, disable=not progress, leave=False):
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in idx], pad_id).items()}
        with autocast():
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=position_ids_for(batch["attention_mask"]),
            ).logits
        labels = next_token_labels(batch["labels"])
        nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        total += float(nll)
        count += int((labels != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / count if count else float("nan")


@torch.no_grad()
def decode(
    model,
    tokenizer,
    sources: Sequence[str],
    cfg: Mapping,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
    progress: bool = False,
) -> list[str]:
    """Generate one output per source (beam search or greedy), in input order."""
    was_training = model.training
    model.eval()
    if cfg["decoding"] not in ("beam", "greedy"):
        raise ValueError(f"unknown decoding {cfg['decoding']!r}; valid: beam, greedy")
    num_beams = int(cfg["num_beams"]) if cfg["decoding"] == "beam" else 1
    max_new = int(cfg["max_new_tokens"])
    context = model.config.max_position_embeddings  # every family's name for it (GPT-2 maps n_positions)
    prompts = [fit_prompt(encode_prompt(tokenizer, s), context, max_new) for s in sources]
    # Similar lengths batched together: less padding; results are put back in input order.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[str] = [""] * len(prompts)
    batch_size = int(cfg["batch_size"])
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    for idx in tqdm(chunks, desc="decode", disable=not progress, leave=False):
        batch = {k: v.to(device) for k, v in collate_prompts([prompts[i] for i in idx], tokenizer.pad_token_id).items()}
        with autocast():
            generated = model.generate(
                **batch,
                do_sample=False,
                num_beams=num_beams,
                early_stopping=num_beams > 1,
                # Positions are finite: a long prompt leaves room for fewer new tokens.
                max_new_tokens=min(max_new, context - batch["input_ids"].shape[1]),
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        new_tokens = generated[:, batch["input_ids"].shape[1] :]
        for i, row in zip(idx, new_tokens.tolist()):
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            outputs[i] = tokenizer.decode(row, skip_special_tokens=True).strip()
    model.train(was_training)
    return outputs


MIN_NEW_TOKENS = 16


def fit_prompt(prompt: list[int], context: int, max_new_tokens: int) -> list[int]:
    """The prompt, left-truncated if needed so that at least min(16, max_new_tokens) tokens fit.

    Only small models (few positions) ever truncate: GPT-2's 1024 positions hold every E2E and
    DART prompt. The source's end and the separator eos are kept.
    """
    room = context - min(MIN_NEW_TOKENS, max_new_tokens)
    return prompt if len(prompt) <= room else prompt[len(prompt) - room :]


def validation_nll(t: Training) -> float:
    batch = int(t.cfg.eval.batch_size) * 4
    return token_nll(t.model, t.data.valid, t.tokenizer.pad_token_id, batch, t.device, t.autocast, t.progress, "valid nll")


def evaluate(t: Training) -> tuple[float | None, dict]:
    """Test NLL and decoding (skipped when eval.test=false: the test set stays unseen)."""
    cfg, pad_id = t.cfg, t.tokenizer.pad_token_id
    if not cfg.eval.test:
        return None, dict.fromkeys(SCORE_KEYS)
    log("evaluating on the test set")
    test_nll = token_nll(t.model, t.data.test, pad_id, int(cfg.eval.batch_size) * 4, t.device, t.autocast, t.progress, "test nll")
    generations = decode(t.model, t.tokenizer, [item.source for item in t.data.test_items], cfg.eval, t.device, t.autocast, t.progress)
    atomic_write(t.run_dir / run_folder.GENERATIONS, lambda f: f.write("".join(g.replace("\n", " ") + "\n" for g in generations).encode()))
    return test_nll, score(generations, [item.references for item in t.data.test_items])
