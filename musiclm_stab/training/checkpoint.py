"""Checkpoints that are complete or absent.

A checkpoint is an accelerate state (model, optimizer, scheduler, grad scaler, RNG states, registered
objects) written into ``checkpoints/.tmp-step_N``, completed by a manifest ``trainer_state.json``
(step, data position, sha256 of every file) and only then renamed to ``checkpoints/step_N``. A crash
at any moment leaves either the previous checkpoints or the new complete one; ``newest_valid`` checks
the hashes and skips a damaged checkpoint with a warning instead of loading it half-way; the
``.tmp-*`` left by a write that a crash interrupted is removed on ``--resume`` and before the next write.

Pruning keeps the newest ``train.keep_checkpoints`` plus, with ``train.keep_every=M``, every checkpoint
at a multiple of M. A write that fails (e.g. the disk is full) removes its partial ``.tmp-*`` and raises
``CheckpointWriteError`` naming the directory, the free space and the previous checkpoint, left intact.

``save`` runs in phases, each a named function: ``remove_partial``, ``write_state`` (every process),
``write_manifest``, ``publish``, ``prune`` (main process). After each, the processes exchange whether
their part failed (``_agree``), so a failure on any one process stops every process with the same
CheckpointWriteError instead of leaving the others at a barrier until the launcher's timeout.

``CheckpointWriter`` is the same protocol with the slow part off the training loop (issue 17: ~7 s per
checkpoint of ``large`` blocked training). ``save`` waits for the previous write, then copies the state
that accelerate's ``save_state`` would write to CPU memory (``snapshot``: weights, optimizer, scheduler,
scaler, registered objects, RNG states; fast) and returns; a thread writes those files into the
``.tmp-step_N`` directory in accelerate's layout, fsyncs and hashes them. The manifest, the rename and the
pruning follow in the training thread, at the first ``poll`` that finds every process's thread done (a
tiny all-reduce while a write is pending, none otherwise), at the next ``save``, or at ``wait`` (end of
training, SIGTERM, before a rollback reads the checkpoints). Atomicity is unchanged: nothing is renamed
into ``step_N`` before the manifest, and a failure on any process is agreed on (``_agree``) and raised on
every process with the same CheckpointWriteError as ``save``'s, at the poll/save/wait that publishes.
Where the snapshot cannot stand for ``save_state`` (FSDP, DeepSpeed, save hooks, stateful data loaders,
other accelerators) the writer falls back to ``save`` itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import threading
import warnings
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
    broadcast_object_list,
    gather_object,
)
from accelerate.utils.other import clean_state_dict_for_safetensors
from safetensors.torch import save_file

CHECKPOINT_PREFIX = "step_"
STATE_FILE = "trainer_state.json"
PARTIAL_PREFIX = ".tmp-"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); the previous ones are intact."""


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX):])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run that have their manifest, oldest first (integrity not yet checked)."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob(f"{CHECKPOINT_PREFIX}*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=checkpoint_step)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(ckpt: Path) -> str | None:
    """None if the checkpoint is intact, else the reason it is not."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"unreadable {STATE_FILE}: {e}"
    for name, digest in state.get("files", {}).items():
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing"
        if _sha256(f) != digest:
            return f"{name} does not match its sha256 in {STATE_FILE}"
    return None


def newest_valid(run_dir: Path) -> Path | None:
    """The newest intact checkpoint; damaged ones are named in a warning and skipped."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        warnings.warn(f"skipping damaged checkpoint {ckpt}: {problem}", stacklevel=2)
    return None


def read_state(ckpt: Path) -> dict:
    return json.loads((ckpt / STATE_FILE).read_text())


def remove_partial(run_dir: Path) -> list[Path]:
    """Remove the ``.tmp-*`` writes a crash left unfinished (never loaded: they were never renamed)."""
    found = sorted((Path(run_dir) / "checkpoints").glob(f"{PARTIAL_PREFIX}*"))
    for partial in found:
        if partial.is_dir():
            shutil.rmtree(partial)
        else:
            partial.unlink()
    return found


def to_prune(steps: list[int], keep: int, keep_every: int = 0) -> list[int]:
    """Steps to delete: all but the newest ``keep`` (>= 1) and, if ``keep_every`` > 0, its multiples."""
    return [s for s in sorted(steps)[:-keep] if not (keep_every and s % keep_every == 0)]


def write_state(accelerator: Accelerator, tmp: Path) -> None:
    """Phase 1 of a write, on every process: the accelerate state (weights, optimizer, scheduler, scaler,
    registered objects, this process's RNG states) into ``tmp``."""
    accelerator.save_state(str(tmp))


