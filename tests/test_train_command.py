"""`musiclm-stab train`: the trainer under accelerate launch, from a checkout or an installed package. Its
arguments split at `--` (accelerate's before, the trainer's after), recipes and packaged accelerate configs
by name, every setting listed by --help with its type, default and meaning, and --print-config printing the
config the launch would train with, touching nothing."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import yaml

from musiclm_stab import cli
from musiclm_stab.config import Config, ConfigError, load_config
from musiclm_stab.config.recipes import PACKAGED_RECIPES
from musiclm_stab.experiments.train import launch_argv, split_arguments
from musiclm_stab.training import trainer
from musiclm_stab.training.arguments import parse_trainer_args

ROOT = Path(__file__).resolve().parent.parent


def _help_text(capsys) -> str:
    with pytest.raises(SystemExit) as caught:
        cli.main(["train", "--help"])
    assert caught.value.code == 0
    return " ".join(re.sub(r"-\n\s+", "-", capsys.readouterr().out).split())  # argparse's wrapping undone


def _settings() -> list[tuple[str, dataclasses.Field]]:
    cfg = Config()
    return [(f"{s.name}.{f.name}", f) for s in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, s.name))]


def test_help_lists_every_setting_with_type_default_and_meaning(capsys):
    """`musiclm-stab train --help` names every setting of config/, each with a type, the line its field
    gives, and a default that is true: every default shown, given back as a setting, loads the default
    config; a per-size default shows each size's value."""
    text = _help_text(capsys)
    shown, per_size = [], {}
    for name, f in _settings():
        doc = f.metadata["help"]
        assert doc.strip() and "\n" not in doc, name
        m = re.search(rf"--{re.escape(name)} (\S+) {re.escape(doc)}.*? \(default: ([^)]*)\)", text)
        assert m, f"--help does not list {name} with its type, description and default"
        kind, default = m.groups()
        assert kind, name
        if default.startswith("the size's: "):
            per_size[name] = dict(pair.split(" ", 1) for pair in default.removeprefix("the size's: ").split(", "))
        else:
            shown.append(f"{name}={default}")
    assert load_config(None, shown) == load_config()
    assert set(per_size) >= {"model.num_layers", "model.norm_scheme", "data.mixup_max_seconds"}
    for name, values in per_size.items():
        for size, value in values.items():  # the size's own value, given explicitly, changes nothing
            sized = [f"model.size={size}"]
            assert load_config(None, [*sized, f"{name}={value}"]) == load_config(None, sized), (name, size)
    assert "--model.norm_scheme {pre,post,deepnorm,sandwich,subln}|none" in text
    assert "--train.max_steps INT" in text and "--optim.betas [FLOAT,FLOAT]" in text


def test_trainer_arguments_by_name_setting_forms_and_refusals():
    """The trainer takes recipes by name, settings as --section.key=value or --section.key value, and refuses
    a word that is neither (argparse's usage error, exit 2); an unknown setting reaches load_config, which
    names the valid keys."""
    args = parse_trainer_args(["--config", "tiny", "--data.path", "a", "--train.max_steps=3", "--resume"])
    assert (args.configs, args.overrides, args.resume, args.print_config) == (
        ["tiny"], ["data.path=a", "train.max_steps=3"], True, False)
    with pytest.raises(SystemExit) as caught:
        parse_trainer_args(["--config", "tiny", "stray"])
    assert caught.value.code == 2
    unknown = parse_trainer_args(["--model.colour=red"])
    with pytest.raises(ConfigError, match="unknown setting 'model.colour'; valid keys of model"):
        load_config(unknown.configs, unknown.overrides)


def test_launch_is_accelerate_launch_of_the_trainer_module():
    """`musiclm-stab train [OPTIONS --] ARGS` becomes `accelerate launch OPTIONS -m musiclm_stab.pretrain
    ARGS`; without `--` every argument is the trainer's; --config_file names a packaged accelerate config."""
    cmd = launch_argv(["--num_processes", "2", "--config_file", "accelerate/8gpu", "--", "--config", "tiny",
                       "--train.max_steps=3"])
    launch = cmd.index("launch")
    assert cmd[launch:] == ["launch", "--num_processes", "2", "--config_file",
                            str(PACKAGED_RECIPES / "accelerate" / "8gpu.yaml"), "-m", "musiclm_stab.pretrain",
                            "--config", "tiny", "--train.max_steps=3"]
    assert Path(cmd[0]).parent == Path(sys.executable).parent  # this environment's accelerate, never another's
    cmd = launch_argv(["--config", "tiny", "--resume"])
    assert cmd[cmd.index("launch"):] == ["launch", "-m", "musiclm_stab.pretrain", "--config", "tiny", "--resume"]
    assert split_arguments(["--", "--config", "tiny"]) == ([], ["--config", "tiny"])


@pytest.mark.parametrize("argv, says", [
    (["--config", "tiny", "--", "--train.max_steps=3"], "--config before '--', among accelerate launch's options"),
    (["--train.max_steps=3", "--"], "--train.max_steps=3 before '--'"),
    (["--config_file", "accelerate/16gpu", "--", "--config", "tiny"], "accelerate config file accelerate/16gpu does not "
     "exist, and no packaged one has that name (packaged: accelerate/1gpu, accelerate/2nodes_8gpu"),
    (["--config", "tinny"], "config file tinny does not exist, and no packaged one has that name (packaged: "),
    (["--config", "tiny", "--model.colour=red"], "unknown setting 'model.colour'"),
])
def test_bad_arguments_fail_before_accelerate_starts(argv, says, capsys):
    """A trainer's argument among accelerate's, an unknown packaged config or recipe, a bad setting: one line
    naming it, exit 2, before anything is launched."""
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1, err


def test_print_config_is_the_resolved_config_as_the_launch_decides_it(tmp_path, monkeypatch, capsys):
    """--print-config prints the config a launch trains with as YAML: recipes by name, overlays and settings
    resolved, accelerate's precision applied and grad_accum derived at the launch's process count, each
    said in a comment; only the main process prints, and no file is written."""
    monkeypatch.chdir(tmp_path)
    for name in ("ACCELERATE_MIXED_PRECISION", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert trainer.main(["--config", "tiny", "--train.max_steps=7", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out) == load_config(ROOT / "recipes" / "tiny.yaml", ["train.max_steps=7"]).to_dict()
    assert out.startswith("# launched with global batch 4 crops = 20 audio-s per update")

    study = ["--config", "study_prenorm_clip1_run2", "--print-config"]
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert trainer.main(study) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    recipe = load_config("study_prenorm_clip1_run2")
    assert printed["train"]["mixed_precision"] == "bf16" and recipe.train.mixed_precision == "fp16"
    per_process = recipe.train.global_batch_crops // (recipe.data.batch_size * 8)
    assert printed["train"]["grad_accum"] == per_process
    assert "# training in bf16, as accelerate launch (ACCELERATE_MIXED_PRECISION=bf16" in out
    monkeypatch.setenv("RANK", "3")
    assert trainer.main(study) == 0 and capsys.readouterr().out == ""
    assert list(tmp_path.iterdir()) == []
