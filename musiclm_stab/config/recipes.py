"""The packaged recipes by name: ``recipe_file``, the one reading of a recipe's name (a file, or a recipe that
ships with the package), for ``--config``, ``musiclm-stab train --config_file`` and ``ms.recipe`` alike."""

from __future__ import annotations

from pathlib import Path

from musiclm_stab.config.checks import ConfigError

# The recipes ship inside the package (musiclm_stab/recipes, package data), so their names work in an installed
# wheel as in a checkout, whose recipes/ is a symlink to that folder; its accelerate/ holds accelerate's config
# files for `musiclm-stab train --config_file`.
PACKAGED_RECIPES = Path(__file__).resolve().parent.parent / "recipes"
ACCELERATE_CONFIGS = "accelerate"


def recipe_names(accelerate: bool = False) -> list[str]:
    """The names of the packaged recipes and overlays (``tiny``, ``overlays/tiny``), or with ``accelerate``
    of the packaged accelerate config files (``accelerate/8gpu``)."""
    names = (p.relative_to(PACKAGED_RECIPES).with_suffix("").as_posix() for p in PACKAGED_RECIPES.rglob("*.yaml"))
    return sorted(n for n in names if n.startswith(f"{ACCELERATE_CONFIGS}/") == accelerate)


def recipe_file(name: str | Path, accelerate: bool = False) -> Path:
    """The YAML file a recipe names: a path to an existing file, else a packaged recipe by name, ``.yaml``
    optional and ``recipes/`` as a checkout writes it allowed (``tiny``, ``overlays/tiny``,
    ``recipes/tiny.yaml``); with ``accelerate``, an accelerate config file (``accelerate/8gpu``). The one
    reading of a recipe's name: ``--config``, ``musiclm-stab train --config_file``, ``ms.recipe``. ConfigError
    naming the packaged ones when it is neither."""
    path = Path(name)
    if path.is_file():
        return path
    text = path.as_posix()
    for stem in (text, text.removeprefix("recipes/")):
        stem = stem if stem.endswith(".yaml") else f"{stem}.yaml"
        if stem[:-5] in recipe_names(accelerate):
            return PACKAGED_RECIPES / stem
    what = "accelerate config file" if accelerate else "config file"
    raise ConfigError(f"{what} {name} does not exist, and no packaged one has that name (packaged: "
                      f"{', '.join(recipe_names(accelerate))})")
