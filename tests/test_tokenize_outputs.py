"""An error writing the tokenizer's output (a full disk, a file size limit, a file in the way) stops the
run with one line naming the path; it is never recorded as a failure of an input, the units committed
stay, and a rerun of the same command finishes with every track."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import soundfile as sf
from datasets.arrow_writer import ArrowWriter
from proc import run_group

import musiclm_stab.tokenizer.store as store_mod
import musiclm_stab.tokenizer.units as units_mod
from musiclm_stab.data.tokenized import load_tokenized
from musiclm_stab.output_errors import OutputWriteError
from musiclm_stab.tokenizer.cli import cli_main
from musiclm_stab.tokenizer.pipeline import tokenize

SR = 24_000
NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


@pytest.fixture(scope="module")
def four_tracks(tmp_path_factory, make_music):
    """4 tracks of 2 s: 192 kB of pcm each in the output."""
    src = tmp_path_factory.mktemp("four") / "src"
    src.mkdir()
    for i in range(4):
        sf.write(src / f"t{i}.wav", make_music(2.0, seed=40 + i), SR)
    return src


def _ids(out) -> list[str]:
    return load_tokenized(out)[0]["id"]


@pytest.fixture(scope="module")
def clean_ids(four_tracks, local_weights, tmp_path_factory) -> list[str]:
    """The row ids of an uninterrupted run over ``four_tracks`` (1 s segments, a unit per track; the batch
    size does not change the rows)."""
    out = tmp_path_factory.mktemp("clean") / "out"
    tokenize(four_tracks, out, weights=str(local_weights), segment_seconds=1.0, part_tracks=1, workers=0,
             progress=False)
    return _ids(out)


class _Disk:
    """Room for ``capacity`` bytes of part files: a write beyond fails as a full disk fails (ENOSPC).

    Installed as the units' ArrowWriter: the real writer, whose file's write() is metered (the disk is
    what is simulated, not the tokenizer)."""

    def __init__(self, capacity: int):
        self.left = capacity

    def writer(self, *args, **kwargs) -> ArrowWriter:
        w = ArrowWriter(*args, **kwargs)
        w.stream = _Metered(w.stream, self)
        return w


class _Metered:
    def __init__(self, stream, disk: _Disk):
        self._stream, self._disk = stream, disk

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._disk.left:
            raise OSError(errno.ENOSPC, NO_SPACE)
        self._disk.left -= n
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_a_full_disk_stops_the_run_and_loses_no_track(four_tracks, clean_ids, tmp_path, local_weights, monkeypatch,
                                                      batch_size):
    """Room for two units' parts: the run stops at the third with OutputWriteError (the part file, "No space
    left on device", what is kept, "free some space"), no failure is recorded, the two units stay, and the
    rerun writes the other two: the rows of an uninterrupted run. Before: with --batch-size 1 the last two
    tracks went to failures.jsonl as input errors and the output was called finished; with 8, an OSError."""
    kw = dict(weights=str(local_weights), segment_seconds=1.0, batch_size=batch_size, part_tracks=1, workers=0,
              progress=False)
    out = tmp_path / "out"
    monkeypatch.setattr(units_mod, "ArrowWriter", _Disk(int(2.5 * 2 * SR * 4)).writer)
    with pytest.raises(OutputWriteError) as e:
        tokenize(four_tracks, out, **kw)
    message = str(e.value)
    assert "\n" not in message and e.value.errno == errno.ENOSPC
    assert message.startswith(f"cannot write {out / 'parts'}/.u000002.")
    assert f"{NO_SPACE} (" in message and "MB free" in message
    assert message.endswith("Tokenizing stopped; the 2 units committed so far are kept: free some space, then rerun "
                            "the same command to continue with the rest")
    assert not (out / "failures.jsonl").exists() and not (out / "tokenizer.json").exists()
    assert sorted(p.name for p in (out / "parts").iterdir()) == ["u000000.arrow", "u000001.arrow"]  # no debris
    monkeypatch.undo()
    s = tokenize(four_tracks, out, **kw)
    assert (s.num_tracks, s.num_failures, s.units_done_before) == (4, 0, 2)
    assert _ids(out) == clean_ids


def test_a_full_disk_at_a_unit_record_stops_the_run(four_tracks, tmp_path, local_weights, monkeypatch):
    """ENOSPC writing the commit record of unit 1 (in the main process, after its part file): the run stops
    with one line naming the record's temporary file; unit 0 stays, the rerun does units 1-3."""
    kw = dict(weights=str(local_weights), segment_seconds=1.0, part_tracks=1, workers=0, progress=False)
    out = tmp_path / "out"
    real_open = open

    def full_at_unit_1(file, mode="r", *args, **kwargs):
        if "w" in mode and os.path.basename(str(file)).startswith(".u000001.json."):
            raise OSError(errno.ENOSPC, NO_SPACE, str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(store_mod, "open", full_at_unit_1, raising=False)
    with pytest.raises(OutputWriteError, match=rf"^cannot write {out}/\.tokenize/units/\.u000001\.json\.\d+\.tmp: "
                       rf"{NO_SPACE} \(.* MB free\)\. Tokenizing stopped; the 1 units committed so far are kept"):
        tokenize(four_tracks, out, **kw)
    assert not (out / "failures.jsonl").exists()
    monkeypatch.undo()
    s = tokenize(four_tracks, out, **kw)
    assert (s.num_tracks, s.num_failures, s.units_done_before) == (4, 0, 1)


def _file_size_limit(limit: int):
    def apply() -> None:  # in the child: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_file_size_limit_is_named_as_such_and_loses_no_track(tmp_path, local_weights, make_music):
    """A real process under a 512 kB file size limit (ulimit -f, RLIMIT_FSIZE) tokenizing with a worker
    process and the default batch size: the 6 s track's part cannot be written (EFBIG); the CLI exits 1
    with one line that names the part and the limit, without the full-disk advice; no failure is
    recorded, and a rerun without the limit tokenizes all 4 tracks. Before: a traceback (or, with
    --batch-size 1, the track recorded as a bad input)."""
    src = tmp_path / "src"
    src.mkdir()
    for i, seconds in enumerate((1.0, 6.0, 1.0, 1.0)):  # t1's part: 576 kB of pcm, the others' 96 kB
        sf.write(src / f"t{i}.wav", make_music(seconds, seed=50 + i), SR)
    out = tmp_path / "out"
    args = [str(src), str(out), "--weights", str(local_weights), "--segment-seconds", "1", "--part-tracks", "1",
            "--workers", "1", "--no-progress"]
    code = "import sys; from musiclm_stab.cli import main; sys.exit(main(sys.argv[1:]))"
    r = run_group([sys.executable, "-c", code, "tokenize", *args], timeout=300, cwd=tmp_path,
                  preexec_fn=_file_size_limit(2**19))
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"musiclm-stab tokenize: cannot write {out / 'parts'}/.u000001.")
    assert os.strerror(errno.EFBIG) in lines[0] and "ulimit -f" in lines[0] and "free some space" not in lines[0]
    assert "then rerun the same command to continue with the rest" in lines[0]
    assert not (out / "failures.jsonl").exists()
    assert cli_main([*args, "--workers", "0"]) == 0
    meta = json.loads((out / "tokenizer.json").read_text())
    assert (meta["num_tracks"], meta["num_failures"]) == (4, 0)


