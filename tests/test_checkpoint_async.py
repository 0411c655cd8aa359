"""Checkpoints written in the background (checkpoint_writer.CheckpointWriter): the same files as the
synchronous write (accelerate's save_state and registered.json), the training thread blocked only for the
CPU copy, still atomic, failures still raised."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from musiclm_stab.training import checkpoint, checkpoint_load, checkpoint_writer
from musiclm_stab.training.checkpoint_writer import CheckpointWriter

SLOW_S = 2.0  # a slow disk: each file written into a partial checkpoint takes this long


class Counter:
    """A registered object (as the trainer's GradClipper and SpikeGuard are: stored as JSON)."""

    def __init__(self):
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


@pytest.fixture
def accelerator():
    """An in-process accelerate state as the trainer prepares it: model, fused AdamW with state (one step
    taken), LambdaLR, one registered object; reset afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    sched.step()
    counter.n = 7
    acc.test_objects = (model, opt, sched, counter)
    acc.registered = [("counter", counter)]
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)


def _slow_torch_save(monkeypatch, delay: float = SLOW_S, fail: bool = False) -> list[str]:
    """torch.save into a partial checkpoint takes ``delay`` s (and, with ``fail``, then fails as a full disk
    does); returns the names of the threads that called it."""
    original, threads = torch.save, []

    def slow(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and Path(f).parent.name.startswith(checkpoint.PARTIAL_PREFIX):
            threads.append(threading.current_thread().name)
            time.sleep(delay)
            if fail:
                Path(f).write_bytes(b"\0" * 16)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", slow)
    return threads


def test_background_files_hash_as_save_state(accelerator, tmp_path):
    """The writer's files are accelerate's: the same names and the same sha256 as accelerator.save_state
    (checkpoint.save) gives for the same state, so accelerator.load_state reads them as its own."""
    objects = accelerator.registered
    sync_ckpt = checkpoint.save(accelerator, tmp_path / "sync", 3, {"consumed_micro_batches": 5}, keep=2,
                                objects=objects)
    writer = CheckpointWriter(accelerator, tmp_path / "bg")
    assert writer.background
    final = writer.save(3, {"consumed_micro_batches": 5}, keep=2, objects=objects)
    assert writer.wait() == final
    sync_files = json.loads((sync_ckpt / checkpoint.STATE_FILE).read_text())["files"]
    bg_state = json.loads((final / checkpoint.STATE_FILE).read_text())
    assert bg_state["files"] == sync_files
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "registered.json",
            "random_states_0.pkl"} == set(sync_files)
    assert json.loads((final / "registered.json").read_text()) == {"counter": {"n": 7}}
    assert bg_state["step"] == 3 and bg_state["consumed_micro_batches"] == 5
    assert checkpoint.verify(final) is None


def test_load_state_restores_a_background_checkpoint(accelerator, tmp_path):
    """checkpoint_load.load of a background checkpoint restores weights, optimizer moments, scheduler,
    registered object and RNG exactly, even though training changed all of them after the save."""
    model, opt, sched, counter = accelerator.test_objects
    writer = CheckpointWriter(accelerator, tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    torch.manual_seed(123)
    expected_draw = torch.rand(3)  # what the RNG gives next from the state saved below
    torch.manual_seed(123)
    final = writer.save(1, {}, keep=2, objects=accelerator.registered)
    # training goes on while the thread writes: parameters, moments, schedule, object, RNG all change
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    sched.step()
    counter.n = 99
    torch.rand(5)
    writer.wait()
    checkpoint_load.load(accelerator, final, accelerator.registered)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    for k, v in opt.state_dict()["state"][0].items():
        torch.testing.assert_close(v, moments[k], rtol=0, atol=0, msg=k)
    assert counter.n == 7 and sched.scheduler.last_epoch == 1
    torch.testing.assert_close(torch.rand(3), expected_draw, rtol=0, atol=0)


def test_save_returns_before_the_slow_write(accelerator, tmp_path, monkeypatch):
    """With a disk that takes SLOW_S per file, save() returns at once (the old synchronous save took
    >= 3 * SLOW_S: three torch.save files); the files are written by the checkpoint thread; poll() does not
    wait for it and publishes nothing while it runs; wait() publishes a complete, intact checkpoint."""
    threads = _slow_torch_save(monkeypatch)
    writer = CheckpointWriter(accelerator, tmp_path)
    t = time.perf_counter()
    final = writer.save(2, {}, keep=2)
    blocked = time.perf_counter() - t
    # 6 s of writes on the thread vs the copy of a 700-parameter model: a margin of 6 s on a loaded machine
    assert blocked < SLOW_S, blocked
    t = time.perf_counter()
    assert writer.poll() is None and not final.exists()
    assert time.perf_counter() - t < SLOW_S
    assert writer.wait() == final
    assert set(threads) == {"checkpoint-2"} and len(threads) == 3  # optimizer, scheduler, RNG
    assert checkpoint.verify(final) is None and not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_poll_publishes_when_done_and_prunes(accelerator, tmp_path):
    """poll() publishes a finished write (manifest, rename, pruning to keep=2) without a wait; the next save
    publishes a write poll has not seen yet."""
    writer = CheckpointWriter(accelerator, tmp_path)
    for step in (1, 2, 3):
        final = writer.save(step, {}, keep=2)
        writer.pending.thread.join()
        assert writer.poll() == final and writer.poll() is None
    writer.save(4, {}, keep=2)
    writer.save(5, {}, keep=2)  # publishes 4 first
    assert [checkpoint.checkpoint_step(c) for c in checkpoint.list_checkpoints(tmp_path)] == [3, 4]
    writer.wait()
    assert [checkpoint.checkpoint_step(c) for c in checkpoint.list_checkpoints(tmp_path)] == [4, 5]
    assert all(checkpoint.verify(c) is None for c in checkpoint.list_checkpoints(tmp_path))


def test_background_write_failure_raised_at_wait(accelerator, tmp_path, monkeypatch):
    """A full disk in the checkpoint thread: wait() raises the CheckpointWriteError the synchronous save
    raises (directory, reason, previous checkpoint intact), the partial write is removed, nothing is
    published, and the writer is usable again afterwards."""
    writer = CheckpointWriter(accelerator, tmp_path)
    writer.save(2, {}, keep=2)
    writer.wait()
    _slow_torch_save(monkeypatch, delay=0.0, fail=True)
    writer.save(4, {}, keep=2)  # returns: the failure happens on the thread
    with pytest.raises(checkpoint.CheckpointWriteError) as e:
        writer.wait()
    for part in (f"could not write checkpoint step_00000004 in {tmp_path / 'checkpoints'}", "No space left on device",
                 "previous checkpoint step_00000002 is intact", "--resume"):
        assert part in str(e.value), str(e.value)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert [c.name for c in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002"]
    monkeypatch.undo()
    assert writer.pending is None and writer.wait() is None
    writer.save(6, {}, keep=2)
    writer.wait()
    assert [c.name for c in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000006"]


def test_unsupported_setup_falls_back_to_synchronous_save(accelerator, tmp_path):
    """A save_state pre-hook (which the snapshot would bypass) makes the writer the synchronous save: the
    checkpoint is published when save() returns, and the hook ran."""
    calls = []
    accelerator.register_save_state_pre_hook(lambda models, weights, out: calls.append(out))
    writer = CheckpointWriter(accelerator, tmp_path)
    assert not writer.background
    final = writer.save(1, {}, keep=2)
    assert writer.pending is None and checkpoint.verify(final) is None and len(calls) == 1


@pytest.mark.parametrize("failure", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                     MemoryError()], ids=["cuda-oom", "host-oom"])
def test_a_failed_copy_is_reported_as_a_failed_copy(accelerator, tmp_path, monkeypatch, failure):
    """The copy of the state into host memory failing (out of GPU or host memory) raises a
    CheckpointWriteError that says so and names the error, without the full-disk advice (before: "could
    not write checkpoint ... Free some space" for the CUDA error, and a bare MemoryError for the host's)."""
    writer = CheckpointWriter(accelerator, tmp_path)
    writer.save(2, {}, keep=2)
    writer.wait()

    def fail(self, t, key):
        raise failure

    monkeypatch.setattr(checkpoint_writer._HostCopies, "copy", fail)
    with pytest.raises(checkpoint.CheckpointWriteError) as e:
        writer.save(4, {}, keep=2)
    message = str(e.value)
    for part in ("could not copy the training state of checkpoint step_00000004 to host memory: "
                 f"{type(failure).__name__}", "previous checkpoint step_00000002 is intact", "--resume"):
        assert part in message, message
    assert "Free some space" not in message and "GiB free" not in message, message
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert [c.name for c in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002"]


def test_a_write_failure_that_is_no_full_disk_gets_no_disk_advice(accelerator, tmp_path, monkeypatch):
    """An I/O error (not ENOSPC/EDQUOT) on the checkpoint thread is named as it is, with "Fix the cause"
    rather than the advice to free space (before: every write failure was told to free some space)."""
    writer = CheckpointWriter(accelerator, tmp_path)
    original = torch.save

    def io_error(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and Path(f).parent.name.startswith(checkpoint.PARTIAL_PREFIX):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(f))
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", io_error)
    writer.save(2, {}, keep=2)
    with pytest.raises(checkpoint.CheckpointWriteError) as e:
        writer.wait()
    message = str(e.value)
    assert f"could not write checkpoint step_00000002 in {tmp_path / 'checkpoints'}" in message, message
    assert "Input/output error" in message and "Fix the cause" in message, message
    assert "Free some space" not in message and "there is no earlier checkpoint" in message, message


@pytest.mark.parametrize("background", [True, False])
def test_an_object_registered_with_accelerate_is_refused_not_pickled(accelerator, tmp_path, background):
    """An object registered with accelerate's register_for_checkpointing (which would be pickled into
    custom_checkpoint_0.pkl and unpickled on resume) makes a checkpoint write raise a ValueError naming its
    type, and nothing is published (before: both write paths published a checkpoint regardless)."""
    accelerator.register_for_checkpointing(Counter())
    writer = CheckpointWriter(accelerator, tmp_path, background=background)
    with pytest.raises(ValueError, match=r"register_for_checkpointing \(Counter\) would be pickled"):
        writer.save(2, {"consumed_micro_batches": 2}, keep=2, objects=accelerator.registered)
        writer.wait()
    assert checkpoint.list_checkpoints(tmp_path) == []
    assert not list(tmp_path.rglob("custom_checkpoint_*.pkl"))