def write_manifest(tmp: Path, step: int, state: dict, files: dict[str, str] | None = None) -> None:
    """Phase 2, main process: ``trainer_state.json`` (step, ``state``, sha256 of every file), fsynced.
    Its presence is what makes ``tmp`` a complete checkpoint. ``files``: {name: sha256} already computed
    by the processes that wrote them (CheckpointWriter); by default every file in ``tmp`` is hashed here."""
    if files is None:
        files = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    files = dict(sorted(files.items()))
    manifest = tmp / STATE_FILE
    manifest.write_text(json.dumps({"step": step, **state, "files": files}, indent=1))
    with manifest.open("rb") as f:
        os.fsync(f.fileno())


def publish(tmp: Path, final: Path) -> None:
    """Phase 3, main process: move the complete checkpoint into place (replacing one of the same step)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def prune(run_dir: Path, keep: int, keep_every: int = 0) -> None:
    """Phase 4, main process: delete the checkpoints ``to_prune`` names."""
    by_step = {checkpoint_step(c): c for c in list_checkpoints(run_dir)}
    for old in to_prune(list(by_step), keep, keep_every):
        shutil.rmtree(by_step[old])


def _reason(error: BaseException) -> str:
    return str(getattr(error, "strerror", None) or error)


def _agree(accelerator: Accelerator, error: BaseException | None) -> list[str]:
    """Every process's failure (``"process i of n: reason"``) of the phase just done, known to all of them.

    Under several processes this is a collective (it also orders the phases, as a barrier would): a
    process whose write failed must not leave the others waiting at the next barrier until the
    launcher's timeout. One process: no communication."""
    if accelerator.num_processes == 1:
        return [] if error is None else [_reason(error)]
    mine = None
    if error is not None:
        mine = f"process {accelerator.process_index} of {accelerator.num_processes}: {_reason(error)}"
    return [r for r in gather_object([mine]) if r is not None]


def _write_failure(run_dir: Path, tmp: Path, reasons: list[str]) -> str:
    ckpt_dir = Path(run_dir) / "checkpoints"
    try:
        free = f"{shutil.disk_usage(ckpt_dir).free / 2**30:.2f} GiB free"
    except OSError as e:
        free = f"free space unknown: {e.strerror}"
    previous = newest_valid(run_dir)
    kept = (f"the previous checkpoint {previous.name} is intact" if previous is not None
            else "there is no earlier checkpoint")
    return (f"could not write checkpoint {tmp.name[len(PARTIAL_PREFIX):]} in {ckpt_dir} ({free}): "
            f"{'; '.join(reasons)}. The partial write was removed and {kept}. Free some space (or lower "
            "train.keep_checkpoints, or set train.output_dir elsewhere), then resume with the same command "
            "and --resume.")


def _fail(accelerator: Accelerator, message: str) -> CheckpointWriteError:
    """The one error every process raises, worded by the main process (``message`` there) and sent to all."""
    box = [message]
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return CheckpointWriteError(box[0])


# torch.save reports a full disk as RuntimeError ("unexpected pos"), not OSError.
_WRITE_ERRORS = (OSError, RuntimeError)


def _phase(accelerator: Accelerator, run_dir: Path, tmp: Path, run: bool, action, *args,
           published: bool = False) -> None:
    """``action(*args)`` where ``run`` (this process's part of a phase), then ``_agree``. If it failed on any
    process, every process raises the same CheckpointWriteError; before a checkpoint is ``published``
    the main process first removes the partial write (safe: every process is past its part of the
    phase). An exception that is no write error (a bug, not the disk) is re-raised as itself where it
    happened; the other processes still stop with the CheckpointWriteError naming it."""
    error = None
    if run:
        try:
            action(*args)
        except Exception as e:  # any failure: the other processes must learn of it (_agree)
            error = e
    reasons = _agree(accelerator, error)
    if not reasons:
        return
    message = ""
    if accelerator.is_main_process:
        if published:  # the new checkpoint is complete and in place
            message = (f"checkpoint {tmp.name[len(PARTIAL_PREFIX):]} was written, but removing older "
                       f"checkpoints of {tmp.parent} failed: {'; '.join(reasons)}. Fix the cause, then resume "
                       "with the same command and --resume.")
        else:
            shutil.rmtree(tmp, ignore_errors=True)  # partial files only: nothing here was ever loadable
            message = _write_failure(run_dir, tmp, reasons)
    failure = _fail(accelerator, message)
    if error is not None and not isinstance(error, _WRITE_ERRORS):
        raise error
    raise failure from error


