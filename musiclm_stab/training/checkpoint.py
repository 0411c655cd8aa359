"""Checkpoints that are complete or absent, and durable once published.

A checkpoint is an accelerate state (model, optimizer, scheduler, grad scaler, RNG states) plus the
trainer's registered objects as JSON (``registered.py``; nothing in a checkpoint is a pickle of code),
written into ``checkpoints/.tmp-step_N``, completed by a manifest ``trainer_state.json`` (step, data
position, sha256 of every file) and only then renamed to ``checkpoints/step_N``. Every file, the
manifest and the directory are fsynced before the rename, and the directory holding ``step_N`` after it
(``durable.fsync_dir``), so a crash or a power loss at any moment leaves either the previous checkpoints
or the new complete one; ``newest_valid`` checks the hashes and skips a damaged checkpoint with a warning
instead of loading it half-way; the ``.tmp-*`` left by a write that a crash interrupted is removed on
``--resume`` and before the next write. The manifest lists every file of the checkpoint: a file it does
not list (the loader would read it unchecked) makes the checkpoint damaged. A file that cannot be read
(EACCES, as a shared file system may answer for a moment) is no damage: such a checkpoint is unreadable,
and is neither used, moved nor removed. ``--resume`` takes ``resume_point``: the newest intact checkpoint,
but it stops (ResumeRefused) where checkpoints exist and none is intact, or a newer one is unreadable,
naming each and why, instead of starting again from step 0.

Pruning keeps the newest ``train.keep_checkpoints`` *intact* checkpoints (hashes checked; never fewer
than one, the one just written) plus, with ``train.keep_every=M``, every checkpoint at a multiple of M;
the others go, but a damaged one is moved aside (``step_N.aside-<time>``, removal.move_aside: damaged by
what?) and an unreadable one left in place, each with a warning. A damaged checkpoint of the step being
published is moved aside the same way, never replaced. A step that is already published and intact is
never written again (a SIGTERM right after a checkpoint asks for the same step): rewriting it would
delete it before its replacement is in place. A write that fails (e.g. the disk is full) removes its
partial ``.tmp-*`` and raises ``CheckpointWriteError`` naming the directory, the free space and the
previous checkpoint, left intact. Every removal goes through removal.py.

``save`` runs in phases, each a named function: ``remove_partial``, ``already_published``,
``write_state`` (every process), ``write_manifest``, ``publish``, ``prune`` (main process). After each,
the processes exchange whether their part failed (``_agree``), so a failure on any one process stops
every process with the same CheckpointWriteError instead of leaving the others at a barrier until the
launcher's timeout.

``checkpoint_writer.CheckpointWriter`` (what the trainer uses) runs the same protocol with the slow part
on a thread; ``checkpoint_load`` loads a checkpoint without unpickling code.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import resource
import shutil
import stat
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import (
    broadcast_object_list,
    gather_object,
)

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.durable import fsync_dir, fsync_file
from musiclm_stab.output_errors import OS_ERROR_IN_TEXT as _OS_ERROR_IN_TEXT
from musiclm_stab.removal import discard_temporary, move_aside, remove_own
from musiclm_stab.training import registered
from musiclm_stab.training.registered import Registered

CHECKPOINT_PREFIX = "step_"
STATE_FILE = "trainer_state.json"
PARTIAL_PREFIX = ".tmp-"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); the previous ones are intact."""


class ResumeRefused(ConfigError):
    """--resume found checkpoints but none it may resume from; nothing was changed."""


CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}\d+$")  # step_N: not step_N.aside-<time>


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX):])


