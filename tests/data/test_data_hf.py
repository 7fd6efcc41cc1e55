"""`dataset=hf`: your own JSON Lines / CSV / text files through Hugging Face `datasets` — rows to
Examples, references grouped per source, the length filter, the tokenization cache, located
errors, the split rule, and a smoke-scale private run on the committed example file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pytest
from datasets import load_dataset
from helpers_tokenizers import CharTokenizer
from helpers_train import compose_config

from dpmuon.data import DataError, Example, HFReader, HFSettings, encode_for_training, group_references
from dpmuon.data import hf as hf_module
from dpmuon.data.hf import holdout_band
from dpmuon.paths import REPO_ROOT
from dpmuon.training.data import prepare_data
from dpmuon.training.loop import run

ROWS = [
    {"source": {"name": "Aster", "food": "Thai"}, "target": ["Aster serves Thai food.", "Thai food at Aster."]},
    {"source": [["Oslo", "capital of", "Norway"], ["Oslo", "population", "700000"]], "target": "Oslo is the capital of Norway."},
    {"source": "plain : text", "target": "One reference."},
    {"source": "plain : text", "target": "Another row, the same source."},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def reader(tmp_path: Path, files: dict[str, Path], tokenizer=None, **settings) -> HFReader:
    dataset = {"files": {split: str(path) for split, path in files.items()}, "cache_dir": str(tmp_path / "cache"), **settings}
    return HFReader(HFSettings.from_config(dataset, data_root=tmp_path), tokenizer or CharTokenizer())


def one_file_for_every_split(path: Path) -> dict[str, Path]:
    return dict.fromkeys(("train", "validation", "test"), path)


def test_rows_become_linearized_examples_with_references_grouped_per_source(tmp_path):
    data = reader(tmp_path, one_file_for_every_split(write_jsonl(tmp_path / "rows.jsonl", ROWS)))

    assert data.examples("train") == [
        Example("name : Aster | food : Thai", "Aster serves Thai food."),  # a mapping, as E2E's
        Example("name : Aster | food : Thai", "Thai food at Aster."),  # a list: one example per reference
        Example("Oslo : capital of : Norway | Oslo : population : 700000", "Oslo is the capital of Norway."),  # triples, as DART's
        Example("plain : text", "One reference."),  # text as it is
        Example("plain : text", "Another row, the same source."),
    ]
    grouped = group_references(data.examples("test"))
    assert [(item.source, len(item.references)) for item in grouped] == [("name : Aster | food : Thai", 2), (grouped[1].source, 1), ("plain : text", 2)]
    assert grouped[2].references == ("One reference.", "Another row, the same source.")


def test_encoding_equals_encode_for_training_and_the_length_filter_drops_long_rows(tmp_path):
    long_row = {"source": "short", "target": "a reference far longer than the limit " * 3}
    data = reader(tmp_path, one_file_for_every_split(write_jsonl(tmp_path / "rows.jsonl", [*ROWS, long_row])))
    examples = data.examples("train")
    limit = 100  # CharTokenizer: one token per byte; the long row has 122, the others at most 90

    kept, dropped = data.encode(examples, limit)
    assert (kept, dropped) == encode_for_training(examples, CharTokenizer(), limit)
    assert dropped == 1 and len(kept) == len(examples) - 1 and all(len(e.input_ids) <= limit for e in kept)

    # N for δ < 1/N is what the run samples from: the training examples left after the filter.
    run_data = prepare_data(
        {
            "_target_": "dpmuon.data.hf.HFDataset",
            "delta": 1e-5,
            "max_length": limit,
            "cache_dir": str(tmp_path / "cache"),
            "files": one_file_for_every_split(tmp_path / "rows.jsonl"),
        },  # fmt: skip
        {"root": str(tmp_path)},
        CharTokenizer(),
        context_length=512,
        log=lambda message: None,
    )
    assert len(run_data.train) == len(examples) - 1
    assert [len(item.references) for item in run_data.test_items] == [2, 1, 2, 1]


def test_a_second_read_of_the_same_file_reuses_the_cached_tokenization(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    first = reader(tmp_path, {"train": path, "validation": path, "test": path}).examples("train")
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("cache-*.arrow"))
    assert len(cached) == 2  # the linearized rows and their token ids, beside the loaded file

    calls = []
    tokenize = hf_module._encode_rows
    monkeypatch.setattr(hf_module, "_encode_rows", lambda batch, tokenizer: calls.append(len(batch["source"])) or tokenize(batch, tokenizer))
    again = reader(tmp_path, {"train": path, "validation": path, "test": path})
    assert again.examples("train") == first and calls == []  # a new reader, the same file and settings: no tokenization
    assert again.encode(first, 512) == encode_for_training(first, CharTokenizer(), 512)
    assert sorted(p.name for p in (tmp_path / "cache").rglob("cache-*.arrow")) == cached

    # Another file content is tokenized afresh, never served stale token ids, even under the
    # same modification time (which is all `datasets` itself checks of a local file).
    before = path.stat()
    write_jsonl(path, [*ROWS, {"source": "new", "target": "row"}])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    changed = reader(tmp_path, {"train": path, "validation": path, "test": path})
    assert changed.examples("train")[-1] == Example("new", "row") and calls == [len(first) + 1]
    assert changed.encode(changed.examples("train"), 512)[0][-1] == encode_for_training([Example("new", "row")], CharTokenizer(), 512)[0][0]


def test_a_missing_value_names_the_file_the_row_and_the_column(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [ROWS[0], ROWS[2], {"source": "no reference here"}])
    with pytest.raises(DataError, match=rf"^{path}, row 3: no 'target' \(missing or empty\)"):
        reader(tmp_path, one_file_for_every_split(path)).examples("train")

    with pytest.raises(DataError, match=rf"^{path}: no column 'mr' \(columns: source, target\); set dataset.source_key"):
        reader(tmp_path, one_file_for_every_split(path), source_key="mr").examples("train")

    bad = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"source": {"name": ["nested"]}, "target": "x"}])
    with pytest.raises(DataError, match=rf"^{bad}, row 2: attribute 'name' has the value \['nested'\]"):
        reader(tmp_path, one_file_for_every_split(bad)).examples("train")


@pytest.mark.parametrize(
    "name, text",
    [
        ("rows.csv", 'source,target\n"name : Aster | food : Thai",Aster serves Thai food.\n"name : Aster | food : Thai","Thai food, at Aster."\nplain,One.\n'),
        ("rows.txt", "name : Aster | food : Thai||Aster serves Thai food.\nname : Aster | food : Thai||Thai food, at Aster.\n\nplain||One.\n"),
    ],
)
def test_csv_and_text_files_read_alike(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    examples = reader(tmp_path, one_file_for_every_split(path)).examples("train")
    assert examples == [
        Example("name : Aster | food : Thai", "Aster serves Thai food."),
        Example("name : Aster | food : Thai", "Thai food, at Aster."),
        Example("plain", "One."),
    ]


def test_a_csv_row_without_a_reference_is_located(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("source,target\na,one\nb,\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{path}, row 2: no 'target'"):
        reader(tmp_path, one_file_for_every_split(path)).examples("train")


def test_splits_without_a_file_are_carved_from_train_by_source_hash(tmp_path):
    rows = [{"source": f"item : {i}", "target": [f"first {i}", f"second {i}"]} for i in range(60)]
    data = reader(tmp_path, {"train": write_jsonl(tmp_path / "rows.jsonl", rows)}, holdout_fraction=0.2)
    splits = {split: data.examples(split) for split in ("train", "valid", "test")}

    sources = {split: {e.source for e in examples} for split, examples in splits.items()}
    assert all(sources.values()) and not (sources["train"] & sources["valid"] or sources["train"] & sources["test"] or sources["valid"] & sources["test"])
    assert sum(len(s) for s in sources.values()) == 60 and sum(len(e) for e in splits.values()) == 120  # every reference, once
    assert all(holdout_band(s, 0.2) == band for split, band in (("valid", "validation"), ("test", "test"), ("train", "train")) for s in sources[split])

    with pytest.raises(DataError, match=r"no source hashes into the validation split .*give dataset.files.validation"):
        reader(tmp_path, {"train": write_jsonl(tmp_path / "one.jsonl", rows[:1])}, holdout_fraction=0.01).examples("valid")


def test_settings_name_the_key_to_fix(tmp_path):
    with pytest.raises(DataError, match=r"dataset.files.train: no such file: .*absent.jsonl"):
        HFSettings.from_config({"files": {"train": str(tmp_path / "absent.jsonl")}}, tmp_path)
    with pytest.raises(DataError, match=r"set either dataset.files \(local files, train at least\) or dataset.hub_id"):
        HFSettings.from_config({"files": {"train": None}, "hub_id": None}, tmp_path)
    with pytest.raises(DataError, match=r"set either dataset.files .* or dataset.hub_id .*, not both"):
        HFSettings.from_config({"files": {"test": str(write_jsonl(tmp_path / "rows.jsonl", ROWS))}, "hub_id": "someone/tables"}, tmp_path)
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"")
    with pytest.raises(DataError, match=r"rows.parquet: cannot tell the format from the extension '.parquet'; set dataset.builder"):
        reader(tmp_path, one_file_for_every_split(path)).examples("train")


def test_the_example_config_trains_privately_at_smoke_scale(tmp_path, monkeypatch):
    tokenizer = os.environ.get("DPMUON_TOKENIZER")
    if not (tokenizer and Path(tokenizer).is_dir()):
        pytest.skip("DPMUON_TOKENIZER not set to a local tokenizer directory")
    monkeypatch.chdir(REPO_ROOT)  # the example's file path is relative to the working directory
    cfg = compose_config(
        "experiment=smoke", "dataset=hf_example", f"dataset.cache_dir={tmp_path / 'cache'}", "logger=none", "logging.progress=false",
        "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "privacy.expected_lot_size=4", "privacy.noise_multiplier=1.0", "logging.epsilon_every=2",
        "trainer.steps=2", "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.checkpoint_every=0",
        "data.max_test_sources=2", "data.max_valid_examples=8", "eval.decoding=greedy", "eval.max_new_tokens=4",
    )  # fmt: skip
    summary = run(cfg, tmp_path / "run")

    examples = HFReader(HFSettings.from_config(cfg.dataset, tmp_path), CharTokenizer()).examples("train")
    assert summary["dataset"] == "hf" and summary["steps"] == 2 and 0 < summary["epsilon"]
    assert summary["sample_rate"] == pytest.approx(4 / len(examples))  # N: every training reference (none is over 100 tokens)
    assert summary["test_sources"] == 2 and summary["test_nll"] > 0


def test_a_malformed_file_is_named_with_the_parser_s_complaint(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"source": "a", "target": "b"}\n{"source": "a", "target\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{path}: cannot read it as json \(ArrowInvalid: JSON parse error"):
        reader(tmp_path, one_file_for_every_split(path)).examples("train")


def test_a_hub_dataset_uses_its_splits_and_carves_the_missing_ones(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"source": f"item : {i}", "target": f"text {i}"} for i in range(40)])
    asked = []

    def hub_with_train_and_test(hub_id, config, cache_dir):  # stands in for the download, which tests never do
        asked.append((hub_id, config))
        return load_dataset("json", data_files={"train": str(path), "test": str(path)}, cache_dir=cache_dir)

    monkeypatch.setattr(datasets, "load_dataset", hub_with_train_and_test)
    settings = HFSettings.from_config({"hub_id": "someone/tables", "hub_config": "v1", "cache_dir": str(tmp_path / "cache"), "holdout_fraction": 0.2}, tmp_path)
    data = HFReader(settings, CharTokenizer())
    train, valid, test = (data.examples(split) for split in ("train", "valid", "test"))
    assert asked == [("someone/tables", "v1")] and len(test) == 40  # the hub's own test split
    assert valid and {e.source for e in valid} == {f"item : {i}" for i in range(40) if holdout_band(f"item : {i}", 0.2) == "validation"}
    assert len(train) + len(valid) == 40  # only the validation band leaves train: test has its own split


def test_progress_off_silences_the_datasets_bars(tmp_path):
    import datasets

    settings = HFSettings.from_config({"files": {"train": str(write_jsonl(tmp_path / "x.jsonl", ROWS))}}, data_root=tmp_path)
    datasets.enable_progress_bars()
    try:
        HFReader(settings, CharTokenizer())
        assert datasets.is_progress_bar_enabled()
        HFReader(settings, CharTokenizer(), progress=False)
        assert not datasets.is_progress_bar_enabled()
    finally:
        datasets.enable_progress_bars()  # process-wide: the other tests keep their bars


def test_the_tokenization_cache_sits_beside_the_file_it_copies_not_in_the_data_root(tmp_path):
    """It went to <data root>/hf_cache: the E2E/DART folder ($DPMUON_DATA_DIR) got a tokenized copy of every user file."""
    own = tmp_path / "mine"
    own.mkdir()
    path = write_jsonl(own / "rows.jsonl", ROWS)
    data_root = tmp_path / "data_root"
    data_root.mkdir()
    HFReader(HFSettings.from_config({"files": {"train": str(path)}}, data_root=data_root), CharTokenizer(), progress=False).examples("train")
    assert list(data_root.iterdir()) == []
    assert len(list((own / hf_module.FILE_CACHE).rglob("cache-*.arrow"))) == 2  # the linearized rows and their token ids
    assert HFSettings.from_config({"hub_id": "someone/tables"}, data_root).cache_dir == data_root / "hf_cache"  # downloads stay with the data


def test_a_folder_that_cannot_take_the_cache_says_where_to_put_it(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    (tmp_path / hf_module.FILE_CACHE).write_text("a file where the cache folder would go")
    with pytest.raises(DataError, match=rf"^{path}: cannot write its tokenization cache .*; set dataset.cache_dir elsewhere$"):
        HFReader(HFSettings.from_config({"files": {"train": str(path)}}, data_root=tmp_path), CharTokenizer(), progress=False).examples("train")
