"""The tokenizer's worker processes never outlive it: kill -9 of `musiclm-stab tokenize` at any moment of
its workers' start-up leaves no process behind (they asked for SIGKILL on their parent's death only after
spawn's bootstrap and imports, so a parent killed before that left them waiting for work forever)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import soundfile as sf

SR = 24_000

# Run as a subreaper: the tokenizer's orphans are handed to this process (not to init), so it can list
# them by pid. It starts the command, kills it with SIGKILL `delay` s after its first spawned worker
# appears, then waits up to `settle` s for every process under it to exit, and prints what it saw as JSON.
# Whatever is still alive then is killed, so a failing run leaves nothing behind either.
HARNESS = r"""
import ctypes, json, os, signal, subprocess, sys, time
import psutil

ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
delay, settle, cmd = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
me = psutil.Process()


def alive():
    out = {}
    for p in me.children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = " ".join(p.cmdline())
        except psutil.Error:
            pass
    return out


def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.monotonic() + 300
while proc.poll() is None and time.monotonic() < deadline:
    if any("spawn_main" in c for c in alive().values()):
        break
    time.sleep(0.005)
time.sleep(delay)
at_kill = alive()
finished = proc.poll() is not None
os.kill(proc.pid, signal.SIGKILL)
proc.wait()
t0 = time.monotonic()
while alive() and time.monotonic() - t0 < settle:
    reap()
    time.sleep(0.05)
left = alive()
print(json.dumps({"finished_before_kill": finished, "at_kill": at_kill, "left": left,
                  "seconds_to_empty": None if left else round(time.monotonic() - t0, 2)}))
for pid in left:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
time.sleep(0.5)
reap()
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, make_music):
    """40 tracks of 0.6 s, one per work unit: the workers have work for longer than the latest kill."""
    src = tmp_path_factory.mktemp("orphans") / "audio"
    src.mkdir()
    for i in range(40):
        sf.write(src / f"t{i:02d}.wav", make_music(0.6, seed=300 + i), SR)
    return src


# A worker's first act after spawn's bootstrap is asking for SIGKILL on its parent's death; the bootstrap
# (python and the modules it imports first) took 0.1 s of CPU, 0.3 s at a load of 8 on 2 cores (measured).
# 0.0 and 0.2 s land in or near it (the parent is gone before the request), 0.5 s near its end on a busy
# machine, 2.0 s well after it (the signal kills the worker in its imports, model loading or encoding):
# a delay of 1.0 s tested that last case a second time.
@pytest.mark.parametrize("delay", [0.0, 0.2, 0.5, 2.0])
def test_a_tokenizer_killed_during_worker_start_up_leaves_no_process(corpus, local_weights, tmp_path, delay):
    """`musiclm-stab tokenize --workers 2` killed with SIGKILL `delay` s after its first worker process
    appeared (in spawn's bootstrap, in the imports, loading the model, or encoding): within 60 s (a few
    seconds when idle) no process it started is alive, by pid (workers, resource tracker), though workers
    were alive at the kill."""
    cmd = [sys.executable, "-m", "musiclm_stab.cli", "tokenize", str(corpus), str(tmp_path / "out"),
           "--weights", str(local_weights), "--workers", "2", "--segment-seconds", "0.5", "--min-seconds", "0.1",
           "--part-tracks", "1", "--no-progress"]
    out = subprocess.run([sys.executable, "-c", HARNESS, str(delay), "60", *cmd], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout)
    assert not seen["finished_before_kill"]
    workers = [pid for pid, cmdline in seen["at_kill"].items() if "spawn_main" in cmdline]
    assert workers, f"no worker process was running at the kill: {seen}"
    assert seen["left"] == {}, f"left running after the tokenizer was killed: {seen}"
    print(f"killed {delay} s after the first worker appeared: all gone after {seen['seconds_to_empty']} s")