def _has_manifest(ckpt: Path) -> bool:
    """Whether ``ckpt`` has its manifest; one that cannot be looked at (EACCES) counts: the checkpoint is
    then unreadable, which ``problem`` says, not absent."""
    try:
        return stat.S_ISREG((ckpt / STATE_FILE).stat().st_mode)
    except FileNotFoundError:
        return False
    except OSError:
        return True


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run that have their manifest, oldest first (integrity not yet checked)."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if CHECKPOINT_NAME.match(p.name) and _has_manifest(p)]
    return sorted(found, key=checkpoint_step)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a published checkpoint of a run: ``checkpoints/step_N`` with its manifest (what
    pruning may remove: removal.remove_own)."""
    return path.parent.name == "checkpoints" and bool(CHECKPOINT_NAME.match(path.name)) and \
        not path.is_symlink() and (path / STATE_FILE).is_file()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Problem:
    """Why a checkpoint cannot be loaded: ``unreadable`` (an OS error reading it: no damage, it may be
    readable again) or damaged (a file missing, unlisted, or not matching its sha256)."""

    reason: str
    unreadable: bool = False


def problem(ckpt: Path) -> Problem | None:
    """None if the checkpoint is intact: its manifest lists every file it holds (but itself and a
    temporary ``.tmp-*``), and each matches its sha256; else what is wrong."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        held = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")
                      if not p.is_dir() and p.name != STATE_FILE and not p.name.startswith(PARTIAL_PREFIX))
    except OSError as e:
        return Problem(f"unreadable: {e.strerror or e}", unreadable=True)
    except ValueError as e:
        return Problem(f"unreadable {STATE_FILE}: {e}")
    files = state.get("files") if isinstance(state, dict) else None
    if not isinstance(files, dict):
        return Problem(f"{STATE_FILE} lists no files")
    unlisted = [name for name in held if name not in files]
    if unlisted:
        return Problem(f"{', '.join(unlisted)} {'is' if len(unlisted) == 1 else 'are'} not listed in {STATE_FILE} "
                       "(the manifest must vouch for every file the loader reads)")
    for name, digest in files.items():
        f = ckpt / name
        try:
            if not f.is_file():
                return Problem(f"{name} is missing")
            if sha256_file(f) != digest:
                return Problem(f"{name} does not match its sha256 in {STATE_FILE}")
        except OSError as e:
            return Problem(f"{name} is unreadable: {e.strerror or e}", unreadable=True)
    return None


def verify(ckpt: Path) -> str | None:
    """None if the checkpoint is intact, else the reason it is not (``problem``)."""
    found = problem(ckpt)
    return None if found is None else found.reason


class Intact:
    """The checkpoints this process wrote or verified, so that pruning and a repeated save do not hash
    them again (a checkpoint of a large model is gigabytes). Keyed by the directory's inode: a directory
    replaced since (published again, or removed and made anew) is verified again."""

    def __init__(self):
        self._known: dict[Path, int] = {}

    def add(self, ckpt: Path) -> None:
        """``ckpt`` was just written (its manifest hashes what was written) or verified."""
        self._known[Path(ckpt)] = Path(ckpt).stat().st_ino

    def forget(self, ckpt: Path) -> None:
        self._known.pop(Path(ckpt), None)

    def problem(self, ckpt: Path) -> Problem | None:
        """``problem(ckpt)``, skipped for a checkpoint known intact."""
        ckpt = Path(ckpt)
        try:
            inode = ckpt.stat().st_ino
        except OSError as e:
            return Problem(f"unreadable: {e.strerror}", unreadable=True)
        if self._known.get(ckpt) == inode:
            return None
        found = problem(ckpt)
        if found is None:
            self._known[ckpt] = inode
        return found


