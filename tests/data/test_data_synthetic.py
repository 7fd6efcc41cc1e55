"""The smoke run's offline stand-ins (data/synthetic.py, data.fallback=synthetic): a deterministic
synthetic E2E-format set the real readers parse, a tokenizer built on it, both used only when
the real source is missing and the option is on, and said so in the log and the summary.

Nothing here needs ../shared or the network: the real sources are made absent (no
$DPMUON_DATA_DIR or $DPMUON_TOKENIZER, the hub offline) and the stand-ins go to tmp_path."""

from __future__ import annotations

import pytest
from helpers_train import compose_config

from dpmuon.config.schema import ConfigError, blamed_on, validate
from dpmuon.data import DataError, load_examples, synthetic
from dpmuon.data.tokenizer import LOADED, PAD_TOKEN, STAND_IN, load_tokenizer, load_tokenizer_or_stand_in
from dpmuon.eval.runs import Run
from dpmuon.training.data import prepare_data

SMOKE_SIZES = {"train": 2000, "valid": 64}  # conf/experiment/smoke.yaml's subsets (and 8 test sources)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No real data or tokenizer reachable; the stand-ins written under tmp_path/synthetic."""
    from huggingface_hub import constants

    from dpmuon import hub

    for name in ("DPMUON_DATA_DIR", "DPMUON_TOKENIZER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read once, at import
    hub.hub_unreachable.cache_clear()
    monkeypatch.setattr(synthetic, "data_dir", lambda: tmp_path / "synthetic")
    yield tmp_path / "synthetic"
    hub.hub_unreachable.cache_clear()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The stand-in tokenizer's directory, built once for the module (about a second)."""
    return synthetic.build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def test_the_set_is_a_pure_function_of_its_seed_with_disjoint_splits_sized_for_the_smoke_run():
    splits = synthetic.generate()
    assert splits == synthetic.generate() and splits != synthetic.generate(seed=1)
    for split, least in SMOKE_SIZES.items():
        assert len(splits[split]) >= least
    sources = {split: {mr for mr, _ in pairs} for split, pairs in splits.items()}
    assert len(sources["test"]) >= 8
    assert not (sources["train"] & sources["valid"] or sources["train"] & sources["test"] or sources["valid"] & sources["test"])
    for pairs in splits.values():  # three distinct references per MR: multi-reference BLEU has something to do
        for mr in {mr for mr, _ in pairs}:
            assert len({ref for m, ref in pairs if m == mr}) == synthetic.REFERENCES_PER_SOURCE


@pytest.mark.parametrize("fmt", ["prefix", "csv"])
def test_the_e2e_readers_parse_what_is_written(tmp_path, fmt):
    root = synthetic.write_data(tmp_path)
    splits = synthetic.generate()
    for split in ("train", "valid", "test"):
        examples = load_examples("e2e", split, root, fmt)
        assert len(examples) == len(splits[split])
    first = load_examples("e2e", "test", root, fmt)[0]
    assert first.source.startswith("name : ") and " | Type : " in first.source and first.target.endswith(".")
    before = {path: path.stat().st_mtime_ns for path in root.rglob("*") if path.is_file()}
    synthetic.write_data(tmp_path)  # the same text again: no file is rewritten
    assert {path: path.stat().st_mtime_ns for path in root.rglob("*") if path.is_file()} == before
    assert "NOT E2E" in (root / "README.txt").read_text()


def test_the_built_tokenizer_round_trips_text_and_has_eos_and_pad(built):
    tokenizer = load_tokenizer(str(built))
    assert tokenizer.eos_token == synthetic.EOS and tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.eos_token_id == 256 + synthetic.merges_of(tokenizer) and tokenizer.pad_token_id == len(tokenizer) - 1
    for text in (" The Old Mill is a pub near Market Hall .", " Prices £20-25, café ☕ — text it never saw"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    seen = len(tokenizer(" The Old Mill is a pub near Market Hall .", add_special_tokens=False)["input_ids"])
    assert seen < 12  # trained on the set: its words are whole tokens
    small = load_tokenizer(str(built), 50)  # truncate_bpe: laid out as GPT-2's BPE (256 bytes, the merges in order, eos)
    assert len(small) == 256 + 50 + 2 and small.decode(small(" Market Hall")["input_ids"]) == " Market Hall"
    stamp = (built / "corpus.sha256").stat().st_mtime_ns
    assert synthetic.build_tokenizer(built) == built and (built / "corpus.sha256").stat().st_mtime_ns == stamp  # not rebuilt


def test_with_the_option_on_a_missing_gpt2_is_replaced_by_the_local_build_and_said(offline):
    lines = []
    tokenizer, source = load_tokenizer_or_stand_in("gpt2", 8000, "synthetic", lines.append)
    if source == LOADED:
        pytest.skip("gpt2 is in this machine's Hugging Face cache: nothing to stand in for")
    merges = synthetic.merges_of(tokenizer)
    assert source == STAND_IN and merges < 8000 and len(tokenizer) == 256 + merges + 2  # all merges kept, eos, pad
    assert len(lines) == 1 and "byte-level BPE built from the synthetic set" in lines[0] and "keeping all of them" in lines[0]
    assert "make data" in lines[0] and "$DPMUON_TOKENIZER" in lines[0] and (offline / "tokenizer" / "tokenizer.json").is_file()
    fewer, _ = load_tokenizer_or_stand_in(None, 40, "synthetic", lines.append)
    assert len(fewer) == 256 + 40 + 2 and "keeping its first 40 of" in lines[-1]


def test_without_the_option_or_for_a_named_tokenizer_the_old_error_stands(offline, tmp_path):
    with pytest.raises(ConfigError, match=r"^model.tokenizer=gpt2: not a local directory, and the Hugging Face hub could not provide it"):
        with blamed_on("model.tokenizer", "gpt2"):
            tokenizer, source = load_tokenizer_or_stand_in("gpt2", None, "none", print)
            if source == LOADED:
                pytest.skip("gpt2 is in this machine's Hugging Face cache")
    missing = str(tmp_path / "no-such-tokenizer")  # $DPMUON_TOKENIZER or a path: the user's choice, never replaced
    with pytest.raises(DataError, match="cannot load the tokenizer"):
        load_tokenizer_or_stand_in(missing, None, "synthetic", print)
    assert not offline.exists()


def test_with_the_option_on_missing_e2e_files_are_replaced_by_the_synthetic_set_and_said(offline, tmp_path, built):
    tokenizer, lines = load_tokenizer(str(built)), []
    cfg = compose_config("experiment=smoke", f"data.root={tmp_path / 'empty'}")
    (tmp_path / "empty").mkdir()
    data = prepare_data(cfg.dataset, cfg.data, tokenizer, 160, lines.append)
    assert data.data_source == "synthetic" and len(data.train) == 2000 and len(data.valid) == 64 and len(data.test_items) == 8
    assert "reads the SYNTHETIC E2E-format set" in lines[0] and "make data" in lines[0] and str(offline) in lines[0]
    real = synthetic.write_data(tmp_path / "real")  # files present: read as they are, whatever they hold
    cfg = compose_config("experiment=smoke", f"data.root={real}")
    assert prepare_data(cfg.dataset, cfg.data, tokenizer, 160, lines.append).data_source == "files"


def test_without_the_option_missing_files_stop_the_run_saying_what_to_run(offline, tmp_path, built):
    cfg = compose_config("experiment=smoke", "data.fallback=none", f"data.root={tmp_path}")
    with pytest.raises(DataError, match=r"(?s)^no e2e train file .*make data"):
        prepare_data(cfg.dataset, cfg.data, load_tokenizer(str(built)), 160, print)
    partial = synthetic.write_data(tmp_path / "partial")
    (partial / "e2e" / "prefix_tuning_format" / "src1_test.txt").unlink()  # a broken copy is reported, not papered over
    cfg = compose_config("experiment=smoke", f"data.root={partial}")
    with pytest.raises(DataError, match=r"^no e2e test file"):
        prepare_data(cfg.dataset, cfg.data, load_tokenizer(str(built)), 160, print)
    assert not offline.exists()


def test_only_the_smoke_experiment_turns_it_on_and_a_bad_value_is_one_line():
    assert compose_config().data.fallback == "none" and compose_config("experiment=e2e").data.fallback == "none"
    assert compose_config("experiment=smoke").data.fallback == "synthetic"
    with pytest.raises(ConfigError, match=r"^data.fallback=maybe: .*valid: none \| synthetic$"):
        validate(compose_config("data.fallback=maybe"))


def test_a_run_on_the_synthetic_set_is_grouped_apart_from_the_real_set(tmp_path):
    assert Run(tmp_path, {"dataset": "e2e", "data_source": "synthetic"}).dataset == "e2e-synthetic"
    assert Run(tmp_path, {"dataset": "e2e", "data_source": "files"}).dataset == Run(tmp_path, {"dataset": "e2e"}).dataset == "e2e"


@pytest.mark.slow
def test_the_smoke_experiment_runs_end_to_end_offline_on_the_stand_ins(offline, tmp_path, capsys):
    """`make smoke` on a fresh clone without internet, shortened (about 40 s on 2 busy cores)."""
    from dpmuon.training.loop import run

    (tmp_path / "empty").mkdir()
    short = ["trainer.steps=2", "trainer.eval_every=2", "trainer.checkpoint_every=2", "eval.max_new_tokens=8", "logging.progress=false"]
    cfg = compose_config("experiment=smoke", "optimizer=dp_muonbc", "dataset=e2e", "logger=none", f"data.root={tmp_path / 'empty'}", *short)
    summary = run(cfg, tmp_path / "run")
    assert summary["data_source"] == "synthetic" and summary["dataset_size"] == 2000 and summary["test_sources"] == 8
    assert summary["tokenizer_source"] in (STAND_IN, LOADED)  # LOADED only where gpt2 is in the local hub cache
    assert 0 < summary["epsilon"] <= summary["target_epsilon"] and summary["bleu"] is not None
    assert "on the SYNTHETIC stand-in data (data.fallback), not E2E" in capsys.readouterr().err
