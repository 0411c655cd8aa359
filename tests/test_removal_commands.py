"""No command destroys a training run (issue 53), on a real run of the tiny recipe: `tokenize --overwrite`
into it and `export` onto it are refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import soundfile as sf

from musiclm_stab.cli import main as cli
from musiclm_stab.training import trainer as train

REPO = Path(__file__).resolve().parent.parent
STEP_4 = "step_00000004"


def train_main(data: Path, run_dir: Path, *extra: str) -> int:
    """recipes/pretrain.py's main in this process, on the tiny recipe (2 s crops): its exit code."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        return train.main(["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={data}",
                           f"--train.output_dir={run_dir.parent}", f"--train.name={run_dir.name}",
                           "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3",
                           "--optim.warmup_steps=2", "--train.checkpoint_every=2", "--train.keep_checkpoints=10",
                           "--train.trackers=[]", *extra])
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture(scope="module")
def trained(tokenized_dataset, tmp_path_factory) -> Path:
    """A 4-step run (checkpoints 2 and 4, metrics rows of steps 1-4); tests work on copies of it."""
    run = tmp_path_factory.mktemp("kept") / "r"
    assert train_main(tokenized_dataset, run, "--train.max_steps=4") == 0
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run, for a test to change."""
    copy = tmp_path / "runs" / "r"
    shutil.copytree(trained, copy)
    return copy


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every file's bytes (None for a folder) under ``folder``, by relative path; the trainer's lock file,
    which records its latest holder, is left out."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*")) if p.name != ".train.lock"}


def test_tokenize_overwrite_into_a_run_is_refused_by_name(run, tmp_path, local_weights, make_music, capsys):
    """`tokenize SRC RUN --overwrite` on a run directory (which holds a copy of its data's tokenizer.json):
    refused, naming the run's files, without advising --overwrite, the run untouched (before: --overwrite
    was advised, and deleted checkpoints/, config.yaml and metrics.jsonl)."""
    src = tmp_path / "audio"
    src.mkdir()
    sf.write(src / "a.wav", make_music(2.0, seed=60), 24_000)
    before = tree(run)
    for extra in ([], ["--overwrite"]):
        assert cli(["tokenize", str(src), str(run), "--weights", str(local_weights), "--workers", "0",
                    "--no-progress", *extra]) == 1
        err = capsys.readouterr().err
        assert err == (f"musiclm-stab tokenize: refusing to use {run}: it holds a training run (config.yaml, "
                       "checkpoints, metrics.jsonl, .train.lock); tokenize into another folder\n")
        assert tree(run) == before


def test_export_onto_its_own_run_or_a_folder_holding_it_is_refused(run, capsys):
    """`export RUN RUN --overwrite` and `export RUN/checkpoints/step_4 RUNS --overwrite`: exit 2, one line
    saying why, the run untouched (before: rc 0 and only the export left)."""
    before = tree(run.parent)
    ckpt = run / "checkpoints" / STEP_4
    cases = {(str(run), str(run)): f"refusing to replace {run}: it is the source {run}",
             (str(ckpt), str(run.parent)): f"refusing to replace {run.parent}: it holds the source {ckpt}",
             (str(run), str(ckpt / "hf")): f"refusing to write the export to {ckpt / 'hf'}: it is inside "
                                           f"{run / 'checkpoints'}"}
    for (source, target), why in cases.items():
        assert cli(["export", source, target, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {why}") and err.count("\n") == 1, err
    assert tree(run.parent) == before
