"""Bad input and impossible settings: one clear message, non-zero exit, no traceback."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest
from helpers_train import compose_config, require_real_data

from dpmuon.config.roster import optimizer_names
from dpmuon.config.schema import ConfigError, blamed_on, one_line, validate
from dpmuon.data import DataError, load_tokenizer
from dpmuon.errors import UserError
from dpmuon.privacy.plan import plan_length
from dpmuon.training import loop
from dpmuon.training.loop import run
from dpmuon.training.secret import MECHANISM_SEED_ENV, user_mechanism_secret

SMALL = [
    "experiment=smoke",
    "data.fallback=none",  # missing files must be an error here, not the synthetic set's cue
    "logging.progress=false",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "data.max_train_examples=100",
    "privacy.expected_lot_size=10",
]


def e2e_prefix_root(tmp_path, train_lines: list[str]):
    folder = tmp_path / "e2e" / "prefix_tuning_format"
    folder.mkdir(parents=True)
    good = "name : A | Type : pub||A is a pub . \n"
    (folder / "src1_train.txt").write_text("".join(train_lines))
    (folder / "src1_valid.txt").write_text(good * 3)
    (folder / "src1_test.txt").write_text(good * 3)
    return tmp_path


def cli(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpmuon.train", *overrides], capture_output=True, text=True, timeout=300)


def test_malformed_prefix_line_names_file_and_line(tmp_path):
    require_real_data()
    root = e2e_prefix_root(tmp_path, ["name : A||fine . \n"] * 4 + ["no separator here\n"])
    with pytest.raises(DataError, match=r"src1_train\.txt, line 5"):
        run(compose_config(*SMALL, f"data.root={root}"), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing half-written


def test_malformed_csv_row_names_file_and_line(tmp_path):
    require_real_data()
    (tmp_path / "e2e").mkdir()
    (tmp_path / "e2e" / "trainset.csv").write_text('mr,ref\n"name[A]","ok"\n"name[B]","x","extra"\n')
    with pytest.raises(DataError, match=r"trainset\.csv, line 3"):
        run(compose_config(*SMALL, f"data.root={tmp_path}", "dataset.format=csv"), tmp_path / "run")


def test_malformed_dart_json_names_the_file(tmp_path):
    require_real_data()
    (tmp_path / "dart").mkdir()
    (tmp_path / "dart" / "dart-v1.1.1-full-train.json").write_text('[{"tripleset": [["a", "b", "c"]], "annotations": [{"text": "x"}]},\n{"tripleset": ')
    with pytest.raises(DataError, match=r"dart-v1\.1\.1-full-train\.json.*line 2"):
        run(compose_config(*SMALL, f"data.root={tmp_path}", "dataset=dart"), tmp_path / "run")


def test_missing_split_says_what_to_run(tmp_path):
    require_real_data()
    with pytest.raises(DataError, match="make data"):
        run(compose_config(*SMALL, f"data.root={tmp_path}"), tmp_path / "run")


@pytest.mark.parametrize(
    "override,message",
    [
        ("privacy.delta=0.02", r"delta=0.02 must be in \(0, 1/N\)"),
        ("privacy.expected_lot_size=500", r"^privacy.expected_lot_size=500: .*valid: an integer in \[1, 100\]"),
        ("privacy.noise_multiplier=0.3", "over by"),
    ],
)
def test_impossible_settings_are_refused_before_training(tmp_path, override, message):
    require_real_data()
    with pytest.raises(UserError, match=message):
        run(compose_config(*SMALL, override), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# The six values of issue #14, then one bad value per option kind; (override, the one line).
ONE_LINE_ERRORS = [
    ("privacy.clip_norm=-1", "privacy.clip_norm=-1: must be > 0; valid: a number > 0"),
    ("privacy.accountant=gdp", "privacy.accountant=gdp: not one of the choices; valid: prv | rdp"),
    ("optimizer.lr=-1", "optimizer.lr=-1: must be > 0; valid: a number > 0"),
    ("trainer.micro_batch_size=0", "trainer.micro_batch_size=0: must be >= 1; valid: an integer >= 1"),
    ("privacy.target_epsilon=abc", "privacy.target_epsilon=abc: not a number; valid: a number > 0"),
    (
        "model.name_or_path=/some/missing/dir",
        "model.name_or_path=/some/missing/dir: local directory not found: /some/missing/dir; "
        "valid: null or a local directory or a Hugging Face hub id (e.g. gpt2)",
    ),
    ("privacy.delta=1.5", "privacy.delta=1.5: must be < 1; valid: a number > 0 and < 1"),
    ("trainer.steps=2.5", "trainer.steps=2.5: not an integer; valid: null or an integer >= 1"),
    ("eval.validation=maybe", "eval.validation=maybe: not true or false; valid: true or false"),
    ("trainer.device=tpu", "trainer.device=tpu: not one of the choices; valid: auto | cpu | cuda"),
    ("trainer.fixed_batch_shape=1", "trainer.fixed_batch_shape=1: not one of the choices; valid: auto | true | false"),
    ("data.root=/no/such/data", "data.root=/no/such/data: directory not found: /no/such/data; valid: null or an existing directory"),
    ("model.n_embd=30", "model.n_embd=30: not a multiple of model.n_head=4; valid: a multiple of 4"),
    ("optimizer.betas=[0.9,1.5]", "optimizer.betas=[0.9, 1.5]: needs two numbers in [0, 1); valid: [β1, β2] with 0 <= β < 1"),
]


@pytest.mark.parametrize("override,line", ONE_LINE_ERRORS, ids=[o for o, _ in ONE_LINE_ERRORS])
def test_bad_value_is_one_line_naming_key_value_and_valid_range(override, line):
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(override))
    assert str(caught.value) == line


def test_a_bad_value_stops_the_run_before_any_data_is_read(tmp_path):
    # data.root is empty: reading data first would end in a DataError ("make data") instead
    with pytest.raises(ConfigError, match=r"^trainer.micro_batch_size=0: "):
        run(compose_config("trainer.micro_batch_size=0", f"data.root={tmp_path}"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_default_config_and_every_experiment_validate():
    for experiment in ("smoke", "e2e", "dart", "pretrained_tiny_e2e", "cpu_e2e"):
        validate(compose_config(f"experiment={experiment}"))


@pytest.mark.parametrize("value, problem", [("s3cr3t", "not an integer"), ("-12345", "negative")])
def test_a_bad_mechanism_seed_is_refused_without_printing_it(monkeypatch, value, problem):
    monkeypatch.setenv(MECHANISM_SEED_ENV, value)
    with pytest.raises(UserError) as caught:
        user_mechanism_secret(compose_config())
    assert value not in str(caught.value) and str(caught.value).startswith(f"{MECHANISM_SEED_ENV}: the mechanism seed is {problem}")


def test_library_errors_from_a_configured_value_name_the_key():
    with pytest.raises(
        ConfigError, match=r"^model.name_or_path=gpt2: not a local directory, and the Hugging Face hub could not provide it .*model.name_or_path=/path/to/model"
    ):
        with blamed_on("model.name_or_path", "gpt2"):
            raise OSError("We couldn't connect to 'https://huggingface.co'\nmany more lines")
    with pytest.raises(ConfigError, match=r"^optimizer.warmup_steps=9: warmup must end"):
        with blamed_on("optimizer.warmup_steps", 9):
            raise ValueError("warmup must end before the last of the 8 planned steps")


def test_cli_prints_one_line_and_exits_2(tmp_path):
    # a hub model with a local path that is not there: refused before any hub access
    overrides = ["model=gpt2", "model.name_or_path=/some/missing/dir"]
    out = cli(*overrides, f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: {dict(ONE_LINE_ERRORS)[overrides[-1]]}"]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cli_unknown_optimizer_lists_the_valid_ones(tmp_path):
    out = cli("optimizer=dp_lion", f"hydra.run.dir={tmp_path}")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    for name in optimizer_names():
        assert name in out.stderr


def test_a_lot_larger_than_the_training_set_names_the_key():
    # N is known only once the data is read (long sequences are dropped): checked before the model
    with pytest.raises(ConfigError, match=r"^privacy.expected_lot_size=20: not in \[1, N=10\] .*valid: an integer in \[1, 10\]$"):
        plan_length(10, 20, None, 5)


def test_an_empty_tokenizer_folder_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match=rf"^model.tokenizer={tmp_path}: the local directory {tmp_path} is empty; valid: "):
        with blamed_on("model.tokenizer", str(tmp_path)):
            load_tokenizer(str(tmp_path), None)


def test_a_library_message_announcing_a_list_keeps_the_list():
    message = "Couldn't instantiate the backend tokenizer from one of: \n(1) a serialization file, \n(2) a slow tokenizer"
    assert one_line(message) == "Couldn't instantiate the backend tokenizer from one of: (1) a serialization file, (2) a slow tokenizer"
    assert one_line("first line\nsecond line") == "first line"


def test_an_unreadable_data_file_is_named_with_the_key_that_locates_it(tmp_path, monkeypatch):
    require_real_data()

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/data/e2e/src1_train.txt")

    monkeypatch.setattr(loop, "prepare_data", unreadable)
    with pytest.raises(DataError, match=r"^cannot read /data/e2e/src1_train.txt: Permission denied; data.root sets the data folder"):
        run(compose_config(*SMALL), tmp_path / "run")


# ---- issue 42: shuffled lots, empty data, an unreachable hub ---------------------------------------


def test_shuffled_lots_are_refused_for_a_private_run_as_the_accountant_does_not_cover_them():
    """Before, the run trained with one mid-log warning and reported the Poisson ε as its guarantee."""
    for private in ("optimizer=dp_muon", "optimizer=dp_sgd"):
        with pytest.raises(ConfigError) as caught:
            validate(compose_config(private, "privacy.sampling=shuffle"))
        assert str(caught.value) == (
            "privacy.sampling=shuffle: fixed-size shuffled lots are not covered by the Poisson-subsampled accountant, "
            "so a private run's ε would not be a guarantee; valid: poisson"
        )
    validate(compose_config("optimizer=adam", "privacy.sampling=shuffle"))  # non-private: Poisson lots, no ε to mislead


def hf_run(tmp_path, train_file):
    files = [f"dataset.files.train={train_file}", f"dataset.cache_dir={tmp_path / 'cache'}"]
    return run(compose_config(*SMALL, "dataset=hf_example", *files), tmp_path / "run")


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("empty.jsonl", "", "holds no rows (the file is empty or only blank lines); dataset.files.train needs rows with a 'source' and a 'target'"),
        ("blank.jsonl", "\n  \n\n", "holds no rows (the file is empty or only blank lines)"),
        ("blank.txt", "\n\n", "holds no rows (the file is empty or only blank lines); dataset.files.train needs `source||target` lines"),
        ("none.json", "[]", "holds no rows (it parses to zero rows: a JSON [] or a CSV header alone)"),
        ("header.csv", "source,target\n", "holds no rows (it parses to zero rows"),
        ("other.jsonl", '{"mr": "a", "ref": "b"}\n', "no column 'source' (columns: mr, ref); set dataset.source_key to the column that holds it"),
    ],
)
def test_a_data_file_without_rows_or_their_columns_is_one_line_naming_it(tmp_path, name, content, problem):
    """An empty JSONL was a 45-line StopIteration from inside `datasets`."""
    require_real_data()
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError) as caught:
        hf_run(tmp_path, path)
    assert str(caught.value).startswith(f"{path}: {problem}") and "\n" not in str(caught.value)


def test_a_split_the_length_filter_empties_is_one_line_naming_the_limit(tmp_path):
    """Before: "the training set is empty" (train), or a validation NLL of 0/0 taken for divergence."""
    require_real_data()
    with pytest.raises(DataError, match=r"^e2e train: all 100 examples are longer than dataset.max_length=3 tokens; raise dataset.max_length$"):
        run(compose_config(*SMALL, "dataset.max_length=3"), tmp_path / "run")


def test_an_unreachable_hub_fails_a_hub_id_in_seconds_not_after_a_minute_of_retries(monkeypatch):
    from dpmuon import hub

    def no_network(*args, **kwargs):
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(hub.socket, "create_connection", no_network)
    for name in hub.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    hub.hub_unreachable.cache_clear()
    started, refused = time.monotonic(), r"^model.tokenizer=someone/no-such-tokenizer: not a local directory, and the Hugging Face hub could not provide it"
    try:
        with pytest.raises(ConfigError, match=refused):
            with blamed_on("model.tokenizer", "someone/no-such-tokenizer"):
                load_tokenizer("someone/no-such-tokenizer")
    finally:
        hub.hub_unreachable.cache_clear()
    assert time.monotonic() - started < 5


def test_the_hub_is_skipped_only_when_it_does_not_answer(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from dpmuon import hub

    answers = []
    monkeypatch.setattr(hub.socket, "create_connection", lambda address, timeout: answers.append(address) or socket.socket())
    for name in hub.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    hub.hub_unreachable.cache_clear()
    try:
        assert not hub.local_files_only("gpt2") and answers == [(urlsplit(constants.ENDPOINT).hostname, 443)]  # the real hub path
        assert not hub.local_files_only(str(tmp_path))  # a local directory never asks
        hub.hub_unreachable.cache_clear()
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        assert hub.local_files_only("gpt2") and len(answers) == 1  # offline by setting: not even one attempt
    finally:
        hub.hub_unreachable.cache_clear()
