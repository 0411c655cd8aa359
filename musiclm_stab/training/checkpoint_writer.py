"""Checkpoints written in the background (``CheckpointWriter``, what the trainer uses).

The protocol of ``checkpoint.save`` with the slow part off the training loop (issue 17: ~7 s per
checkpoint of ``large`` blocked training). ``save`` waits for the previous write, then copies the state
that ``checkpoint.write_state`` would write to CPU memory (``snapshot``: weights, optimizer, scheduler,
scaler, RNG states, and the registered objects as JSON; fast) and returns; a thread writes those files
into the ``.tmp-step_N`` directory in accelerate's layout, fsyncs them and the directory, and hashes them.
The manifest, the rename and the pruning follow in the training thread, at the first ``poll`` that finds
every process's thread done (a tiny all-reduce while a write is pending, none otherwise), at the next
``save``, or at ``wait`` (end of training, SIGTERM, before a rollback reads the checkpoints), or at
``after_error`` when the loop raised. Atomicity is unchanged: nothing is renamed into ``step_N`` before
the manifest, and a failure on any process is agreed on (``run_phase``) and raised on every process with
the same CheckpointWriteError as ``checkpoint.save``'s, at the poll/save/wait that publishes. Where the
snapshot cannot stand for ``save_state`` (FSDP, DeepSpeed, save hooks, stateful data loaders, other
accelerators) the writer falls back to ``checkpoint.save`` itself.
"""

from __future__ import annotations

import copy
import os
import random
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    DistributedType,
    gather_object,
)
from accelerate.utils.other import clean_state_dict_for_safetensors
from safetensors.torch import save_file

from musiclm_stab.durable import fsync_dir
from musiclm_stab.training import checkpoint, registered
from musiclm_stab.training.registered import Registered

_SNAPSHOT_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def snapshot_unsupported(accelerator: Accelerator) -> str | None:
    """Why ``snapshot`` cannot stand for ``accelerator.save_state`` here (None: it can)."""
    if accelerator.distributed_type not in _SNAPSHOT_TYPES:
        return f"distributed type {accelerator.distributed_type}"
    if accelerator.device.type not in ("cpu", "cuda"):
        return f"device {accelerator.device}"
    if accelerator._save_model_state_pre_hook:
        return "a save_state pre-hook is registered"
    if accelerator.project_configuration.save_on_each_node:
        return "save_on_each_node"
    from accelerate.data_loader import IterableDatasetShard

    for dl in accelerator._dataloaders:
        if isinstance(getattr(dl, "dataset", None), IterableDatasetShard) or getattr(
                dl, "use_stateful_dataloader", False):
            return "a data loader whose sampler state save_state writes"
    return None


