"""Training in fp16 on CPU (emulated): fairseq's --fp16 (master weights, its loss scaler, overflowed updates
skipped and not counted, the floor ending the run, exact resume) and torch amp (GradScaler)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from musiclm_stab.config import load_config
from musiclm_stab.model.fp16_arith import round_fp16
from musiclm_stab.training.loss_scaler import DynamicLossScaler, MinLossScaleError
from musiclm_stab.training.precision import MASTER_KEY
from musiclm_stab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's tensors on shared cores: intra-op threads only add overhead (their waiting made each
    step cost about 5x its CPU time here); the runs each test compares all train under it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fp16_cfg(data, tmp_path, *overrides, name="run"):
    return load_config("recipes/tiny.yaml", [
        f"--data.path={data}", f"--train.output_dir={tmp_path}", f"--train.name={name}", "--data.crop_seconds=2.0",
        "--data.batch_size=2", "--data.eval_fraction=0.3", "--optim.warmup_steps=1", "--train.checkpoint_every=100",
        "--train.mixed_precision=fp16", "--model.dropout=0.0", "--model.attention_dropout=0.0", *overrides])


class OverflowTrainer(Trainer):
    """The real trainer whose loss is inf at the chosen (step, micro-batch) pairs, each once."""

    def __init__(self, cfg, resume=False, at=()):
        super().__init__(cfg, resume)
        self.due, self.seen = set(at), []

    def perturb_loss(self, step, loss):
        self.seen = self.seen + [step] if self.seen and self.seen[-1] == step else [step]
        key = (step, len(self.seen) - 1)
        if key in self.due:
            self.due.discard(key)
            return loss * float("inf")
        return loss


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def state(trainer):
    """Copies of everything an update may change: model, fp32 masters, optimizer state, lr."""
    return {"model": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "master": [m.detach().clone() for m in trainer.precision.master],
            "optimizer": copy.deepcopy({k: v for k, v in trainer.optimizer.state_dict().items() if k != MASTER_KEY}),
            "lr": trainer.scheduler.get_last_lr()[0]}


def assert_same(a, b):
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert all(torch.equal(x, y) for x, y in zip(a["master"], b["master"]))
    for pid, s in a["optimizer"]["state"].items():
        for key, value in s.items():
            assert torch.equal(value, b["optimizer"]["state"][pid][key]), (pid, key)
    assert a["lr"] == b["lr"]


def test_fairseq_overflow_skips_update_halves_scale_and_is_no_step(tokenized_dataset, tmp_path):
    """An overflow in fairseq mode: no parameter, master or optimizer-state change, the scale halves
    (128 -> 64), and the step and the learning rate do not advance; the model holds fp16 values throughout."""
    trainer = OverflowTrainer(fp16_cfg(tokenized_dataset, tmp_path, "--train.max_steps=5"), at=[(2, 0)])
    assert trainer.precision.name == "fairseq" and trainer.precision.loss_scale == 128
    trainer.train_step()
    first = trainer.update()
    assert first["advanced"] and not first["overflow"] and trainer.step == 1
    before = state(trainer)
    trainer.train_step()
    result = trainer.update()
    assert result["overflow"] and not result["advanced"] and not result["skipped"]
    assert trainer.step == 1 and trainer.precision.loss_scale == 64
    assert_same(before, state(trainer))
    trainer.train_step()  # the same step again, with the next batch: applied
    assert trainer.update()["advanced"] and trainer.step == 2
    after = state(trainer)
    assert not torch.equal(after["master"][0], before["master"][0])
    for p, m in zip(trainer.precision.params, trainer.precision.master):
        assert torch.equal(p.detach(), round_fp16(m.detach()))  # the model is the rounded masters


def test_overflow_in_one_micro_batch_skips_the_whole_update(tokenized_dataset, tmp_path):
    """With train.grad_accum=2 an inf in the second micro-batch only skips the whole accumulated update."""
    trainer = OverflowTrainer(fp16_cfg(tokenized_dataset, tmp_path, "--train.max_steps=5", "--train.grad_accum=2"),
                              at=[(2, 1)])
    trainer.train_step()
    trainer.update()
    before = state(trainer)
    trainer.train_step()
    result = trainer.update()
    assert result["overflow"] and trainer.step == 1 and trainer.precision.loss_scale == 64
    assert_same(before, state(trainer))


def test_scale_doubles_after_the_window(tokenized_dataset, tmp_path):
    """fp16_scale_window=2: the scale doubles after every 2 clean updates (128 -> 256 -> 512), an overflow
    halves it and restarts the count; metrics rows log loss_scale and overflow_step."""
    cfg = fp16_cfg(tokenized_dataset, tmp_path, "--train.max_steps=5", "--train.fp16_scale_window=2")
    trainer = OverflowTrainer(cfg, at=[(3, 0)])
    scales = []
    for _ in range(6):
        trainer.train_step()
        trainer.update()
        scales.append(trainer.precision.loss_scale)
    # updates 1, 2 clean (x2 after 2), overflow at step 3 (/2), then 3, 4 clean (x2 after 2 since it)
    assert scales == [128, 256, 128, 128, 256, 256]


def test_min_loss_scale_ends_the_run_with_a_clear_error(tokenized_dataset, tmp_path):
    """Overflows at every update from step 2: the scale halves to its floor and the run ends with
    MinLossScaleError naming the step and the floor; metrics.jsonl ends with a min_loss_scale event."""
    cfg = fp16_cfg(tokenized_dataset, tmp_path, "--train.max_steps=5", "--train.fp16_init_scale=4",
                   "--train.fp16_min_loss_scale=0.5")
    class Always(OverflowTrainer):
        def perturb_loss(self, step, loss):
            return loss * float("inf") if step >= 2 else loss

    trainer = Always(cfg)
    with pytest.raises(MinLossScaleError, match=r"step 2: the fp16 loss scale would fall to 0.5.*fp16_min_loss_scale=0.5"):
        trainer.run()
    last = rows(trainer.run_dir)[-1]
    assert last["event"] == "min_loss_scale" and last["step"] == 1 and last["loss_scale"] == 1.0
    assert last["overflow_step"] == 3  # 4 -> 2 -> 1, then the halving to 0.5 ends it


def straight_and_stopped(data, tmp_path, common: list[str]):
    """An uninterrupted run and one stopped at step 3 (train.stop_at), both with an overflow at step 2."""
    straight = OverflowTrainer(fp16_cfg(data, tmp_path, *common, name="straight"), at=[(2, 0)])
    straight.run()
    first = OverflowTrainer(fp16_cfg(data, tmp_path, *common, "--train.stop_at=3", name="split"), at=[(2, 0)])
    first.run()
    return straight, first


def assert_same_rows_and_weights(straight, resumed) -> None:
    """Every logged row equal (but the wall-clock throughput) and every weight equal to the bit."""
    a, b = rows(straight.run_dir), rows(resumed.run_dir)
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        ra, rb = dict(ra), dict(rb)
        ra.pop("audio_s_per_s"), rb.pop("audio_s_per_s")
        assert ra == rb
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_fp16_resume_is_bit_exact(tokenized_dataset, tmp_path):
    """Stopped at step 3 and resumed, a fairseq-fp16 run (with an overflow and window doublings) restores its
    loss scaler's counters from registered.json, logs the same rows, loss scale included, and ends with the
    same weights as an uninterrupted run."""
    common = ["--train.max_steps=6", "--train.fp16_scale_window=2", "--train.checkpoint_every=3"]
    straight, first = straight_and_stopped(tokenized_dataset, tmp_path, common)
    resumed = OverflowTrainer(fp16_cfg(tokenized_dataset, tmp_path, *common, name="split"), resume=True)
    assert resumed.step == 3
    saved = json.loads((resumed.run_dir / "checkpoints" / "step_00000003" / "registered.json").read_text())
    # iterations: 3 updates and the overflow (the second); restored, not restarted from the settings
    assert saved["precision"]["loss_scaler"]["iteration"] == 4
    assert saved["precision"]["loss_scaler"]["last_overflow"] == 1
    assert resumed.precision.scaler.state_dict() == saved["precision"]["loss_scaler"]
    resumed.run()
    a = rows(straight.run_dir)
    assert [r["step"] for r in a] == [1, 2, 3, 4, 5, 6]
    assert [r["overflow_step"] for r in a] == [0, 1, 0, 0, 0, 0]
    assert all("loss_scale" in r for r in a)
    assert_same_rows_and_weights(straight, resumed)
    assert all(torch.equal(x, y) for x, y in zip(straight.precision.master, resumed.precision.master))


def test_amp_fp16_resume_is_bit_exact_with_the_grad_scaler_in_registered_json(tokenized_dataset, tmp_path):
    """Stopped at step 3 and resumed, an amp-fp16 run with an overflow logs the same rows (loss scale
    included) and ends with the same weights as an uninterrupted run; the GradScaler's state rides in the
    checkpoint's registered.json (JSON, its scale the one logged at step 3), not in a pickle."""
    common = ["--train.max_steps=6", "--train.fp16_mode=amp", "--train.checkpoint_every=3"]
    straight, first = straight_and_stopped(tokenized_dataset, tmp_path, common)
    ckpt = first.run_dir / "checkpoints" / "step_00000003"
    saved = json.loads((ckpt / "registered.json").read_text())["precision"]["grad_scaler"]
    a = rows(straight.run_dir)
    assert saved["scale"] == a[2]["loss_scale"] < 65536 and saved["_growth_tracker"] == 1
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith(("custom_checkpoint", "scaler"))]
    resumed = OverflowTrainer(fp16_cfg(tokenized_dataset, tmp_path, *common, name="split"), resume=True)
    assert resumed.step == 3 and resumed.precision.loss_scale == saved["scale"]
    resumed.run()
    assert [r["step"] for r in a] == [1, 2, 3, 4, 5, 6] and a[1]["overflow_step"] == 1
    assert_same_rows_and_weights(straight, resumed)


