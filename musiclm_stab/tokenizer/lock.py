"""One writer per output folder: an OS record lock (``fcntl.lockf``) on ``OUT/.tokenize.lock``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from musiclm_stab.locks import Held, ProcessLock

LOCK_FILE = ".tokenize.lock"


class OutputBusy(RuntimeError):
    """Another process is writing the same output folder."""


@contextmanager
def output_lock(out: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on an output folder (created if missing) for the duration of the block.

    A process-owned OS record lock on ``OUT/.tokenize.lock`` (musiclm_stab/locks.py): a second run on the
    same folder fails at once (OutputBusy, naming the holder's pid and command) instead of interleaving its
    writes; the kernel releases it when the holder exits, however it dies, so a killed run never blocks a
    rerun. A second lock of the same folder in the same process is refused too.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        lock = ProcessLock(out / LOCK_FILE)
    except Held as e:
        if e.this_process:
            raise OutputBusy(f"{out} is being written by {e.holder} (this process); wait for it to finish "
                             f"(the lock, {out / LOCK_FILE}, is released when that block ends)") from None
        raise OutputBusy(f"{out} is being written by {e.holder}; wait for it to finish or stop "
                         f"it (the lock, {out / LOCK_FILE}, is released when that process exits)") from None
    try:
        lock.write_holder()
        yield
    finally:
        lock.release()
