"""Training and evaluation in the study's units (bits, as fairseq logs losses), the unit recorded with the
run, and resume refusing what it would silently ignore (optimizer hyperparameters, a unit change)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from musiclm_stab.analysis.evaluate import evaluate
from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)


def tiny(data, out, name, *overrides):
    return load_config("recipes/tiny.yaml", [
        f"--data.path={data}", f"--train.output_dir={out}", f"--train.name={name}", "--data.crop_seconds=2.0",
        "--data.batch_size=2", "--data.eval_fraction=0.3", "--train.checkpoint_every=2", *overrides])


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fresh_run_logs_bits_and_records_the_unit(tokenized_dataset, tmp_path):
    """A fresh tiny run logs codebook-0 CE near log2(1024) = 10 bits at step 1 and records
    train.loss_unit: bits in config.yaml; the same run in nats logs every loss times ln 2 (the objective,
    and so the training, is the same), accuracy and mask share unchanged."""
    bits_dir = Trainer(tiny(tokenized_dataset, tmp_path, "bits", "--train.max_steps=2")).run()
    nats_dir = Trainer(tiny(tokenized_dataset, tmp_path, "nats", "--train.max_steps=2",
                            "--train.loss_unit=nats")).run()
    assert yaml.safe_load((bits_dir / "config.yaml").read_text())["train"]["loss_unit"] == "bits"
    assert yaml.safe_load((nats_dir / "config.yaml").read_text())["train"]["loss_unit"] == "nats"
    bits, nats = rows(bits_dir), rows(nats_dir)
    # A uniform guess over 1024 codes is exactly 10 bits; at init the cosine logits (temperature 0.1) are
    # not quite flat: measured 10.28 bits (7.13 nats). Bounds 10 and 11 leave 0.28 / 0.72 bits.
    assert 10.0 < bits[0]["acoustic_mlm_loss/cb0"] < 11.0
    for b, n in zip(bits, nats):
        for name in ("loss", "acoustic_mlm_loss", "acoustic_mlm_loss/cb0", "acoustic_mlm_loss/cb7",
                     "musical_mlm_loss", "features_pen"):
            assert n[name] == pytest.approx(b[name] * math.log(2), rel=1e-5), name
        for name in ("acoustic_acc/cb0", "mask_fraction", "grad_norm"):
            assert n[name] == pytest.approx(b[name], rel=1e-5), name
    assert 6.9 < nats[0]["acoustic_mlm_loss/cb0"] < 7.7  # ln 1024 = 6.93 and the same gap, in nats


def test_evaluation_names_its_unit(tokenized_dataset, tmp_path):
    """evaluate reports the run's unit in its JSON and table header, and its losses in that unit: an old
    run (no train.loss_unit in config.yaml) evaluates in nats, its bits twin gives the same numbers / ln 2."""
    run_dir = Trainer(tiny(tokenized_dataset, tmp_path, "r", "--train.max_steps=2")).run()
    result = evaluate(run_dir, split="all", write=True)
    assert result["unit"] == "bits"
    assert json.loads((run_dir / "eval" / "step_00000002.all.json").read_text())["unit"] == "bits"
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    del cfg["train"]["loss_unit"]  # as written before the setting existed
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    old = evaluate(run_dir, split="all", write=False)
    assert old["unit"] == "nats"
    assert old["eval/acoustic_mlm_loss/cb0"] == pytest.approx(result["eval/acoustic_mlm_loss/cb0"] * math.log(2),
                                                             rel=1e-5)
    assert old["eval/loss"] == pytest.approx(result["eval/loss"] * math.log(2), rel=1e-5)


@pytest.mark.parametrize("override, listed", [
    ("--optim.lr=2e-3", "optim.lr: 0.001 in the checkpoint, 0.002 now"),
    ("--optim.betas=[0.9,0.95]", "optim.betas: [0.9, 0.98] in the checkpoint, [0.9, 0.95] now"),
    ("--optim.weight_decay=0.1", "optim.weight_decay: 0.01 in the checkpoint, 0.1 now"),
])
def test_resume_refuses_changed_optimizer_settings(tokenized_dataset, tmp_path, override, listed):
    """--resume with a changed optim.lr / betas / eps / weight_decay is refused, naming the change: torch
    would restore the checkpoint's values and silently ignore the new ones."""
    Trainer(tiny(tokenized_dataset, tmp_path, "r", "--train.max_steps=2")).run()
    with pytest.raises(ConfigError) as err:
        Trainer(tiny(tokenized_dataset, tmp_path, "r", "--train.max_steps=4", override), resume=True)
    assert "cannot resume" in str(err.value) and "changed optimizer settings" in str(err.value)
    assert listed in str(err.value)


def test_resume_refuses_a_changed_loss_unit(tokenized_dataset, tmp_path):
    """--resume with another train.loss_unit is refused (one unit per metrics.jsonl), naming the fix."""
    Trainer(tiny(tokenized_dataset, tmp_path, "r", "--train.max_steps=2")).run()
    with pytest.raises(ConfigError, match="its metrics are in bits; pass --train.loss_unit=bits"):
        Trainer(tiny(tokenized_dataset, tmp_path, "r", "--train.max_steps=4", "--train.loss_unit=nats"), resume=True)
