"""Your own table-to-text data through Hugging Face `datasets` (the `HFDataset` settings; the
committed example is `dataset=hf_example`, conf/dataset/hf_example.yaml).

A local JSON / JSON Lines, CSV or text file per split (or a hub dataset id) holds rows of a
source under `source_key` and one reference or a list of references under `target_key` (a
source may also repeat over rows, as E2E's do). Text files hold one `source||target` line per example, E2E's Prefix-Tuning format.
Sources are linearized as E2E's and DART's are (text as it is, a mapping as `key : value | …`,
a list of [subject, relation, object] triples as `subject : relation : object | …`), and every
reference becomes one Example, so several references of a source are grouped for scoring as
E2E's are (`group_references`). As for E2E, the privacy unit is that example: a row with k
references is k training examples, and N (for δ < 1/N and q) counts them after the length filter.

Splits: the files given under `dataset.files` (train, validation, test). A split given no
file is carved out of the train file by a hash of the source text: sources hashing into
[0, f) go to test, [f, 2f) to validation (f = `holdout_fraction`), so every reference of a
source lands in one split, whatever the order of the rows, and adding rows moves no source.

Tokenization runs through `Dataset.map`, cached under `cache_dir` with a fingerprint of the
file's content (each content gets its own folder: a file rewritten under the same modification
time, which `datasets` alone would take for unchanged, is read afresh), the column settings,
the tokenizer and the encoding code: a second run on the same data skips it. The cache holds a
tokenized copy of the (private) data, so by default it sits beside the file it copies (in
`.dpmuon_cache/` in the file's folder, under the file's own protections), a hub dataset's under
the data root with the other downloads; never in a home-directory cache, unless configured there.

A file or hub split without a row (empty, only blank lines, a JSON `[]`, a CSV with only its
header) is one line naming it, as is a column that no row holds.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpmuon.data.dart import linearize_tripleset
from dpmuon.data.dataset import DatasetSettings
from dpmuon.data.errors import DataError
from dpmuon.data.records import Example
from dpmuon.settings import option, settings

if TYPE_CHECKING:  # `datasets` and `transformers` load when data is read, not when the options are
    import datasets
    from transformers import PreTrainedTokenizerBase

    from dpmuon.data.encoding import EncodedExample
from dpmuon.errors import one_line

# Builders by file extension (before a `.gz`, which `datasets` decompresses itself).
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}
# The loop's split names → the `dataset.files` keys and hub split names (Hugging Face's).
SPLIT_NAMES = {"train": "train", "valid": "validation", "test": "test"}
# Bands of the source hash that a split without a file takes from the train file, in units of `holdout_fraction`.
HOLDOUT_BANDS = {"test": 0, "validation": 1}
TEXT_COLUMN, TEXT_SEPARATOR = "text", "||"
FILE_CACHE = ".dpmuon_cache"  # the tokenization cache's folder beside a file (dataset.cache_dir=null)


@dataclass(kw_only=True)
class HFFiles:
    train: str | None = option(None, "the training file (.json/.jsonl, .csv, .txt; relative to the working directory)")
    validation: str | None = option(None, "the validation file (null: carved from train by source hash)")
    test: str | None = option(None, "the test file (null: carved from train by source hash)")


@settings("dataset")
@dataclass(kw_only=True)
class HFDataset(DatasetSettings):
    """Your own files (or a hub dataset) through Hugging Face `datasets`; δ must be < 1/N of them."""

    name: str = option("hf", "the private set's name (run folders, the ledger, tables)")
    files: HFFiles = option(factory=HFFiles, help="a local file per split")
    builder: str | None = option(None, "the datasets builder (null: from each file's extension)", choices=tuple(dict.fromkeys(BUILDERS.values())))
    hub_id: str | None = option(None, "a Hugging Face hub dataset instead of files (downloads)")
    hub_config: str | None = option(None, "the hub dataset's configuration name")
    source_key: str = option("source", "the column holding the source (text, mapping or triples)")
    target_key: str = option("target", "the column holding the reference (text or list of texts)")
    holdout_fraction: float = option(0.1, "share of train sources hashed into each split given no file", gt=0, lt=0.5)
    cache_dir: str | None = option(None, f"where the tokenization cache goes (null: {FILE_CACHE}/ beside each file; a hub dataset's: <data root>/hf_cache)")

    def reader(self, data_root: Path, tokenizer, progress: bool = True) -> HFReader:
        return HFReader(HFSettings.from_config(dataclasses.asdict(self), data_root), tokenizer, progress=progress)


@dataclass(frozen=True)
class HFSettings:
    """Where a `dataset=hf` config's rows come from and which columns hold what."""

    files: Mapping[str, Path]  # split name (train / validation / test) → local file
    hub_id: str | None
    hub_config: str | None
    builder: str | None  # json | csv | text; None: from each file's extension
    source_key: str
    target_key: str
    holdout_fraction: float
    cache_dir: Path | None  # None: each file's own FILE_CACHE folder beside it

    @classmethod
    def from_config(cls, dataset: Mapping, data_root: str | PathLike[str]) -> HFSettings:
        """Read the `dataset` config group; relative paths are taken from the working directory."""
        files = {split: Path(path).expanduser().resolve() for split, path in (dataset.get("files") or {}).items() if path is not None}
        unknown = set(files) - set(SPLIT_NAMES.values())
        if unknown:
            raise DataError(f"dataset.files has unknown split(s) {', '.join(sorted(unknown))}; expected train, validation, test")
        hub_id = dataset.get("hub_id")
        if (hub_id is None) == ("train" not in files) or (hub_id is not None and files):
            raise DataError("set either dataset.files (local files, train at least) or dataset.hub_id (a Hugging Face hub dataset), not both")
        for split, path in files.items():
            if not path.is_file():
                raise DataError(f"dataset.files.{split}: no such file: {path}")
        builder = dataset.get("builder")
        if builder is not None and builder not in set(BUILDERS.values()):
            raise DataError(f"dataset.builder={builder!r}: expected json, csv or text (null: from the file extension)")
        holdout_fraction = float(dataset.get("holdout_fraction", 0.1))
        if not 0 < holdout_fraction < 0.5:
            raise DataError(f"dataset.holdout_fraction={holdout_fraction}: expected a number in (0, 0.5)")
        cache_dir = dataset.get("cache_dir")
        return cls(
            files=files,
            hub_id=hub_id,
            hub_config=dataset.get("hub_config"),
            builder=builder,
            source_key=str(dataset.get("source_key", "source")),
            target_key=str(dataset.get("target_key", "target")),
            holdout_fraction=holdout_fraction,
            cache_dir=Path(cache_dir).expanduser() if cache_dir is not None else (Path(data_root) / "hf_cache" if hub_id is not None else None),
        )


