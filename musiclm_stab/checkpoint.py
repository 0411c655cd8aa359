"""Checkpoints that are complete or absent.

A checkpoint is an accelerate state (model, optimizer, scheduler, grad scaler, RNG states, registered
objects) written into ``checkpoints/.tmp-step_N``, completed by a manifest ``trainer_state.json``
(step, data position, sha256 of every file) and only then renamed to ``checkpoints/step_N``. A crash
at any moment leaves either the previous checkpoints or the new complete one; ``newest_valid`` checks
the hashes and skips a damaged checkpoint with a warning instead of loading it half-way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

from accelerate import Accelerator

CHECKPOINT_PREFIX = "step_"
STATE_FILE = "trainer_state.json"


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


def save(accelerator: Accelerator, run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Write the accelerate state aside, add the manifest, move it into place; keep the newest ``keep``."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = ckpt_dir / f".tmp-{CHECKPOINT_PREFIX}{step:08d}"
    if accelerator.is_main_process:
        for stale in ckpt_dir.glob(".tmp-*"):  # left by a crash during an earlier write
            shutil.rmtree(stale)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        files = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = tmp / STATE_FILE
        manifest.write_text(json.dumps({"step": step, **state, "files": files}, indent=1))
        with manifest.open("rb") as f:
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final