class _HostCopies:
    """CPU copies of the state's tensors, into buffers kept from one checkpoint to the next (the previous
    write has finished with them: ``CheckpointWriter.save`` waits for it first). Kept because a fresh
    allocation costs its page faults every time: on the 2-core machine copying 380 MB into a kept buffer
    took 0.23 s, a clone 1.2 s. For CUDA tensors the buffers are pinned and the copies asynchronous,
    synchronized once (``done``). Costs one CPU copy of the state in host memory for the whole run."""

    def __init__(self):
        self.kept: dict[tuple, torch.Tensor] = {}
        self.cuda = False

    def copy(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        t = t.detach()
        buf = self.kept.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:  # first checkpoint (or a new shape)
            # contiguous, as safetensors wants; pinned for a fast asynchronous copy from the GPU
            buf = self.kept[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        if t.device.type == "cuda":
            buf.copy_(t, non_blocking=True)
            self.cuda = True
        else:
            buf.copy_(t)
        return buf

    def tree(self, obj, key: tuple = ()):
        """``obj`` with every tensor in it (dicts, lists, tuples) replaced by its CPU copy; the rest deep-copied."""
        if isinstance(obj, torch.Tensor):
            return self.copy(obj, key)
        if isinstance(obj, dict):
            return type(obj)((k, self.tree(v, (*key, k))) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.tree(v, (*key, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def done(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # the non_blocking copies have landed
            self.cuda = False


def snapshot(accelerator: Accelerator, copies: _HostCopies | None = None,
             objects: Registered = ()) -> dict[str, tuple[str, object]]:
    """What ``checkpoint.write_state`` (accelerate 1.x ``save_state``, safetensors weights, and
    ``registered.json``) writes from this process, as {file name: (format, CPU object)}, format
    "safetensors", "torch" or "json" (text): the same files, loadable by ``accelerator.load_state``
    (tests/test_checkpoint_async.py checks they hash the same on CPU). Weights, optimizer, scheduler,
    scaler and registered objects come from the main process (save_state writes them there only), the
    RNG states from every process."""
    registered.refuse_pickled_objects(accelerator)
    copies = copies or _HostCopies()
    out: dict[str, tuple[str, object]] = {}
    main = accelerator.is_main_process
    if main:
        for i, model in enumerate(accelerator._models):
            name = SAFE_WEIGHTS_NAME if i == 0 else SAFE_WEIGHTS_NAME.replace(".", f"_{i}.")
            weights = clean_state_dict_for_safetensors(accelerator.get_state_dict(model, unwrap=False))
            out[name] = ("safetensors", copies.tree(dict(weights), ("model", i)))
        for i, opt in enumerate(accelerator._optimizers):
            name = f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"
            out[name] = ("torch", copies.tree(opt.state_dict(), ("optimizer", i)))
        for i, sched in enumerate(accelerator._schedulers):
            name = f"{SCHEDULER_NAME}.bin" if i == 0 else f"{SCHEDULER_NAME}_{i}.bin"
            out[name] = ("torch", copies.tree(sched.state_dict(), ("scheduler", i)))
        if accelerator.scaler is not None:
            out[SCALER_NAME] = ("torch", copies.tree(accelerator.scaler.state_dict(), ("scaler",)))
        out[registered.REGISTERED_FILE] = ("json", registered.to_json(objects))
    rng = {"step": accelerator.step, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
           "torch_manual_seed": torch.get_rng_state()}
    if torch.cuda.is_available():  # as accelerate: every visible GPU's generator
        rng["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    out[f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl"] = ("torch", rng)
    copies.done()
    return out


def write_snapshot(files: dict[str, tuple[str, object]], tmp: Path) -> dict[str, str]:
    """Write ``snapshot``'s files into ``tmp``, each fsynced, then ``tmp`` itself (its entries name them);
    returns {name: sha256} of what was written."""
    tmp.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, (fmt, obj) in files.items():
        path = tmp / name
        if fmt == "safetensors":
            save_file(obj, str(path), metadata={"format": "pt"})
        elif fmt == "json":
            path.write_text(obj)
        else:
            torch.save(obj, path)
        with path.open("rb") as f:
            os.fsync(f.fileno())
        digests[name] = checkpoint.sha256_file(path)
    fsync_dir(tmp)
    return digests


class _Pending:
    """One write in flight: its thread and, once that is done, its result (digests or error)."""

    def __init__(self, step: int, state: dict, keep: int, keep_every: int, tmp: Path, final: Path):
        self.step, self.state, self.keep, self.keep_every = step, state, keep, keep_every
        self.tmp, self.final = tmp, final
        self.digests: dict[str, str] = {}
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def run(self, files: dict[str, tuple[str, object]]) -> None:
        try:
            self.digests = write_snapshot(files, self.tmp)
        except Exception as e:  # handed to the training thread, which raises it on every process (_finish)
            self.error = e


class CheckpointWriter:
    """Checkpoints written in the background (module docstring); the calls are collective, as
    ``checkpoint.save`` is: every process calls ``save``, ``poll`` and ``wait`` at the same points of the loop.

    ``background=False`` (or a setup ``snapshot_unsupported`` names) makes ``save`` the synchronous
    ``checkpoint.save``, published before it returns."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, background: bool = True):
        self.accelerator, self.run_dir = accelerator, Path(run_dir)
        self.background = background and snapshot_unsupported(accelerator) is None
        self.pending: _Pending | None = None
        self.copies = _HostCopies()
        self.intact = checkpoint.Intact()  # checkpoints written or verified here: pruning need not hash them
        # called with the step before a write is published, once its files are written (collective): the
        # trainer's check that it still holds the run directory (run_dir.RunLock.check)
        self.before_publish: Callable[[int], None] | None = None

    def save(self, step: int, state: dict, keep: int, keep_every: int = 0, objects: Registered = ()) -> Path:
        """Start checkpoint ``step`` (after publishing the previous one) with the registered ``objects``;
        returns the path it will have. Blocks only for the CPU copy of the state (and for the previous
        write, if still going). A step already published and intact is not written again."""
        self.wait()
        acc = self.accelerator
        if not self.background:
            return checkpoint.save(acc, self.run_dir, step, state, keep, keep_every, objects, self.intact)
        ckpt_dir = self.run_dir / "checkpoints"
        final = ckpt_dir / f"{checkpoint.CHECKPOINT_PREFIX}{step:08d}"
        tmp = ckpt_dir / f"{checkpoint.PARTIAL_PREFIX}{checkpoint.CHECKPOINT_PREFIX}{step:08d}"
        main = acc.is_main_process
        checkpoint.run_phase(acc, self.run_dir, tmp, main, checkpoint.remove_partial, self.run_dir)
        if checkpoint.already_published(acc, self.run_dir, tmp, final, step, state, self.intact):
            return final
        checkpoint.run_phase(acc, self.run_dir, tmp, main, lambda: tmp.mkdir(parents=True))
        box: list = []
        checkpoint.run_phase(acc, self.run_dir, tmp, True, lambda: box.append(snapshot(acc, self.copies, objects)),
                             doing="copy")
        pending = _Pending(step, state, keep, keep_every, tmp, final)
        pending.thread = threading.Thread(target=pending.run, args=(box[0],), daemon=True,
                                          name=f"checkpoint-{step}")
        pending.thread.start()
        self.pending = pending
        return final

    def poll(self) -> Path | None:
        """Publish the pending write if every process has finished its files; never waits for them.
        Returns the checkpoint published now, if any."""
        if self.pending is None:
            return None
        done = not self.pending.thread.is_alive()
        if self.accelerator.num_processes > 1:  # all or none: publishing is collective
            flag = torch.tensor([1.0 if done else 0.0], device=self.accelerator.device)
            done = self.accelerator.reduce(flag, reduction="sum").item() == self.accelerator.num_processes
        return self._finish() if done else None

    def wait(self) -> Path | None:
        """Wait for the pending write and publish it (end of training, SIGTERM, before reading checkpoints).
        Returns the checkpoint published, if one was pending."""
        return self._finish() if self.pending is not None else None

    def after_error(self, error: BaseException) -> Path | None:
        """The training loop raised ``error``: publish the pending write if that needs no other process.

        One process: wait for it and publish it, so that a finished write is not thrown away (``--resume``
        would remove its ``.tmp-step_N`` as interrupted). A failure to do so is printed, not raised: the
        loop's own error is what the caller re-raises. Several processes: publishing is collective, and
        the others may not have failed (one process calling a collective the others do not would hang),
        so the write is left unpublished and ``--resume`` starts from the checkpoint before it."""
        if self.pending is None:
            return None
        if self.accelerator.num_processes > 1:
            step, self.pending = self.pending.step, None
            self.accelerator.print(f"checkpoint {step} was being written when training failed; it is not "
                                   "published (that needs every process): --resume starts from the one before")
            return None
        try:
            return self.wait()
        except Exception as e:  # reported; the loop's error is raised by the caller
            print(f"checkpoint {self.run_dir / 'checkpoints'}: the write pending when training failed "
                  f"({type(error).__name__}) could not be published either: {e}", file=sys.stderr)
            return None

    def _finish(self) -> Path:
        pending, self.pending = self.pending, None
        pending.thread.join()
        if self.before_publish is not None:
            self.before_publish(pending.step)
        acc, run_dir, tmp, main = self.accelerator, self.run_dir, pending.tmp, self.accelerator.is_main_process

        def files_written() -> None:
            if pending.error is not None:
                raise pending.error

        checkpoint.run_phase(acc, run_dir, tmp, True, files_written)
        digests = dict(pending.digests)
        if acc.num_processes > 1:
            for d in gather_object([pending.digests]):
                digests.update(d)
        checkpoint.run_phase(acc, run_dir, tmp, main, checkpoint.write_manifest, tmp, pending.step, pending.state,
                             digests)
        checkpoint.run_phase(acc, run_dir, tmp, main,
                             lambda: (checkpoint.publish(tmp, pending.final), self.intact.add(pending.final)))
        checkpoint.run_phase(acc, run_dir, tmp, main, checkpoint.prune, run_dir, pending.keep, pending.keep_every,
                             self.intact, published=True)
        return pending.final
