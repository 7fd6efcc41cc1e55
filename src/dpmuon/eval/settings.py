"""The driver's evaluation options (eval.*), declared once as fields; `@settings("eval")` offers
their defaults to conf/config.yaml (see dpmuon/training/settings.py for the pattern)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import Settings, option, settings

VALIDATION_SPLITS = ("private", "public")
DECODINGS = ("beam", "greedy")


@settings("eval", target=False)
@dataclass(frozen=True, kw_only=True)
class EvalSettings(Settings):
    """What the driver scores after (and while) training."""

    test: bool = option(True, "score the test set (false: validation only, e.g. tuning)")
    validation: bool = option(True, "compute the validation NLL (every trainer.eval_every steps and at the end)")
    validation_split: str = option(
        "private",
        "whether the validation split is public: a private dataset's own validation split is private data outside the guarantee "
        "(private: its NLL is not covered); declare public only when it is",
        choices=VALIDATION_SPLITS,
    )
    decoding: str = option("beam", "decoding of the test sources", choices=DECODINGS)
    num_beams: int = option(5, "beam width", ge=1)
    max_new_tokens: int = option(100, "longest generation", ge=1)
    batch_size: int = option(16, "evaluation batch (NLL uses 4×)", ge=1)