def newest_valid(run_dir: Path) -> Path | None:
    """The newest intact checkpoint; damaged and unreadable ones are named in a warning and skipped (for
    reading a trained model; ``--resume`` takes ``resume_point``)."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        found = problem(ckpt)
        if found is None:
            return ckpt
        warnings.warn(f"skipping {'unreadable' if found.unreadable else 'damaged'} checkpoint {ckpt}: "
                      f"{found.reason}", stacklevel=2)
    return None


def resume_point(run_dir: Path) -> Path | None:
    """The checkpoint ``--resume`` starts from: the newest intact one, newer damaged ones named in a warning
    and skipped (pruning and publishing move them aside later, never delete them); None where there is no
    checkpoint at all. ResumeRefused, naming each checkpoint and why, where checkpoints exist and none is
    intact, or a newer one is unreadable (no damage: it may be readable again, and it is the run's
    progress): a new run from step 0 would write over their steps. Nothing is changed."""
    skipped: list[tuple[Path, Problem]] = []
    for ckpt in reversed(list_checkpoints(run_dir)):
        found = problem(ckpt)
        if found is not None and found.unreadable:
            raise ResumeRefused(f"cannot resume {run_dir}: checkpoint {ckpt.name}: {found.reason}, which is no damage: "
                                "it is neither used, moved nor removed; make it readable, then resume with the same "
                                "command")
        if found is None:
            for bad, why in skipped:
                warnings.warn(f"skipping damaged checkpoint {bad}: {why.reason}", stacklevel=2)
            return ckpt
        skipped.append((ckpt, found))
    if skipped:
        raise ResumeRefused(f"cannot resume {run_dir}: none of its {len(skipped)} checkpoint(s) is intact: "
                            + "; ".join(f"{c.name}: {why.reason}" for c, why in skipped)
                            + ". Nothing was changed (a new run from step 0 would write over them): restore them "
                            "from a copy, or start a new run (another --train.name)")
    return None


def read_state(ckpt: Path) -> dict:
    return json.loads((ckpt / STATE_FILE).read_text())


def remove_partial(run_dir: Path) -> list[Path]:
    """Remove the ``.tmp-*`` writes a crash left unfinished (never loaded: they were never renamed)."""
    found = sorted((Path(run_dir) / "checkpoints").glob(f"{PARTIAL_PREFIX}*"))
    for partial in found:
        discard_temporary(partial)
    return found


def to_prune(steps: Sequence[int], keep: int, keep_every: int = 0,
             intact: Callable[[int], bool] = lambda step: True) -> list[int]:
    """Steps to delete: all but the newest ``keep`` (>= 1) of those ``intact`` says are intact and, if
    ``keep_every`` > 0, the multiples of it. A damaged checkpoint never counts towards ``keep`` (it can
    never be loaded): it goes unless it is such a multiple. ``intact`` is asked about the newest steps
    only, until ``keep`` of them are intact."""
    kept, doomed = 0, []
    for step in sorted(steps, reverse=True):
        if kept < keep and intact(step):
            kept += 1
        elif not (keep_every and step % keep_every == 0):
            doomed.append(step)
    return sorted(doomed)


def write_state(accelerator: Accelerator, tmp: Path, objects: Registered = ()) -> None:
    """Phase 1 of a write, on every process: the accelerate state (weights, optimizer, scheduler, scaler,
    this process's RNG states) into ``tmp``; on the main process also ``registered.json``."""
    registered.refuse_pickled_objects(accelerator)
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        registered.write(objects, tmp)


def _fsync_tree(root: Path) -> None:
    """fsync every directory under ``root`` (deepest first) and ``root``: their entries name the files."""
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)
    fsync_dir(root)


def write_manifest(tmp: Path, step: int, state: dict, files: dict[str, str] | None = None) -> None:
    """Phase 2, main process: ``trainer_state.json`` (step, ``state``, sha256 of every file). Its presence
    is what makes ``tmp`` a complete checkpoint. ``files``: {name: sha256} already computed, and the files
    fsynced, by the processes that wrote them (CheckpointWriter); by default every file in ``tmp`` is
    hashed and fsynced here. Then the manifest and the directories are fsynced: once this returns, the
    checkpoint is on disk whole, and renaming it into place (``publish``) cannot expose a part of it."""
    if files is None:
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                fsync_file(p)
                files[p.relative_to(tmp).as_posix()] = sha256_file(p)
    files = dict(sorted(files.items()))
    manifest = tmp / STATE_FILE
    manifest.write_text(json.dumps({"step": step, **state, "files": files}, indent=1))
    fsync_file(manifest)
    _fsync_tree(tmp)


