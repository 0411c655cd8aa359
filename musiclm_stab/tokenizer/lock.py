"""One writer per output folder: an OS record lock (``fcntl.lockf``) on ``OUT/.tokenize.lock``."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

LOCK_FILE = ".tokenize.lock"
_HELD: set[str] = set()  # lock files this process holds (record locks do not conflict within a process)


class OutputBusy(RuntimeError):
    """Another process is writing the same output folder."""


def _lock_holder(fd: int) -> str:
    """Who holds the lock, as the holder wrote it in the lock file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "another process"
    return (f"process {info['pid']} on {info.get('host', '?')}, started {info.get('started', '?')}: "
            f"{info.get('command', '?')}")


@contextmanager
def output_lock(out: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on an output folder (created if missing) for the duration of the block.

    An OS record lock (``fcntl.lockf``, POSIX) on ``OUT/.tokenize.lock``: a second run on the same
    folder fails at once (OutputBusy, naming the holder's pid and command) instead of interleaving its
    writes. The lock belongs to the holding process alone: the kernel releases it when that process
    exits, however it dies, so a killed run never blocks a rerun. (A BSD ``flock`` belongs to the open
    file, which a child shares from fork until exec: a run killed while spawning its workers kept
    blocking the rerun for that moment.) A second lock of the same folder in the same process is
    refused too. The file stays (deleting it would let a waiting process lock a file that is no longer
    the lock). Not reliable on network file systems without lock support.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = str((out / LOCK_FILE).resolve())
    fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            if key in _HELD:
                raise BlockingIOError(errno.EAGAIN, "held by this process")
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise OutputBusy(f"{out} is being written by {_lock_holder(fd)}; wait for it to finish or stop "
                             f"it (the lock, {out / LOCK_FILE}, is released when that process exits)") from None
        _HELD.add(key)
        try:
            holder = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "command": " ".join(sys.argv) or sys.executable}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            yield
        finally:
            _HELD.discard(key)
    finally:
        os.close(fd)  # releases the lock (a record lock: closing any descriptor of the file in this process)
