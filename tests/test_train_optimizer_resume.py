"""A resumed run uses the optimizer kernel of its current config (optim.fused), not the checkpoint's."""

from __future__ import annotations

import pytest
import torch

from musiclm_stab.config import load_config
from musiclm_stab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)


def trainer(data, out, fused: bool, max_steps: int, resume: bool = False) -> Trainer:
    cfg = load_config("recipes/tiny.yaml", [
        f"--data.path={data}", f"--train.output_dir={out}", "--train.name=r", "--data.crop_seconds=2.0",
        "--data.batch_size=2", "--data.eval_fraction=0.3", "--train.checkpoint_every=2",
        f"--train.max_steps={max_steps}", f"--optim.fused={str(fused).lower()}"])
    return Trainer(cfg, resume=resume)


@pytest.mark.parametrize("before", [False, True], ids=["foreach-then-fused", "fused-then-foreach"])
def test_resume_uses_the_configured_fused_setting(tokenized_dataset, tmp_path, monkeypatch, before):
    """Resumed with the other optim.fused, the optimizer's param_groups and the kernel that runs (the fused
    AdamW op called or not) follow the config, and the step counters sit where that kernel keeps them."""
    trainer(tokenized_dataset, tmp_path, before, max_steps=2).run()
    calls = []
    fused_op = torch._fused_adamw_

    def counting(*args, **kwargs):
        calls.append(1)
        return fused_op(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    resumed = trainer(tokenized_dataset, tmp_path, not before, max_steps=3, resume=True)
    assert resumed.step == 2
    groups = resumed.optimizer.optimizer.param_groups
    assert all(bool(g["fused"]) == (not before) for g in groups), [g["fused"] for g in groups]
    resumed.run()
    assert resumed.step == 3
    assert (len(calls) > 0) == (not before), calls  # one fused call per step with fused, none without
    steps = [s["step"] for s in resumed.optimizer.optimizer.state.values()]
    assert steps and all(float(s) == 3 for s in steps)


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_frontend_lr_gives_the_conv_frontend_its_own_peak_lr(tokenized_dataset, tmp_path, precision):
    """optim.frontend_lr puts the conv frontend's parameters (or, in fairseq fp16, their fp32 masters) in an
    optimizer group of their own on the same schedule: at a near-zero frontend lr the frontend stays as it
    was after three updates while the rest of the model moves; the logged lr is the main group's."""
    cfg = load_config("recipes/tiny.yaml", [
        f"--data.path={tokenized_dataset}", f"--train.output_dir={tmp_path}", "--train.name=f",
        "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3", "--train.max_steps=3",
        "--optim.warmup_steps=1", "--optim.lr=1e-2", "--optim.frontend_lr=1e-12",
        f"--train.mixed_precision={precision}"])
    t = Trainer(cfg)
    model = t.accelerator.unwrap_model(t.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = t.optimizer.optimizer.param_groups
    assert [g["initial_lr"] for g in groups] == [1e-2, 1e-12]
    assert len(groups[1]["params"]) == len(list(model.frontend.parameters()))
    t.run()
    for name, p in model.named_parameters():
        moved = (p.detach() - before[name]).abs().max().item()
        if name.startswith("frontend."):
            assert moved < 1e-6, name
        elif name.startswith(("encoder.layers.0.ffn.fc1", "feature_proj")):
            assert moved > 1e-4, name
