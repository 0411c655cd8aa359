"""One writer per output folder: an OS record lock (``fcntl.lockf``) on ``OUT/.tokenize.lock``, respecting a
trainer's lock of the same folder (musiclm_stab/locks.py ``writer_lock``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from musiclm_stab.locks import WRITERS, Held, folder_writer, writer_lock

LOCK_FILE = WRITERS["tokenize"]


class OutputBusy(RuntimeError):
    """Another process (a tokenizer, or a trainer whose run directory it is) is writing the same folder."""


def _busy(out: Path, e: Held) -> OutputBusy:
    if e.this_process:
        return OutputBusy(f"{out} is being written by {e.holder} (this process); wait for it to finish (the "
                          f"lock, {e.path}, is released when that block ends)")
    return OutputBusy(f"{out} is being written by {e.holder}; wait for it to finish or stop it (its lock, "
                      f"{e.path}, is released when that process exits)")


def check_not_busy(out: str | Path) -> None:
    """OutputBusy, naming the holder, if a writer (a tokenizer, or a trainer) holds ``out``; creates nothing.
    For a refusal before any other look at the folder, whose contents another writer is changing."""
    held = folder_writer(out)
    if held is not None:
        raise _busy(Path(out), held)


@contextmanager
def output_lock(out: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on an output folder (created if missing) for the duration of the block.

    A process-owned OS record lock on ``OUT/.tokenize.lock`` (musiclm_stab/locks.py): a second run on the
    same folder, or on a folder a trainer holds (its run directory), fails at once (OutputBusy, naming the
    holder's pid and command) instead of interleaving its writes; the kernel releases it when the holder
    exits, however it dies, so a killed run never blocks a rerun. A second lock of the same folder in the
    same process is refused too.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        lock = writer_lock(out, "tokenize")
    except Held as e:
        raise _busy(out, e) from None
    try:
        lock.write_holder()
        yield
    finally:
        lock.release()
