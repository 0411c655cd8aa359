"""Config: recipes, dotted overrides, validation messages."""

import re
from pathlib import Path

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


# Every error load_config raises, one example per kind: (command-line arguments, the message or its start).
# README.md lists exactly these rows in its table under "Preemption and resuming" (checked below).
BAD_SETTINGS = [
    ("--nosuch.key=1", "unknown setting 'nosuch.key'; settings are <section>.<key> with section one of: "
                       "data, model, optim, train"),
    ("--model.colour=red", "unknown setting 'model.colour'; valid keys of model: size, num_layers, width"),
    ("--train.max_steps=many", "train.max_steps must be int, got 'many'"),
    ("--model.qk_norm=maybe", "model.qk_norm must be true or false, got 'maybe'"),
    ("--optim.betas=[0.9]", "optim.betas must be a list of 2 values, got ['0.9']"),
    ("--config=nope.yaml", "config file nope.yaml does not exist"),
    ("--model.size=huge", "model.size='huge' is not valid; choose one of: tiny, base, large"),
    ("--model.norm_scheme=bogus", "model.norm_scheme='bogus' is not valid; choose one of: pre, post, deepnorm, "
                                  "sandwich, subln"),
    ("--model.attention=flash", "model.attention='flash' is not valid; choose one of: sdpa, math, relax"),
    ("--model.norm_type=batchnorm", "model.norm_type='batchnorm' is not valid; choose one of: layernorm, rmsnorm"),
    ("--optim.clip_mode=norm", "optim.clip_mode='norm' is not valid; choose one of: fixed, zclip, autoclip"),
    ("--train.mixed_precision=fp8", "train.mixed_precision='fp8' is not valid; choose one of: no, fp16, bf16"),
    ("--model.attention=relax --model.qk_norm=true",
     "model.attention=relax cannot be combined with model.qk_norm=true"),
    ("--model.num_heads=3", "model.width=128 must be divisible by model.num_heads=3"),
    ("--model.pos_conv_groups=3", "model.width=128 must be divisible by model.pos_conv_groups"),
    ("--model.mask_prob=1.5", "model.mask_prob must be in [0, 1], got 1.5"),
    ("--data.eval_fraction=1", "data.eval_fraction must be in [0, 1), got 1.0"),
    ("--model.attention_dropout=1", "model.attention_dropout must be in [0, 1), got 1.0"),
    ("--optim.clip_grad=0", "optim.clip_grad must be > 0, got 0.0"),
    ("--train.checkpoint_every=0", "train.checkpoint_every must be >= 1, got 0"),
    ("--optim.warmup_steps=-1", "optim.warmup_steps must be >= 0, got -1"),
    ("--train.keep_every=-1", "train.keep_every must be >= 0 (0 = off), got -1"),
    ("--optim.zclip_alpha=1", "optim.zclip_alpha must be in (0, 1), got 1.0"),
    ("--optim.autoclip_percentile=0", "optim.autoclip_percentile must be in (0, 100], got 0.0"),
    ("--train.diagnostics_every=3 --train.log_every=2",
     "train.diagnostics_every=3 must be 0 (off) or a multiple of train.log_every=2"),
    ("--data.mixup_min_seconds=2", "data.mixup_min_seconds must be > 0 and <= data.mixup_max_seconds"),
    ("--data.path=[]", "data.path must be a non-empty list, got []"),
    ("--data.shuffle_buffer=-1", "data.shuffle_buffer must be >= 0 (0 = stream order), got -1"),
]


@pytest.mark.parametrize("args, fragment", BAD_SETTINGS)
def test_bad_settings_name_the_setting(args, fragment):
    """Each bad setting fails with a message naming it and the valid choices."""
    argv = args.split()
    recipe = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(recipe, [a for a in argv if not a.startswith("--config=")])


def test_readme_lists_every_config_error():
    """README's table of config errors has exactly the rows of BAD_SETTINGS, so the two cannot drift."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Preemption and resuming\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| [^|]* \| `([^`]*)` \| `([^`]*)` \|$", section, flags=re.M)
    assert sorted(rows) == sorted(BAD_SETTINGS)


def test_roundtrip_through_run_dir(tmp_path):
    """A saved resolved config reads back identical, with the size's dimensions written out."""
    cfg = load_config("recipes/tiny.yaml", ["--model.norm_scheme=post"])
    save_config(cfg, tmp_path / "config.yaml")
    back = config_from_run(tmp_path)
    assert back.to_dict() == cfg.to_dict()
    assert back.model.width == 128  # resolved dimensions are written explicitly


def test_yaml_words_stay_strings(tmp_path):
    """`no` on the command line and in a recipe stays the string "no", not YAML's boolean False."""
    assert load_config(None, ["--train.mixed_precision=no"]).train.mixed_precision == "no"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  mixed_precision: no\n")
    assert load_config(recipe).train.mixed_precision == "no"


@pytest.mark.parametrize("make", ["missing", "not_tokenized"])
def test_bad_data_path_is_a_clear_error_before_any_work(tmp_path, capsys, make):
    """A data.path that does not exist, or is a folder but not a tokenized dataset: exit code 2 and one
    line naming data.path, not a traceback; no run directory is left behind."""
    from musiclm_stab.training.trainer import main

    data = tmp_path / "tokens"
    if make == "not_tokenized":
        data.mkdir()
    rc = main(["--config", "recipes/tiny.yaml", f"--data.path={data}", f"--train.output_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: data.path: {data}") or err.startswith(f"error: data.path: tokenized dataset {data}")
    assert ("does not exist" if make == "missing" else "is not a tokenized dataset") in err
    assert not (tmp_path / "runs").exists()
