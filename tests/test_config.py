"""Config: recipes, dotted overrides, validation messages."""

import re
from pathlib import Path

import pytest
import yaml

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
# docs/TRAINING.md lists exactly these rows in its table under "Config errors" (checked below).
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
    ("--train.fp16_mode=apex", "train.fp16_mode='apex' is not valid; choose one of: fairseq, amp"),
    ("--train.fp16_impl=bf16", "train.fp16_impl='bf16' is not valid; choose one of: auto, half, emulate"),
    ("--train.fp16_min_loss_scale=0", "train.fp16_min_loss_scale must be > 0 and below train.fp16_init_scale=128.0, "
                                      "got 0.0"),
    ("--train.fp16_scale_window=0", "train.fp16_scale_window must be >= 1 (or null), got 0"),
    ("--train.fp16_scale_tolerance=2", "train.fp16_scale_tolerance must be in [0, 1], got 2.0"),
    ("--train.global_batch_crops=0", "train.global_batch_crops must be >= 1 (or null), got 0"),
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
    ("--model.init=kaiming", "model.init='kaiming' is not valid; choose one of: mert, xavier"),
    ("--data.mixup_mode=loud", "data.mixup_mode='loud' is not valid; choose one of: mert, rms"),
    ("--train.loss_unit=dB", "train.loss_unit='dB' is not valid; choose one of: bits, nats"),
    ("--optim.warmup_share=1", "optim.warmup_share must be in [0, 1), got 1.0"),
    ("--optim.warmup_steps=30 --train.max_steps=20", "optim.warmup_steps=30 is longer than the run, "
                                                     "train.max_steps=20: at most 20 (or null: optim.warmup_share "
                                                     "of the run)"),
    ("--train.eval_every=3 --train.log_every=2", "train.eval_every=3 must be 0 (off) or a multiple of train.log_every=2"),
    ("--train.eval_batches=-1", "train.eval_batches must be >= 0 (0 = all), got -1"),
    ("--train.trackers=[tb]", "train.trackers='tb' is not valid; choose one of: all, tensorboard"),
    ("--optim.lr=nan", "optim.lr must be a finite number, got nan"),
    ("--optim.betas=[0.9,1]", "optim.betas must be in [0, 1), got [0.9, 1.0]"),
    ("--data.mixup_gain_db=[0,-10]", "data.mixup_gain_db must be [low, high] with low <= high, got [0.0, -10.0]"),
    ("--train.spike_warmup=60", "train.spike_warmup must be in [0, train.spike_window=50], got 60"),
    ("--train.seed=4294967296", "train.seed must be < 2**32, got 4294967296"),
    # issue 47: settings that passed validation and then failed at start, or silently misbehaved
    ("--train.fp16_init_scale=1e308", "train.fp16_init_scale must be <= 2**24 = 16777216 (fairseq starts at 128, "
                                      "torch amp at 65536), got 1e+308"),
    ("--train.name=", "train.name must be a folder name (not empty, '.' or '..', without '/'; the folder that "
                      "holds it is train.output_dir), got ''"),
    ("--data.crop_seconds=0.0001", "data.crop_seconds must be at least one 320-sample frame (1/75 s = 0.0133 s), "
                                   "got 0.0001"),
    ("--model.cqt_bins=100000", "model.cqt_bins=100000 reaches above the Nyquist frequency (12000 Hz) from "
                                "model.cqt_fmin=32.7 Hz at model.cqt_bins_per_octave=48: at most 409 bins"),
    ("--model.cqt_fmin=0.1", "model.cqt_fmin=0.1 Hz at model.cqt_bins_per_octave=48 makes the CQT's lowest kernel "
                             "16,621,002 samples; at most 1,048,576 (43.7 s): cqt_fmin must be >= 1.59 Hz"),
]


@pytest.mark.parametrize("args, fragment", BAD_SETTINGS)
def test_bad_settings_name_the_setting(args, fragment):
    """Each bad setting fails with a message naming it and the valid choices."""
    argv = args.split()
    recipe = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(recipe, [a for a in argv if not a.startswith("--config=")])


