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
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

from accelerate import Accelerator

CHECKPOINT_PREFIX = "step_"
STATE_FILE = "trainer_state.json"
PARTIAL_PREFIX = ".tmp-"
# Test hook: "<step>,<phase>,<marker file>" makes the write of checkpoint <step> create the marker and
# sleep at <phase> ("files": accelerate state written, no manifest yet; "rename": complete but not yet
# moved into place), so that a test can SIGKILL the process in the middle of a checkpoint write.
TEST_PAUSE_ENV = "MUSICLM_STAB_TEST_CKPT_PAUSE"


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


def _test_pause(phase: str, step: int) -> None:
    spec = os.environ.get(TEST_PAUSE_ENV)
    if spec:
        at, where, marker = spec.split(",", 2)
        if int(at) == step and where == phase:
            Path(marker).write_text(f"{phase} {step}\n")
            time.sleep(600)


def _write_failure(run_dir: Path, tmp: Path, error: Exception) -> str:
    ckpt_dir = Path(run_dir) / "checkpoints"
    try:
        free = f"{shutil.disk_usage(ckpt_dir).free / 2**30:.2f} GiB free"
    except OSError:
        free = "free space unknown"
    previous = newest_valid(run_dir)
    kept = (f"the previous checkpoint {previous.name} is intact" if previous is not None
            else "there is no earlier checkpoint")
    return (f"could not write checkpoint {tmp.name[len(PARTIAL_PREFIX):]} in {ckpt_dir} ({free}): "
            f"{getattr(error, 'strerror', None) or error}. The partial write was removed and {kept}. Free some space (or lower "
            "train.keep_checkpoints, or set train.output_dir elsewhere), then resume with the same command "
            "and --resume.")


def save(accelerator: Accelerator, run_dir: Path, step: int, state: dict, keep: int,
         keep_every: int = 0) -> Path:
    """Write the accelerate state aside, add the manifest, move it into place; keep the newest ``keep``
    and every multiple of ``keep_every``. Raises CheckpointWriteError if the write fails (disk full)."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = ckpt_dir / f"{PARTIAL_PREFIX}{CHECKPOINT_PREFIX}{step:08d}"
    if accelerator.is_main_process:
        remove_partial(run_dir)  # left by a crash during an earlier write
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _test_pause("files", step)
            files = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
            manifest = tmp / STATE_FILE
            manifest.write_text(json.dumps({"step": step, **state, "files": files}, indent=1))
            with manifest.open("rb") as f:
                os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError ("unexpected pos")
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(_write_failure(run_dir, tmp, e)) from e
    if accelerator.is_main_process:
        _test_pause("rename", step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        by_step = {checkpoint_step(c): c for c in list_checkpoints(run_dir)}
        for old in to_prune(list(by_step), keep, keep_every):
            shutil.rmtree(by_step[old])
    accelerator.wait_for_everyone()
    return final
