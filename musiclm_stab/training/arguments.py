"""The trainer's command line: recipes (``--config``), ``--resume``, ``--print-config`` and every setting as
``--section.key=value``, each listed by ``--help`` with its type, default and what it does (read from the
fields of config/, the one place a setting is described). Light: no torch, so ``musiclm-stab train --help``
answers at once.

    musiclm-stab train [ACCELERATE OPTIONS --] [--config RECIPE ...] [--resume] [--print-config] [--s.key=value ...]
    accelerate launch [ACCELERATE OPTIONS] -m musiclm_stab.pretrain [the same arguments]
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from musiclm_stab.config.loading import setting_text
from musiclm_stab.config.model_section import SIZE_DEFAULTS
from musiclm_stab.config.recipes import recipe_names
from musiclm_stab.config.sections import Config

PROG = "musiclm-stab train"
ENTRY_MODULE = "musiclm_stab.pretrain"  # what `musiclm-stab train` runs under accelerate launch
REFERENCE = "Reference: docs/TRAINING.md (offline: musiclm-stab docs TRAINING)"


@dataclass
class TrainerArgs:
    configs: list[str]  # recipes in order: names of packaged ones or YAML files
    overrides: list[str]  # section.key=value, applied after the recipes
    resume: bool
    print_config: bool


def _kind(annotation: Any, choices: tuple[str, ...]) -> str:
    """A setting's type as --help shows it: INT, FLOAT, STR, {a,b}, [NAME,...], INT|none, ..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [_kind(a, choices) for a in args if a is not type(None)]
        return "|".join(inner + (["none"] if type(None) in args else []))
    if origin is list:
        return "[NAME,...]" if choices else f"[{_kind(args[0], choices)},...]"
    if origin is tuple:
        return "[" + ",".join(_kind(a, ()) for a in args) + "]"
    if annotation is bool:
        return "{true,false}"
    if choices:
        return "{" + ",".join(choices) + "}"
    return annotation.__name__.upper()


def _default(section: str, name: str, value: Any) -> str:
    """A setting's default as the command line writes it; a per-size one (None) with each size's value."""
    per_size = {size: rows[section][name] for size, rows in SIZE_DEFAULTS.items() if name in rows.get(section, {})}
    if value is None and per_size:
        return "the size's: " + ", ".join(f"{size} {setting_text(v)}" for size, v in per_size.items())
    return setting_text(value)


def setting_lines() -> list[tuple[str, str, str, str]]:
    """Every setting as (``section.key``, type, default, description), in Config's order."""
    out = []
    for section, cls in typing.get_type_hints(Config).items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            choices = tuple(f.metadata.get("choices", ()))
            doc = f.metadata["help"]
            if choices and typing.get_origin(hints[f.name]) is list:  # the type says [NAME,...]
                doc += f"; names: {', '.join(choices)}"
            out.append((f"{section}.{f.name}", _kind(hints[f.name], choices), _default(section, f.name, default),
                        doc))
    return out


def trainer_parser() -> argparse.ArgumentParser:
    """The trainer's parser, shared by ``musiclm-stab train`` and ``-m musiclm_stab.pretrain``."""
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} [ACCELERATE OPTIONS --] [--config RECIPE ...] [--resume] [--print-config] "
              "[--section.key=value ...]",
        description="Pretrain a music masked-LM under accelerate: the recipes layered in order, then the "
        "settings. It runs `accelerate launch [ACCELERATE OPTIONS] -m musiclm_stab.pretrain ARGS`: "
        "accelerate's options (--num_processes 8, --mixed_precision bf16, --config_file accelerate/8gpu for a "
        "packaged one; `accelerate launch --help`) come first, ended by `--`; without `--` every argument is "
        "the trainer's and accelerate uses its default config (`accelerate config`).",
        epilog=REFERENCE)
    p.add_argument("--config", action="append", default=[], metavar="RECIPE",
                   help="a recipe: a packaged one by name (" + ", ".join(recipe_names()) + ") or a YAML file; "
                   "again for an overlay layered on top (--config study_prenorm_clip1_run2 --config overlays/tiny)")
    p.add_argument("--resume", action="store_true", help="continue the run from its newest complete checkpoint")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML (recipes, overlays, settings, and the precision and "
                   "process count of the launch) and exit; touches no file")
    groups: dict[str, Any] = {}  # section -> its argument group
    for name, kind, default, doc in setting_lines():
        section = name.split(".")[0]
        if section not in groups:
            groups[section] = p.add_argument_group(f"{section} settings (--{section}.key=value)")
        groups[section].add_argument(f"--{name}", metavar=kind, default=argparse.SUPPRESS,
                                     help=f"{doc} (default: {default})".replace("%", "%%"))
    return p


def parse_trainer_args(argv: list[str] | None) -> TrainerArgs:
    """The trainer's arguments; argparse's usage error (exit 2) for anything that is not one. A setting that
    is not one of config/'s is passed on as an override, so that load_config names the valid keys."""
    parser = trainer_parser()
    args, rest = parser.parse_known_args(argv)
    bad = [r for r in rest if not (r.startswith("--") and "=" in r)]
    if bad:
        parser.error(f"unrecognized arguments {bad}; settings look like --section.key=value")
    given = [f"{key}={value}" for key, value in vars(args).items() if "." in key]
    return TrainerArgs(args.config, [*given, *rest], args.resume, args.print_config)