def test_docs_list_every_config_error():
    """docs/TRAINING.md's table of config errors has exactly the rows of BAD_SETTINGS, so the two cannot drift."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "TRAINING.md").read_text()
    section = page.split("## Config errors\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| [^|]* \| `([^`]*)` \| `([^`]*)` \|$", section, flags=re.M)
    assert sorted(rows) == sorted(BAD_SETTINGS)


def _number_settings() -> list[tuple[str, str]]:
    """(section, key) of every setting whose type holds floats: float, float | None, tuple[float, ...]."""
    import dataclasses
    import typing

    from musiclm_stab.config import Config

    out = []
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(section.default_factory)
        for key, hint in hints.items():
            if float in (hint, *typing.get_args(hint)):
                out.append((section.name, key))
    return out


def test_every_float_setting_is_covered():
    """The finiteness test below reaches settings of every section (so it is not vacuous)."""
    found = _number_settings()
    assert {s for s, _ in found} == {"data", "model", "optim", "train"}
    assert {("optim", "lr"), ("train", "spike_z"), ("data", "crop_seconds"), ("optim", "betas"),
            ("data", "mixup_min_seconds")} <= set(found)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("section, key", _number_settings())
def test_every_number_setting_must_be_finite(section, key, value):
    """nan, inf and -inf are refused for every float setting of every section, naming the setting (nan
    passed every range check written as `if value <= 0: raise`, inf every lower bound)."""
    from musiclm_stab.config import Config

    default = getattr(getattr(Config(), section), key)
    given = f"[{value},{value}]" if isinstance(default, tuple) else value
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{key} must be a finite number, got ")):
        load_config(None, [f"--{section}.{key}={given}"])


def test_non_finite_numbers_in_a_recipe_are_refused(tmp_path):
    """YAML's .nan and .inf in a recipe are refused like the command line's, naming the setting."""
    for text, message in [("optim:\n  lr: .nan\n", "optim.lr must be a finite number, got nan"),
                          ("train:\n  spike_z: .nan\n", "train.spike_z must be a finite number, got nan"),
                          ("data:\n  crop_seconds: .inf\n", "data.crop_seconds must be a finite number, got inf")]:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(recipe)


def test_an_infinite_crop_is_a_config_error_before_any_work(tmp_path, capsys):
    """--data.crop_seconds=inf: exit code 2 and one line naming the setting (it failed later, with a
    traceback), and no run directory."""
    from musiclm_stab.training.trainer import main

    rc = main(["--config", "recipes/tiny.yaml", "--data.crop_seconds=inf", f"--train.output_dir={tmp_path / 'runs'}"])
    assert rc == 2
    assert capsys.readouterr().err == "error: data.crop_seconds must be a finite number, got inf\n"
    assert not (tmp_path / "runs").exists()


# The range checks of the settings that had none (README's table shows one example of each kind).
RANGES = [
    ("--data.num_workers=-1", "data.num_workers must be >= 0, got -1"),
    ("--data.mixup_max_segments=0", "data.mixup_max_segments must be >= 1, got 0"),
    ("--data.order_seed=-1", "data.order_seed must be >= 0, got -1"),
    *[(f"--model.{k}=0", f"model.{k} must be >= 1, got 0")
      for k in ("num_layers", "width", "ffn_dim", "num_heads", "conv_dim", "final_dim", "num_codebooks",
                "codebook_size", "cqt_bins", "cqt_bins_per_octave", "pos_conv_kernel", "pos_conv_groups")],
    ("--model.logit_temp=0", "model.logit_temp must be > 0, got 0.0"),
    ("--model.cqt_fmin=0", "model.cqt_fmin must be > 0, got 0.0"),
    ("--model.feature_grad_mult=-0.1", "model.feature_grad_mult must be >= 0, got -0.1"),
    ("--model.musical_weight=-1", "model.musical_weight must be >= 0, got -1.0"),
    ("--model.features_pen_weight=-1", "model.features_pen_weight must be >= 0, got -1.0"),
    ("--optim.betas=[-0.1,0.9]", "optim.betas must be in [0, 1), got [-0.1, 0.9]"),
    ("--optim.eps=-1e-8", "optim.eps must be >= 0, got -1e-08"),
    ("--optim.weight_decay=-0.01", "optim.weight_decay must be >= 0, got -0.01"),
    ("--optim.clip_warmup=-1", "optim.clip_warmup must be >= 0, got -1"),
    ("--optim.zclip_z=0", "optim.zclip_z must be > 0, got 0.0"),
    ("--train.run=-1", "train.run must be >= 0, got -1"),
    ("--train.seed=-1", "train.seed must be >= 0, got -1"),
    ("--train.spike_min_rel=-0.1", "train.spike_min_rel must be >= 0, got -0.1"),
    ("--train.max_rollbacks=-1", "train.max_rollbacks must be >= 0, got -1"),
    ("--train.spike_z=0", "train.spike_z must be > 0, got 0.0"),
    ("--train.spike_warmup=-1", "train.spike_warmup must be in [0, train.spike_window=50], got -1"),
    # fp16's loss scaler: a scale of 0 was refused as if train.fp16_min_loss_scale were wrong
    ("--train.fp16_init_scale=0", "train.fp16_init_scale must be > 0, got 0.0"),
    ("--train.fp16_init_scale=-128", "train.fp16_init_scale must be > 0, got -128.0"),
    ("--train.fp16_min_loss_scale=-1", "train.fp16_min_loss_scale must be > 0 and below train.fp16_init_scale=128.0, "
                                       "got -1.0"),
    ("--train.fp16_min_loss_scale=128", "train.fp16_min_loss_scale must be > 0 and below "
                                        "train.fp16_init_scale=128.0, got 128.0"),
    ("--train.fp16_scale_window=-1", "train.fp16_scale_window must be >= 1 (or null), got -1"),
    ("--train.fp16_scale_tolerance=-0.1", "train.fp16_scale_tolerance must be in [0, 1], got -0.1"),
    ("--train.fp16_scale_tolerance=1.5", "train.fp16_scale_tolerance must be in [0, 1], got 1.5"),
    ("--train.global_batch_crops=-4", "train.global_batch_crops must be >= 1 (or null), got -4"),
]


@pytest.mark.parametrize("args, message", RANGES)
def test_number_settings_out_of_range_are_refused(args, message):
    """Each number setting without a range check before has one now, naming it (model.num_heads=0 was a
    ZeroDivisionError, a negative train.seed failed in numpy at the start of the run)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, args.split())