def save(accelerator: Accelerator, run_dir: Path, step: int, state: dict, keep: int,
         keep_every: int = 0) -> Path:
    """Write the accelerate state aside, add the manifest, move it into place; keep the newest ``keep``
    and every multiple of ``keep_every``.

    Raises CheckpointWriteError (e.g. disk full) with the previous checkpoints intact. Under several
    processes a failure on any one of them is raised on all of them, with the same message, at the end
    of the phase it happened in (``_phase``): none is left waiting at a barrier for the one that failed."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = ckpt_dir / f"{PARTIAL_PREFIX}{CHECKPOINT_PREFIX}{step:08d}"
    main = accelerator.is_main_process
    _phase(accelerator, run_dir, tmp, main, remove_partial, run_dir)  # left by a crash in an earlier write
    _phase(accelerator, run_dir, tmp, True, write_state, accelerator, tmp)
    _phase(accelerator, run_dir, tmp, main, write_manifest, tmp, step, state)
    _phase(accelerator, run_dir, tmp, main, publish, tmp, final)
    _phase(accelerator, run_dir, tmp, main, prune, run_dir, keep, keep_every, published=True)
    return final


# ---------------------------------------------------------------------------------------------------------
# The overlapped write (CheckpointWriter)

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


def snapshot(accelerator: Accelerator, copies: _HostCopies | None = None) -> dict[str, tuple[str, object]]:
    """What ``accelerator.save_state`` (accelerate 1.x, safetensors weights) writes from this process, as
    {file name: (format, CPU object)}, format "safetensors" or "torch": the same files, loadable by
    ``accelerator.load_state`` (tests/test_checkpoint_async.py checks they hash the same on CPU).
    Weights, optimizer, scheduler, scaler and registered objects come from the main process (save_state
    writes them there only), the RNG states from every process."""
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
        for i, obj in enumerate(accelerator._custom_objects):
            out[f"custom_checkpoint_{i}.pkl"] = ("torch", copies.tree(obj.state_dict(), ("custom", i)))
    rng = {"step": accelerator.step, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
           "torch_manual_seed": torch.get_rng_state()}
    if torch.cuda.is_available():  # as accelerate: every visible GPU's generator
        rng["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    out[f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl"] = ("torch", rng)
    copies.done()
    return out


def write_snapshot(files: dict[str, tuple[str, object]], tmp: Path) -> dict[str, str]:
    """Write ``snapshot``'s files into ``tmp``, each fsynced; returns {name: sha256} of what was written."""
    tmp.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, (fmt, obj) in files.items():
        path = tmp / name
        if fmt == "safetensors":
            save_file(obj, str(path), metadata={"format": "pt"})
        else:
            torch.save(obj, path)
        with path.open("rb") as f:
            os.fsync(f.fileno())
        digests[name] = _sha256(path)
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
    """Checkpoints written in the background (module docstring); the calls are collective, as ``save`` is:
    every process calls ``save``, ``poll`` and ``wait`` at the same points of the loop.

    ``background=False`` (or a setup ``snapshot_unsupported`` names) makes ``save`` the synchronous
    ``save`` above, published before it returns."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, background: bool = True):
        self.accelerator, self.run_dir = accelerator, Path(run_dir)
        self.background = background and snapshot_unsupported(accelerator) is None
        self.pending: _Pending | None = None
        self.copies = _HostCopies()

    def save(self, step: int, state: dict, keep: int, keep_every: int = 0) -> Path:
        """Start checkpoint ``step`` (after publishing the previous one); returns the path it will have.
        Blocks only for the CPU copy of the state (and for the previous write, if still going)."""
        self.wait()
        acc = self.accelerator
        if not self.background:
            return save(acc, self.run_dir, step, state, keep, keep_every)
        ckpt_dir = self.run_dir / "checkpoints"
        final = ckpt_dir / f"{CHECKPOINT_PREFIX}{step:08d}"
        tmp = ckpt_dir / f"{PARTIAL_PREFIX}{CHECKPOINT_PREFIX}{step:08d}"
        main = acc.is_main_process
        _phase(acc, self.run_dir, tmp, main, remove_partial, self.run_dir)
        _phase(acc, self.run_dir, tmp, main, lambda: tmp.mkdir(parents=True))
        box: list = []
        _phase(acc, self.run_dir, tmp, True, lambda: box.append(snapshot(acc, self.copies)))
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

    def _finish(self) -> Path:
        pending, self.pending = self.pending, None
        pending.thread.join()
        acc, run_dir, tmp, main = self.accelerator, self.run_dir, pending.tmp, self.accelerator.is_main_process

        def files_written() -> None:
            if pending.error is not None:
                raise pending.error

        _phase(acc, run_dir, tmp, True, files_written)
        digests = dict(pending.digests)
        if acc.num_processes > 1:
            for d in gather_object([pending.digests]):
                digests.update(d)
        _phase(acc, run_dir, tmp, main, write_manifest, tmp, pending.step, pending.state, digests)
        _phase(acc, run_dir, tmp, main, publish, tmp, pending.final)
        _phase(acc, run_dir, tmp, main, prune, run_dir, pending.keep, pending.keep_every, published=True)
        return pending.final
