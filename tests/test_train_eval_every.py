"""train.eval_every: held-out rows in metrics.jsonl as `musiclm-stab evaluate` computes them, without
changing training, and the same result however the batches are split across processes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from musiclm_stab.analysis.evaluate import evaluate
from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.data import CropDataset
from musiclm_stab.data.loader import held_out_loader
from musiclm_stab.data.tokenized import load_tokenized
from musiclm_stab.model import MusicMLM
from musiclm_stab.training.held_out import held_out_metrics
from musiclm_stab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)


def tiny_cfg(data, out, name, *overrides):
    return load_config("recipes/tiny.yaml", [
        f"--data.path={data}", f"--train.output_dir={out}", f"--train.name={name}", "--data.crop_seconds=2.0",
        "--data.batch_size=2", "--data.eval_fraction=0.3", "--optim.warmup_steps=1", "--train.checkpoint_every=2",
        "--train.max_steps=3", "--train.keep_checkpoints=5", "--train.trackers=[]", *overrides])


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_eval_rows_leave_training_bit_identical(tokenized_dataset, tmp_path):
    """With eval_every=2 the rows of steps 2 and 3 (the last) carry the eval/* metrics, and every training
    metric of every step is bit-identical to a run without evaluation (RNG, dropout mode untouched)."""
    plain = Trainer(tiny_cfg(tokenized_dataset, tmp_path, "plain")).run()
    evald = Trainer(tiny_cfg(tokenized_dataset, tmp_path, "eval", "--train.eval_every=2")).run()
    a, b = rows(plain), rows(evald)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert [sorted(k for k in r if k.startswith("eval/")) != [] for r in b] == [False, True, True]
    assert not any(k.startswith("eval/") for r in a for k in r)
    for ra, rb in zip(a, b):
        train_keys = [k for k in ra if k != "audio_s_per_s"]  # wall-clock throughput differs
        assert {k: ra[k] for k in train_keys} == {k: rb[k] for k in train_keys}
    names = {k for k in b[-1] if k.startswith("eval/")}
    assert {"eval/loss", "eval/acoustic_mlm_loss", "eval/musical_mlm_loss", "eval/features_pen",
            "eval/acoustic_mlm_loss/cb0", "eval/acoustic_acc/cb7"} <= names and "eval/mask_fraction" not in names
    assert all(math.isfinite(b[-1][k]) for k in names)


@pytest.mark.parametrize("precision", [[], ["--train.mixed_precision=fp16"]], ids=["fp32", "fp16"])
def test_eval_row_equals_musiclm_stab_evaluate_of_that_checkpoint(tokenized_dataset, tmp_path, precision):
    """The eval/* values logged at step 2 are exactly those `musiclm-stab evaluate` gives for checkpoint
    step_2 (same crops, masks, batches and loop; for a fairseq-fp16 run, the same emulated fp16 arithmetic)."""
    run = Trainer(tiny_cfg(tokenized_dataset, tmp_path, "r", "--train.eval_every=2", "--train.max_steps=2",
                           *precision)).run()
    logged = rows(run)[-1]
    result = evaluate(run / "checkpoints" / "step_00000002", write=False)
    assert {k: v for k, v in result.items() if k.startswith("eval/")} == {
        k: v for k, v in logged.items() if k.startswith("eval/")}


def test_eval_split_across_processes_sums_to_the_whole(tokenized_dataset):
    """held_out_loader's share of process 0 and of process 1 (of 2), their frame-weighted sums added as
    accelerate's reduce does, give the single-process metrics (to float rounding: 1e-12 relative)."""
    cfg = load_config("recipes/tiny.yaml", [f"--data.path={tokenized_dataset}", "--data.crop_seconds=2.0"])
    hf = load_tokenized(tokenized_dataset)[0]
    dataset = CropDataset(hf, list(range(len(hf))), 2.0, random_crop=False)  # 6 crops: 3 batches of 2
    torch.manual_seed(0)
    model = MusicMLM(cfg.model).eval()
    whole, frames = held_out_metrics(model, held_out_loader(cfg, dataset, batch_size=2), cfg.model, "bits", "cpu")
    shares = {}

    def keep(rank):
        def reduce_sum(t):
            shares[rank] = t.clone()
            return t if rank == 1 else t + shares[1]
        return reduce_sum

    held_out_metrics(model, held_out_loader(cfg, dataset, 2, rank=1, world_size=2), cfg.model, "bits", "cpu",
                     reduce_sum=keep(1))
    split, split_frames = held_out_metrics(model, held_out_loader(cfg, dataset, 2, rank=0, world_size=2),
                                           cfg.model, "bits", "cpu", reduce_sum=keep(0))
    assert shares[0][-1] > 0 and shares[1][-1] > 0 and split_frames == frames  # both processes had batches
    assert split.keys() == whole.keys()
    for k in whole:
        assert split[k] == pytest.approx(whole[k], rel=1e-12, abs=1e-12), k
    capped = [len(b["mask"]) for b in held_out_loader(cfg, dataset, 2, max_batches=2)]  # train.eval_batches
    assert capped == [2, 2] and [len(b["mask"]) for b in held_out_loader(cfg, dataset, 4)] == [4, 2]


@pytest.mark.parametrize("args, message", [
    (["--train.eval_every=3", "--train.log_every=2"],
     "train.eval_every=3 must be 0 (off) or a multiple of train.log_every=2"),
    (["--train.eval_batches=-1"], "train.eval_batches must be >= 0 (0 = all), got -1"),
])
def test_bad_eval_settings_name_the_setting(args, message):
    """eval_every must fall on logged steps (its metrics join that row); eval_batches is a count."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, args)


def test_eval_without_held_out_crops_is_refused_before_training(tokenized_dataset, tmp_path):
    """eval_every with no held-out segment as long as the crop: a ConfigError naming train.eval_every, before
    any run directory is written."""
    cfg = tiny_cfg(tokenized_dataset, tmp_path, "none", "--train.eval_every=1", "--data.eval_fraction=0")
    with pytest.raises(ConfigError, match="train.eval_every=1: the held-out tracks"):
        Trainer(cfg)
    assert not (tmp_path / "none").exists()
