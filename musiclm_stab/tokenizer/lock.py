"""One writer per output folder: an OS record lock (``fcntl.lockf``) on ``OUT/.tokenize.lock``."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

LOCK_FILE = ".tokenize.lock"
# Lock files this process holds -> who holds them: record locks do not conflict within a process, and
# closing any descriptor of a locked file drops the lock, so a second lock is refused from this table.
_HELD: dict[str, str] = {}
_GUARD = threading.Lock()  # the table and the descriptors of its files change together


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
    refused too, without opening the file: closing a second descriptor of it would drop the first
    one's lock. The file stays (deleting it would let a waiting process lock a file that is no longer
    the lock). Not reliable on network file systems without lock support.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = str((out / LOCK_FILE).resolve())
    with _GUARD:
        if key in _HELD:
            # Refused before opening the file: closing a descriptor of it, even one that never got the
            # lock, would drop this process's record lock and let another process in.
            raise OutputBusy(f"{out} is being written by {_HELD[key]} (this process); wait for it to finish "
                             f"(the lock, {out / LOCK_FILE}, is released when that block ends)")
        fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _lock_holder(fd)
            os.close(fd)  # this process holds no lock on the file: closing drops nothing
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise OutputBusy(f"{out} is being written by {holder}; wait for it to finish or stop "
                             f"it (the lock, {out / LOCK_FILE}, is released when that process exits)") from None
        command = " ".join(sys.argv) or sys.executable
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        _HELD[key] = f"process {os.getpid()} on {socket.gethostname()}, started {started}: {command}"
    try:
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "command": command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        yield
    finally:
        with _GUARD:  # closed before the key is freed: a new lock of the folder cannot open it in between
            os.close(fd)  # releases the lock (a record lock: closing any descriptor of the file in this process)
            del _HELD[key]
