"""Config: recipes, dotted overrides, validation messages."""

import pytest

from musiclm_stab.config import ConfigError, config_from_run, load_config, save_config


def test_defaults_resolve_tiny_size():
    """The default config validates and the tiny size fills the model dimensions."""
    cfg = load_config()
    m = cfg.model.resolved()
    assert (m.num_layers, m.width, m.num_heads) == (2, 128, 4)


def test_dotted_overrides_are_typed():
    """Overrides are coerced to the field's type (int, float, bool, tuple, optional)."""
    cfg = load_config(None, ["--model.norm_scheme=post", "optim.lr=1e-3", "--train.max_steps=7",
                             "--model.qk_norm=true", "--optim.betas=[0.9,0.95]", "--model.num_layers=3"])
    assert cfg.model.norm_scheme == "post" and cfg.optim.lr == 1e-3 and cfg.train.max_steps == 7
    assert cfg.model.qk_norm is True and cfg.optim.betas == (0.9, 0.95)
    assert cfg.model.resolved().num_layers == 3


@pytest.mark.parametrize("override, fragment", [
    ("--model.norm_scheme=bogus", "choose one of: pre, post, deepnorm, sandwich, subln"),
    ("--model.attention=flash", "choose one of: sdpa, math, relax"),
    ("--model.size=huge", "choose one of: tiny, base, large"),
    ("--model.colour=red", "valid keys of model"),
    ("--nosuch.key=1", "section one of: data, model, optim, train"),
    ("--train.max_steps=many", "train.max_steps must be int"),
    ("--train.mixed_precision=fp8", "choose one of: no, fp16, bf16"),
    ("--model.qk_norm=maybe", "must be true or false"),
    ("--optim.clip_grad=0", "optim.clip_grad must be > 0"),
])
def test_bad_settings_name_the_setting(override, fragment):
    """Each bad setting fails with a message naming it and the valid choices."""
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_contradictory_combination_refused():
    """PB-relax on top of QK-norm is refused at config time."""
    with pytest.raises(ConfigError, match="relax cannot be combined"):
        load_config(None, ["--model.attention=relax", "--model.qk_norm=true"])


def test_roundtrip_through_run_dir(tmp_path):
    """A saved resolved config reads back identical, with the size's dimensions written out."""
    cfg = load_config("recipes/tiny.yaml", ["--model.norm_scheme=post"])
    save_config(cfg, tmp_path / "config.yaml")
    back = config_from_run(tmp_path)
    assert back.to_dict() == cfg.to_dict()
    assert back.model.width == 128  # resolved dimensions are written explicitly


def test_missing_recipe_named():
    """A missing recipe file is named in the error."""
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config("nope.yaml")


def test_yaml_words_stay_strings(tmp_path):
    """`no` on the command line and in a recipe stays the string "no", not YAML's boolean False."""
    assert load_config(None, ["--train.mixed_precision=no"]).train.mixed_precision == "no"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  mixed_precision: no\n")
    assert load_config(recipe).train.mixed_precision == "no"