def test_the_limits_themselves_are_accepted():
    """The edge values of the new ranges are valid settings."""
    cfg = load_config(None, ["--data.num_workers=0", "--data.mixup_max_segments=1", "--data.order_seed=0",
                             "--model.feature_grad_mult=0", "--optim.betas=[0,0]", "--optim.eps=0",
                             "--optim.weight_decay=0", "--optim.clip_warmup=0", "--train.run=0", "--train.seed=0",
                             "--train.spike_warmup=50", "--data.mixup_gain_db=[-3,-3]",
                             f"--train.seed={2**32 - 1}"])
    assert (cfg.train.seed, cfg.train.spike_warmup, cfg.optim.betas) == (2**32 - 1, 50, (0.0, 0.0))


def test_the_fp16_limits_themselves_are_accepted():
    """The edge values of the loss scaler's settings are valid (window 1, tolerance 0 and 1, a tiny scale
    above a tinier floor, no window: fairseq's default), as is one crop per update."""
    for args in (["--train.fp16_scale_window=1", "--train.fp16_scale_tolerance=0", "--train.global_batch_crops=1",
                  "--train.fp16_init_scale=1e-3", "--train.fp16_min_loss_scale=1e-6"],
                 ["--train.fp16_scale_window=null", "--train.fp16_scale_tolerance=1"]):
        tcfg = load_config(None, args).train
        given = {a.split("=")[0].split(".")[1]: a.split("=")[1] for a in args}
        for key, text in given.items():
            expected = None if text == "null" else type(getattr(tcfg, key))(float(text))
            assert getattr(tcfg, key) == expected, key


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/abs"])
def test_a_name_that_is_not_a_folder_name_is_refused(name):
    """train.name must name one folder inside train.output_dir: empty or "." made the output folder itself
    the run directory, ".." its parent, "a/b" or "/abs" a folder elsewhere."""
    with pytest.raises(ConfigError, match=re.escape("train.name must be a folder name")):
        load_config(None, [f"--train.name={name}"])


