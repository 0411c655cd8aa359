"""Pruning by integrity (never a damaged checkpoint kept in place of intact ones) and a published step
never written again."""

from __future__ import annotations

from pathlib import Path

import pytest

from musiclm_stab.training import checkpoint
from musiclm_stab.training.checkpoint_writer import CheckpointWriter


def steps(run_dir: Path) -> list[int]:
    return [checkpoint.checkpoint_step(c) for c in checkpoint.list_checkpoints(run_dir)]


def damage(ckpt: Path) -> None:
    """Flip a byte of the weights, as a power loss or a bad disk may leave them."""
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))


def write(accelerator, run_dir: Path, step: int, keep: int) -> Path:
    """A checkpoint as the trainer writes it, by a fresh writer (a new process: nothing known intact)."""
    writer = CheckpointWriter(accelerator, run_dir)
    final = writer.save(step, {"consumed_micro_batches": step}, keep=keep)
    writer.wait()
    return final


def test_to_prune_counts_only_intact_checkpoints():
    """The newest `keep` intact steps are kept: a damaged step never takes the place of an intact one,
    multiples of keep_every stay whatever their state."""
    assert checkpoint.to_prune([100, 200, 300], keep=2, intact=lambda s: s != 200) == [200]
    assert checkpoint.to_prune([100, 200, 300], keep=1, intact=lambda s: s != 200) == [100, 200]
    assert checkpoint.to_prune([100, 150, 200], keep=1, intact=lambda s: s != 200) == [100, 200]
    assert checkpoint.to_prune([3, 5, 6, 7], keep=1, keep_every=3, intact=lambda s: s != 6) == [5]


def test_a_damaged_newest_checkpoint_never_costs_an_intact_one(accelerator, tmp_path):
    """keep_checkpoints=2 and a damaged newest step 200: resume starts from 100, and the next save keeps
    100 and the new 300, removing the damaged 200 with a warning naming it (before: 100 was pruned and
    the damaged 200 kept)."""
    write(accelerator, tmp_path, 100, keep=2)
    damage(write(accelerator, tmp_path, 200, keep=2))
    with pytest.warns(UserWarning, match="skipping damaged checkpoint .*step_00000200"):
        assert checkpoint.newest_valid(tmp_path).name == "step_00000100"
    with pytest.warns(UserWarning, match="removing damaged checkpoint .*step_00000200.*model.safetensors"):
        write(accelerator, tmp_path, 300, keep=2)
    assert steps(tmp_path) == [100, 300]
    assert all(checkpoint.verify(c) is None for c in checkpoint.list_checkpoints(tmp_path))


def test_keep_one_keeps_the_checkpoint_just_written(accelerator, tmp_path):
    """keep_checkpoints=1 with a damaged step 200 on disk: the checkpoint of step 150 written after
    resuming from 100 is the one kept (before: it was deleted right after it was written, since the
    damaged 200 is newer)."""
    write(accelerator, tmp_path, 100, keep=10)
    damage(write(accelerator, tmp_path, 200, keep=10))
    with pytest.warns(UserWarning, match="removing damaged checkpoint .*step_00000200"):
        final = write(accelerator, tmp_path, 150, keep=1)
    assert steps(tmp_path) == [150] and checkpoint.verify(final) is None
    with pytest.warns(UserWarning, match="removing damaged checkpoint .*step_00000200"):  # synchronous save too
        checkpoint.save(accelerator, tmp_path / "sync", 100, {}, keep=10)
        damage(checkpoint.save(accelerator, tmp_path / "sync", 200, {}, keep=10))
        checkpoint.save(accelerator, tmp_path / "sync", 150, {}, keep=1)
    assert steps(tmp_path / "sync") == [150]


@pytest.mark.parametrize("background", [True, False], ids=["writer", "synchronous"])
def test_a_published_step_is_not_written_again(accelerator, tmp_path, monkeypatch, background):
    """Saving a step that is published and intact (SIGTERM right after a checkpoint step) neither publishes
    nor writes anything: the directory and its files are the same ones (before: it was deleted and
    replaced, leaving no checkpoint in between with keep_checkpoints=1). A changed data position only
    replaces the manifest."""
    writer = CheckpointWriter(accelerator, tmp_path, background=background)
    final = writer.save(2, {"consumed_micro_batches": 4}, keep=1)
    writer.wait()
    before = {p.name: p.stat().st_ino for p in [final, *final.iterdir()]}
    published = []
    original = checkpoint.publish
    monkeypatch.setattr(checkpoint, "publish", lambda tmp, dst: (published.append(dst), original(tmp, dst)))
    assert writer.save(2, {"consumed_micro_batches": 4}, keep=1) == final
    writer.wait()
    assert published == [] and not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert {p.name: p.stat().st_ino for p in [final, *final.iterdir()]} == before
    writer.save(2, {"consumed_micro_batches": 9}, keep=1)  # after a spike-guard rollback: same files
    writer.wait()
    assert published == [] and checkpoint.read_state(final)["consumed_micro_batches"] == 9
    assert checkpoint.verify(final) is None and final.stat().st_ino == before[final.name]


def test_a_damaged_published_step_is_written_anew(accelerator, tmp_path):
    """A damaged checkpoint of the step being saved is replaced by an intact one."""
    damage(write(accelerator, tmp_path, 2, keep=2))
    final = write(accelerator, tmp_path, 2, keep=2)
    assert steps(tmp_path) == [2] and checkpoint.verify(final) is None
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