def test_amp_mode_on_cpu_uses_grad_scaler_and_counts_overflows_as_steps(tokenized_dataset, tmp_path):
    """train.fp16_mode=amp on CPU: emulated autocast, GradScaler at 65536; an overflow halves it, skips the
    update and (as amp always did) still counts as a step."""
    trainer = OverflowTrainer(fp16_cfg(tokenized_dataset, tmp_path, "--train.max_steps=5", "--train.fp16_mode=amp"),
                              at=[(2, 0)])
    assert trainer.precision.name == "amp" and trainer.precision.loss_scale == 65536
    trainer.train_step()
    trainer.update()  # may overflow by itself at 65536 (GradScaler's usual first steps)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    scale = trainer.precision.loss_scale
    trainer.train_step()
    result = trainer.update()
    assert result["overflow"] and result["advanced"] and trainer.step == 2
    assert trainer.precision.loss_scale == scale / 2
    assert all(torch.equal(p, params[n]) for n, p in trainer.model.named_parameters())


def test_loss_scaler_rules():
    """DynamicLossScaler: doubles after `window` updates since the last overflow, halves on overflow, raises
    below the floor keeping the scale, and tolerance keeps the scale while overflows are rare."""
    s = DynamicLossScaler(loss_scale=8.0, scale_window=3, min_loss_scale=1.0)
    for _ in range(3):
        s.update()
    assert s.loss_scale == 16.0
    s.overflow()
    assert s.loss_scale == 8.0
    s.update(), s.update()
    assert s.loss_scale == 8.0
    s.update()
    assert s.loss_scale == 16.0
    s.overflow(), s.overflow(), s.overflow()
    assert s.loss_scale == 2.0
    with pytest.raises(MinLossScaleError):
        s.overflow()
    assert s.loss_scale == 2.0
    lenient = DynamicLossScaler(loss_scale=8.0, scale_window=100, tolerance=0.5)
    for _ in range(4):
        lenient.update()
    lenient.overflow()  # 1 overflow in 5 iterations since the start: below 0.5, kept
    assert lenient.loss_scale == 8.0
    lenient.overflow()
    lenient.overflow()  # 3 of 7: still below
    assert lenient.loss_scale == 8.0
    lenient.overflow()  # 4 of 8: halved
    assert lenient.loss_scale == 4.0
    restored = DynamicLossScaler()
    restored.load_state_dict(json.loads(json.dumps(lenient.state_dict())))
    assert restored.state_dict() == lenient.state_dict()


