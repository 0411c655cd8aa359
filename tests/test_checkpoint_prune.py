"""Pruning by integrity (never a damaged checkpoint kept in place of intact ones; a damaged one moved aside,
never deleted; an unreadable one left alone) and a published step never written again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from permissions import permissions_apply

from musiclm_stab.training import checkpoint
from musiclm_stab.training.checkpoint_writer import CheckpointWriter


def steps(run_dir: Path) -> list[int]:
    return [checkpoint.checkpoint_step(c) for c in checkpoint.list_checkpoints(run_dir)]


def damage(ckpt: Path) -> bytes:
    """Flip a byte of the weights, as a power loss or a bad disk may leave them; returns the damaged bytes."""
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    return bytes(data)


def aside(run_dir: Path) -> list[Path]:
    """The checkpoints moved aside (``step_N.aside-<time>``)."""
    return sorted((run_dir / "checkpoints").glob("step_*.aside-*"))


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
    100 and the new 300, moving the damaged 200 aside with a warning naming it and where (before: 100 was
    pruned and the damaged 200 kept; later the damaged one was deleted)."""
    write(accelerator, tmp_path, 100, keep=2)
    damage(write(accelerator, tmp_path, 200, keep=2))
    with pytest.warns(UserWarning, match="skipping damaged checkpoint .*step_00000200"):
        assert checkpoint.newest_valid(tmp_path).name == "step_00000100"
    with pytest.warns(UserWarning, match="moved damaged checkpoint .*step_00000200 aside to step_00000200.aside-"
                      ".*model.safetensors"):
        write(accelerator, tmp_path, 300, keep=2)
    assert steps(tmp_path) == [100, 300]
    assert all(checkpoint.verify(c) is None for c in checkpoint.list_checkpoints(tmp_path))
    assert [p.name[:len("step_00000200.aside-")] for p in aside(tmp_path)] == ["step_00000200.aside-"]


def test_keep_one_keeps_the_checkpoint_just_written(accelerator, tmp_path):
    """keep_checkpoints=1 with a damaged step 200 on disk: the checkpoint of step 150 written after
    resuming from 100 is the one kept (before: it was deleted right after it was written, since the
    damaged 200 is newer)."""
    write(accelerator, tmp_path, 100, keep=10)
    damage(write(accelerator, tmp_path, 200, keep=10))
    with pytest.warns(UserWarning, match="moved damaged checkpoint .*step_00000200 aside"):
        final = write(accelerator, tmp_path, 150, keep=1)
    assert steps(tmp_path) == [150] and checkpoint.verify(final) is None and len(aside(tmp_path)) == 1
    with pytest.warns(UserWarning, match="moved damaged checkpoint .*step_00000200 aside"):  # synchronous save too
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
    """A damaged checkpoint of the step being saved is moved aside (never deleted) and an intact one written
    in its place."""
    damaged = damage(write(accelerator, tmp_path, 2, keep=2))
    with pytest.warns(UserWarning, match="moved damaged checkpoint .*step_00000002 aside to step_00000002.aside-"):
        final = write(accelerator, tmp_path, 2, keep=2)
    assert steps(tmp_path) == [2] and checkpoint.verify(final) is None
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert [(p / "model.safetensors").read_bytes() for p in aside(tmp_path)] == [damaged]


def test_an_unreadable_checkpoint_is_never_pruned_or_moved(accelerator, tmp_path):
    """keep_checkpoints=2 with step 200's weights unreadable (EACCES, no damage): the next save keeps 100 and
    300 as the intact ones and leaves 200 where it is, with a warning (before: removed as damaged)."""
    write(accelerator, tmp_path, 100, keep=10)
    weights = write(accelerator, tmp_path, 200, keep=10) / "model.safetensors"
    os.chmod(weights, 0)
    try:
        with permissions_apply(), pytest.warns(UserWarning, match="keeping unreadable checkpoint .*step_00000200 "
                                                "in place: model.safetensors is unreadable: Permission denied"):
            write(accelerator, tmp_path, 300, keep=2)
    finally:
        os.chmod(weights, 0o644)
    assert steps(tmp_path) == [100, 200, 300] and not aside(tmp_path)
    assert checkpoint.verify(tmp_path / "checkpoints" / "step_00000200") is None
