"""Loading a config: recipes layered in order, then ``section.key=value`` overrides, each value turned into its
setting's type (``_coerce``; ``setting_text`` writes one back), validated and resolved; writing the resolved
config (a run's config.yaml, ``--print-config``) and reading a run's back as it ran."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from musiclm_stab.config.checks import ConfigError, _show
from musiclm_stab.config.recipes import recipe_file
from musiclm_stab.config.sections import Config
from musiclm_stab.config.settings_file import read_settings_file

# List settings that may be empty (every other list setting must name at least one thing).
EMPTY_LIST_OK = ("train.trackers",)

# What a run directory written before a setting existed did, for the settings added since (issue 15):
# config_from_run fills these in when its config.yaml lacks them, so an old run reads back as it ran.
SETTINGS_BEFORE_THEY_EXISTED: dict[str, dict[str, Any]] = {
    "model": {"init": "xavier", "require_same_masks": False},
    "data": {"mixup_mode": "rms"},
    "train": {"loss_unit": "nats", "fp16_mode": "amp"},
}


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Turn a YAML or command-line value into the field's declared type, or raise ConfigError."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        lists = [a for a in inner if typing.get_origin(a) is list]
        if lists and (isinstance(value, (list, tuple)) or (isinstance(value, str) and value.strip().startswith("["))):
            return _coerce(key, value, lists[0])
        return _coerce(key, value, inner[0])
    if origin is list:  # YAML list, or "[a, b]" on the command line
        if isinstance(value, str):
            value = [v.strip() for v in value.strip().strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or (not value and key not in EMPTY_LIST_OK):
            raise ConfigError(f"{key} must be a non-empty list, got {_show(value)}")
        return [_coerce(key, v, args[0]) for v in value]
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {_show(value)}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key} must be true or false, got {_show(value)}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {_show(value)}")
        if not isinstance(value, (int, float, str)):  # checked before str(value) below formats a whole list
            raise ConfigError(f"{key} must be {annotation.__name__}, got {_show(value)}")
        try:
            number = float(value) if annotation is float else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be {annotation.__name__}, got {_show(value)}") from None
        return number
    if annotation is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare `no` / `yes` as a boolean
            return "no" if value is False else "yes"
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {_show(value)}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {annotation}")


def setting_text(value: Any) -> str:
    """A setting's value as the command line writes it (``--section.key=TEXT``), which ``_coerce`` reads back:
    true/false, none, [a,b] for a list or pair, a float's repr."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(setting_text(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else str(value)


@functools.cache
def _hints(section_type: type) -> dict[str, Any]:
    """The declared type of each setting of a section's class: ``typing.get_type_hints`` evaluates every
    annotation's text again on each call (most of a config's loading time, which a study's plan pays once per
    run and setting), and a class's annotations do not change, so each class's are evaluated once."""
    return typing.get_type_hints(section_type)


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(f"unknown setting {_show(dotted)}; settings are <section>.<key> with section one of: "
                          f"{', '.join(sections)}")
    section = getattr(cfg, parts[0])
    hints = _hints(type(section))
    names = [f.name for f in dataclasses.fields(section)]
    if parts[1] not in names:
        raise ConfigError(f"unknown setting {_show(dotted)}; valid keys of {parts[0]}: {', '.join(names)}")
    setattr(section, parts[1], _coerce(dotted, value, hints[parts[1]]))


def load_config(path: str | Path | list[str | Path] | tuple | None = None, overrides: list[str] | None = None,
                recorded: bool = False) -> Config:
    """Read a recipe YAML, or several layered in order (a recipe, then overlays such as
    recipes/overlays/tiny.yaml: a later file sets what it names, the rest stays), apply ``section.key=value``
    overrides, validate, and fill in the per-size values (``Config.resolved``). A recipe is a file or the
    name of a packaged one (``recipe_file``: ``tiny``, ``overlays/tiny``).

    Raises ConfigError naming the offending setting and the valid choices. ``recorded``: the file is a run's
    own record (``config_from_run``), read as the run had it: checks that concern starting a run
    (``check_schedule``, added after runs were made that it refuses) are left out.
    """
    cfg = Config()
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    for path in map(recipe_file, paths):
        raw = read_settings_file(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}")
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: section {_show(section)} must be a mapping")
            for key, value in values.items():
                try:
                    _set(cfg, f"{section}.{key}", value)
                except ConfigError as e:  # which of the files holds the bad value
                    raise ConfigError(f"{path}: {e}") from None
    for item in overrides or []:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {_show(item)} must look like section.key=value")
        key, value = item.split("=", 1)
        _set(cfg, key, value)  # raw text: _coerce converts it by the field's type ("no" stays a string)
    cfg.validate()
    if not recorded:
        check_schedule(cfg)
    return cfg.resolved()


def check_schedule(cfg: Config) -> None:
    """Refuse a warmup longer than the run (``optim.warmup_steps`` > ``train.max_steps``): the lr would never
    reach ``optim.lr``, and the decay after the warmup would never start."""
    warmup, steps = cfg.optim.warmup_steps, cfg.train.max_steps
    if warmup is not None and warmup > steps:
        raise ConfigError(f"optim.warmup_steps={warmup} is longer than the run, train.max_steps={steps}: at most "
                          f"{steps} (or null: optim.warmup_share of the run)")


def config_yaml(cfg: Config, comment: str = "") -> str:
    """The resolved config as YAML, after ``comment`` (as # lines, which loading ignores): what a run's
    config.yaml holds and what the trainer's --print-config prints."""
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    return header + yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: Config, path: str | Path, comment: str = "") -> None:
    """Write the resolved config as YAML (``config_yaml``)."""
    Path(path).write_text(config_yaml(cfg, comment))


def config_from_run(run_dir: str | Path) -> Config:
    """The resolved config of an existing run directory. Settings added after the run was made, and so
    absent from its config.yaml, read back as the run had them (``SETTINGS_BEFORE_THEY_EXISTED``)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: {path.name} is missing")
    saved = read_settings_file(path) or {}
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(saved).__name__}")
    missing = [f"{section}.{key}={value}" for section, values in SETTINGS_BEFORE_THEY_EXISTED.items()
               for key, value in values.items()
               if isinstance(saved.get(section), dict) and key not in saved[section]]
    return load_config(path, missing, recorded=True)