def test_the_new_limits_themselves_are_accepted():
    """The edges of issue 47's ranges are valid: a scale of 2**24, a one-frame crop, a name with dots, the
    most CQT bins below Nyquist and the lowest cqt_fmin whose kernel fits."""
    cfg = load_config(None, ["--train.fp16_init_scale=16777216", f"--data.crop_seconds={1 / 75}",
                             "--train.name=run.v2", "--model.cqt_bins=409", "--model.cqt_fmin=1.6"])
    assert (cfg.train.fp16_init_scale, cfg.model.cqt_bins, cfg.train.name) == (2**24, 409, "run.v2")


@pytest.mark.parametrize("fmin, per_octave", [(32.7, 48), (32.7, 12), (1.0, 12), (100.0, 7), (5000.0, 3)])
def test_the_cqt_limit_is_the_cqts_own(fmin, per_octave):
    """The most bins the config accepts are what model/cqt.py builds: the CQT is made at that count and
    refuses one more (the config's check restates its formula, so the two cannot drift apart)."""
    from musiclm_stab.model.cqt import CQT

    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--model.cqt_fmin={fmin}", f"--model.cqt_bins_per_octave={per_octave}",
                           "--model.cqt_bins=100000"])
    most = int(re.search(r"at most (\d+) bins", str(e.value)).group(1))
    load_config(None, [f"--model.cqt_fmin={fmin}", f"--model.cqt_bins_per_octave={per_octave}",
                       f"--model.cqt_bins={most}"])
    CQT(fmin=fmin, n_bins=most, bins_per_octave=per_octave)
    with pytest.raises(ValueError, match="above the Nyquist frequency"):
        CQT(fmin=fmin, n_bins=most + 1, bins_per_octave=per_octave)


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


# size -> (norm_scheme, dropout, attention_dropout, feature_dropout, layerdrop, feature_grad_mult, final_dim,
#          mixup seconds): MERT-95M (config/pretrain/MERT_RVQ-VAE_CQT_95M.yaml) and MERT-330M (..._330M.yaml)
SIZE_TABLE = {
    "tiny": ("pre", 0.1, 0.1, 0.1, 0.0, 0.1, 64, (0.5, 1.5)),
    "base": ("post", 0.1, 0.1, 0.1, 0.05, 0.1, 64, (0.5, 1.0)),
    "large": ("pre", 0.0, 0.0, 0.0, 0.0, 1.0, 128, (0.5, 1.5)),
}


@pytest.mark.parametrize("size", SIZE_TABLE)
def test_per_size_defaults(size, tmp_path):
    """Each size fills in its own defaults (base: MERT-95M's, large: MERT-330M's), MERT's init, masking,
    mixup form, bits, the warmup as 8% of max_steps; config.yaml records the resolved values."""
    cfg = load_config(None, [f"--model.size={size}", "--train.max_steps=400000"])
    m = cfg.model
    got = (m.norm_scheme, m.dropout, m.attention_dropout, m.feature_dropout, m.layerdrop, m.feature_grad_mult,
           m.final_dim, (cfg.data.mixup_min_seconds, cfg.data.mixup_max_seconds))
    assert got == SIZE_TABLE[size]
    assert (m.init, m.require_same_masks, cfg.data.mixup_mode, cfg.train.loss_unit) == ("mert", True, "mert", "bits")
    assert cfg.optim.warmup_steps == 32000  # MERT's 32k of 400k updates
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["final_dim"] == SIZE_TABLE[size][6] and saved["optim"]["warmup_steps"] == 32000
    assert saved["data"]["mixup_max_seconds"] == SIZE_TABLE[size][7][1]


