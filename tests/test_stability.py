"""Stability tools: skipped non-finite steps, spike rollback, adaptive clipping, diagnostics."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from musiclm_stab.config import OptimConfig, TrainConfig, load_config
from musiclm_stab.training.stability import GradClipper, SpikeGuard
from musiclm_stab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)


def tiny_cfg(data, tmp_path, *overrides):
    return load_config("recipes/tiny.yaml", [
        f"--data.path={data}", f"--train.output_dir={tmp_path}", "--train.name=run", "--data.crop_seconds=2.0",
        "--data.batch_size=2", "--data.eval_fraction=0.3", "--optim.warmup_steps=1", "--train.checkpoint_every=2",
        "--train.keep_checkpoints=10", *overrides])


class FaultyTrainer(Trainer):
    """The real trainer with faults injected once through its seams: at step ``nan_at`` every gradient is
    NaN, at ``spike_at`` the loss is multiplied by 1000 (once, even when a rollback replays the step)."""

    def __init__(self, cfg, nan_at=None, spike_at=None):
        super().__init__(cfg)
        self.due = {"nan": nan_at, "spike": spike_at}

    def _fire(self, fault, step):
        if self.due[fault] == step:
            self.due[fault] = None
            return True
        return False

    def perturb_loss(self, step, loss):
        return loss * 1000.0 if self._fire("spike", step) else loss

    def perturb_grads(self, step):
        if self._fire("nan", step):
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_nonfinite_gradient_leaves_state_untouched(tokenized_dataset, tmp_path):
    """A NaN gradient skips the update: parameters and optimizer state are bit-identical, the step counted."""
    trainer = Trainer(tiny_cfg(tokenized_dataset, tmp_path, "--train.max_steps=5"))
    trainer.train_step()
    trainer.update()  # one good step, so the optimizer has state
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    opt_state = copy.deepcopy(trainer.optimizer.state_dict())
    trainer.train_step()
    for p in trainer.model.parameters():
        p.grad.fill_(float("nan"))
    result = trainer.update()
    assert result["skipped"] and not math.isfinite(result["grad_norm"])
    assert all(torch.equal(p, params[n]) for n, p in trainer.model.named_parameters())
    after = trainer.optimizer.state_dict()
    assert after["state"].keys() == opt_state["state"].keys()
    for k, st in opt_state["state"].items():
        assert all(torch.equal(st[x], after["state"][k][x]) for x in st)
    assert trainer.clipper.count == 1  # the skipped norm fed no statistic


def test_injected_nan_is_logged_and_training_goes_on(tokenized_dataset, tmp_path):
    """Through the real loop: the NaN step is logged as skipped_step=1 and the next steps train normally."""
    run_dir = FaultyTrainer(tiny_cfg(tokenized_dataset, tmp_path, "--train.max_steps=4"), nan_at=2).run()
    r = rows(run_dir)
    assert [x["skipped_step"] for x in r] == [0, 1, 0, 0]
    assert math.isnan(r[1]["grad_norm"]) and all(math.isfinite(x["grad_norm"]) for x in r[2:])


def test_spike_triggers_rollback_and_skip(tokenized_dataset, tmp_path):
    """An injected loss spike rolls back to the last checkpoint, skips its batches, and training finishes."""
    cfg = tiny_cfg(tokenized_dataset, tmp_path, "--train.max_steps=8", "--train.spike_guard=true",
                   "--train.spike_warmup=3", "--train.spike_z=3")
    trainer = FaultyTrainer(cfg, spike_at=6)
    run_dir = trainer.run()
    r = rows(run_dir)
    events = [x for x in r if x.get("event") == "rollback"]
    assert len(events) == 1 and events[0]["step"] == 6 and events[0]["to_step"] == 4
    assert events[0]["skipped_micro_batches"] == 2
    steps = [x["step"] for x in r if "event" not in x]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # the abandoned 5-6 (with the spike), then 5-8 again
    assert trainer.step == 8 and trainer.consumed == 10  # 8 updates + the 2 skipped micro-batches
    spiky = [x for x in r if x.get("step") == 6 and "event" not in x]
    assert spiky[0]["loss"] > 100 * spiky[1]["loss"]


def test_guard_off_by_default(tokenized_dataset, tmp_path):
    """Without spike_guard, an injected spike is trained through (no rollback event)."""
    run_dir = FaultyTrainer(tiny_cfg(tokenized_dataset, tmp_path, "--train.max_steps=3"), spike_at=2).run()
    assert not [x for x in rows(run_dir) if "event" in x]


def test_diagnostics_logged_per_layer(tokenized_dataset, tmp_path):
    """With diagnostics_every=2, even steps log per-layer max attention logit and gradient norm."""
    run_dir = Trainer(tiny_cfg(tokenized_dataset, tmp_path, "--train.max_steps=2",
                               "--train.diagnostics_every=2")).run()
    r = rows(run_dir)
    assert "diag/max_attn_logit/layer0" not in r[0]
    for i in range(2):
        assert r[1][f"diag/max_attn_logit/layer{i}"] > 0 and r[1][f"diag/grad_norm/layer{i}"] > 0


def test_diagnostics_locate_a_failure_frontend_rms_and_fp16_headroom(tokenized_dataset, tmp_path):
    """Diagnostic steps also log the frontend output's RMS (the dead-input detector: with one micro-batch per
    step it is sqrt of the step's features penalty) and the fp16 headroom, max |x| / 65504, of the frontend's
    convolutions, each layer's residual stream and FFN intermediate, the heads and the largest (scaled)
    gradient; in fairseq fp16 the gradients carry loss scale x masked frames, far above their fp32 values."""
    run_dir = Trainer(tiny_cfg(tokenized_dataset, tmp_path, "--train.max_steps=2", "--train.diagnostics_every=1",
                               "--train.log_every=1", "--train.mixed_precision=fp16")).run()
    for row in rows(run_dir):
        pen = row["features_pen"] * math.log(2.0)  # logged in bits: pen / ln 2
        assert row["diag/frontend_rms"] == pytest.approx(math.sqrt(pen), rel=1e-4)
        names = ["frontend", "heads", "grad"] + [f"{part}/layer{i}" for part in ("residual", "ffn") for i in range(2)]
        for name in names:
            assert 0 < row[f"diag/headroom/{name}"] < 1, name
        assert row["diag/headroom/grad"] * 65504 > 1.0  # scaled by 128 x ~165 masked frames


def test_headroom_sees_a_residual_stream_past_fp16s_range():
    """A residual stream pushed past 65504 reads as headroom >= 1 in that layer (inf under the fairseq
    emulation, where it overflowed), while the recording itself changes no value of the model."""
    from musiclm_stab.config import ModelConfig
    from musiclm_stab.model import MusicMLM
    from musiclm_stab.model.fp16_arith import Fp16Emulation, round_parameters_
    from musiclm_stab.training.stability import record_activations

    torch.manual_seed(0)
    model = MusicMLM(ModelConfig(size="tiny", cqt_bins=84, cqt_bins_per_octave=12)).eval()
    with torch.no_grad():
        model.encoder.layers[1].ffn.fc2.bias.fill_(7e4)
    round_parameters_(model)
    wav = torch.randn(1, 320 * 20) * 0.1
    with torch.no_grad(), Fp16Emulation("fairseq"):
        plain = model.encode(wav)[0]
        with record_activations(model) as seen:
            recorded = model.encode(wav)[0]
    torch.testing.assert_close(recorded, plain, rtol=0, atol=0, equal_nan=True)
    assert seen["headroom/residual/layer0"] < 1 <= seen["headroom/residual/layer1"]
    assert seen["frontend_rms"] > 0


def test_zclip_threshold_follows_norm_statistics():
    """ZClip: after warmup the threshold is EMA mean + z * EMA std of past norms; non-finite norms ignored."""
    c = GradClipper(OptimConfig(clip_mode="zclip", clip_grad=5.0, clip_warmup=3, zclip_z=2.0, zclip_alpha=0.5))
    assert c.threshold() == 5.0
    for n in (1.0, 3.0, float("nan"), 1.0):
        c.observe(n)
    # EMA with a=0.5: mean 1 -> 2 -> 1.5; var 0 -> 0.5*(0+0.5*4)=1 -> 0.5*(1+0.5*1)=0.75
    assert c.count == 3
    assert c.threshold() == pytest.approx(1.5 + 2.0 * math.sqrt(0.75))


def test_autoclip_threshold_is_percentile():
    """AutoClip: the threshold is the configured percentile of the norms seen."""
    c = GradClipper(OptimConfig(clip_mode="autoclip", clip_warmup=1, autoclip_percentile=50))
    for n in range(1, 101):
        c.observe(float(n))
    assert c.threshold() == 51.0
    assert GradClipper(OptimConfig(clip_grad=1.0)).threshold() == 1.0


def test_spike_guard_detection():
    """The guard flags a loss far above its recent window, not ordinary noise, and only after warmup."""
    g = SpikeGuard(TrainConfig(spike_window=10, spike_warmup=5, spike_z=4.0, spike_min_rel=0.1))
    for x in (2.0, 2.1, 1.9, 2.05, 1.95):
        assert not g.is_spike(50.0) if len(g.window) < 5 else True
        g.observe(x)
    assert not g.is_spike(2.15) and g.is_spike(5.0) and not g.is_spike(float("nan"))
