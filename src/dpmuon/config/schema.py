"""The configuration schema: one declaration per option (type, allowed values, help).

The driver's own options are declared here, with their defaults in `conf/`, or by a settings class
of their group (`GROUP_CLASSES`: data, recipe, privacy, trainer, eval, logging, logger). A config group whose
section names a class in `_target_` (an optimizer, a dataset, a model) takes the rest from that
class's fields (`dpmuon.settings.option`: type, default, checks, help), declared once beside the
code that uses them. `validate` checks a composed config before anything is read or loaded, so
a mistyped or out-of-range value ends in one line naming the key:

    error: privacy.clip_norm=-1: must be > 0; valid: a number > 0
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
from pathlib import Path
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..data.dataset import DataSettings
from ..errors import ConfigError, UserError, one_line, shown_value  # noqa: F401  (ConfigError, one_line: re-exported)
from ..eval.settings import EvalSettings
from ..paths import CONFIG_DIR
from ..privacy.settings import PrivacySettings
from ..settings import Option, declared_options, looks_local  # noqa: F401  (looks_local: re-exported)
from ..training.settings import LoggerSettings, LoggingSettings, RecipeSettings, TrainerSettings

ABSENT = object()


# The top-level options and the `_target_` of the groups that name their class; the classes
# (SETTINGS_GROUPS' `_target_`s and GROUP_CLASSES) declare every other option.
FIXED: tuple[Option, ...] = (
    # ---- top level
    Option("seed", "int", "public seed: initialisation, dropout, DP-MuonBC probes (never the mechanism)", ge=0),
    Option("resume", "path", "run directory to continue (its stored config is used)", nullable=True),
    Option("experiment_name", "text", "tag naming the output folder and the W&B group"),
    # ---- dataset
    Option("dataset._target_", "text", "the dataset's settings class (its fields are the other options; reader() reads it)"),
    # ---- model
    Option("model._target_", "text", "the model's settings class (its fields are the other options; build() makes the model)"),
    # ---- optimizer (its class, `_target_`, declares the rest: dpmuon.optim.settings)
    Option("optimizer._target_", "text", "the optimizer's settings class (its fields are the other options; build() makes it)"),
)

SETTINGS_GROUPS = ("optimizer", "dataset", "model")  # groups whose `_target_` class declares their options
# Groups declared by one class of their own (no `_target_`).
GROUP_CLASSES = {
    "data": DataSettings,
    "recipe": RecipeSettings,
    "privacy": PrivacySettings,
    "trainer": TrainerSettings,
    "eval": EvalSettings,
    "logging": LoggingSettings,
    "logger": LoggerSettings,
}


def driver_options() -> dict[str, Option]:
    """The options every config has: FIXED's and those of the GROUP_CLASSES."""
    options = {option.key: option for option in FIXED}
    for group, cls in GROUP_CLASSES.items():
        options.update((o.key, o) for o in declared_options(group, cls))
    return options


# Annotated types → option kinds (a field's `kind` metadata overrides).
def target_class(group: str, target: Any) -> type:
    """The settings class a group's `_target_` names."""
    try:
        cls = get_class(str(target))
    except Exception as err:  # Hydra wraps the import error in its own
        valid = "a settings class, e.g. dpmuon.optim.settings.AdamSettings"
        raise ConfigError(f"{group}._target_", target, f"cannot import ({one_line(err)})", valid) from None
    if not dataclasses.is_dataclass(cls) or not all("help" in f.metadata for f in dataclasses.fields(cls)):
        raise ConfigError(f"{group}._target_", target, "not a settings class", "a dataclass whose fields are options (dpmuon.settings.option)")
    return cls


def options_for(cfg: DictConfig) -> dict[str, Option]:
    """The options of this config: the driver's, and those of the classes its groups name."""
    options = driver_options()
    for group in SETTINGS_GROUPS:
        target = OmegaConf.select(cfg, f"{group}._target_", default=None)
        if target is not None:
            options.update((o.key, o) for o in declared_options(group, target_class(group, target)))
    return options


