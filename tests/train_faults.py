"""recipes/pretrain.py with one fault injected, for the crash-safety tests (not collected by pytest).

    python tests/train_faults.py [pretrain arguments]        (also under torchrun)

The fault is chosen by the environment variable ``TRAIN_FAULT``; it patches the package from outside
(the package itself has no test hooks):

- ``pause:<phase>:<step>:<marker>`` holds the write of checkpoint ``<step>`` at ``<phase>`` forever, after
  creating the file ``<marker>``, so that the test can SIGKILL the process there. ``files``: before
  ``checkpoint.write_manifest`` (the accelerate state is written, there is no manifest); ``rename``:
  before ``checkpoint.publish`` (complete, not yet moved into place).
- ``enospc:<rank>:<step>:<seconds>`` makes every ``torch.save`` of the process of that rank (env ``RANK``, 0
  without a launcher) into the partial write of checkpoint ``<step>`` write 16 bytes, wait ``<seconds>`` (a
  slow disk: the other processes are done with their part meanwhile) and fail as a full disk does.
- ``hold:<step>:<marker>`` holds the training loop right after update ``<step>`` (before its metrics row),
  after publishing a checkpoint still written in the background and creating the file ``<marker>``, until
  the test deletes that file; then training goes on.
- ``raise:<step>`` raises a RuntimeError (an error ``main`` does not handle: a bug) on every process right
  after update ``<step>``, as a checkpoint of the step before may still be written in the background.

Whatever the fault, each process reports on stderr, after ``main`` and before the interpreter's teardown,
whether it left the process group and how many of gloo's threads still run (Linux: by thread name).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import torch

from musiclm_stab.training import checkpoint
from musiclm_stab.training import trainer as train

PAUSE_AT = {"files": "write_manifest", "rename": "publish"}


def pause(phase: str, step: int, marker: Path) -> None:
    name = PAUSE_AT[phase]
    original = getattr(checkpoint, name)
    partial = f"{checkpoint.PARTIAL_PREFIX}{checkpoint.CHECKPOINT_PREFIX}{step:08d}"

    def held(tmp: Path, *args, **kwargs):
        if Path(tmp).name == partial:
            marker.write_text(f"{phase} {step}\n")
            while True:  # until the test kills the process
                time.sleep(1)
        return original(tmp, *args, **kwargs)

    setattr(checkpoint, name, held)


def disk_full(rank: int, step: int, delay: float) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    original = torch.save
    partial = f"{checkpoint.PARTIAL_PREFIX}{checkpoint.CHECKPOINT_PREFIX}{step:08d}"

    def full(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and Path(f).parent.name == partial:
            Path(f).write_bytes(b"\0" * 16)  # cut short, as by a full disk
            time.sleep(delay)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return original(obj, f, *args, **kwargs)

    torch.save = full


def crash(step: int) -> None:
    original = train.Trainer.update

    def update(self):
        result = original(self)
        if self.step == step:
            raise RuntimeError(f"injected fault after update {step}")
        return result

    train.Trainer.update = update


def hold(step: int, marker: Path) -> None:
    original = train.Trainer.update

    def update(self):
        result = original(self)
        if self.step == step:
            # a checkpoint still written in the background is published first, as the loop's next poll would
            # once its files are done: what the test sees held does not depend on how fast the disk was
            self.checkpoints.wait()
            marker.write_text(f"held after update {step}\n")
            while marker.exists():  # until the test lets it go on
                time.sleep(0.05)
        return result

    train.Trainer.update = update


def gloo_threads() -> int:
    """Threads of this process that belong to gloo (its transport loop, the process group's workers)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum("gloo" in name for name in names)


def inject(spec: str) -> None:
    kind, *args = spec.split(":", 3)
    if kind == "pause":
        phase, step, marker = args
        pause(phase, int(step), Path(marker))
    elif kind == "enospc":
        rank, step, delay = args
        disk_full(int(rank), int(step), float(delay))
    elif kind == "hold":
        step, marker = args
        hold(int(step), Path(marker))
    elif kind == "raise":
        crash(int(args[0]))
    else:
        raise SystemExit(f"TRAIN_FAULT={spec!r}: unknown fault {kind!r} (pause, enospc, hold, raise)")


if __name__ == "__main__":
    if os.environ.get("TRAIN_FAULT"):
        inject(os.environ["TRAIN_FAULT"])
    try:
        code = train.main()
    finally:
        # Checked by the tests: every exit tears torch.distributed down first, gloo's threads included (left
        # to exit-time destructors, they sometimes abort a process that has done everything: exit -6 under
        # torchrun).
        print(f"process group left before exit: {not torch.distributed.is_initialized()}", file=sys.stderr)
        print(f"gloo threads left before exit: {gloo_threads()}", file=sys.stderr)
    sys.exit(code)