class HFReader:
    """The splits of one `dataset=hf` config as Examples, with token ids from the cached map.

    `examples(split)` and `encode(examples, max_length)` stand in for `load_examples` and
    `encode_for_training` (same results); `encode` takes only Examples this reader returned.
    """

    def __init__(self, settings: HFSettings, tokenizer: PreTrainedTokenizerBase, progress: bool = True):
        self.settings, self.tokenizer = settings, tokenizer
        if not progress:  # logging.progress=false: `datasets` draws its bars process-wide unless told
            import datasets

            datasets.disable_progress_bars()
        self._rows: dict[str, list[Example]] = {}  # by split name of the file (or hub split) read
        self._encoded: dict[Example, EncodedExample] = {}
        self._hub: datasets.DatasetDict | None = None

    def examples(self, split: str) -> list[Example]:
        """All examples of `split` (train / valid / test), one per reference, in file order."""
        if split not in SPLIT_NAMES:
            raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLIT_NAMES)}")
        name = SPLIT_NAMES[split]
        if name in self._given_splits():
            examples = self._read(name)
            carved_out = set(HOLDOUT_BANDS) - set(self._given_splits()) if name == "train" else set()
            return [e for e in examples if self._band(e.source) not in carved_out]
        examples = [e for e in self._read("train") if self._band(e.source) == name]
        if not examples:
            raise DataError(
                f"{self._where('train')}: no source hashes into the {name} split (holdout_fraction={self.settings.holdout_fraction}); "
                f"give dataset.files.{name}, or raise dataset.holdout_fraction"
            )
        return examples

    def encode(self, examples: Sequence[Example], max_length: int) -> tuple[list[EncodedExample], int]:
        """`encode_for_training` of Examples this reader returned, from the cached token ids."""
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        kept = [encoded for encoded in (self._encoded[e] for e in examples) if len(encoded.input_ids) <= max_length]
        return kept, len(examples) - len(kept)

    def _band(self, source: str) -> str:
        return holdout_band(source, self.settings.holdout_fraction)

    def _given_splits(self) -> Sequence[str]:
        return list(self._hub_splits()) if self.settings.hub_id is not None else list(self.settings.files)

    def _hub_splits(self) -> datasets.DatasetDict:
        if self._hub is None:
            import datasets

            # Downloads on first use: behind config only, never in tests or defaults.
            self._hub = datasets.load_dataset(self.settings.hub_id, self.settings.hub_config, cache_dir=str(self.settings.cache_dir))
            if "train" not in self._hub:
                raise DataError(f"hub dataset {self.settings.hub_id} has no train split (splits: {', '.join(self._hub)})")
        return self._hub

    def _where(self, name: str) -> str:
        return str(self.settings.files[name]) if self.settings.hub_id is None else f"hub dataset {self.settings.hub_id} ({name} split)"

    def _read(self, name: str) -> list[Example]:
        """Every (source, reference) pair of one file or hub split, its token ids kept for `encode`."""
        if name not in self._rows:
            from dpmuon.data.encoding import EncodedExample

            rows = self._tokenized(self._linearized(name), name).to_dict()
            examples = [Example(source, target) for source, target in zip(rows["source"], rows["target"], strict=True)]
            for example, input_ids, labels in zip(examples, rows["input_ids"], rows["labels"], strict=True):
                self._encoded[example] = EncodedExample(input_ids, labels)
            self._rows[name] = examples
        return self._rows[name]

    def _linearized(self, name: str) -> datasets.Dataset:
        table, where = self._load(name), self._where(name)
        if not table.num_rows:
            raise self._no_rows(name, "the split is empty")
        columns = [TEXT_COLUMN] if self._builder(name) == "text" else [self.settings.source_key, self.settings.target_key]
        for column in columns:
            if column not in table.column_names:
                key = "source_key" if column == self.settings.source_key else "target_key"
                raise DataError(f"{where}: no column {column!r} (columns: {', '.join(table.column_names)}); set dataset.{key} to the column that holds it")
        return table.map(
            _pairs_of_rows,
            batched=True,
            with_indices=True,  # row numbers for errors
            input_columns=columns,
            remove_columns=table.column_names,
            fn_kwargs={"where": where, "columns": columns},
            desc=f"linearizing {name}",
        )

    def _tokenized(self, pairs: datasets.Dataset, name: str) -> datasets.Dataset:
        # Our own fingerprint rather than one hashed from the map function: what decides the
        # token ids is the linearized rows (their fingerprint follows the file's content and the
        # column settings), the tokenizer, and the encoding code itself.
        from datasets.fingerprint import Hasher

        from dpmuon.data.encoding import encode_for_training

        fingerprint = Hasher.hash([pairs._fingerprint, Hasher.hash(self.tokenizer), Hasher.hash(encode_for_training)])
        return pairs.map(_encode_rows, batched=True, fn_kwargs={"tokenizer": self.tokenizer}, new_fingerprint=fingerprint, desc=f"tokenizing {name}")

    def _builder(self, name: str) -> str | None:
        if self.settings.hub_id is not None:
            return None
        return self.settings.builder or builder_for(self.settings.files[name])

    def _load(self, name: str) -> datasets.Dataset:
        if self.settings.hub_id is not None:
            return self._hub_splits()[name]
        import datasets

        path = self.settings.files[name]
        if not holds_text(path):  # `datasets` would fail on it with a StopIteration or "no data"
            raise self._no_rows(name, "the file is empty or only blank lines")
        cache_dir = (self.settings.cache_dir or path.parent / FILE_CACHE) / f"{self._builder(name)}-{file_digest(path)}"
        try:  # beside the file by default: its folder may be read-only (a shared data set)
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DataError(f"{path}: cannot write its tokenization cache {cache_dir} ({error.strerror}); set dataset.cache_dir elsewhere") from error
        try:
            return datasets.load_dataset(self._builder(name), data_files={"train": str(path)}, split="train", cache_dir=str(cache_dir))
        except (datasets.exceptions.DatasetGenerationError, ValueError, OSError) as error:
            cause = error.__cause__ or error  # the generation error wraps the parser's, which says what is wrong
            if "corresponds to no data" in str(cause):  # parsed to zero rows: a JSON [], a CSV header alone
                raise self._no_rows(name, "it parses to zero rows: a JSON [] or a CSV header alone") from error
            raise DataError(f"{path}: cannot read it as {self._builder(name)} ({type(cause).__name__}: {one_line(cause)})") from error

    def _no_rows(self, name: str, why: str) -> DataError:
        if self._builder(name) == "text":
            wanted = f"`source{TEXT_SEPARATOR}target` lines"
        else:
            wanted = f"rows with a {self.settings.source_key!r} and a {self.settings.target_key!r}"
        given = f"dataset.files.{name}" if self.settings.hub_id is None else "dataset.hub_id"
        return DataError(f"{self._where(name)}: holds no rows ({why}); {given} needs {wanted}")


