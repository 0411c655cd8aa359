"""Folders the tests cannot read, also as root (a helper of the tests, not collected).

Root reads a mode-000 folder anyway: it holds CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, which skip the
kernel's permission checks. ``permissions_apply()`` takes both out of the calling thread's effective
set for a block (the capset system call; the permitted set keeps them, so they come back after), so
that the kernel really refuses what the mode bits refuse, as it does for any other user. Not root:
nothing to do, the checks apply already.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

_SYSCALLS = {"x86_64": (125, 126), "aarch64": (90, 91)}  # capget, capset
_VERSION_3 = 0x20080522
_DAC = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextmanager
def permissions_apply() -> Iterator[None]:
    """Within the block this thread is refused what the mode bits refuse, also as root."""
    if os.geteuid() != 0:
        yield
        return
    if platform.machine() not in _SYSCALLS:
        pytest.skip(f"running as root on {platform.machine()}: no capset syscall number known here")
    capget, capset = _SYSCALLS[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _Header(_VERSION_3, 0), (_Data * 2)()
    if libc.syscall(capget, ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    before = data[0].effective
    data[0].effective &= ~_DAC
    if libc.syscall(capset, ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    try:
        yield
    finally:
        data[0].effective = before
        if libc.syscall(capset, ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capset (restoring the capabilities) failed")


@contextmanager
def locked_folder(path: os.PathLike) -> Iterator[None]:
    """``path`` at mode 000 within the block (then 755 again, so that the test's cleanup can delete it),
    with ``permissions_apply``; checks that listing it is refused indeed."""
    os.chmod(path, 0)
    try:
        with permissions_apply():
            with pytest.raises(PermissionError):
                os.listdir(path)
            yield
    finally:
        os.chmod(path, 0o755)
