"""One writer at a time: an exclusive, process-owned lock of a file, what guards a tokenizer's output folder
(tokenizer/lock.py) and a run directory (training/run_dir.py).

An OS record lock (``fcntl.lockf``, POSIX) belongs to the holding process alone: the kernel releases it when
that process exits, however it dies, so a killed writer never blocks a rerun. (A BSD ``flock`` belongs to
the open file, which a child shares from fork until exec: a writer killed while spawning workers kept the
lock for that moment.) A record lock is dropped when the process closes *any* descriptor of the file, so a
second lock of the same file in the same process is refused from a table kept here, without opening the
file. The table is keyed by the file itself (device and inode), not by its name: a hard link, a path through
a symlinked folder or a bind mount names the same file, and a second lock through it must be refused too.
The holder writes who it is (pid, host, start, command) into the file for the refusal message of the next
one. The file stays when the lock is released: deleting it would let a waiting process lock a file that is
no longer the lock. Not reliable on network file systems without lock support.

A folder has one writer of any kind (``WRITERS``): the tokenizer writing its output, the trainer writing a
run directory. Each takes its own lock file and refuses a folder where another writer's is held
(``writer_lock``): it looks before taking its own, so that a refused writer creates nothing there, and again
after, so that two writers starting at once cannot both miss each other.

A lock file deleted or replaced while held no longer excludes anyone: the next writer creates a new file and
locks that. Nothing a lock holds can prevent it, so the holder checks (``lost``) that its file is still the
one at the path before it writes, and stops when it is not.
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

# The lock file of each writer of a folder: the tokenizer's output (tokenizer/lock.py), the trainer's run
# directory (training/run_dir.py). A writer refuses a folder where any of them is held.
WRITERS = {"tokenize": ".tokenize.lock", "train": ".train.lock"}

_HELD: dict[tuple[int, int], str] = {}  # lock file (st_dev, st_ino) -> who holds it in this process
# descriptors of a held file opened by a lookup that raced with a rename (_opened): closing them would drop
# the lock, so they are closed with it
_ALSO_OPEN: dict[tuple[int, int], list[int]] = {}
_GUARD = threading.Lock()  # the table and the descriptors of its files change together
_NOT_FREE = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # lockf's answers for "another process holds it"


class Held(Exception):
    """The lock is held: ``holder`` says by whom; ``this_process``: by another lock of this process;
    ``path``: the lock file that is held (another writer's, for ``writer_lock``)."""

    def __init__(self, holder: str, this_process: bool, path: Path | None = None):
        super().__init__(holder)
        self.holder, self.this_process, self.path = holder, this_process, path


def _key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


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


def _held_here(path: Path) -> Held | None:
    """Held (this process) if this process holds the file at ``path``; looked up without opening it."""
    try:
        key = _key(os.stat(path))
    except (FileNotFoundError, NotADirectoryError):  # no lock file there (nor a folder)
        return None
    return Held(_HELD[key], True, path) if key in _HELD else None


def _opened(fd: int, path: Path) -> Held | None:
    """For a descriptor just opened on ``path``: Held (this process) if it is a file this process holds (a
    rename put it at ``path`` since ``_held_here`` looked); the descriptor is then kept open with the lock."""
    key = _key(os.fstat(fd))
    if key not in _HELD:
        return None
    _ALSO_OPEN.setdefault(key, []).append(fd)
    return Held(_HELD[key], True, path)


def _probe(path: Path) -> Held | None:
    """Held if a lock of ``path`` is held, by another process or by this one; None if it is free or missing.
    Creates nothing; needs no write permission (a shared lock, given back at once, is what asks)."""
    held = _held_here(path)
    if held is not None:
        return held
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    held = _opened(fd, path)
    if held is not None:
        return held
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in _NOT_FREE:
            raise
        return Held(_holder_of(fd), False, path)
    finally:
        os.close(fd)  # this process holds no other lock on the file (_HELD): closing drops only the probe's
    return None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open at ``fd``."""
    try:
        return _key(os.stat(path)) == _key(os.fstat(fd))
    except FileNotFoundError:
        return False


class ProcessLock:
    """The exclusive lock of ``path`` (created if missing; its folder must exist), taken at construction.

    Raises Held when another process or another ProcessLock of this process holds it, or holds one of the
    lock files ``respect`` (other writers of the same folder: ``writer_lock``); OSError when the file cannot be
    opened or locked for another reason. ``write_holder`` records this process in the file (its OSError,
    e.g. a full disk, is the caller's to handle); ``lost`` says whether the file was deleted or replaced
    since; ``release`` (or the process's exit) frees it."""

    def __init__(self, path: str | Path, respect: tuple[Path, ...] = ()):
        self.path = Path(path)
        self.fd: int | None = None
        with _GUARD:
            for other in respect:  # before anything is created here
                held = _probe(other)
                if held is not None:
                    raise held
            fd, key = self._take()
            try:  # another writer that started meanwhile sees this lock, or this one sees its
                for other in respect:
                    held = _probe(other)
                    if held is not None:
                        raise held
            except BaseException:
                os.close(fd)  # not in the table yet: closing gives back what _take took
                raise
            self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")
            self.command = " ".join(sys.argv) or sys.executable
            _HELD[key] = f"process {os.getpid()} on {socket.gethostname()}, started {self.started}: {self.command}"
            self.fd, self.key = fd, key

    def _take(self) -> tuple[int, tuple[int, int]]:
        """Open and lock the file at ``self.path``: the descriptor and the file's key. Called under _GUARD."""
        for _ in range(100):  # another try only when the file was deleted or replaced in the meantime
            held = _held_here(self.path)  # refused before opening the file: closing it would drop the lock
            if held is not None:
                raise held
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            held = _opened(fd, self.path)
            if held is not None:
                raise held
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _holder_of(fd)
                os.close(fd)  # this process holds no lock on the file: closing drops nothing
                if e.errno not in _NOT_FREE:
                    raise
                raise Held(holder, False, self.path) from None
            if _same_file(fd, self.path):  # else the file locked is no longer the one named: lock that one
                return fd, _key(os.fstat(fd))
            os.close(fd)
        raise OSError(errno.EAGAIN, "the lock file keeps being deleted or replaced", str(self.path))

    def write_holder(self) -> None:
        """Write who holds the lock into its file (for the refusal message of the next writer)."""
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": self.started, "command": self.command}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(holder).encode(), 0)

    def lost(self) -> str | None:
        """Why this lock no longer excludes another writer: its file was ``"deleted"``, or ``"deleted or
        replaced"`` (another file is at the path now, which the next writer locks, or has locked: a new lock
        file of a writer that found none); None while it is the file locked.
        A path that cannot be looked at for another reason (EACCES, EIO) is not taken for a lost lock."""
        try:
            here = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return "deleted"
        except OSError:
            return None
        return None if _key(here) == self.key else "deleted or replaced"

    def release(self) -> None:
        with _GUARD:  # closed before the key is freed: a new lock of the file cannot open it in between
            if self.fd is None:
                return
            os.close(self.fd)  # releases the record lock
            for fd in _ALSO_OPEN.pop(self.key, []):
                os.close(fd)
            self.fd = None
            del _HELD[self.key]

    def __del__(self):  # a lock dropped without release (e.g. a Trainer a test never ran): it goes with it
        if getattr(self, "fd", None) is not None:
            self.release()


def writer_lock(folder: str | Path, writer: str) -> ProcessLock:
    """The lock of ``writer`` (a key of WRITERS) on ``folder``, which must exist: Held (its ``path`` naming
    the lock file held) while any writer's lock of the folder is held, by another process or this one."""
    folder = Path(folder)
    own = folder / WRITERS[writer]
    return ProcessLock(own, respect=tuple(folder / name for name in WRITERS.values() if name != own.name))


def folder_writer(folder: str | Path) -> Held | None:
    """Held, naming the holder and its lock file, if a writer's lock of ``folder`` is held (by another process
    or this one); None if none is. Creates nothing: for a refusal before anything is written."""
    with _GUARD:
        for name in WRITERS.values():
            held = _probe(Path(folder) / name)
            if held is not None:
                return held
    return None
