"""Errors writing an output (a full disk, a file size limit, a read-only or failing disk, a file where a
folder should be): faults of the output, never of the input being processed.

A job that reads many inputs and writes their results (``tokenize``, ``features``, ``make-weights``)
records a bad input and goes on; an OS error while writing its output is another matter: every later
write would fail the same way, and blaming the input would lose it (a rerun would not try it again).
So each write path converts such an error, where it happens, into ``OutputWriteError``, which stops the
run with one line naming the path and the reason; the caller adds what was kept and how to go on.
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The reasons whose remedy is more space (a full disk, or a quota).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# The reasons only a write fails with (a read never does): wherever such an error happens in a job that reads
# its inputs and writes an output, it is the output's (``stops_on_write_errors``).
WRITE_ONLY = (*NO_SPACE, errno.EFBIG, errno.EROFS)
# An error that is no OSError but names one: safetensors' SafetensorError ("... (os error 28)").
OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


class OutputWriteError(RuntimeError):
    """Writing an output failed; the message is one line: what could not be written, and why.

    ``path`` is the file or folder, ``errno`` the OS error number (None when unknown). Picklable, so that
    a worker process can raise it to its parent."""

    def __init__(self, message: str, path: str = "", code: int | None = None):
        super().__init__(message)
        self.path, self.errno = path, code

    def advice(self) -> str:
        """What to do before rerunning, as a clause: depends on the reason only."""
        if self.errno in NO_SPACE:
            return "free some space"
        if self.errno == errno.EFBIG:
            return "raise the file size limit (ulimit -f) or write to a file system that allows larger files"
        if self.errno in (errno.ENOTDIR, errno.EEXIST):
            return "move that file or choose another output path"
        return "fix the cause"


def _blocking_file(path: Path) -> Path | None:
    """The nearest ancestor of ``path`` that exists and is not a folder, if one is in the way."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def _free(path: Path) -> str:
    """Free space on the file system of ``path`` (its nearest existing ancestor), for the message."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return f"{shutil.disk_usage(p).free / 2**20:.1f} MB free"
            except OSError:
                return "free space unknown"
    return "free space unknown"


def as_output_error(e: OSError, path: str | Path, what: str = "write") -> OutputWriteError:
    """``e`` (raised while doing ``what`` to ``path``) as an OutputWriteError with a one-line message.

    EFBIG is named as a file size limit, not as a full disk; ENOTDIR names the file in the way. A failed
    rename (two file names) is named by its destination, what could not be put in place."""
    named = getattr(e, "filename2", None) or getattr(e, "filename", None)
    path = Path(named) if named else Path(path)
    reason = (e.strerror or os.strerror(e.errno)) if e.errno else (str(e) or type(e).__name__)
    if e.errno in NO_SPACE:
        reason += f" ({_free(path)})"
    elif e.errno == errno.EFBIG:
        reason += " (the process's file size limit, ulimit -f, or the largest file the file system allows)"
    elif e.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = _blocking_file(path)
        if blocker is not None:
            reason = f"{blocker} is a file, not a folder"
    return OutputWriteError(f"cannot {what} {path}: {reason}", str(path), e.errno)


def check_folder_path(path: str | Path, what: str = "create the output folder") -> None:
    """Raise OutputWriteError (ENOTDIR) when a file stands where a folder of ``path`` must be created: checked
    before any slow work, so that such an output is refused at once."""
    blocker = _blocking_file(Path(path))
    if blocker is not None:
        raise OutputWriteError(f"cannot {what} {path}: {blocker} is a file, not a folder", str(path),
                               errno.ENOTDIR)


def os_error_of(e: BaseException) -> OSError | None:
    """``e`` as an OSError: itself, or the OS error its text names (``OS_ERROR_IN_TEXT``); None for neither."""
    if isinstance(e, OSError):
        return e
    named = OS_ERROR_IN_TEXT.search(str(e))
    if named is None:
        return None
    code = int(named.group(1))
    return OSError(code, os.strerror(code))


def stops_on_write_errors(out: str, then: Callable[[OutputWriteError, Path], str], what: str = "write"):
    """Decorator of a job that writes an output: an error only a write raises (``WRITE_ONLY``: a full disk,
    a quota, a file size limit, a read-only file system), as an OSError or named in another error's text,
    anywhere in the call, becomes an OutputWriteError of one line: what could not be done (``what``) to which
    file (the error's, else the output), why, and ``then(error, output)``: what was kept and what to do.
    ``out``: the name of the parameter that holds the output's path. Other errors pass through as they are."""
    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            output = Path(signature.bind(*args, **kwargs).arguments[out])
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - only write errors are turned into one line, the rest re-raised
                error = e if isinstance(e, OutputWriteError) else os_error_of(e)
                if error is None or error.errno not in WRITE_ONLY:
                    raise
                if not isinstance(error, OutputWriteError):
                    error = as_output_error(error, output, what)
                raise OutputWriteError(f"{error}. {then(error, output)}", error.path, error.errno) from None
        return wrapper
    return decorate


@contextmanager
def writing(path: str | Path, what: str = "write") -> Iterator[None]:
    """Within the block, an OSError with an errno (the OS refused a write) becomes an OutputWriteError
    naming ``path`` (or the error's own file name). OSErrors without one are messages of the code's own
    (e.g. a refusal raised as FileExistsError) and pass through."""
    try:
        yield
    except OutputWriteError:
        raise
    except OSError as e:
        if e.errno is None:
            raise
        raise as_output_error(e, path, what) from e
