"""The Python API: `import musiclm_stab as ms` names the main verbs, loads them on first use, types them,
documents them (docs/API.md), and the README's example runs as written."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import soundfile as sf

import musiclm_stab
from musiclm_stab import api
from musiclm_stab.config import Config, ConfigError

ROOT = Path(__file__).resolve().parent.parent
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.M | re.S)
GUARD_WARNING = "each spawned worker would run the script again"


def test_import_is_light():
    """`import musiclm_stab` imports neither torch nor any submodule but the constants it hands on (no torch
    there either): the verbs load on first use."""
    script = "import json, sys, musiclm_stab\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith(('musiclm_stab', 'torch')))))"
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == ["musiclm_stab", "musiclm_stab.constants"]


def test_every_verb_is_the_apis_even_after_the_submodules_are_imported():
    """Each name of musiclm_stab.API is musiclm_stab.api's function, also once musiclm_stab.config and
    musiclm_stab.export (submodules, whose import sets attributes of the package) have been imported."""
    import musiclm_stab.config  # noqa: F401
    import musiclm_stab.export  # noqa: F401

    assert list(musiclm_stab.API) == sorted(api.__all__)
    for name in musiclm_stab.API:
        assert getattr(musiclm_stab, name) is getattr(api, name), name
    assert set(musiclm_stab.API) <= set(dir(musiclm_stab))
    with pytest.raises(AttributeError):
        musiclm_stab.no_such_verb  # noqa: B018


def test_every_verb_is_typed_and_documented():
    """Each verb has a docstring, annotations that resolve, a return type, and a place in docs/API.md."""
    import numpy as np
    import torch

    from musiclm_stab.export.features import FeatureModel, FrameFeatures
    from musiclm_stab.export.hubert import ExportResult
    from musiclm_stab.tokenizer.pipeline import TokenizeSummary

    checking = {"np": np, "torch": torch, "Config": Config, "FeatureModel": FeatureModel,  # api's TYPE_CHECKING names
                "FrameFeatures": FrameFeatures, "ExportResult": ExportResult, "TokenizeSummary": TokenizeSummary}
    page = (ROOT / "docs" / "API.md").read_text()
    assert (ROOT / "musiclm_stab" / "py.typed").is_file()
    for name in api.__all__:
        fn = getattr(api, name)
        assert inspect.getdoc(fn), name
        hints = typing.get_type_hints(fn, vars(api) | checking)
        assert "return" in hints, name
        assert f"ms.{name}(" in page, f"docs/API.md does not show ms.{name}"


def test_make_config_takes_recipe_names_paths_and_settings(tmp_path):
    """Packaged recipe names (layered in order), YAML paths, settings as a mapping or strings; an unknown
    recipe or a bad setting is a ConfigError naming it."""
    cfg = musiclm_stab.make_config(["study_prenorm_clip1_run2", "overlays/tiny"],
                                   {"train.max_steps": 5, "optim.warmup_steps": 1, "data.crop_seconds": 2.0,
                                    "train.trackers": [],
                                    "train.spike_guard": True}, data=["a", "b"])
    assert (cfg.model.size, cfg.optim.clip_grad, cfg.train.max_steps) == ("tiny", 1.0, 5)
    assert (cfg.data.path, cfg.data.crop_seconds, cfg.train.trackers, cfg.train.spike_guard) == (["a", "b"], 2.0, [], True)
    own = tmp_path / "mine.yaml"
    own.write_text("train:\n  name: mine\n")
    assert musiclm_stab.make_config(own, ["train.max_steps=3"]).train.max_steps == 3
    assert musiclm_stab.recipe("tiny") == musiclm_stab.recipe("tiny.yaml") and "overlays/tiny" in musiclm_stab.recipes()
    with pytest.raises(ConfigError, match="config file nope does not exist.*tiny"):
        musiclm_stab.make_config("nope")
    with pytest.raises(ConfigError, match="train.max_stepz"):
        musiclm_stab.make_config("tiny", {"train.max_stepz": 1})
    with pytest.raises(TypeError):
        musiclm_stab.train(cfg, {"train.max_steps": 1})


def _write_songs(folder: Path, make_music, count: int, seconds: float) -> None:
    """``count`` tracks of ``seconds`` (under 10 s: one segment each): song.wav, then track_1.wav, ..."""
    folder.mkdir()
    for i in range(count):
        sf.write(folder / ("song.wav" if i == 0 else f"track_{i}.wav"), make_music(seconds, seed=300 + i), 24_000)


@pytest.mark.slow
def test_readme_example_runs_as_a_file(tmp_path, local_weights, make_music):
    """The README's Python example, saved as example.py and run as `python example.py` (spawned tokenizer
    workers import the file again) from a folder outside the checkout, on tiny data: it tokenizes, trains,
    evaluates, takes features and plots, in worker processes and with no warning."""
    blocks = PYTHON_BLOCK.findall((ROOT / "README.md").read_text())
    assert len(blocks) == 1 and "import musiclm_stab as ms" in blocks[0]
    # 4 to train on (the tiny recipe's batch of 4 crops of 5 s), 1 held out (data.eval_fraction 0.1: one track)
    _write_songs(tmp_path / "audio", make_music, 5, 5.5)
    (tmp_path / "work").mkdir()
    shutil.copy(local_weights, tmp_path / "work" / "encodec_local.pt")
    (tmp_path / "example.py").write_text(blocks[0])
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env={**_env(), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and GUARD_WARNING not in proc.stderr, proc.stderr[-4000:]
    cb0 = float(proc.stdout.strip().splitlines()[-1])
    assert 0 < cb0 < 12
    run = tmp_path / "runs" / "tiny"
    assert json.loads((run / "eval" / "step_00000020.json").read_text())["eval/acoustic_mlm_loss/cb0"] == cb0
    assert (tmp_path / "figures" / "loss.png").is_file()


@pytest.mark.slow
def test_a_script_without_the_guard_gets_one_warning_not_a_storm(tmp_path, local_weights, make_music):
    """A script that calls ms.tokenize with two workers at its top level (no `if __name__ == "__main__":`)
    tokenizes all the same, in its own process, and says so in one warning naming its line and the guard:
    no worker runs the script again, no traceback."""
    _write_songs(tmp_path / "audio", make_music, 2, 2.0)
    (tmp_path / "example.py").write_text(
        "import musiclm_stab as ms\n"
        f"summary = ms.tokenize('audio/', 'tokens', weights={str(local_weights)!r}, workers=2)\n"
        "print('rows', summary.num_rows)\n")
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**_env(), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.splitlines() == ["rows 2"]
    warned = [line for line in proc.stderr.splitlines() if GUARD_WARNING in line]
    assert len(warned) == 1 and "example.py:2: UserWarning: tokenize runs in this process" in warned[0], proc.stderr
    assert 'if __name__ == "__main__":' in warned[0] and "Traceback" not in proc.stderr, proc.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}


def test_train_errors_speak_python(tmp_path, tokenized_dataset):
    """`ms.train` on a run directory that exists says what a Python caller passes (resume=True, the setting
    "train.name" in settings), not the command line's --resume and --train.name."""
    settings = {"train.output_dir": str(tmp_path), "train.name": "taken", "data.crop_seconds": 2.0,
                "train.trackers": []}
    cfg = musiclm_stab.make_config("tiny", settings, data=tokenized_dataset)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text((ROOT / "recipes" / "tiny.yaml").read_text())
    with pytest.raises(ConfigError) as caught:
        musiclm_stab.train("tiny", settings, data=tokenized_dataset)
    message = str(caught.value)
    assert message == (f"run directory {cfg.run_dir} already exists; pass resume=True to continue it, or choose "
                       'another "train.name" in settings')


def test_evaluate_defaults_to_the_device_the_other_verbs_use():
    """ms.evaluate, ms.load_encoder and ms.features default to no device (CUDA when there is one), as the
    evaluate command does."""
    for verb in (musiclm_stab.evaluate, musiclm_stab.load_encoder, musiclm_stab.features):
        assert inspect.signature(verb).parameters["device"].default is None, verb.__name__


def test_the_trainer_module_leaves_the_recipes_verb_in_place():
    """Importing the trainer's module (`-m musiclm_stab.pretrain`, what `musiclm-stab train` launches) in a
    process leaves `musiclm_stab.recipes` the API's function (before: the trainer lived in the recipes folder,
    whose import replaced the verb with that folder's namespace module)."""
    script = ("import musiclm_stab, musiclm_stab.api, musiclm_stab.pretrain\n"
              "assert musiclm_stab.recipes is musiclm_stab.api.recipes, musiclm_stab.recipes\n"
              "assert 'tiny' in musiclm_stab.recipes()\n")
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