def test_fp16_musical_mse_pins_the_loss_scale_below_65504_over_the_masked_frames(tokenized_dataset, tmp_path):
    """With the scale window at 1 the scale doubles after every clean update from 128; the fp16 musical MSE
    (as MERT computes it) overflows once loss_scale x masked frames passes 65504, so with ~165 masked frames
    a batch (2 crops of 150 frames) the scale is pinned at 256 and overflows at every try of 512."""
    trainer = Trainer(fp16_cfg(tokenized_dataset, tmp_path, "--train.max_steps=8", "--train.fp16_scale_window=1"))
    tried = []  # (the scale an update ran at, whether it overflowed)
    for _ in range(10):
        scale = trainer.precision.loss_scale
        trainer.train_step()
        tried.append((scale, trainer.update()["overflow"]))
    assert max(s for s, _ in tried) == 512, tried
    assert all(overflow == (s == 512) for s, overflow in tried), tried


def test_fp16_accum_group_sums_groups_of_micro_batches_as_fairseqs_gpus_did(fresh_accelerate_state):
    """train.fp16_accum_group=2 with 4 micro-batches: each pair's fp16 sum is divided in fp16 by the 2 groups and
    the two added in fp16 (fairseq's legacy DDP on 2 GPUs of update_freq 2), so gradients of 20000 per
    micro-batch stay finite (40000 / 2 + 40000 / 2), where one fp16 sum of the 4 overflows (80000); unscaled,
    both are the mean per micro-batch."""
    from accelerate import Accelerator

    from musiclm_stab.config import TrainConfig
    from musiclm_stab.training.precision import FairseqFp16

    def update(group):
        torch.manual_seed(0)
        layer = torch.nn.Linear(1, 1, bias=False)
        precision = FairseqFp16(Accelerator(cpu=True), TrainConfig(mixed_precision="fp16", grad_accum=4,
                                                                  fp16_accum_group=group), "emulate")
        precision.prepare_model(layer)
        precision.begin_update(torch.tensor(1.0))
        for i in range(4):
            x = torch.full((1, 1), 20000.0 / 128)  # d(loss)/dw = x; backpropagated x 128 (the loss scale)
            precision.backward(layer(x).sum(), 4)
            precision.after_backward(i)
        return layer.weight.grad.clone(), precision.grad_scale()

    grouped, scale = update(2)
    assert grouped.item() == 40000.0 and scale == 128 * 2  # (20000 + 20000) / 2 + (20000 + 20000) / 2
    assert grouped.item() / scale == pytest.approx(20000.0 / 128)  # the mean per micro-batch, unscaled
    whole, _ = update(None)
    assert torch.isinf(whole).all()  # 4 x 20000 in one fp16 sum
    with pytest.raises(Exception, match="fp16_accum_group=3 must divide train.grad_accum=4"):
        FairseqFp16(Accelerator(cpu=True), TrainConfig(mixed_precision="fp16", grad_accum=4, fp16_accum_group=3),
                    "emulate")


def test_trainer_with_fp16_accum_group_updates_like_one_fp16_sum(tokenized_dataset, tmp_path):
    """Through the trainer, grad_accum 2 summed as 2 groups of 1 (each divided by 2 in fp16) moves the fp32
    masters as one fp16 sum of the 2 does, to fp16 precision (same batches, same init)."""
    masters = []
    for group in ("null", "1"):
        trainer = Trainer(fp16_cfg(tokenized_dataset, tmp_path, "--train.max_steps=2", "--train.grad_accum=2",
                                   f"--train.fp16_accum_group={group}", name=f"g{group}"))
        for _ in range(2):
            trainer.train_step()
            assert trainer.update()["advanced"]
        masters.append([m.detach().clone() for m in trainer.precision.master])
    for a, b in zip(*masters):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-5)
