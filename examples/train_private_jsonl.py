"""Train a small causal LM privately on your own JSONL file, with your own training loop.

    python examples/train_private_jsonl.py                       # examples/data/restaurants.jsonl, a few steps
    python examples/train_private_jsonl.py --data my.jsonl --source-key question --target-key answer --steps 50

Each line of the file is one private example {"source": …, "target": …}; the model learns to
continue "source => " with the target (the loss covers the target only). Runs offline: a tiny
random GPT-2 and a byte-level tokenizer (public: nothing of it comes from the data), or the
tokenizer in $DPMUON_TOKENIZER (a local Hugging Face tokenizer folder). The data in
examples/data/restaurants.jsonl is synthetic.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import dpmuon
from dpmuon.models import IGNORE_INDEX, Shape, build_random_lm, per_example_lm_loss

HERE = Path(__file__).resolve().parent
SEPARATOR = " => "
MAX_TOKENS = 256  # longer examples are left out; every micro-batch is this wide (public: not taken from the data)


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus end-of-text and padding: a vocabulary that owes nothing to the data."""

    eos_token_id, pad_token_id = 256, 257

    def __len__(self) -> int:
        return 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def load_tokenizer():
    path = os.environ.get("DPMUON_TOKENIZER")
    if not path:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return tokenizer


def read_examples(path: Path, source_key: str, target_key: str, tokenizer, max_tokens: int) -> list[dict[str, list[int]]]:
    """Token ids and labels (the prompt's masked) of every line of the file that fits `max_tokens`."""
    examples = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [key for key in (source_key, target_key) if key not in row]
        if missing:
            raise SystemExit(f"{path}:{number}: no {missing[0]!r} column (columns: {', '.join(row)})")
        prompt = tokenizer.encode(row[source_key] + SEPARATOR)
        target = tokenizer.encode(row[target_key]) + [tokenizer.eos_token_id]
        if len(prompt) + len(target) <= max_tokens:
            examples.append({"input_ids": prompt + target, "labels": [IGNORE_INDEX] * len(prompt) + target})
    return examples


def collate(pad_id: int, width: int):
    """Right-pad one micro-batch to `width` tokens; padding is masked and carries no loss. One
    width for every micro-batch, not its longest example's: with constant-time lots (the default)
    a wider micro-batch would take longer, and step times would tell how long a lot's examples are."""

    def collate_fn(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        ids = torch.full((len(examples), width), pad_id)
        labels = torch.full((len(examples), width), IGNORE_INDEX)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for row, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(e["input_ids"]), torch.tensor(e["labels"]), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=HERE / "data" / "restaurants.jsonl")
    parser.add_argument("--source-key", default="source")
    parser.add_argument("--target-key", default="target")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/example_jsonl"), help="where the privacy ledger is written")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lot", type=int, default=32, help="expected lot size")
    parser.add_argument("--epsilon", type=float, default=8.0, help="target ε")
    parser.add_argument("--noise-multiplier", type=float, help="σ (default: calibrated to the target ε)")
    parser.add_argument("--optimizer", default="dp_muon", choices=["dp_sgd", "dp_adam", "dp_muon", "dp_muonbc"])
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    # Before any torch work: torch's worker threads then flush subnormal floats, which constant-time
    # lots need on the CPU (their slow arithmetic would otherwise time the lot's values).
    dpmuon.privacy.start_flushing_threads()
    torch.manual_seed(0)  # the model's initial weights (public); the lots and the noise are secret
    tokenizer = load_tokenizer()
    examples = read_examples(args.data, args.source_key, args.target_key, tokenizer, max_tokens=MAX_TOKENS)
    model = build_random_lm("gpt2", Shape(len(tokenizer), n_layer=2, n_embd=64, n_head=2, n_positions=MAX_TOKENS))
    model.train()

    private = dpmuon.make_private(
        model,
        examples,
        collate(tokenizer.pad_token_id, MAX_TOKENS),
        per_example_lm_loss,
        target_epsilon=args.epsilon,
        delta=1 / (10 * len(examples)),  # well below 1/N
        steps=args.steps,
        noise_multiplier=args.noise_multiplier,
        expected_lot_size=args.lot,
        clip_norm=1.0,
        micro_batch_size=16,
        run_dir=args.run_dir,
        dataset_name=args.data.stem,
    )
    optimizer = dpmuon.optim.build(args.optimizer, model, private, lr=args.lr)
    trained = 0
    for lot in private.lots():  # none when --run-dir already holds the plan's releases (it says so)
        private.release(lot)  # p.grad := the private release of this lot (an empty lot too: noise only)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trained += 1
    private.close()
    plan, charged = private.plan, private.mechanism.release.accountant.steps
    print(
        f"trained {trained} private steps in this run ({charged} of the plan's {plan.steps} in the ledger) on {len(examples)} examples: "
        f"σ={plan.noise_multiplier:.3f}, q={plan.sample_rate:.4f}"
    )
    print(f"epsilon = {private.epsilon:.4f} (target {plan.target_epsilon:g}, delta {plan.delta:.3g}); ledger: {private.ledger_path}")


if __name__ == "__main__":
    main()