@functools.cache
def repo_options() -> dict[str, Option]:
    """Every option of the repository's configs: the driver's, and those of every class a file of
    conf/optimizer/, conf/dataset/ or conf/model/ names (the first declaration of a key wins, its
    choices joined with those of the others: E2E's and DART's `format`)."""
    from .roster import group_yaml  # (the roster imports this module's package)

    options = driver_options()
    for group in SETTINGS_GROUPS:
        for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
            target = group_yaml(group, path.stem).get("_target_")
            for option in declared_options(group, target_class(group, target)) if target else ():
                first = options.setdefault(option.key, option)
                if first.choices != option.choices:
                    options[option.key] = dataclasses.replace(first, choices=first.choices + tuple(c for c in option.choices if c not in first.choices))
    return options


def configured(cfg: DictConfig, key: str, option: Option | None = None) -> Any:
    """The composed, resolved value of `key`, or ABSENT if this config has no such key."""
    option = option or repo_options()[key]
    parent, _, leaf = key.rpartition(".")
    section = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    if isinstance(section, DictConfig) and leaf in section.keys() and OmegaConf.is_missing(section, leaf):
        raise ConfigError(key, None, "must be set (it has no default)", option.valid())
    try:
        value = OmegaConf.select(cfg, key, default=ABSENT, throw_on_missing=True)
    except OmegaConfBaseException as err:
        shown = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        raise ConfigError(key, shown, f"cannot resolve ({one_line(err)})", option.valid()) from None
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return value


def validate(cfg: DictConfig) -> None:
    """Check every declared option that the composed config sets; raise ConfigError on the first bad one."""
    options = options_for(cfg)
    _check_known_keys(cfg, options)
    for option in options.values():
        value = configured(cfg, option.key, option)
        if value is not ABSENT:
            option.check(value)
    _check_heads(cfg)
    _check_sampling(cfg)
    _check_lot_fits(cfg)


# Options whose value is a whole mapping or list: the keys below them are the value's own.
CONTAINER_KINDS = {"mapping", "list", "betas", "ns_coefficients", "any"}


def is_option(key: str, options: dict[str, Option] | None = None) -> bool:
    """A declared option, or a key inside a declared mapping (recipe.lr.dp_adam)."""
    options = repo_options() if options is None else options
    return key in options or any(key.startswith(f"{name}.") for name, option in options.items() if option.kind in CONTAINER_KINDS)


def unknown_option(key: str, value: Any, options: dict[str, Option] | None = None) -> ConfigError:
    """`key=value: not an option`, with the declared keys it is closest to."""
    near = difflib.get_close_matches(key, repo_options() if options is None else options, n=3, cutoff=0.75)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    return ConfigError(key, value, "not an option", f"an option listed by python -m dpmuon.train --options{hint}")


def _check_known_keys(cfg: DictConfig, options: dict[str, Option]) -> None:
    """Every key of the config is declared: a `+key=` or a YAML typo would otherwise be ignored."""

    def walk(prefix: str, node: Any):
        if isinstance(node, dict) and node and prefix not in options:
            for key, value in node.items():
                if not (prefix == "" and key == "hydra"):  # Hydra's own section, where a caller kept it
                    yield from walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            yield prefix, node

    for key, value in walk("", OmegaConf.to_container(cfg, resolve=False)):
        if not is_option(key, options):
            raise unknown_option(key, value, options)


def _check_sampling(cfg: DictConfig) -> None:
    """A private run samples Poisson lots: fixed-size shuffled lots are not what the accountant
    composes, so the ε it would report for them is no guarantee (make_private refuses them too,
    unless told allow_shuffle_sampling=True). They are drawn from a seeded permutation besides,
    which the OS CSPRNG of secure_noise cannot draw. A non-private run samples Poisson lots
    whatever the key says (it has no accountant to mislead)."""
    if configured(cfg, "optimizer.private") is not True or configured(cfg, "privacy.sampling") != "shuffle":
        return
    if configured(cfg, "privacy.secure_noise") is True:
        raise ConfigError("privacy.sampling", "shuffle", "cannot be drawn from the OS CSPRNG (privacy.secure_noise=true)", "poisson")
    raise ConfigError(
        "privacy.sampling",
        "shuffle",
        "fixed-size shuffled lots are not covered by the Poisson-subsampled accountant, so a private run's ε would not be a guarantee",
        "poisson",
    )


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
        raise ConfigError(key, value, *_explain(repo_options()[key], value, cause)) from err


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
