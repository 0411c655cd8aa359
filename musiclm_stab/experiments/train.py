"""``musiclm-stab train``: pretraining under accelerate launch, from a checkout or an installed package.

    musiclm-stab train --config tiny --data.path=work/tokens --train.name=my-run
    musiclm-stab train --config_file accelerate/8gpu -- --config study_prenorm_clip1_run2 --data.path=work/tokens

It becomes ``accelerate launch [ACCELERATE OPTIONS] -m musiclm_stab.pretrain [ARGS]`` (the process is
replaced, so signals, exit status and accelerate's own handling are exactly that command's). accelerate's
options come first, ended by ``--``; without ``--`` every argument is the trainer's (training/arguments.py)
and accelerate uses its default config, as a bare ``accelerate launch`` does. ``--config_file`` may name a
packaged accelerate config (``accelerate/1gpu``, ``accelerate/8gpu``, ...) as ``--config`` names a recipe.
The recipes and settings are checked here first, so a bad one fails before accelerate starts anything;
``--help`` is answered here.
"""

from __future__ import annotations

import os
import re
import sys

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import load_config
from musiclm_stab.config.recipes import recipe_file
from musiclm_stab.config.sections import SETTING_NAME
from musiclm_stab.experiments.launch import accelerate_executable
from musiclm_stab.training.arguments import ENTRY_MODULE, parse_trainer_args, trainer_parser

SEPARATOR = "--"
# The trainer's own arguments, which are never accelerate's (its option is --config_file, not --config).
_TRAINER_WORD = re.compile(rf"^(--config(=.*)?|--resume|--print-config|--{SETTING_NAME}(=.*)?)$")
_CONFIG_FILE = ("--config_file", "--config-file")


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate's options, the trainer's arguments): before and after the first ``--``; without one,
    every argument is the trainer's. ConfigError for a trainer's argument among accelerate's."""
    if SEPARATOR not in argv:
        return [], list(argv)
    i = argv.index(SEPARATOR)
    accelerate, trainer = argv[:i], argv[i + 1:]
    misplaced = [w for w in accelerate if _TRAINER_WORD.match(w)]
    if misplaced:
        raise ConfigError(f"{' '.join(misplaced)} before '--', among accelerate launch's options: the trainer's "
                          f"arguments go after it ({trainer_parser().usage})")
    return accelerate, trainer


def packaged_config_files(options: list[str]) -> list[str]:
    """accelerate's options with a ``--config_file`` that names a packaged accelerate config
    (``accelerate/8gpu``) given as its file; a file that exists is kept as it is."""
    out = list(options)
    for i, word in enumerate(out):
        name, value = word.split("=", 1) if "=" in word else (word, None)
        if name not in _CONFIG_FILE:
            continue
        if value is not None:
            out[i] = f"{name}={recipe_file(value, accelerate=True)}"
        elif i + 1 < len(out):
            out[i + 1] = str(recipe_file(out[i + 1], accelerate=True))
    return out


def launch_argv(argv: list[str]) -> list[str]:
    """The ``accelerate launch ... -m musiclm_stab.pretrain ...`` command that ``musiclm-stab train
    ARGV`` runs, its recipes and settings checked (ConfigError otherwise)."""
    accelerate, trainer = split_arguments(argv)
    args = parse_trainer_args(trainer)  # argparse's usage error (exit 2) for what is not the trainer's
    load_config(args.configs, args.overrides)
    head = accelerate_executable()
    return [*([head] if isinstance(head, str) else head), "launch", *packaged_config_files(accelerate),
            "-m", ENTRY_MODULE, *trainer]


def cli_main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        trainer_parser().parse_args(["--help"])  # prints every setting and exits 0
    try:
        cmd = launch_argv(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)  # becomes accelerate launch: its exit status and signal handling are this command's
