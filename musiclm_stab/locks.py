"""One writer at a time: an exclusive, process-owned lock of a file, what guards a tokenizer's output folder
(tokenizer/lock.py) and a run directory (training/run_dir.py).

An OS record lock (``fcntl.lockf``, POSIX) belongs to the holding process alone: the kernel releases it when
that process exits, however it dies, so a killed writer never blocks a rerun. (A BSD ``flock`` belongs to
the open file, which a child shares from fork until exec: a writer killed while spawning workers kept the
lock for that moment.) A record lock is dropped when the process closes *any* descriptor of the file, so a
second lock of the same file in the same process is refused from a table kept here, without opening the
file. The holder writes who it is (pid, host, start, command) into the file for the refusal message of the
next one. The file stays when the lock is released: deleting it would let a waiting process lock a file
that is no longer the lock. Not reliable on network file systems without lock support.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

_HELD: dict[str, str] = {}  # lock file (resolved) -> who holds it in this process
_GUARD = threading.Lock()  # the table and the descriptors of its files change together


class Held(Exception):
    """The lock is held: ``holder`` says by whom; ``this_process``: by another lock of this process."""

    def __init__(self, holder: str, this_process: bool):
        super().__init__(holder)
        self.holder, self.this_process = holder, this_process


def _holder_of(fd: int) -> str:
    """Who holds the lock, as the holder wrote it in the lock file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or not info.get("pid"):
        return "another process"
    return (f"process {info['pid']} on {info.get('host', '?')}, started {info.get('started', '?')}: "
            f"{info.get('command', '?')}")


class ProcessLock:
    """The exclusive lock of ``path`` (created if missing; its folder must exist), taken at construction.

    Raises Held when another process or another ProcessLock of this process holds it, OSError when the file
    cannot be opened or locked for another reason. ``write_holder`` records this process in the file (its
    OSError, e.g. a full disk, is the caller's to handle); ``release`` (or the process's exit) frees it."""

    def __init__(self, path: str | Path):
        self.key = str(Path(path).resolve())
        self.fd: int | None = None
        with _GUARD:
            if self.key in _HELD:  # refused before opening the file: closing a descriptor would drop the lock
                raise Held(_HELD[self.key], this_process=True)
            fd = os.open(self.key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _holder_of(fd)
                os.close(fd)  # this process holds no lock on the file: closing drops nothing
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise Held(holder, this_process=False) from None
            self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            self.command = " ".join(sys.argv) or sys.executable
            _HELD[self.key] = f"process {os.getpid()} on {socket.gethostname()}, started {self.started}: {self.command}"
            self.fd = fd

    def write_holder(self) -> None:
        """Write who holds the lock into its file (for the refusal message of the next writer)."""
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": self.started, "command": self.command}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(holder).encode(), 0)

    def release(self) -> None:
        with _GUARD:  # closed before the key is freed: a new lock of the file cannot open it in between
            if self.fd is None:
                return
            os.close(self.fd)  # releases the record lock
            self.fd = None
            del _HELD[self.key]

    def __del__(self):  # a lock dropped without release (e.g. a Trainer a test never ran): it goes with it
        if getattr(self, "fd", None) is not None:
            self.release()