def publish(tmp: Path, final: Path) -> None:
    """Phase 3, main process: move the complete checkpoint into place, and fsync the directories whose
    entries that changed (``checkpoints/``, and the run directory holding it) before anything older is
    pruned. A checkpoint already at ``final`` is a damaged one (an intact one is never written again:
    ``already_published``): it is moved aside (``step_N.aside-<time>``) with a warning saying where, never
    deleted; an unreadable one is no damage, and stops the write (OSError) with it left in place."""
    if final.exists() or final.is_symlink():
        found = problem(final)
        if found is not None and found.unreadable:
            raise OSError(errno.EACCES, f"{final} exists and is {found.reason} (no damage: it is not moved)")
        aside = move_aside(final)
        warnings.warn(f"moved damaged checkpoint {final} aside to {aside.name}"
                      + (f": {found.reason}" if found else ""), stacklevel=2)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    fsync_dir(final.parent.parent)


def prune(run_dir: Path, keep: int, keep_every: int = 0, intact: Intact | None = None) -> list[Path]:
    """Phase 4, main process: delete the checkpoints ``to_prune`` names, checking the integrity of the
    newest ones (``intact`` knows those this process wrote or verified); of those, a damaged one is moved
    aside and an unreadable one left, each with a warning. Returns the ones gone from their place."""
    intact = intact or Intact()
    ckpt_dir = Path(run_dir) / "checkpoints"
    by_step = {checkpoint_step(c): c for c in list_checkpoints(run_dir)}
    problems: dict[int, Problem | None] = {}

    def is_intact(step: int) -> bool:
        problems[step] = intact.problem(by_step[step])
        return problems[step] is None

    gone = []
    for ckpt in [by_step[s] for s in to_prune(list(by_step), keep, keep_every, is_intact)]:
        found = problems.get(checkpoint_step(ckpt))
        if found is not None and found.unreadable:
            warnings.warn(f"keeping unreadable checkpoint {ckpt} in place: {found.reason}", stacklevel=2)
            continue
        if found is not None:
            aside = move_aside(ckpt)
            warnings.warn(f"moved damaged checkpoint {ckpt} aside to {aside.name}: {found.reason}", stacklevel=2)
        else:
            remove_own(ckpt, ckpt_dir, recognised=is_checkpoint)
        intact.forget(ckpt)
        gone.append(ckpt)
    return gone


def reuse_published(final: Path, step: int, state: dict, intact: Intact) -> bool:
    """True if checkpoint ``step`` is already in place and intact: it is then not written again. If the
    ``state`` it records differs (after a spike-guard rollback the data position moved on, while the files
    are those of the checkpoint just loaded), only its manifest is replaced, atomically. False if it is
    absent or damaged (then written anew)."""
    if not final.is_dir() or intact.problem(final) is not None:
        return False
    manifest = read_state(final)
    wanted = json.loads(json.dumps({"step": step, **state, "files": manifest["files"]}))  # as JSON reads back
    if wanted != manifest:
        part = final / f"{PARTIAL_PREFIX}{STATE_FILE}"
        part.write_text(json.dumps(wanted, indent=1))
        fsync_file(part)
        os.replace(part, final / STATE_FILE)
        fsync_dir(final)
    return True


def already_published(accelerator: Accelerator, run_dir: Path, tmp: Path, final: Path, step: int, state: dict,
                      intact: Intact) -> bool:
    """``reuse_published``, decided by the main process and known to all (a collective)."""
    box: list[bool] = []
    run_phase(accelerator, run_dir, tmp, accelerator.is_main_process,
              lambda: box.append(reuse_published(final, step, state, intact)))
    flag = [box[0] if box else False]
    if accelerator.num_processes > 1:
        broadcast_object_list(flag, from_process=0)
    return flag[0]


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


# torch.save reports any failed write (a full disk, a file size limit) as a RuntimeError of its zip writer,
# without the OS error; safetensors as a SafetensorError ending in "(os error N)".
_TORCH_WRITE_FAILED = ("unexpected pos", "file write failed")
# Free space below which a write that failed for an unknown reason is taken for a full disk.
_NEARLY_FULL = 64 * 2**20


