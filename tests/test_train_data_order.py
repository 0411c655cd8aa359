"""data.order_seed: runs can share one data order (segments, their order, crops) while init, dropout,
noise mixup and masks differ by train.seed, or differ in data order alone; resuming refuses a changed one."""

from __future__ import annotations

import pytest
import torch

from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)

MICRO_BATCHES = 5  # 2 per epoch here (4 training crops, batch 2): three epochs' permutations and crops


def trainer(data, out, name, *overrides, resume=False) -> Trainer:
    cfg = load_config("recipes/tiny.yaml", [
        f"--data.path={data}", f"--train.output_dir={out}", f"--train.name={name}", "--data.crop_seconds=2.0",
        "--data.batch_size=2", "--data.eval_fraction=0.3", "--train.trackers=[]", "--train.checkpoint_every=2",
        "--train.max_steps=2", *overrides])
    return Trainer(cfg, resume=resume)


def batches(t: Trainer) -> list[dict]:
    return [next(t.stream) for _ in range(MICRO_BATCHES)]


def same(a: list[dict], b: list[dict], key: str) -> bool:
    return all(torch.equal(x[key], y[key]) for x, y in zip(a, b))


def first_weight(t: Trainer) -> torch.Tensor:
    return next(t.accelerator.unwrap_model(t.model).parameters()).detach().clone()


@pytest.mark.parametrize("streaming", [False, True], ids=["saved", "streamed"])
def test_shared_order_seed_same_crops_other_init_and_masks(tokenized_dataset, tmp_path, streaming):
    """Same data.order_seed, train.seed 1 vs 2: the same crops (clean audio and codes) in the same order
    over three epochs, but other initial weights and other span masks. Without order_seed (old behaviour:
    data seeded by train.seed) the crops differ."""
    s = f"--data.streaming={str(streaming).lower()}"
    a = trainer(tokenized_dataset, tmp_path, "a", s, "--train.seed=1", "--data.order_seed=7")
    b = trainer(tokenized_dataset, tmp_path, "b", s, "--train.seed=2", "--data.order_seed=7")
    c = trainer(tokenized_dataset, tmp_path, "c", s, "--train.seed=2")
    ba, bb, bc = batches(a), batches(b), batches(c)
    assert same(ba, bb, "clean_wav") and same(ba, bb, "codes")
    assert not same(ba, bb, "mask")
    assert not torch.equal(first_weight(a), first_weight(b))
    assert not same(bb, bc, "clean_wav")  # the order_seed, not train.seed, chose b's crops


def test_other_order_seed_other_crops_same_init(tokenized_dataset, tmp_path):
    """Same train.seed, data.order_seed 3 vs 4: other crops, the same initial weights; order_seed null is
    train.seed (the default: each seed its own data order), batch for batch, masks included."""
    a = trainer(tokenized_dataset, tmp_path, "a", "--train.seed=3", "--data.order_seed=3")
    b = trainer(tokenized_dataset, tmp_path, "b", "--train.seed=3", "--data.order_seed=4")
    d = trainer(tokenized_dataset, tmp_path, "d", "--train.seed=3")
    ba, bb, bd = batches(a), batches(b), batches(d)
    assert not same(ba, bb, "clean_wav")
    assert torch.equal(first_weight(a), first_weight(b))
    for key in ("clean_wav", "wav", "codes", "mask"):
        assert same(ba, bd, key), key


def test_resume_refuses_a_changed_order_seed(tokenized_dataset, tmp_path):
    """--resume with another data.order_seed is refused as a change of the data position, naming it; an
    explicit order_seed equal to the checkpoint's train.seed (null then) is the same order and resumes."""
    trainer(tokenized_dataset, tmp_path, "r", "--train.seed=5").run()
    with pytest.raises(ConfigError, match=r"settings that define its data position changed\n  data.order_seed "
                                          r"\(null: train.seed\): 5 in the checkpoint, 6 now"):
        trainer(tokenized_dataset, tmp_path, "r", "--train.seed=5", "--data.order_seed=6", "--train.max_steps=3",
                resume=True)
    resumed = trainer(tokenized_dataset, tmp_path, "r", "--train.seed=5", "--data.order_seed=5",
                      "--train.max_steps=3", resume=True)
    assert resumed.step == 2