def test_an_output_path_under_a_file_is_one_line(four_tracks, tmp_path, capsys):
    """An output folder whose parent is a file: exit 1 and one line naming the file, at once (before the
    weights are even looked at); before, a NotADirectoryError traceback after loading the model."""
    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "afile" / "out"
    assert cli_main([str(four_tracks), str(out), "--weights", str(tmp_path / "absent.th"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err == (f"musiclm-stab tokenize: cannot create the output folder {out}: {tmp_path / 'afile'} is a file, "
                   "not a folder. Tokenizing stopped before any unit was committed: move that file or choose "
                   "another output path, then rerun the same command\n")


def _mount_tmpfs(where, size: str) -> bool:
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


def test_a_real_full_disk(tmp_path, four_tracks, local_weights):
    """The issue's case on a real small file system (a 512 kB tmpfs; needs the right to mount, else skipped):
    --part-tracks 1 --batch-size 1, a worker process: exit 1 with one line ("No space left on device"), no
    failures.jsonl; after freeing space (the tmpfs made larger) the rerun tokenizes all 4 tracks."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "512k"):
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN): the other tests simulate it")
    try:
        out = disk / "out"
        args = [str(four_tracks), str(out), "--weights", str(local_weights), "--segment-seconds", "1",
                "--part-tracks", "1", "--batch-size", "1", "--no-progress"]
        code = "import sys; from musiclm_stab.cli import main; sys.exit(main(sys.argv[1:]))"
        r = run_group([sys.executable, "-c", code, "tokenize", *args, "--workers", "1"], timeout=300, cwd=tmp_path)
        assert r.returncode == 1, (r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and NO_SPACE in lines[0] and "free some space" in lines[0], r.stderr
        assert lines[0].startswith(f"musiclm-stab tokenize: cannot write {out}/")
        assert not (out / "failures.jsonl").exists()
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        assert cli_main([*args, "--workers", "0"]) == 0
        meta = json.loads((out / "tokenizer.json").read_text())
        assert (meta["num_tracks"], meta["num_failures"]) == (4, 0)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