def builder_for(path: Path) -> str:
    """The `datasets` builder for a file, by its extension (`.jsonl.gz` counts as `.jsonl`)."""
    suffix = Path(path.stem).suffix if path.suffix == ".gz" else path.suffix
    if suffix.lower() not in BUILDERS:
        raise DataError(f"{path}: cannot tell the format from the extension {suffix!r}; set dataset.builder to json, csv or text")
    return BUILDERS[suffix.lower()]


def holds_text(path: Path) -> bool:
    """Whether the file (decompressed, for .gz) holds anything but whitespace; an unreadable
    one counts as holding text, for `datasets` to say what is wrong with it."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as handle:
            return any(block.strip() for block in iter(lambda: handle.read(1 << 16), b""))
    except (OSError, EOFError):
        return True


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256: its content's name in the cache."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def holdout_band(source: str, fraction: float) -> str:
    """The split a source of the train file belongs to when test / validation have no file."""
    position = int.from_bytes(hashlib.sha256(source.encode("utf-8")).digest()[:8], "big") / 2.0**64
    for split, band in HOLDOUT_BANDS.items():
        if band * fraction <= position < (band + 1) * fraction:
            return split
    return "train"


def linearize_source(value: Any) -> str:
    """A row's source as a prompt line; raises ValueError (without a location) for other shapes."""
    if isinstance(value, str):
        text = value.strip()
    elif isinstance(value, Mapping):
        # E2E's `key : value | key : value`; null values are absent attributes.
        text = " | ".join(f"{key} : {_scalar_text(key, item)}" for key, item in value.items() if item is not None)
    elif isinstance(value, list) and value and all(isinstance(t, list) and len(t) == 3 and all(isinstance(v, str) for v in t) for t in value):
        text = linearize_tripleset(value)
    else:
        raise ValueError(f"source {value!r:.80} is neither text, a mapping, nor a list of [subject, relation, object] triples")
    if not text:
        raise ValueError("empty source")
    return text


