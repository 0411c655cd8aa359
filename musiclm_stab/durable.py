"""Making a written file, and the directory entry that names it, survive a power loss.

``os.fsync`` of a file puts its data on disk, but not its name: a file created or renamed into place
lives in its directory's entries, which reach the disk only when the directory itself is fsynced. A
rename that makes a write count (a checkpoint moved into place, a tokenizer file or part renamed over
its temporary name) is therefore followed by ``fsync_dir`` of the directory it happened in; until then a
power loss may undo the rename, or keep it while losing what it named.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

# What fsync of a directory raises on file systems that cannot sync one (some network and FUSE file
# systems): their renames are as durable as the file system makes them, and there is nothing more to do.
_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS)


def fsync_file(path: str | Path) -> None:
    """Put a file's data on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Put a directory's entries (files created, renamed or removed in it) on disk.

    A file system that cannot sync a directory gets a warning naming it, not an error: the rename already
    happened and cannot be made more durable there."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
        warnings.warn(f"{path}: this file system cannot fsync a directory ({e.strerror}); a power loss may "
                      "undo the latest renames in it", stacklevel=2)
    finally:
        os.close(fd)
