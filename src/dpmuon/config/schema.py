"""The configuration schema: one declaration per option (type, allowed values, help).

Defaults live in `conf/` (one YAML value per option, the composed config is the default); this
module says what each value may be. `validate` checks a composed config before anything is
read or loaded, so a mistyped or out-of-range value ends in one line naming the key:

    error: privacy.clip_norm=-1: must be > 0; valid: a number > 0
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError, UserError, one_line, shown_value  # noqa: F401  (ConfigError, one_line: re-exported)

ABSENT = object()


@dataclass(frozen=True)
class Option:
    """One option: `kind` is float | int | bool | choice | path | model_source | text | list | mapping | betas | any."""

    key: str
    kind: str
    help: str
    nullable: bool = False
    choices: tuple = ()
    gt: float | None = None  # bounds: value > gt, >= ge, < lt
    ge: float | None = None
    lt: float | None = None

    @property
    def group(self) -> str:
        return self.key.split(".")[0] if "." in self.key else ""

    def valid(self) -> str:
        """What the option accepts, as printed after `valid:`."""
        if self.kind == "bool":
            text = "true or false"
        elif self.kind == "choice":
            text = " | ".join(shown_value(choice) for choice in self.choices)
        elif self.kind in ("float", "int"):
            bounds = [f"{op} {_number(b)}" for op, b in ((">", self.gt), (">=", self.ge), ("<", self.lt)) if b is not None]
            text = ("an integer" if self.kind == "int" else "a number") + (" " + " and ".join(bounds) if bounds else "")
        elif self.kind == "path":
            text = "an existing directory"
        elif self.kind == "model_source":
            text = "a local directory or a Hugging Face hub id (e.g. gpt2)"
        elif self.kind == "list":
            text = "a list, e.g. [a, b]"
        elif self.kind == "betas":
            text = "[β1, β2] with 0 <= β < 1"
        elif self.kind == "mapping":
            text = "a mapping, e.g. {e2e: 1e-3}"
        elif self.kind == "ns_coefficients":
            text = "quintic | series:K (K >= 1) | [c0, c1, ...]"
        elif self.kind == "any":
            text = "see the help"
        else:
            text = "a string"
        return f"null or {text}" if self.nullable else text

    def check(self, value: Any) -> None:
        """Raise ConfigError unless `value` is allowed."""
        if value is None:
            if not self.nullable:
                raise ConfigError(self.key, value, "must be set", self.valid())
            return
        problem = CHECKS[self.kind](self, value)
        if problem:
            raise ConfigError(self.key, value, problem, self.valid())


def _number(value: float) -> str:
    return f"{value:g}"


def _check_number(option: Option, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "not an integer" if option.kind == "int" else "not a number"
    if option.kind == "int" and not isinstance(value, int):
        return "not an integer"
    if isinstance(value, float) and not math.isfinite(value):
        return "not a finite number"
    for bound, fails, word in (
        (option.gt, lambda b: value <= b, ">"),
        (option.ge, lambda b: value < b, ">="),
        (option.lt, lambda b: value >= b, "<"),
    ):
        if bound is not None and fails(bound):
            return f"must be {word} {_number(bound)}"
    return None


def _check_bool(option: Option, value: Any) -> str | None:
    return None if isinstance(value, bool) else "not true or false"


def _check_choice(option: Option, value: Any) -> str | None:
    # Typed comparison: True == 1 in Python, but `true` is no valid `1`.
    allowed = any(type(value) is type(choice) and value == choice for choice in option.choices)
    return None if allowed else "not one of the choices"


def _check_path(option: Option, value: Any) -> str | None:
    if not isinstance(value, str):
        return "not a path"
    path = Path(value).expanduser()
    if not path.exists():
        return f"directory not found: {path}"
    return None if path.is_dir() else f"not a directory: {path}"


def looks_local(value: str) -> bool:
    """A path rather than a hub id (hub ids are `name` or `org/name`)."""
    return value.startswith(("/", ".", "~")) or value.count("/") > 1 or os.sep != "/" and os.sep in value


def _check_model_source(option: Option, value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return "not a directory or hub id"
    path = Path(value).expanduser()
    if path.exists():
        return None if path.is_dir() else f"not a directory: {path}"
    if looks_local(value):
        return f"local directory not found: {path}"
    return None  # a hub id: whether the hub has it is known only when it is loaded


def _check_text(option: Option, value: Any) -> str | None:
    return None if isinstance(value, str) else "not a string"


def _check_list(option: Option, value: Any) -> str | None:
    return None if isinstance(value, (list, tuple)) else "not a list"


def _check_mapping(option: Option, value: Any) -> str | None:
    return None if isinstance(value, dict) else "not a mapping"


def _check_betas(option: Option, value: Any) -> str | None:
    numbers = isinstance(value, (list, tuple)) and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)
    return None if numbers and len(value) == 2 and all(0 <= b < 1 for b in value) else "needs two numbers in [0, 1)"


def _check_ns_coefficients(option: Option, value: Any) -> str | None:
    """What optim/newton_schulz.resolve_coefficients takes, checked without importing torch."""
    if isinstance(value, str):
        order = value.removeprefix("series:")
        if value == "quintic" or (value.startswith("series:") and order.isdigit() and int(order) >= 1):
            return None
        return "not quintic or series:K"
    if isinstance(value, (list, tuple)) and value:
        numbers = all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in value)
        return None if numbers else "not a list of finite numbers"
    return "not a name or a non-empty list"


CHECKS: dict[str, Callable[[Option, Any], str | None]] = {
    "float": _check_number,
    "int": _check_number,
    "bool": _check_bool,
    "choice": _check_choice,
    "path": _check_path,
    "model_source": _check_model_source,
    "text": _check_text,
    "list": _check_list,
    "mapping": _check_mapping,
    "betas": _check_betas,
    "ns_coefficients": _check_ns_coefficients,
    "any": lambda option, value: None,
}


def Float(key, help, **bounds) -> Option:
    return Option(key, "float", help, **bounds)


def Int(key, help, **bounds) -> Option:
    return Option(key, "int", help, **bounds)


def Bool(key, help) -> Option:
    return Option(key, "bool", help)


def Choice(key, choices, help, nullable=False) -> Option:
    return Option(key, "choice", help, choices=tuple(choices), nullable=nullable)


OPTIONS: tuple[Option, ...] = (
    # ---- top level
    Int("seed", "public seed: initialisation, dropout, DP-MuonBC probes (never the mechanism)", ge=0),
    Option("resume", "path", "run directory to continue (its stored config is used)", nullable=True),
    Option("experiment_name", "text", "tag naming the output folder and the W&B group"),
    # ---- data
    Option("data.root", "path", "raw-data folder laid out as e2e/…, dart/… (null: $DPMUON_DATA_DIR, else data/raw/)", nullable=True),
    Option("data.max_train_examples", "int", "use only the first N training examples (null: all)", nullable=True, ge=1),
    Option("data.max_valid_examples", "int", "use only the first N validation examples (null: all)", nullable=True, ge=1),
    Option("data.max_test_sources", "int", "score only the first N test sources (null: all)", nullable=True, ge=1),
    # ---- dataset
    Choice("dataset.name", ("e2e", "dart", "hf"), "the private dataset (hf: your own files through Hugging Face datasets)"),
    Choice("dataset.format", ("prefix", "csv", "json"), "file format read (E2E: prefix or csv; DART: json)"),
    Int("dataset.max_length", "drop training sequences longer than this many tokens", ge=1),
    Option("dataset.exclude_origins", "list", "drop examples of these DART annotation origins, e.g. [e2e]"),
    Option("dataset.files.train", "text", "hf: the training file (.json/.jsonl, .csv, .txt; relative to the working directory)", nullable=True),
    Option("dataset.files.validation", "text", "hf: the validation file (null: carved from train by source hash)", nullable=True),
    Option("dataset.files.test", "text", "hf: the test file (null: carved from train by source hash)", nullable=True),
    Choice("dataset.builder", ("json", "csv", "text"), "hf: the datasets builder (null: from each file's extension)", nullable=True),
    Option("dataset.hub_id", "text", "hf: a Hugging Face hub dataset instead of files (downloads)", nullable=True),
    Option("dataset.hub_config", "text", "hf: the hub dataset's configuration name", nullable=True),
    Option("dataset.source_key", "text", "hf: the column holding the source (text, mapping or triples)"),
    Option("dataset.target_key", "text", "hf: the column holding the reference (text or list of texts)"),
    Float("dataset.holdout_fraction", "hf: share of train sources hashed into each split given no file", gt=0, lt=0.5),
    Option("dataset.cache_dir", "text", "hf: where the tokenization cache goes (null: <data root>/hf_cache)", nullable=True),
    Float("dataset.epochs", "epochs of the recipe (trainer.epochs defaults to it)", gt=0),
    Float("dataset.delta", "δ of the recipe (privacy.delta defaults to it); must be < 1/N", gt=0, lt=1),
    # ---- model
    Option("model.name", "text", "model label in summaries and tables"),
    Option("model.name_or_path", "model_source", "pretrained weights: hub id or local directory (null: random init)", nullable=True),
    Option("model.tokenizer", "model_source", "tokenizer: hub id or local directory ($DPMUON_TOKENIZER, else gpt2)"),
    Int("model.bpe_merges", "keep the first K merges of GPT-2's BPE (null: all)", nullable=True, ge=1),
    Int("model.n_layer", "transformer layers (random init)", ge=1),
    Int("model.n_embd", "embedding width (random init); a multiple of n_head", ge=1),
    Int("model.n_head", "attention heads (random init)", ge=1),
    Int("model.n_positions", "context length (random init)", ge=1),
    Choice("model.architecture", ("gpt2", "llama", "qwen2"), "random-init architecture family (null: gpt2)", nullable=True),
    Int("model.n_kv_head", "key/value heads, dividing n_head (random-init llama/qwen2: grouped-query attention; null: n_head)", nullable=True, ge=1),
    Int("model.intermediate_size", "MLP width (random init; null: 4 × n_embd)", nullable=True, ge=1),
    Bool("model.untie_head", "give the LM head its own parameter instead of the token embedding"),
    Option("model.dropout", "float", "dropout probability (public randomness; null: a pretrained checkpoint's own)", nullable=True, ge=0, lt=1),
    Int("model.lora.r", "LoRA rank: train adapters on the frozen model (null: full fine-tuning)", nullable=True, ge=1),
    Float("model.lora.alpha", "LoRA: adapters add (alpha / r) · B A x (null: alpha = r)", nullable=True, gt=0),
    Float("model.lora.dropout", "LoRA: dropout probability on the adapters' input (public randomness)", ge=0, lt=1),
    Option("model.lora.target_modules", "list", "LoRA: module names to adapt (null: every attention and MLP projection of gpt2 / Llama-like)", nullable=True),
    Bool("model.lora.train_embeddings", "LoRA: also train the token embedding and LM head (position embeddings, norms stay frozen)"),
    # ---- optimizer (keys of every kind; each YAML sets those of its kind)
    Option("optimizer.name", "text", "optimizer label (the YAML's file name)"),
    Choice("optimizer.kind", ("sgd", "adam", "muon", "muonbc"), "which builder of dpmuon.optim.registry"),
    Bool("optimizer.private", "clip, noise and account (false: the non-private reference)"),
    Option("optimizer.display.rank", "int", "row order in tables and curves", ge=0),
    Option("optimizer.display.color", "text", "colour in every figure"),
    Option("optimizer.recipe_lr", "mapping", "the recipe's learning rate per dataset name (lr and adam.lr default to it)"),
    Float("optimizer.lr", "learning rate (peak of the schedule)", gt=0),
    Choice("optimizer.schedule", ("constant", "linear", "cosine"), "learning-rate schedule over the planned steps (public: no privacy cost)"),
    Int("optimizer.warmup_steps", "linear warmup over the first N steps (0: none)", ge=0),
    Float("optimizer.momentum", "momentum β", ge=0, lt=1),
    Bool("optimizer.nesterov", "Nesterov momentum"),
    Float("optimizer.weight_decay", "decoupled weight decay", ge=0),
    Option("optimizer.betas", "betas", "Adam's (β1, β2)"),
    Float("optimizer.eps", "Adam ε", gt=0),
    Choice("optimizer.momentum_kind", ("heavy_ball", "ema"), "Muon momentum: m = βm + g, or m = βm + (1-β)g"),
    Int("optimizer.ns_steps", "Newton–Schulz iterations", ge=1),
    Option("optimizer.ns_coefficients", "ns_coefficients", "Newton–Schulz polynomial: quintic | series:K | [a, b, c]"),
    Choice("optimizer.ns_normalize", ("frobenius", "max1"), "normalisation before Newton–Schulz"),
    Choice("optimizer.ns_dtype", ("bfloat16",), "Newton–Schulz dtype (null: the parameter's)", nullable=True),
    Choice("optimizer.update_scale", ("adam_rms", "reference", "none"), "Muon update scale"),
    Float("optimizer.adam.lr", "learning rate of the Adam part (non-matrix tensors)", gt=0),
    Option("optimizer.adam.betas", "betas", "Adam part (β1, β2)"),
    Float("optimizer.adam.eps", "Adam part ε", gt=0),
    Float("optimizer.adam.weight_decay", "Adam part decoupled weight decay", ge=0),
    Float("optimizer.bias_correction.probe_scale", "DP-MuonBC probe scale ρ / s", gt=0),
    Int("optimizer.bias_correction.num_probes", "DP-MuonBC antithetic probe pairs K", ge=1),
    Float("optimizer.bias_correction.min_snr", "correct only where the public SNR estimate exceeds this (null: always)", nullable=True),
    Bool("optimizer.bias_correction.match_norm", "rescale F_BC(M) per matrix to ‖F(M)‖_F: the correction changes only the direction"),
    Choice("optimizer.bias_correction.noise_std", ("buffer", "step"), "DP-MuonBC's s: the momentum buffer's noise std, or one step's release"),
    # ---- privacy
    Float("privacy.target_epsilon", "ε of the (ε, δ) guarantee", gt=0),
    Float("privacy.delta", "δ of the guarantee; must be < 1/N", gt=0, lt=1),
    Choice("privacy.accountant", ("prv", "rdp"), "privacy accountant"),
    Float("privacy.noise_multiplier", "σ (null: calibrated from ε, δ, q and the steps)", nullable=True, gt=0),
    Int("privacy.expected_lot_size", "expected lot size (q = lot / N)", ge=1),
    Choice("privacy.sampling", ("poisson", "shuffle"), "lot sampling (shuffle is not covered by the accountant)"),
    Choice("privacy.clip_mode", ("per_matrix", "flat"), "per-matrix thresholds or one global threshold"),
    Float("privacy.clip_norm", "total clipping threshold C", gt=0),
    Choice("privacy.threshold_rule", ("split", "scalar", "by_size"), "how C is split over blocks"),
    Choice("privacy.other_blocks", ("per_tensor", "group"), "blocks of the non-matrix tensors"),
    Choice("privacy.noise_allocation", ("uniform", "proportional"), "noise over blocks"),
    Choice("privacy.engine", ("fast", "opacus"), "per-example gradient engine"),
    Choice("privacy.engine_fallback", ("generic", "error"), "a trainable module without an engine rule: torch.func per-example gradients, or refuse"),
    Bool("privacy.secure_noise", "lots and noise from the OS CSPRNG (nothing seeded; slower)"),
    Bool("privacy.constant_time", "pad every lot to a fixed bound and fixed shapes, so step time reveals nothing (costs the padding)"),
    Option("privacy.mechanism_seed_file", "text", "owner-only file holding the mechanism seed (null: $DPMUON_MECHANISM_SEED, else OS entropy)", nullable=True),
    Bool("privacy.keep_mechanism_state", "keep <run>/mechanism_state.pt after the run completes"),
    # ---- trainer
    Choice("trainer.device", ("auto", "cpu", "cuda"), "where to train"),
    Choice("trainer.precision", ("auto", "fp32", "bf16"), "forward precision (auto: bf16 on cuda, fp32 on cpu)"),
    Float("trainer.epochs", "epochs (steps = ⌈epochs/q⌉) unless trainer.steps is set", nullable=True, gt=0),
    Int("trainer.steps", "planned steps (null: from the epochs)", nullable=True, ge=1),
    Int("trainer.micro_batch_size", "physical batch; the lot is split into these", ge=1),
    Choice("trainer.fixed_batch_shape", ("auto", True, False), "private runs: pad micro-batches to one shape (auto: on under bf16)"),
    Int("trainer.eval_every", "validation NLL every N steps (0: only at the end)", ge=0),
    Int("trainer.checkpoint_every", "checkpoint every N steps (0: only at the end)", ge=0),
    Bool("trainer.keep_checkpoint", "keep the final checkpoint in the run directory"),
    Bool("trainer.save_model", "also save the final model + tokenizer (run_dir/model)"),
    Int("trainer.num_threads", "torch CPU threads (null: torch's default)", nullable=True, ge=1),
    # ---- eval
    Bool("eval.test", "score the test set (false: validation only, e.g. tuning)"),
    Bool("eval.validation", "compute the validation NLL"),
    Choice("eval.validation_split", ("private", "public"), "whether the validation split is public (private: not covered)"),
    Choice("eval.decoding", ("beam", "greedy"), "decoding of the test sources"),
    Int("eval.num_beams", "beam width", ge=1),
    Int("eval.max_new_tokens", "longest generation", ge=1),
    Int("eval.batch_size", "evaluation batch (NLL uses 4×)", ge=1),
    # ---- logging
    Choice(
        "logging.nonprivate_diagnostics",
        (False, "file", "publish", True),
        "train loss, lot size, clip fractions, timings (not covered): file (owner-only diagnostics.jsonl) | publish (metrics, W&B too; true)",
    ),  # fmt: skip
    Bool("logging.oracle_alignment", "Muon: log true SNR and F(M)/F_BC(M) alignment with the noise-free buffer (not covered)"),
    Int("logging.epsilon_every", "compute ε spent every N steps (and at the last)", ge=1),
    Bool("logging.progress", "progress bars"),
    # ---- logger
    Choice("logger.name", ("none", "wandb"), "where metrics go besides the run directory"),
    Option("logger.project", "text", "W&B project"),
    Option("logger.entity", "text", "W&B entity", nullable=True),
    Option("logger.group", "text", "W&B group"),
    Option("logger.tags", "list", "W&B tags"),
    Choice("logger.mode", ("online", "offline", "disabled"), "W&B mode (null: online with an API key, else offline)", nullable=True),
)

BY_KEY = {option.key: option for option in OPTIONS}


def configured(cfg: DictConfig, key: str) -> Any:
    """The composed, resolved value of `key`, or ABSENT if this config has no such key."""
    try:
        value = OmegaConf.select(cfg, key, default=ABSENT, throw_on_missing=True)
    except OmegaConfBaseException as err:
        raise ConfigError(
            key, OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False), f"cannot resolve ({one_line(err)})", BY_KEY[key].valid()
        ) from None
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return value


def validate(cfg: DictConfig) -> None:
    """Check every declared option that the composed config sets; raise ConfigError on the first bad one."""
    _check_known_keys(cfg)
    for option in OPTIONS:
        value = configured(cfg, option.key)
        if value is not ABSENT:
            option.check(value)
    _check_heads(cfg)
    _check_sampling(cfg)
    _check_lot_fits(cfg)


# Options whose value is a whole mapping or list: the keys below them are the value's own.
CONTAINER_KINDS = {"mapping", "list", "betas", "ns_coefficients", "any"}


def is_option(key: str) -> bool:
    """A declared option, or a key inside a declared mapping (optimizer.recipe_lr.e2e)."""
    return key in BY_KEY or any(key.startswith(f"{name}.") for name, option in BY_KEY.items() if option.kind in CONTAINER_KINDS)


def unknown_option(key: str, value: Any) -> ConfigError:
    """`key=value: not an option`, with the declared keys it is closest to."""
    near = difflib.get_close_matches(key, BY_KEY, n=3, cutoff=0.75)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    return ConfigError(key, value, "not an option", f"an option listed by python -m dpmuon.train --options{hint}")


def _check_known_keys(cfg: DictConfig) -> None:
    """Every key of the config is declared: a `+key=` or a YAML typo would otherwise be ignored."""

    def walk(prefix: str, node: Any):
        if isinstance(node, dict) and node and prefix not in BY_KEY:
            for key, value in node.items():
                if not (prefix == "" and key == "hydra"):  # Hydra's own section, where a caller kept it
                    yield from walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            yield prefix, node

    for key, value in walk("", OmegaConf.to_container(cfg, resolve=False)):
        if not is_option(key):
            raise unknown_option(key, value)


def _check_sampling(cfg: DictConfig) -> None:
    """Shuffled lots are drawn from a seeded permutation: the OS CSPRNG cannot draw them."""
    secure = configured(cfg, "optimizer.private") is True and configured(cfg, "privacy.secure_noise") is True
    if secure and configured(cfg, "privacy.sampling") == "shuffle":
        raise ConfigError("privacy.sampling", "shuffle", "cannot be drawn from the OS CSPRNG (privacy.secure_noise=true)", "poisson (or secure_noise=false)")


def _check_lot_fits(cfg: DictConfig) -> None:
    """A lot larger than the training set can be refused before the data is read when its size is capped."""
    lot, cap = configured(cfg, "privacy.expected_lot_size"), configured(cfg, "data.max_train_examples")
    if ABSENT not in (lot, cap) and cap is not None and lot > cap:
        raise ConfigError(
            "privacy.expected_lot_size", lot, f"more than data.max_train_examples={cap} (the training set holds at most that many)", f"an integer in [1, {cap}]"
        )


def _check_heads(cfg: DictConfig) -> None:
    """A random-init model splits its width evenly over the heads (GPT-2's attention needs it)."""
    width, heads = configured(cfg, "model.n_embd"), configured(cfg, "model.n_head")
    if ABSENT not in (width, heads) and configured(cfg, "model.name_or_path") is None and width % heads:
        raise ConfigError("model.n_embd", width, f"not a multiple of model.n_head={heads}", f"a multiple of {heads}")


HUB_HINT = "a local directory ({key}=/path/to/model) or a hub id reachable from this machine"


@contextlib.contextmanager
def blamed_on(key: str, value: Any):
    """Report what a library raises for a configured value against that key, as one line.

    An unset (null) key cannot be the culprit: errors then go on to the driver's catch-all."""
    if value is None:
        yield
        return
    try:
        yield
    except (ValueError, TypeError, OSError) as err:  # DataError is a ValueError
        cause = err.__cause__ if isinstance(err.__cause__, (ValueError, TypeError, OSError)) else err
        raise ConfigError(key, value, *_explain(BY_KEY[key], value, cause)) from err


def _explain(option: Option, value: Any, err: BaseException) -> tuple[str, str]:
    """(what is wrong, what is valid) for an error a library raised while reading `value`."""
    if option.kind != "model_source" or not isinstance(value, str):
        return one_line(err), option.valid()
    hint = HUB_HINT.format(key=option.key)
    if Path(value).expanduser().is_dir():
        if not any(Path(value).expanduser().iterdir()):
            return f"the local directory {value} is empty", hint
        return f"cannot load from the local directory {value} ({one_line(err)})", hint
    # The hub's own message is several lines about caches and connections; the cause is one of two.
    return "not a local directory, and the Hugging Face hub could not provide it (offline, or no such id)", hint
