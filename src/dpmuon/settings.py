"""Options declared once, as fields of the class a config group's `_target_` names.

An optimizer's, a dataset's or a model's settings are a dataclass: each field is one option, its
type the annotation (`X | None`: null allowed), its default and its checks given here:

    momentum: float = option(0.95, "momentum β", ge=0, lt=1)

`@settings(group)` stores a class's options with their defaults in Hydra's ConfigStore, where a
YAML of conf/<group>/ takes them from; `dpmuon.config` reads the declarations (validation with
one-line errors, `--options`, the configuration reference). A class checks its own values as it
is built (`Settings.__post_init__`), with the same `Option` checks and the same one-line message
as the command line. The classes know nothing of the config package.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, UserError, shown_value

REQUIRED = dataclasses.MISSING  # an option without a default: the config must give it


def option(
    default: Any = REQUIRED,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    kind: str | None = None,
    choices: tuple = (),
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field that is a config option. `kind` names a check other than the type's
    (e.g. "betas", "model_source"); `choices` lists the allowed values; gt/ge/lt bound a number."""
    metadata = {"help": help, "kind": kind, "choices": tuple(choices), "gt": gt, "ge": ge, "lt": lt}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class Settings:
    """Base of a settings class (a dataclass): an option that is itself a settings class may be
    given as a mapping (as `hydra.utils.instantiate` passes a config section's sub-sections).
    Every option is checked as it is built, with the command line's one-line message
    (`optimizer.lr=-1: must be > 0; valid: a number > 0`), whether from a YAML or from Python."""

    settings_group = ""  # the config group `@settings` stored it under: the prefix of its keys

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), hints[f.name]
            if dataclasses.is_dataclass(kind) and isinstance(value, Mapping):
                setattr(self, f.name, kind(**value))
        prefix = self.settings_group or type(self).__name__
        for option in declared_options(prefix, type(self)):
            value = self
            for name in option.key.split(".")[1:]:
                value = getattr(value, name)
            option.check(value)


def defaults_of(cls: type) -> dict:
    """Every option of `cls` with its default, nested as in a config section; one without a
    default is `???` (OmegaConf's missing value: it does not replace a value set before it)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        else:
            out[f.name] = "???"
    return out


_REGISTERED: dict[str, dict[str, type]] = {}  # group → name → settings class (`@settings(group, name=...)`)


def settings(group: str, target: bool = True, name: str | None = None) -> Callable[[type], type]:
    """Class decorator: store the options of a settings class, with their defaults and (target)
    its `_target_`, in Hydra's ConfigStore as `settings/<group>/<ClassName>`. A YAML of
    conf/<group>/ lists it first in its defaults and sets only what differs:

        defaults:
          - /settings/optimizer/AdamSettings@_here_
          - _self_

    A group whose YAMLs may name one of several classes (optimizer, dataset, model) keeps the
    `_target_`; a group with one class of its own (privacy) has none: the schema knows it.
    `name` registers the class under that name (its `name` option's default; `registered(group)`
    lists them): the one list of a group's entries that code outside the configs reads, e.g.
    `dpmuon.optim.build("dp_muon", ...)`.
    """
    from hydra.core.config_store import ConfigStore

    def store(cls: type) -> type:
        cls.settings_group = group
        node = {"_target_": f"{cls.__module__}.{cls.__qualname__}"} if target else {}
        node |= defaults_of(cls)
        if name is not None:
            taken = _REGISTERED.setdefault(group, {}).get(name)
            if taken is not None and taken.__qualname__ != cls.__qualname__:
                raise ValueError(f"@settings({group!r}, name={name!r}): {taken.__qualname__} is registered under that name already")
            _REGISTERED[group][name] = cls
            node["name"] = name
        ConfigStore.instance().store(group=f"settings/{group}", name=cls.__name__, node=node)
        return cls

    return store


def registered(group: str) -> dict[str, type]:
    """The settings classes registered in `group` by name (`@settings(group, name=...)`)."""
    return dict(_REGISTERED.get(group, {}))


def check_settings_stored(config_dir: str | Path) -> None:
    """Every YAML that lists a settings class (`/settings/<group>/<Class>`) names one that an
    imported module stored with `@settings(<group>)`; else Hydra would fail every run, even one
    that never selects that YAML, with a traceback that does not name the file."""
    from hydra.core.config_store import ConfigStore
    from hydra.plugins.config_source import ConfigLoadError
    from omegaconf import DictConfig, OmegaConf

    for path in sorted(Path(config_dir).glob("*/*.yaml")):
        own = OmegaConf.load(path)
        entries = own.get("defaults", []) if isinstance(own, DictConfig) else []
        for entry in (e for e in entries if isinstance(e, str) and e.startswith("/settings/")):
            try:
                ConfigStore.instance().load(f"{entry.split('@')[0].lstrip('/')}.yaml")
            except ConfigLoadError:
                group, name = entry.split("@")[0].split("/")[2:4]
                stored = sorted(ConfigStore.instance().repo["settings"].get(group, {}))
                raise UserError(
                    f"{path.relative_to(Path(config_dir).parent)}: lists the settings class {name}, which no imported module stored with "
                    f"@settings({group!r}) (stored: {', '.join(s.removesuffix('.yaml') for s in stored)}); "
                    f"import the module that defines it in dpmuon/config/__init__.py"
                ) from None


# -- checking an option's value (the command line's validation and a class's own) -------------


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
            text = "a mapping, e.g. {dp_adam: 1e-3}"
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
    # A file's name may come from Python as a path object (the command line gives strings).
    return None if isinstance(value, (str, os.PathLike)) else "not a string"


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


KIND_OF_TYPE = {float: "float", int: "int", bool: "bool", str: "text", list: "list", dict: "mapping"}


def declared_options(prefix: str, cls: type) -> list[Option]:
    """The options `cls` declares as fields, under `prefix` (a nested settings class: its own keys)."""
    hints = typing.get_type_hints(cls)
    options = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:  # a plain field, not an option (a subclass's inputs from elsewhere)
            continue
        key, meta = f"{prefix}.{f.name}", f.metadata
        hint, nullable = _without_none(hints[f.name])
        if dataclasses.is_dataclass(hint):
            options += declared_options(key, hint)
            continue
        kind = meta.get("kind") or ("choice" if meta.get("choices") else KIND_OF_TYPE.get(typing.get_origin(hint) or hint, "any"))
        bounds = {bound: meta.get(bound) for bound in ("gt", "ge", "lt")}
        options.append(Option(key, kind, meta.get("help", ""), nullable=nullable, choices=tuple(meta.get("choices", ())), **bounds))
    return options


def _without_none(hint: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of an annotation such as `float | None`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return (args[0] if len(args) == 1 else hint), len(args) < len(typing.get_args(hint))
    return hint, False