def test_explicit_values_win_over_the_size():
    """A value given on the command line or in an overlay wins over the size's; the rest follow the size,
    also when an overlay changes the size (the per-size fields are filled in after all layers)."""
    cfg = load_config(None, ["--model.size=large", "--model.dropout=0.2", "--optim.warmup_steps=5",
                             "--data.mixup_max_seconds=2.0"])
    assert (cfg.model.dropout, cfg.model.attention_dropout, cfg.model.final_dim) == (0.2, 0.0, 128)
    assert cfg.optim.warmup_steps == 5 and cfg.data.mixup_max_seconds == 2.0
    twin = load_config(["recipes/study_prenorm_clip10_run1.yaml", "recipes/overlays/tiny.yaml"])
    assert (twin.model.size, twin.model.dropout, twin.model.feature_grad_mult, twin.model.final_dim) == (
        "tiny", 0.1, 0.1, 64)


def test_run_made_before_the_fidelity_settings_reads_back_as_it_ran(tmp_path):
    """A config.yaml written before model.init, model.require_same_masks, data.mixup_mode and
    train.loss_unit existed reads back with the values that run had: xavier, no trim, rms mixup, nats."""
    cfg = load_config("recipes/tiny.yaml")
    save_config(cfg, tmp_path / "config.yaml")
    old = yaml.safe_load((tmp_path / "config.yaml").read_text())
    for section, key in (("model", "init"), ("model", "require_same_masks"), ("data", "mixup_mode"),
                         ("train", "loss_unit"), ("optim", "warmup_share")):
        del old[section][key]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    back = config_from_run(tmp_path)
    assert (back.model.init, back.model.require_same_masks, back.data.mixup_mode, back.train.loss_unit) == (
        "xavier", False, "rms", "nats")
    assert back.optim.warmup_steps == cfg.optim.warmup_steps  # the explicit count, as written


def test_recipes_by_name_from_any_folder(tmp_path, monkeypatch):
    """A recipe is a file or a packaged recipe's name, from any working folder: `tiny`, `overlays/tiny`,
    `tiny.yaml`, and `recipes/tiny.yaml` as a checkout writes it, all read the packaged file; a file of that
    name in the working folder wins; neither is a ConfigError naming the packaged recipes."""
    root = Path(__file__).resolve().parent.parent / "recipes"
    by_path = load_config([root / "study_prenorm_clip1_run2.yaml", root / "overlays" / "tiny.yaml"])
    monkeypatch.chdir(tmp_path)
    assert load_config(["study_prenorm_clip1_run2", "overlays/tiny"]) == by_path
    assert load_config("tiny") == load_config("tiny.yaml") == load_config("recipes/tiny.yaml") == load_config(
        root / "tiny.yaml")
    (tmp_path / "tiny.yaml").write_text("train:\n  name: mine\n")
    assert load_config("tiny.yaml").train.name == "mine" and load_config("tiny").train.name == "tiny"
    with pytest.raises(ConfigError, match=r"config file tinny does not exist, and no packaged one has that name "
                                          r"\(packaged: overlays/instability_cpu, .*, tiny\)"):
        load_config("tinny")


def test_a_run_recorded_with_a_warmup_longer_than_itself_is_still_read(tmp_path):
    """A run an earlier version trained with optim.warmup_steps > train.max_steps (its config.yaml records both)
    is read back as it is, for evaluate, export and the plots; only a new run (or a resume) with them is
    refused."""
    cfg = load_config(None, ["--optim.warmup_steps=2", "--train.max_steps=2"])
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text().replace("warmup_steps: 2", "warmup_steps: 20")
    (tmp_path / "config.yaml").write_text(text)
    back = config_from_run(tmp_path)
    assert (back.optim.warmup_steps, back.train.max_steps) == (20, 2)
    with pytest.raises(ConfigError, match="optim.warmup_steps=20 is longer than the run"):
        load_config(tmp_path / "config.yaml")
