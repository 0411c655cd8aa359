"""`musiclm-stab evaluate`'s records: one per checkpoint, split and data, so that evaluating another split or
other data never replaces the held-out record of the run's own data (what the model card reads)."""

from __future__ import annotations

import json

import pytest

from musiclm_stab.analysis.evaluate import cli_main, evaluate
from musiclm_stab.config import load_config
from musiclm_stab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)


@pytest.fixture
def run_dir(tokenized_dataset, tmp_path):
    """A 2-step tiny run of the session's tokenized dataset (checkpoint 2)."""
    cfg = load_config("recipes/tiny.yaml", [
        f"--data.path={tokenized_dataset}", f"--train.output_dir={tmp_path}", "--train.name=r",
        "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3", "--train.checkpoint_every=2",
        "--train.max_steps=2", "--optim.warmup_steps=1", "--train.trackers=[]"])
    return Trainer(cfg).run()


def test_each_split_and_data_has_its_own_record(run_dir, tokenized_dataset, tmp_path, capsys):
    """Evaluating the held-out split, then the train split, then all rows, then another copy of the data:
    eval/step_N.json keeps the held-out result of the run's own data (before: `--split train` replaced it),
    and each of the others is in a file of its own that names its split (and its data); evaluating again
    replaces only its own record."""
    import shutil

    held_out = evaluate(run_dir, split="eval")
    record = run_dir / "eval" / "step_00000002.json"
    assert json.loads(record.read_text()) == held_out
    train = evaluate(run_dir, split="train")
    assert json.loads(record.read_text()) == held_out
    assert json.loads((run_dir / "eval" / "step_00000002.train.json").read_text()) == train
    assert train["split"] == "train" and train["eval/loss"] != held_out["eval/loss"]
    assert cli_main([str(run_dir), "--split", "all"]) == 0
    assert json.loads((run_dir / "eval" / "step_00000002.all.json").read_text())["split"] == "all"
    other = tmp_path / "other_tokens"
    shutil.copytree(tokenized_dataset, other)
    elsewhere = evaluate(run_dir, data=str(other), split="eval")
    others = sorted(p.name for p in (run_dir / "eval").glob("step_00000002.eval.data-*.json"))
    assert len(others) == 1 and json.loads((run_dir / "eval" / others[0]).read_text()) == elsewhere
    assert json.loads(record.read_text()) == held_out
    assert evaluate(run_dir, data=str(tokenized_dataset), split="eval") == held_out  # the run's own data, named
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == sorted(
        ["step_00000002.json", "step_00000002.train.json", "step_00000002.all.json", others[0]])
