"""Every way of naming a checkpoint checks it against its manifest: a damaged checkpoint given by its
directory to evaluate, export or features is refused (exit 2, one line naming the file), as the run
directory's newest-intact search already skipped it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import soundfile as sf
from inproc import fresh_accelerate

from musiclm_stab.cli import main as cli
from musiclm_stab.training import checkpoint
from musiclm_stab.training import trainer as train
from musiclm_stab.training.trained import load_checkpoint

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def damaged(tokenized_dataset, tmp_path_factory) -> Path:
    """A 4-step run (checkpoints 2 and 4) whose checkpoint 4 has one flipped byte in model.safetensors."""
    out = tmp_path_factory.mktemp("named")
    with fresh_accelerate():
        assert train.main(["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={tokenized_dataset}",
                           f"--train.output_dir={out}", "--train.name=r", "--data.crop_seconds=2.0",
                           "--data.batch_size=2", "--data.eval_fraction=0.3", "--train.max_steps=4",
                           "--train.checkpoint_every=2", "--train.trackers=[]"]) == 0
    weights = out / "r" / "checkpoints" / "step_00000004" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # a weight's bytes: the file still loads, with one value changed
    weights.write_bytes(bytes(data))
    return out / "r"


@pytest.mark.parametrize("command", ["evaluate", "export", "features"])
def test_a_damaged_checkpoint_named_by_its_directory_is_refused(damaged, tmp_path, capsys, make_music, command):
    """`evaluate`, `export` and `features` given checkpoints/step_4 with a flipped byte in its weights:
    exit 2 and one line naming the checkpoint and the file (before: the damaged weights were used without
    a word, and export "verified" its output against them); no output is written."""
    ckpt = damaged / "checkpoints" / "step_00000004"
    sf.write(tmp_path / "a.wav", make_music(1.0), 24_000)
    args = {"evaluate": [str(ckpt)], "export": [str(ckpt), str(tmp_path / "exp")],
            "features": [str(ckpt), str(tmp_path / "a.wav"), str(tmp_path / "feats")]}[command]
    evals = sorted((damaged / "eval").glob("*")) if (damaged / "eval").exists() else []
    assert cli([command, *args]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: checkpoint {ckpt} is damaged: model.safetensors does not match its sha256 in "
                      f"trainer_state.json; it is not loaded (the run directory {damaged} names its newest "
                      "intact checkpoint)"], err[-3000:]
    assert not (tmp_path / "exp").exists() and not (tmp_path / "feats").exists()
    assert (sorted((damaged / "eval").glob("*")) if (damaged / "eval").exists() else []) == evals


def test_the_run_directory_skips_it_and_an_intact_one_loads(damaged, tmp_path):
    """Given the run directory, the damaged newest checkpoint is skipped with a warning naming it and the
    intact step 2 loads; step 2 given by its directory (or a copy of the run) loads as well."""
    with pytest.warns(UserWarning, match="skipping damaged checkpoint .*step_00000004.*model.safetensors"):
        _, ckpt, step = load_checkpoint(damaged)
    assert (ckpt.name, step) == ("step_00000002", 2)
    copy = tmp_path / "copy"
    shutil.copytree(damaged, copy)
    _, ckpt, step = load_checkpoint(copy / "checkpoints" / "step_00000002")
    assert step == 2 and checkpoint.verify(ckpt) is None


def test_evaluate_that_cannot_write_its_result_prints_it_and_says_why(damaged, tmp_path, capsys):
    """evaluate of a run whose eval/ cannot be made (a file there; the disk full or read-only alike): the
    table is printed, then one line naming the file and the reason, exit 1 (before: an OSError traceback
    after the work, and the results lost)."""
    copy = tmp_path / "copy"
    shutil.copytree(damaged, copy, ignore=shutil.ignore_patterns("step_00000004"))
    (copy / "eval").write_text("a file where the folder belongs")
    assert cli(["evaluate", str(copy)]) == 1
    out = capsys.readouterr()
    assert f"evaluation of {copy / 'checkpoints' / 'step_00000002'} (step 2)" in out.out
    errors = [line for line in out.err.splitlines() if line.startswith("error: ")]  # after the progress bar
    assert errors == [f"error: evaluated {copy / 'checkpoints' / 'step_00000002'}, but could not write "
                      f"{copy / 'eval' / 'step_00000002.json'}: File exists"], out.err
    assert out.err.endswith("File exists\n") and "Traceback" not in out.err
