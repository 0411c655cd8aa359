"""How a setting is declared and checked: ``ConfigError``, the field that carries a setting's default and its
one-line description (``_setting``), and the checks every section's ``validate`` uses (a choice, a lower
bound, finite numbers), which quote the value given boundedly (``_show``)."""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A setting is unknown, of the wrong type, or not one of the valid choices."""


# A value as an error message shows it: at most a few elements per level, a few levels deep, long strings
# and numbers cut, so the message stays a line whatever the value (a YAML alias can make a small file hold
# a list of billions of elements, and its full repr took 80 s and 3.6 GB).
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxdict = 3, 4, 4, 4
_SHOW.maxstring, _SHOW.maxlong, _SHOW.maxother = 80, 40, 80
_SHOW_AT_MOST = 160  # characters


def _show(value: Any) -> str:
    """``repr(value)``, bounded (see ``_SHOW``): how every value given by the user is quoted in a message."""
    text = _SHOW.repr(value)
    return text if len(text) <= _SHOW_AT_MOST else text[:_SHOW_AT_MOST - 3] + "..."


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={_show(value)} is not valid; choose one of: {', '.join(choices)}")


def _at_least(name: str, value: float | None, low: float, strict: bool = False) -> None:
    """``value >= low`` (``> low`` when strict); None (the size's value, or off) passes."""
    if value is not None and (value <= low if strict else value < low):
        raise ConfigError(f"{name} must be {'>' if strict else '>='} {low}, got {_show(value)}")


def _finite(section: str, values: Any) -> None:
    """Every float of a config section (alone or in a tuple/list) is finite.

    nan fails every comparison, so a range check written as ``if value <= 0: raise`` lets it through, and
    inf passes every lower bound; one check over all fields covers every setting, present and future.
    """
    for f in dataclasses.fields(values):
        value = getattr(values, f.name)
        numbers = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            raise ConfigError(f"{section}.{f.name} must be a finite number, got {_show(value)}")


def _setting(default: Any, doc: str, choices: tuple[str, ...] = ()) -> Any:
    """A setting's field: its default, one line saying what it does and, for a setting with a fixed set of
    values, its choices (``metadata={"help": ...}``, as HfArgumentParser reads it): the trainer's --help
    lists every setting from these (``setting_docs``)."""
    metadata = {"help": doc, **({"choices": choices} if choices else {})}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)
