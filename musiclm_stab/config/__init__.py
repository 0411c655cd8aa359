"""Typed run configuration: the single source of truth for every setting of a run.

A recipe is a small YAML file with the sections below (`data`, `model`, `optim`, `train`); anything
not given takes the dataclass default. Overlays (recipes/overlays/*.yaml) are recipes layered after
another: ``--config study_prenorm_clip1_run2 --config overlays/tiny``. Command-line overrides use dotted keys:
``--model.norm_scheme=post --train.max_steps=20``. The fully resolved config is written to
``runs/<name>/config.yaml`` and is what evaluation, plotting and export read back.

Every value is validated here, before any work starts: unknown keys, bad types and unknown choices
fail with a message that names the setting and the valid choices; every number must be finite (checked
over all fields of every section, so a new setting is covered too) and in its range.

This package's face: it hands on the names a user imports (``from musiclm_stab.config import load_config``).
Where each part lives:

    checks.py         ConfigError, how a setting is declared (its default and one line) and checked
    model_section.py  the model's settings and the per-size defaults (SIZE_DEFAULTS: tiny, base, large)
    sections.py       the data, optim and train settings, and Config (the four sections)
    settings_file.py  reading a recipe or a run's config.yaml safely (plain YAML values only)
    recipes.py        the packaged recipes by name (recipe_file)
    loading.py        load_config (recipes, overlays, overrides), saving a config, a run's config read back
"""

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import config_from_run, load_config, save_config
from musiclm_stab.config.model_section import SIZE_DEFAULTS, ModelConfig
from musiclm_stab.config.recipes import recipe_file, recipe_names
from musiclm_stab.config.sections import Config, DataConfig, OptimConfig, TrainConfig

__all__ = ["SIZE_DEFAULTS", "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig", "TrainConfig",
           "config_from_run", "load_config", "recipe_file", "recipe_names", "save_config"]
