"""No count of the private set's contents is published: the length filter's drop count tells
whether a long example is in the set (N does not: docs/privacy.md, threat model), so the
published train.log carries it only with logging.nonprivate_diagnostics=publish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_tokenizers import CharTokenizer
from helpers_train import compose_config, require_real_data

from dpmuon.training.data import prepare_data
from dpmuon.training.loop import run

SHORT = [{"source": f"name : place {i}", "target": f"Place {i} serves food."} for i in range(6)]
LONG = {"source": "name : long", "target": "a reference far longer than the limit " * 3}


def logged_lines(tmp_path: Path, long_rows: int, publish_counts: bool = False) -> list[str]:
    path = tmp_path / f"rows-{long_rows}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [*SHORT, *[LONG] * long_rows]), encoding="utf-8")
    dataset = {"_target_": "dpmuon.data.hf.HFDataset", "delta": 1e-5, "max_length": 100, "cache_dir": str(tmp_path / "cache")}
    dataset["files"] = dict.fromkeys(("train", "validation", "test"), str(path))
    lines: list[str] = []
    prepare_data(dataset, {"root": str(tmp_path)}, CharTokenizer(), 512, lines.append, progress=False, publish_counts=publish_counts)
    return [line.replace(path.name, "rows.jsonl") for line in lines]


def test_the_train_line_does_not_depend_on_how_many_long_examples_were_dropped(tmp_path):
    """Sets with 0, 1 or 3 long examples and the same short ones: the published lines are equal
    (the held-out splits are not protected: their counts stay)."""
    trains = {rows: [line for line in logged_lines(tmp_path, rows) if " train: " in line] for rows in (0, 1, 3)}
    assert trains[0] == trains[1] == trains[3] and "not counted here" in trains[0][0]
    (published,) = [line for line in logged_lines(tmp_path, 3, publish_counts=True) if " train: " in line]
    assert "3 dropped as longer than 100 tokens" in published


@pytest.mark.slow
def test_a_default_run_publishes_no_drop_count(tmp_path, capsys):
    """The whole run folder, and the driver's lines (what train.log holds under Hydra). The
    GPT-2 tokenizer: the offline fallback BPE makes every example of the set longer than 60."""
    require_real_data()
    cfg = compose_config(
        "experiment=smoke", "dataset=hf_example", f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.max_length=60", "logger=none",
        "logging.progress=false", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "privacy.expected_lot_size=4",
        "privacy.noise_multiplier=1.0", "trainer.steps=1", "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.checkpoint_every=0",
        "data.max_test_sources=1", "data.max_valid_examples=4", "eval.decoding=greedy", "eval.max_new_tokens=2",
    )  # fmt: skip
    assert cfg.logging.nonprivate_diagnostics != "publish"  # the default
    run(cfg, tmp_path / "run")
    published = [capsys.readouterr().err] + [
        path.read_text(encoding="utf-8", errors="replace") for path in (tmp_path / "run").rglob("*") if path.is_file() and path.suffix != ".pt"
    ]
    assert "(those dropped, not counted here, as longer than 60 tokens)" in published[0]
    assert not any(" dropped as longer" in text or "dropped_" in text for text in published)
