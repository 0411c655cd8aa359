"""Running a script with its children as one process group (a helper of the tests, not collected)."""

from __future__ import annotations

import os
import signal
import subprocess


def run_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a new session; at ``timeout`` the whole
    session is killed (a bash script's python children too, which ``subprocess.run`` would leave running to
    slow every later test, also those in a process group of their own, as `timeout` makes) and the test
    fails with the output so far."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)  # the session: every group in it
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[:2]} still running after {timeout} s\n{out[-2000:]}\n{err[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
