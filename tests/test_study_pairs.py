"""The study's configurations are pairs: at one seed they share their init draws, whatever their run number."""

from __future__ import annotations

import pytest
import torch

from musiclm_stab.config import load_config
from musiclm_stab.experiments.study_plan import STUDY_RECIPES, recipe_path
from musiclm_stab.model.norm_schemes import deepnorm_beta
from musiclm_stab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)


def initial_weights(stem, data, tmp_path, seed=3):
    cfg = load_config([recipe_path(stem), "recipes/overlays/tiny.yaml"], [
        f"--data.path={data}", f"--train.output_dir={tmp_path}", f"--train.name={stem}", f"--train.seed={seed}",
        "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3"])
    trainer = Trainer(cfg)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_configurations_of_one_seed_share_their_init(tokenized_dataset, tmp_path):
    """Pre-Norm clip 10 ("Run 1") and clip 1 ("Run 2") start from identical weights at one seed; DeepNorm
    draws the same numbers, its fc1 scaled by beta and its q projection untouched."""
    clip10, clip1, deepnorm = (initial_weights(stem, tokenized_dataset, tmp_path) for stem in STUDY_RECIPES[:3])
    assert clip10.keys() == clip1.keys()
    assert all(torch.equal(clip10[n], clip1[n]) for n in clip10)
    fc1 = "encoder.layers.0.ffn.fc1.weight"
    q = "encoder.layers.0.attn.q_proj.weight"
    torch.testing.assert_close(deepnorm[fc1], clip10[fc1] * deepnorm_beta(2), rtol=2e-3, atol=6e-8)  # fp16 values (atol: a subnormal step)
    assert torch.equal(deepnorm[q], clip10[q])


def test_unigram_level_is_the_held_out_masked_frames_cross_entropy(tokenized_dataset):
    """unigram_eval_cb0: -mean log2 of the add-one training-split frequency of each held-out masked frame's
    codebook-0 code (recomputed here from the rows and evaluate's batches by hand), and other codebooks differ."""
    import numpy as np

    from musiclm_stab.analysis.unigram import unigram_eval_loss
    from musiclm_stab.data import CropDataset, split_indices
    from musiclm_stab.data.loader import EVAL_SEED, held_out_loader
    from musiclm_stab.data.tokenized import load_tokenized

    cfg = load_config("recipes/tiny.yaml", [f"--data.path={tokenized_dataset}", "--data.crop_seconds=2.0",
                                            "--data.eval_fraction=0.3"])
    got = unigram_eval_loss(cfg)
    hf, _ = load_tokenized(tokenized_dataset)
    train, held = split_indices(hf["track"], 0.3)
    counts = np.ones(1024)
    for i in train:
        for code in hf[i]["codes"][0]:
            counts[code] += 1
    batches = held_out_loader(cfg, CropDataset(hf, held, 2.0, seed=EVAL_SEED, random_crop=False))
    codes = np.concatenate([b["codes"][:, 0][b["mask"]].numpy() for b in batches])
    expected = -np.log2(counts[codes] / counts.sum()).mean()
    assert got["masked_frames"] == len(codes) > 0 and got["train_frames"] == counts.sum() - 1024
    assert abs(got["unigram_eval_cb0"] - expected) < 1e-9
    assert unigram_eval_loss(cfg, codebook=3)["unigram_eval_cb3"] != got["unigram_eval_cb0"]
