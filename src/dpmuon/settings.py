"""Options declared once, as fields of the class a config group's `_target_` names.

An optimizer's, a dataset's or a model's settings are a dataclass: each field is one option, its
type the annotation (`X | None`: null allowed), its default and its checks given here:

    momentum: float = option(0.95, "momentum β", ge=0, lt=1)

`@settings(group)` stores a class's options with their defaults in Hydra's ConfigStore, where a
YAML of conf/<group>/ takes them from; `dpmuon.config` reads the declarations (validation with
one-line errors, `--options`, the configuration reference). The classes know nothing of the
config package.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

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
    given as a mapping (as `hydra.utils.instantiate` passes a config section's sub-sections)."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), hints[f.name]
            if dataclasses.is_dataclass(kind) and isinstance(value, Mapping):
                setattr(self, f.name, kind(**value))


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


def settings(group: str) -> Callable[[type], type]:
    """Class decorator: store the options of a settings class, with their defaults and its
    `_target_`, in Hydra's ConfigStore as `settings/<group>/<ClassName>`. A YAML of conf/<group>/
    lists it first in its defaults and sets only what differs:

        defaults:
          - /settings/optimizer/AdamSettings@_here_
          - _self_
    """
    from hydra.core.config_store import ConfigStore

    def store(cls: type) -> type:
        node = {"_target_": f"{cls.__module__}.{cls.__qualname__}", **defaults_of(cls)}
        ConfigStore.instance().store(group=f"settings/{group}", name=cls.__name__, node=node)
        return cls

    return store
