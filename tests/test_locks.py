"""musiclm_stab/locks.py: one lock per file however it is named (hard link, symlinked folder, bind mount), the
writers of a folder (tokenizer, trainer) excluding each other, and a lock that knows when its file was deleted
or replaced under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from musiclm_stab.locks import WRITERS, Held, ProcessLock, writer_lock

# Another process: takes the lock of a writer of a folder, or of one file, reports, holds it until killed
HOLD = textwrap.dedent("""
    import sys, time
    from musiclm_stab.locks import Held, ProcessLock, writer_lock
    kind, path = sys.argv[1], sys.argv[2]
    try:
        lock = ProcessLock(path) if kind == "file" else writer_lock(path, kind)
        lock.write_holder()
    except Held as e:
        print("held", e.holder, flush=True)
        sys.exit(0)
    print("locked", flush=True)
    if len(sys.argv) > 3:
        time.sleep(float(sys.argv[3]))
""")


def try_in_another_process(kind: str, path: Path) -> str:
    """'locked' or 'held ...': what another process gets when it asks for the lock (it lets go at once)."""
    out = subprocess.run([sys.executable, "-c", HOLD, kind, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


class Holder:
    """A process that holds a lock (``kind``: a writer of WRITERS, or "file") until ``stop``."""

    def __init__(self, kind: str, path: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, kind, str(path), "600"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        assert line == "locked\n", line + self.proc.communicate()[0]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.communicate()


def _bind_mount(src: Path, dst: Path) -> bool:
    """``src`` mounted again at ``dst`` (needs root and the right to mount; False where not allowed)."""
    dst.mkdir()
    return subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True).returncode == 0


@pytest.mark.parametrize("alias", ["hard link", "symlinked folder", "bind mount"])
def test_a_second_lock_through_another_name_of_the_file_is_refused(tmp_path, alias):
    """A lock file held in this process and asked for again through another name of the same file (a hard
    link, a path through a symlinked folder, a bind mount of its folder) is refused as held by this process;
    the first lock still holds against another process, and after its release the file can be locked again
    (before: keyed by resolved path, the hard link and the bind mount were granted, and releasing the second
    dropped the first)."""
    real = tmp_path / "real"
    real.mkdir()
    first = ProcessLock(real / ".lock")
    mounted = None
    try:
        if alias == "hard link":
            os.link(real / ".lock", tmp_path / "alias.lock")
            other = tmp_path / "alias.lock"
        elif alias == "symlinked folder":
            (tmp_path / "link").symlink_to(real)
            other = tmp_path / "link" / ".lock"
        else:
            mounted = tmp_path / "mounted"
            if not _bind_mount(real, mounted):
                mounted = None
                pytest.skip("cannot bind-mount here (not root, or no CAP_SYS_ADMIN); the hard link covers the table")
            other = mounted / ".lock"
        with pytest.raises(Held) as refused:
            ProcessLock(other)
        assert refused.value.this_process
        assert try_in_another_process("file", real / ".lock").startswith("held")
        first.release()
        again = ProcessLock(other)
        assert try_in_another_process("file", real / ".lock").startswith("held")
        again.release()
        assert try_in_another_process("file", real / ".lock") == "locked"
    finally:
        first.release()
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], check=True)


@pytest.mark.parametrize("holder_kind, asker_kind", [("train", "tokenize"), ("tokenize", "train")])
def test_a_writer_is_refused_a_folder_another_writer_holds_touching_nothing(tmp_path, holder_kind, asker_kind):
    """A folder whose trainer's lock another process holds is refused to a tokenizer, and the other way
    round, naming the holder (pid, host, command) and its lock file, without creating anything in the folder;
    this process, holding one writer's lock, is refused the other's too. Before, the two locks were different
    files that neither looked at."""
    holder = Holder(holder_kind, tmp_path)
    try:
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(Held) as refused:
            writer_lock(tmp_path, asker_kind)
        e = refused.value
        assert not e.this_process and e.path == tmp_path / WRITERS[holder_kind]
        assert e.holder.startswith(f"process {holder.proc.pid} on ")
        assert f": -c {holder_kind} {tmp_path}" in e.holder, e.holder
        assert sorted(os.listdir(tmp_path)) == before
    finally:
        holder.stop()
    mine = writer_lock(tmp_path, holder_kind)
    mine.write_holder()
    try:
        with pytest.raises(Held) as refused:
            writer_lock(tmp_path, asker_kind)
        assert refused.value.this_process
        assert try_in_another_process(asker_kind, tmp_path).startswith(f"held process {os.getpid()} on ")
    finally:
        mine.release()
    writer_lock(tmp_path, asker_kind).release()


RACE = textwrap.dedent("""
    import os, sys, time
    from musiclm_stab.locks import Held, writer_lock
    kind, folder, go = sys.argv[1], sys.argv[2], sys.argv[3]
    while not os.path.exists(go):
        pass
    try:
        lock = writer_lock(folder, kind)
    except Held:
        print("refused", flush=True)
        sys.exit(0)
    print("locked", flush=True)
    time.sleep(0.3)
""")


def test_two_writers_starting_at_once_never_both_get_a_folder(tmp_path):
    """A tokenizer and a trainer asking for the same folder at the same moment, 15 rounds: never both get it
    (each takes its own lock, then looks at the other's)."""
    for i in range(15):
        folder, go = tmp_path / f"f{i}", tmp_path / f"go{i}"
        folder.mkdir()
        procs = [subprocess.Popen([sys.executable, "-c", RACE, kind, str(folder), str(go)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for kind in ("tokenize", "train")]
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        got = [out.strip() for out, _ in outs]
        assert got.count("locked") <= 1 and set(got) <= {"locked", "refused"}, (i, got)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_lock_knows_when_its_file_was_deleted_or_replaced(tmp_path, how):
    """``lost`` is None while the lock file is the one locked, and says so once it was deleted or replaced by
    another file (what lets a second writer lock the new file); the holder's record is in the file."""
    lock = ProcessLock(tmp_path / ".lock")
    try:
        lock.write_holder()
        assert lock.lost() is None
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        if how == "deleted":
            (tmp_path / ".lock").unlink()
            assert lock.lost() == "deleted"
        else:
            (tmp_path / "new").write_text("{}")
            os.replace(tmp_path / "new", tmp_path / ".lock")
            assert lock.lost() == "deleted or replaced"
        assert try_in_another_process("file", tmp_path / ".lock") == "locked"  # the bypass lost() reveals
    finally:
        lock.release()
