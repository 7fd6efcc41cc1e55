"""A synthetic E2E-format set and a tokenizer trained on it: the smoke run's stand-ins offline.

A fresh clone without internet has neither the E2E files (`make data` downloads them) nor GPT-2's
tokenizer (the hub). With `data.fallback=synthetic` (conf/experiment/smoke.yaml alone sets it),
a run whose E2E files are missing reads this set instead, and one whose tokenizer is the default
`gpt2` and cannot be loaded uses a byte-level BPE trained here on this set. Both are written
under `data/synthetic/` on first use, by the code below (nothing is downloaded or copied), in the
layout and formats the real readers read, so the run exercises the same reading code.

The set is public and synthetic: invented venue names over E2E's eight attributes, references
from the hand-written templates below (three per meaning representation, so multi-reference
BLEU is exercised). Training a tokenizer on it leaks nothing. It is NOT E2E: a run on it
records `data_source: synthetic` in its summary, and its scores say nothing about the paper.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from dpmuon.data.e2e import linearize_meaning_representation
from dpmuon.data.layout import candidate_paths
from dpmuon.durable import atomic_write
from dpmuon.jsontext import to_json
from dpmuon.paths import REPO_ROOT, in_checkout

FALLBACKS = ("none", "synthetic")  # data.fallback's values
SEED = 0
# Meaning representations per split, three references each: the smoke run takes 2,000 training
# pairs, 64 validation pairs and 8 test sources (conf/experiment/smoke.yaml).
SOURCES_PER_SPLIT = {"train": 700, "valid": 30, "test": 20}
REFERENCES_PER_SOURCE = 3
EOS = "<|endoftext|>"  # GPT-2's eos, the name load_tokenizer and truncate_bpe expect
MAX_MERGES = 8000  # like conf/model/tiny_bpe8k.yaml; this small corpus runs out well before
REAL_SOURCES_HINT = "for the real ones run `make data` (or set $DPMUON_DATA_DIR) and set $DPMUON_TOKENIZER to a GPT-2 tokenizer directory"

# Invented names (none is a venue of E2E); the other values are E2E's own vocabulary.
NAMES = ("The Copper Kettle", "Blue Heron", "The Old Mill", "Saffron House", "The Green Lantern", "Harbour Lights",
         "The Wandering Fox", "Little Olive", "The Iron Gate", "Moonlight Diner", "The Silver Spoon", "Juniper")  # fmt: skip
NEAR = ("The Bell Tower", "Market Hall", "Stone Bridge Cafe", "The Red Lion Inn", "Orchard Gardens", "Clock House")
VALUES = {
    "eatType": ("pub", "restaurant", "coffee shop"),
    "food": ("English", "French", "Italian", "Chinese", "Indian", "Japanese", "Fast food"),
    "priceRange": ("cheap", "moderate", "high", "less than £20", "£20-25", "more than £30"),
    "customer rating": ("low", "average", "high", "1 out of 5", "3 out of 5", "5 out of 5"),
    "area": ("city centre", "riverside"),
    "familyFriendly": ("yes", "no"),
    "near": NEAR,
}
ORDER = ("name", "eatType", "food", "priceRange", "customer rating", "area", "familyFriendly", "near")  # the release's MR order


def data_dir() -> Path:
    """Where the stand-ins are written: `<repo>/data/synthetic` in a checkout, else ./data/synthetic
    (never the data root: that holds inputs, and may be a shared read-only copy)."""
    return (REPO_ROOT if in_checkout() else Path.cwd()) / "data" / "synthetic"


# ---- the set -----------------------------------------------------------------------------------


def meaning_representations(rng: random.Random) -> list[dict[str, str]]:
    """Every distinct MR the splits draw from, shuffled: a name and a type always, each other
    attribute with probability 0.6 (E2E's MRs hold 3 to 8 attributes)."""
    seen: dict[tuple, dict[str, str]] = {}
    while len(seen) < sum(SOURCES_PER_SPLIT.values()):
        mr = {"name": rng.choice(NAMES), "eatType": rng.choice(VALUES["eatType"])}
        mr |= {key: rng.choice(VALUES[key]) for key in ORDER[2:] if rng.random() < 0.6}
        seen.setdefault(tuple(sorted(mr.items())), mr)
    return list(seen.values())


AREA_PHRASES = {"city centre": "in the city centre", "riverside": "by the riverside"}


def _a(word: str) -> str:
    return f"{'an' if word[0].lower() in 'aeiou' else 'a'} {word}"


def _opening(mr: dict[str, str], variant: int) -> str:
    name, kind, food = mr["name"], mr["eatType"], mr.get("food", "").replace("Fast food", "fast food")
    place = " ".join(([AREA_PHRASES[mr["area"]]] if "area" in mr else []) + ([f"near {mr['near']}"] if "near" in mr else []))
    if variant == 0:
        text = f"{name} is {_a(kind)}" + (f" serving {food}" + ("" if food == "fast food" else " food") if food else "")
    elif variant == 1:
        text = f"There is {_a(f'{food} {kind}' if food else kind)} called {name}"
    else:
        text = f"{name} is {_a(f'{food} {kind}' if food else kind)}"
    return f"{text} {place}".rstrip() + "."


def _sentences(mr: dict[str, str], rng: random.Random) -> list[str]:
    price, rating, family = mr.get("priceRange"), mr.get("customer rating"), mr.get("familyFriendly")
    options = []
    if price:
        worded = price in ("cheap", "moderate", "high")
        options.append((f"Prices are {price}.", f"It has a {price} price range." if worded else f"It costs {price}."))
    if rating:
        options.append((f"Its customer rating is {rating}.", f"Customers rate it {rating}."))
    if family:
        welcome = family == "yes"
        options.append(("It is family friendly.", "Children are welcome.") if welcome else ("It is not family friendly.", "It is not suitable for children."))
    chosen = [rng.choice(pair) for pair in options]
    rng.shuffle(chosen)
    return chosen


def references(mr: dict[str, str], rng: random.Random) -> list[str]:
    """REFERENCES_PER_SOURCE distinct texts for `mr`, each opening a different way."""
    found: list[str] = []
    for variant in rng.sample(range(3), REFERENCES_PER_SOURCE):
        text = " ".join([_opening(mr, variant), *_sentences(mr, rng)])
        found.append(text if text not in found else text + " It is worth a visit.")
    return found


def generate(seed: int = SEED) -> dict[str, list[tuple[str, str]]]:
    """{split: [(MR as the CSV writes it, reference)]}, three pairs per MR, the MRs of the splits
    disjoint (as E2E's are). A pure function of `seed`."""
    rng = random.Random(seed)
    mrs, splits, start = meaning_representations(rng), {}, 0
    for split, count in SOURCES_PER_SPLIT.items():
        pairs = []
        for mr in mrs[start : start + count]:
            text = ", ".join(f"{key}[{mr[key]}]" for key in ORDER if key in mr)
            pairs += [(text, reference) for reference in references(mr, rng)]
        splits[split], start = pairs, start + count
    return splits


def prefix_tokenize(text: str) -> str:
    """The Prefix-Tuning files' spacing: punctuation, £ and ranges' hyphens are tokens of their own."""
    return " ".join(re.sub(r"([.,£-])", r" \1 ", text).split())


def file_texts(splits: dict[str, list[tuple[str, str]]]) -> dict[tuple[str, str], str]:
    """{(format, split): the file's text} in the release's two formats (data/layout.py)."""
    texts = {}
    for split, pairs in splits.items():
        lines = [f"{prefix_tokenize(linearize_meaning_representation(mr))}||{prefix_tokenize(ref)} \n" for mr, ref in pairs]
        texts["prefix", split] = "".join(lines)
        buffer = io.StringIO(newline="")
        csv.writer(buffer, lineterminator="\n").writerows([("mr", "ref"), *pairs])
        texts["csv", split] = buffer.getvalue()
    return texts


def write_data(directory: Path | None = None) -> Path:
    """Write the set under `directory` (default: data_dir()) laid out as a data root, `e2e/…` in
    both formats; a file already holding the same text is left alone. Returns the root."""
    root = data_dir() if directory is None else Path(directory)
    for (fmt, split), text in file_texts(generate()).items():
        _write_if_changed(candidate_paths("e2e", split, root, fmt)[0], text)
    _write_if_changed(root / "README.txt", f"Synthetic E2E-format data written by dpmuon.data.synthetic: NOT E2E. {REAL_SOURCES_HINT}.\n")
    return root


def _write_if_changed(path: Path, text: str) -> None:
    data = text.encode("utf-8")
    if not (path.is_file() and path.read_bytes() == data):
        atomic_write(path, lambda sink: sink.write(data))  # a concurrent run reads the old file or this one


def e2e_files_missing(root: Path, fmt: str) -> bool:
    """Whether `root` holds no E2E split in `fmt` at all (a partial copy is an error to report, not to paper over)."""
    return not any(path.is_file() for split in ("train", "valid", "test") for path in candidate_paths("e2e", split, root, fmt))


def data_root_or_synthetic(root: Path, fmt: str, log: Callable[[str], None]) -> tuple[Path, str]:
    """(the data root to read, "files" or "synthetic"): the synthetic set where `root` has no E2E files."""
    if not e2e_files_missing(root, fmt):
        return root, "files"
    written = write_data()
    log(
        f"data.fallback=synthetic: no E2E files under {root}, so this run reads the SYNTHETIC E2E-format set written to {written} "
        f"(not E2E: its scores mean nothing for the paper); {REAL_SOURCES_HINT}"
    )
    return written, "synthetic"


# ---- the tokenizer -----------------------------------------------------------------------------


def corpus(splits: dict[str, list[tuple[str, str]]] | None = None) -> list[str]:
    """The texts the tokenizer is trained on: the training split's sources and references as the
    default (prefix) format spells them, and the CSV's MRs and references."""
    pairs = (splits or generate())["train"]
    sources = list(dict.fromkeys(mr for mr, _ in pairs))
    prefixed = [prefix_tokenize(linearize_meaning_representation(mr)) for mr in sources]
    return prefixed + [prefix_tokenize(ref) for _, ref in pairs] + sources + [ref for _, ref in pairs]


def build_tokenizer(directory: Path | None = None) -> Path:
    """A byte-level BPE like GPT-2's (its pre-tokenizer, 256 byte symbols, one token per merge in
    merge order, eos last), trained on `corpus()` and saved as a Hugging Face tokenizer directory
    (default: data_dir()/tokenizer). Rebuilt only when the corpus changed. Returns the directory."""
    target = (data_dir() / "tokenizer") if directory is None else Path(directory)
    texts = corpus()
    digest = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()
    stamp = target / "corpus.sha256"
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        _train(texts).save_pretrained(str(staging))
        config_file = staging / "tokenizer_config.json"  # the class name every transformers version reads
        config_file.write_text(to_json(json.loads(config_file.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
        (staging / "corpus.sha256").write_text(digest + "\n")
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:  # a concurrent run put its identical build there first
            if not stamp.is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _train(texts: Sequence[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + MAX_MERGES, initial_alphabet=alphabet, show_progress=False)
    # Each text with a leading space, as encoding.py tokenizes it mid-sentence.
    bpe.train_from_iterator([" " + text for text in texts], trainer)
    bpe.add_special_tokens([EOS])  # after the merges: id 256 + merges, as truncate_bpe lays it out
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS)


def merges_of(tokenizer) -> int:
    """How many BPE merges a fast tokenizer has."""
    return len(json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"])
