"""Decoding: one output per source in input order, and long prompts that fill the context."""

from __future__ import annotations

import contextlib

import torch
from conftest import random_gpt2
from helpers_tokenizers import CharTokenizer

from dpmuon.training.evaluation import decode, fit_prompt


def test_fit_prompt_keeps_room_for_new_tokens():
    assert fit_prompt(list(range(10)), context=64, max_new_tokens=100) == list(range(10))
    assert fit_prompt(list(range(60)), context=64, max_new_tokens=100) == list(range(12, 60))  # 48 + 16 = 64
    assert fit_prompt(list(range(60)), context=64, max_new_tokens=4) == list(range(60))


def test_decode_handles_prompts_near_and_beyond_the_context():
    model = random_gpt2(vocab_size=258, n_layer=1, n_embd=16, n_head=2, n_positions=40, eos_token_id=256, seed=1)
    sources = ["short", "x" * 30, "y" * 80, "mid length"]
    cfg = {"decoding": "beam", "num_beams": 2, "max_new_tokens": 30, "batch_size": 2}
    out = decode(model, CharTokenizer(), sources, cfg, torch.device("cpu"), contextlib.nullcontext)
    assert len(out) == 4 and all(isinstance(o, str) for o in out)
    # Greedy decoding is deterministic and order-preserving: the same source gives the same output
    # wherever it sits in the batch order.
    greedy = {**cfg, "decoding": "greedy"}
    a = decode(model, CharTokenizer(), ["short", "mid length"], greedy, torch.device("cpu"), contextlib.nullcontext)
    b = decode(model, CharTokenizer(), ["mid length", "short"], greedy, torch.device("cpu"), contextlib.nullcontext)
    assert a == b[::-1]