def _files_under(where: Path) -> list[Path]:
    try:
        return [p for p in Path(where).rglob("*") if p.is_file()]
    except OSError:
        return []


def _errno_of(error: BaseException, where: Path) -> int | None:
    """The OS error behind a failed write into ``where``: an OSError's own, the one safetensors names in its
    message, or for torch's zip writer (which names none) the likely one: EFBIG if a file there has reached
    this process's file size limit (``ulimit -f``), ENOSPC if the file system is (nearly) full, else None."""
    if isinstance(error, OSError):
        return error.errno
    found = _OS_ERROR_IN_TEXT.search(str(error))
    if found:
        return int(found.group(1))
    if not (isinstance(error, RuntimeError) and any(s in str(error) for s in _TORCH_WRITE_FAILED)):
        return None
    sizes = []
    for f in _files_under(where):
        try:
            sizes.append(f.stat().st_size)
        except OSError:
            pass
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and sizes and max(sizes) >= limit:
        return errno.EFBIG
    folder = Path(where)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    return errno.ENOSPC if free < max(_NEARLY_FULL, max(sizes, default=0)) else None


def _failure(error: BaseException, where: Path) -> tuple[str, bool]:
    """(the reason a write into ``where`` failed, whether it is a full disk or quota: only then is freeing
    space the advice). A file too large for the process's limit or the file system says so."""
    reason, code = _reason(error), _errno_of(error, where)
    if code is not None and not isinstance(error, OSError) and _OS_ERROR_IN_TEXT.search(str(error)) is None:
        reason = f"{os.strerror(code)} (inferred: torch names no cause: {reason})"
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        reason += (f"; this process may write files of at most {limit:,} bytes (ulimit -f)" if limit !=
                   resource.RLIM_INFINITY else "; the largest file this file system holds is smaller")
    return reason, code in (errno.ENOSPC, errno.EDQUOT)


def _agree(accelerator: Accelerator, error: BaseException | None, where: Path) -> list[tuple[str, bool]]:
    """Every process's failure of the phase just done (writing into ``where``), as (``"process i of n:
    reason"``, whether it is a full disk), known to all of them.

    Under several processes this is a collective (it also orders the phases, as a barrier would): a
    process whose write failed must not leave the others waiting at the next barrier until the
    launcher's timeout. One process: no communication."""
    if accelerator.num_processes == 1:
        return [] if error is None else [_failure(error, where)]
    mine = None
    if error is not None:
        reason, full = _failure(error, where)
        mine = (f"process {accelerator.process_index} of {accelerator.num_processes}: {reason}", full)
    return [r for r in gather_object([mine]) if r is not None]


def _write_failure(run_dir: Path, tmp: Path, reasons: list[tuple[str, bool]], doing: str) -> str:
    ckpt_dir = Path(run_dir) / "checkpoints"
    step = tmp.name[len(PARTIAL_PREFIX):]
    previous = newest_valid(run_dir)
    kept = (f"the previous checkpoint {previous.name} is intact" if previous is not None
            else "there is no earlier checkpoint")
    why = "; ".join(text for text, _ in reasons)
    if doing == "copy":  # the copy of the state into host memory, before anything is written
        return (f"could not copy the training state of checkpoint {step} to host memory: {why}. Nothing was "
                f"written to {ckpt_dir} and {kept}. Fix the cause (e.g. free host memory), then resume with "
                "the same command and --resume.")
    try:
        free = f"{shutil.disk_usage(ckpt_dir).free / 2**30:.2f} GiB free"
    except OSError as e:
        free = f"free space unknown: {e.strerror}"
    if any(full for _, full in reasons):
        advice = ("Free some space (or lower train.keep_checkpoints, or set train.output_dir elsewhere), then "
                  "resume with the same command and --resume.")
    else:
        advice = "Fix the cause, then resume with the same command and --resume."
    return (f"could not write checkpoint {step} in {ckpt_dir} ({free}): {why}. The partial write was "
            f"removed and {kept}. {advice}")


