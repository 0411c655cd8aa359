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
