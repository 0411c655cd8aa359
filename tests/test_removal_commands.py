"""No command destroys a training run (issue 53), on a real run of the tiny recipe: `tokenize --overwrite`
into it and `export` onto it are refused by name; `--resume` with no intact checkpoint stops (exit 2) and
changes nothing, an unreadable checkpoint is neither used nor moved, a damaged one is moved aside, never
deleted, and metrics.jsonl never holds a step twice; a manifest that leaves out the weights is refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import soundfile as sf
from inproc import fresh_accelerate
from permissions import permissions_apply

from musiclm_stab.cli import main as cli
from musiclm_stab.training import checkpoint
from musiclm_stab.training import trainer as train

REPO = Path(__file__).resolve().parent.parent
STEP_2, STEP_4 = "step_00000002", "step_00000004"


def train_main(data: Path, run_dir: Path, *extra: str) -> int:
    """recipes/pretrain.py's main in this process, on the tiny recipe (2 s crops): its exit code."""
    with fresh_accelerate():
        return train.main(["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={data}",
                           f"--train.output_dir={run_dir.parent}", f"--train.name={run_dir.name}",
                           "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3",
                           "--optim.warmup_steps=2", "--train.checkpoint_every=2", "--train.keep_checkpoints=10",
                           "--train.trackers=[]", *extra])


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


def steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


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


def test_resume_with_no_intact_checkpoint_stops_and_changes_nothing(run, tokenized_dataset, capsys):
    """model.safetensors swapped between checkpoints 2 and 4: --resume exits 2 naming each checkpoint and why;
    checkpoints, metrics and config are as they were (before: "starting at step 0", the old checkpoints
    deleted as the new run reached their steps, every step twice in metrics.jsonl)."""
    a, b = (run / "checkpoints" / s / "model.safetensors" for s in (STEP_2, STEP_4))
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes)
    b.write_bytes(a_bytes)
    before = tree(run)
    assert train_main(tokenized_dataset, run, "--train.max_steps=4", "--resume") == 2
    err = capsys.readouterr().err
    assert (f"error: cannot resume {run}: none of its 2 checkpoint(s) is intact: {STEP_4}: model.safetensors does not "
            f"match its sha256 in trainer_state.json; {STEP_2}: model.safetensors does not match its sha256 in "
            "trainer_state.json. Nothing was changed") in err, err[-3000:]
    assert tree(run) == before


def test_an_unreadable_checkpoint_is_neither_used_nor_moved(run, tokenized_dataset, capsys):
    """Checkpoint 4's weights unreadable (EACCES, as a shared file system may answer for a moment): --resume
    exits 2 saying it is unreadable, not damaged; nothing is moved or removed, and checkpoint 2 is not taken
    in its place (before: it was skipped as damaged and deleted when the run reached step 4)."""
    weights = run / "checkpoints" / STEP_4 / "model.safetensors"
    before = tree(run)
    os.chmod(weights, 0)
    try:
        with permissions_apply():
            code = train_main(tokenized_dataset, run, "--train.max_steps=6", "--resume")
    finally:
        os.chmod(weights, 0o644)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert (f"error: cannot resume {run}: checkpoint {STEP_4}: model.safetensors is unreadable: Permission denied, "
            "which is no damage: it is neither used, moved nor removed") in err, err[-3000:]
    assert tree(run) == before


def test_a_damaged_checkpoint_is_moved_aside_and_no_step_is_logged_twice(run, tokenized_dataset, capsys):
    """Checkpoint 4 damaged (a flipped byte): --resume starts from 2 with a warning, moves the rows of steps
    3-4 aside before logging them again (metrics.jsonl then holds steps 1-4 once each), and on reaching step
    4 moves the damaged checkpoint aside instead of deleting it (before: deleted, and steps 3-4 logged
    twice)."""
    weights = run / "checkpoints" / STEP_4 / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    damaged, rows = tree(run / "checkpoints" / STEP_4), (run / "metrics.jsonl").read_text().splitlines()
    with pytest.warns(UserWarning) as warned:
        assert train_main(tokenized_dataset, run, "--train.max_steps=4", "--resume") == 0
    messages = [str(w.message) for w in warned]
    assert any(m.startswith(f"skipping damaged checkpoint {run / 'checkpoints' / STEP_4}") for m in messages)
    assert any(m.startswith(f"moved damaged checkpoint {run / 'checkpoints' / STEP_4} aside to {STEP_4}.aside-")
               for m in messages), messages
    assert steps(run) == [1, 2, 3, 4]
    aside = [p for p in run.iterdir() if p.name.startswith("metrics.jsonl.aside-")]
    assert len(aside) == 1 and aside[0].read_text().splitlines() == rows[2:]
    assert "moved the rows of metrics.jsonl after step 2" in capsys.readouterr().out
    moved = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(f"{STEP_4}.aside-")]
    assert len(moved) == 1 and tree(moved[0]) == damaged
    assert [c.name for c in checkpoint.list_checkpoints(run)] == [STEP_2, STEP_4]
    assert checkpoint.verify(run / "checkpoints" / STEP_4) is None


def test_a_manifest_that_leaves_out_the_weights_is_refused(run, capsys):
    """A checkpoint whose manifest does not list model.safetensors, with damaged weights: evaluate exits 2
    naming the file (before: the weights loaded unchecked, total loss 4.4e7 instead of ~69)."""
    ckpt = run / "checkpoints" / STEP_4
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["files"]["model.safetensors"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert cli(["evaluate", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert f"error: checkpoint {ckpt} is damaged: model.safetensors is not listed in trainer_state.json" in err, err
    assert checkpoint.verify(ckpt).startswith("model.safetensors is not listed in trainer_state.json")