def _scalar_text(key: str, value: Any) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value).strip()
    raise ValueError(f"attribute {key!r} has the value {value!r:.80}; expected text or a number")


def references_of(value: Any) -> list[str]:
    """A row's references: one text or a non-empty list of texts (an empty text is kept, as DART's)."""
    if isinstance(value, str):
        return [value.strip()]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [v.strip() for v in value]
    raise ValueError(f"target {value!r:.80} is neither a text nor a non-empty list of texts")


def _pairs_of_rows(*args: Any, where: str, columns: Sequence[str]) -> dict[str, list[str]]:
    """Batched map: rows → one (source, target) pair per reference; blank text lines give none."""
    *values, indices = args
    sources: list[str] = []
    targets: list[str] = []
    for index, row in zip(indices, zip(*values, strict=True), strict=True):
        try:
            pairs = _pairs_of_row(row, columns)
        except ValueError as error:
            raise DataError(f"{where}, row {index + 1}: {error}") from error
        sources.extend(source for source, _ in pairs)
        targets.extend(target for _, target in pairs)
    return {"source": sources, "target": targets}


def _pairs_of_row(row: Sequence[Any], columns: Sequence[str]) -> list[tuple[str, str]]:
    if columns == [TEXT_COLUMN]:
        (line,) = row
        if not line.strip():
            return []
        source, separator, target = line.partition(TEXT_SEPARATOR)
        if not separator:
            raise ValueError(f"no `{TEXT_SEPARATOR}` separator in {line!r:.80}; text files hold lines `source{TEXT_SEPARATOR}target`")
        return [(linearize_source(source), target.strip())]
    for column, value in zip(columns, row, strict=True):
        if value is None:
            raise ValueError(f"no {column!r} (missing or empty); every row needs the columns {' and '.join(map(repr, columns))}")
    source, target = row
    text = linearize_source(source)
    return [(text, reference) for reference in references_of(target)]


def _encode_rows(batch: dict[str, list[str]], tokenizer: PreTrainedTokenizerBase) -> dict[str, list[list[int]]]:
    """Batched map: token ids and labels exactly as `encode_for_training` makes them (no length filter here)."""
    from dpmuon.data.encoding import encode_for_training

    examples = [Example(source, target) for source, target in zip(batch["source"], batch["target"], strict=True)]
    encoded, _ = encode_for_training(examples, tokenizer, max_length=2**62)
    return {"input_ids": [e.input_ids for e in encoded], "labels": [e.labels for e in encoded]}
