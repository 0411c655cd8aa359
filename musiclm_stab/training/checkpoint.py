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

``checkpoint_writer.CheckpointWriter`` (what the trainer uses) runs the same protocol with the slow part
on a thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import (
    broadcast_object_list,
    gather_object,
)

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


def sha256_file(path: Path) -> str:
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
        if sha256_file(f) != digest:
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
        files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
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


def run_phase(accelerator: Accelerator, run_dir: Path, tmp: Path, run: bool, action, *args,
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
    of the phase it happened in (``run_phase``): none is left waiting at a barrier for the one that failed."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = ckpt_dir / f"{PARTIAL_PREFIX}{CHECKPOINT_PREFIX}{step:08d}"
    main = accelerator.is_main_process
    run_phase(accelerator, run_dir, tmp, main, remove_partial, run_dir)  # left by a crash in an earlier write
    run_phase(accelerator, run_dir, tmp, True, write_state, accelerator, tmp)
    run_phase(accelerator, run_dir, tmp, main, write_manifest, tmp, step, state)
    run_phase(accelerator, run_dir, tmp, main, publish, tmp, final)
    run_phase(accelerator, run_dir, tmp, main, prune, run_dir, keep, keep_every, published=True)
    return final