def _fail(accelerator: Accelerator, message: str) -> CheckpointWriteError:
    """The one error every process raises, worded by the main process (``message`` there) and sent to all."""
    box = [message]
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return CheckpointWriteError(box[0])


# Failures of the machine (disk, memory, device), reported as a CheckpointWriteError; anything else is
# a bug, re-raised as itself (but for one that names an OS error, as safetensors' SafetensorError does).
_EXPECTED_ERRORS = (OSError, RuntimeError, MemoryError)


def _expected(error: BaseException) -> bool:
    return isinstance(error, _EXPECTED_ERRORS) or _OS_ERROR_IN_TEXT.search(str(error)) is not None


def run_phase(accelerator: Accelerator, run_dir: Path, tmp: Path, run: bool, action, *args,
              published: bool = False, doing: str = "write") -> None:
    """``action(*args)`` where ``run`` (this process's part of a phase), then ``_agree``. If it failed on any
    process, every process raises the same CheckpointWriteError; before a checkpoint is ``published``
    the main process first removes the partial write (safe: every process is past its part of the
    phase). ``doing="copy"``: the phase copies the state to host memory (the message says so, and gives
    no disk advice). An exception that is no failure of the machine (a bug) is re-raised as itself where
    it happened; the other processes still stop with the CheckpointWriteError naming it."""
    error = None
    if run:
        try:
            action(*args)
        except Exception as e:  # any failure: the other processes must learn of it (_agree)
            error = e
    reasons = _agree(accelerator, error, tmp)
    if not reasons:
        return
    message = ""
    if accelerator.is_main_process:
        if published:  # the new checkpoint is complete and in place
            message = (f"checkpoint {tmp.name[len(PARTIAL_PREFIX):]} was written, but removing older "
                       f"checkpoints of {tmp.parent} failed: {'; '.join(t for t, _ in reasons)}. Fix the cause, "
                       "then resume with the same command and --resume.")
        else:
            discard_temporary(tmp, ignore_errors=True)  # partial files only: nothing here was ever loadable
            message = _write_failure(run_dir, tmp, reasons, doing)
    failure = _fail(accelerator, message)
    if error is not None and not _expected(error):
        raise error
    raise failure from error


def save(accelerator: Accelerator, run_dir: Path, step: int, state: dict, keep: int, keep_every: int = 0,
         objects: Registered = (), intact: Intact | None = None) -> Path:
    """Write the accelerate state and ``objects`` (registered.py) aside, add the manifest, move it into
    place; keep the newest ``keep`` intact checkpoints and every multiple of ``keep_every``. A step
    already published and intact is kept as it is (``already_published``).

    Raises CheckpointWriteError (e.g. disk full) with the previous checkpoints intact. Under several
    processes a failure on any one of them is raised on all of them, with the same message, at the end
    of the phase it happened in (``run_phase``): none is left waiting at a barrier for the one that failed."""
    intact = intact or Intact()
    ckpt_dir = Path(run_dir) / "checkpoints"
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = ckpt_dir / f"{PARTIAL_PREFIX}{CHECKPOINT_PREFIX}{step:08d}"
    main = accelerator.is_main_process
    run_phase(accelerator, run_dir, tmp, main, remove_partial, run_dir)  # left by a crash in an earlier write
    if already_published(accelerator, run_dir, tmp, final, step, state, intact):
        return final
    run_phase(accelerator, run_dir, tmp, True, write_state, accelerator, tmp, objects)
    run_phase(accelerator, run_dir, tmp, main, write_manifest, tmp, step, state)
    run_phase(accelerator, run_dir, tmp, main, lambda: (publish(tmp, final), intact.add(final)))
    run_phase(accelerator, run_dir, tmp, main, prune, run_dir, keep, keep_every, intact, published=True)
    return final
