"""Resuming: a tokenizer killed with SIGKILL mid-run and started again ends with exactly the output of an
uninterrupted run; debris of a kill is cleaned up; other weights against a partial output are refused."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import soundfile as sf
import torch

from musiclm_stab.data.tokenized import load_tokenized
from musiclm_stab.output_errors import OutputWriteError
from musiclm_stab.tokenizer.lock import OutputBusy
from musiclm_stab.tokenizer.pipeline import tokenize
from musiclm_stab.tokenizer.store import OutputMismatch

SR = 24_000
# tiny tracks, one per work unit, so that a kill lands between commits
ARGS = dict(segment_seconds=0.5, min_seconds=0.1, part_tracks=1, progress=False)
CLI_ARGS = ["--segment-seconds", "0.5", "--min-seconds", "0.1", "--part-tracks", "1", "--no-progress"]
ARGS_STREAM = dict(segment_seconds=0.5, min_seconds=0.1, progress=False, workers=0)


def _rows(path) -> dict[str, list]:
    ds, _ = load_tokenized(path)
    return {c: ds[c] for c in ("id", "track", "start", "num_frames", "codes", "pcm")}


def _assert_same_rows(a: dict, b: dict) -> None:
    assert a["id"] == b["id"] and len(set(a["id"])) == len(a["id"])
    assert a["track"] == b["track"] and a["start"] == b["start"] and a["num_frames"] == b["num_frames"]
    for x, y in zip(a["codes"], b["codes"], strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(a["pcm"], b["pcm"], strict=True):
        np.testing.assert_array_equal(np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.float32))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, make_music):
    """Eight 1.2 s tracks (3 rows each: 2 x 0.49 s + a 0.21 s tail) and a text file posing as audio (unit 6)."""
    src = tmp_path_factory.mktemp("resume") / "src"
    src.mkdir()
    for i in range(8):
        sf.write(src / f"t{i:02d}.wav", make_music(1.2, seed=300 + i), SR)
    (src / "t05_broken.wav").write_text("not audio")
    return src


@pytest.fixture(scope="module")
def reference(corpus, local_weights, tmp_path_factory):
    """The uninterrupted run (in this process)."""
    out = tmp_path_factory.mktemp("reference") / "out"
    tokenize(corpus, out, weights=str(local_weights), workers=0, **ARGS)
    return out


def _alive(pid: int) -> bool:
    """A process that runs (not a zombie); one reaped meanwhile is not alive (no race between two looks)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(predicate, proc, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None and not predicate():
        time.sleep(0.05)
    assert proc.poll() is None, f"finished or failed too early: {proc.stderr.read().decode()[-2000:]}"


def test_sigkill_mid_run_then_rerun_equals_uninterrupted_run(corpus, reference, local_weights, tmp_path):
    """`musiclm-stab tokenize` (2 worker processes) on OUT: while it runs, a second run (tokenize() on OUT)
    raises OutputBusy at once, naming its pid and command; killed with SIGKILL after some units are
    committed it leaves no process behind and no tokenizer.json, and its lock dies with it: the same call
    again finishes with the reference rows (ids, codes, pcm) exactly once each and the same failures.
    (One launch serves both: the refusal is checked before the units the kill waits for.)"""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "musiclm_stab.cli", "tokenize", str(corpus), str(out),
           "--weights", str(local_weights), "--workers", "2", *CLI_ARGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    units = out / ".tokenize" / "units"
    try:
        # a second run on one output fails fast
        lock = out / ".tokenize.lock"
        _wait_for(lambda: lock.is_file() and f'"pid": {proc.pid}' in lock.read_text(), proc)
        t0 = time.monotonic()
        with pytest.raises(OutputBusy, match=rf"being written by process {proc.pid} on .*tokenize {corpus}"):
            tokenize(corpus, out, weights=str(local_weights), workers=0, **ARGS)
        assert time.monotonic() - t0 < 20  # no waiting for the lock (measured ~0.1 s)
        assert proc.poll() is None, "the other run finished before the check: no concurrency was tested"

        # SIGKILL once some units are committed
        deadline, family = time.monotonic() + 600, set()
        while time.monotonic() < deadline and proc.poll() is None:
            family |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            if units.is_dir() and len(list(units.glob("u*.json"))) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"finished or failed before the kill: {proc.stderr.read().decode()[-2000:]}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    done = len(list(units.glob("u*.json")))
    assert 3 <= done < 9 and not (out / "tokenizer.json").exists()
    deadline = time.monotonic() + 30  # the workers die with their parent (PR_SET_PDEATHSIG)
    while time.monotonic() < deadline and any(map(_alive, family)):
        time.sleep(0.1)
    assert family and not any(map(_alive, family))

    # the lock died with its holder: the same call runs and ends with the reference
    summary = tokenize(corpus, out, weights=str(local_weights), workers=0, **ARGS)
    assert summary.units_done_before >= done and summary.num_units == 9
    assert (summary.num_rows, summary.num_failures) == (24, 1)
    _assert_same_rows(_rows(out), _rows(reference))
    assert (out / "failures.jsonl").read_text() == (reference / "failures.jsonl").read_text()
    assert sorted(p.name for p in (out / "parts").iterdir()) == [f"u{k:06d}.arrow" for k in range(9) if k != 6]


def test_kill_debris_and_an_interrupted_finish_are_recovered(corpus, reference, local_weights, tmp_path):
    """A temporary part, a part without its record (a kill between the two renames) and a missing
    tokenizer.json/state.json (a kill while finishing) are all repaired by rerunning: only the
    unrecorded unit is encoded again, and the rows equal the reference."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    (out / "tokenizer.json").unlink()
    (out / "state.json").unlink()
    (out / ".tokenize" / "units" / "u000007.json").unlink()
    (out / "parts" / ".u000003.99999.tmp").write_bytes(b"half a part")
    summary = tokenize(corpus, out, weights=str(local_weights), workers=0, **ARGS)
    assert (summary.units_done_before, summary.seconds_this_run) == (8, 1.2)  # unit 7 only: one track
    _assert_same_rows(_rows(out), _rows(reference))
    assert not list((out / "parts").glob(".*"))


def test_other_weights_or_settings_against_a_partial_output_are_refused(corpus, reference, local_weights,
                                                                        tmp_path):
    """Against an unfinished output, other weights are refused naming the weights' sha256, and other
    settings naming the setting; load_tokenized says the output is unfinished."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    (out / "tokenizer.json").unlink()
    for k in (6, 7, 8):
        (out / ".tokenize" / "units" / f"u{k:06d}.json").unlink()
    with pytest.raises(ValueError, match=r"unfinished tokenization \(6 of 9 work units done\); rerun"):
        load_tokenized(out)
    state = torch.load(local_weights, map_location="cpu", weights_only=True)
    state["quantizer.vq.layers.0._codebook.embed"][0, 0] += 1.0
    other = tmp_path / "other.th"
    torch.save(state, other)
    with pytest.raises(OutputMismatch, match=r"unfinished tokenization.*\n  tokenizer.weights_sha256: '"):
        tokenize(corpus, out, weights=str(other), workers=0, **ARGS)
    with pytest.raises(OutputMismatch, match=r"encode.batch_size: 8 \(existing output\) != 4 \(this run\)"):
        tokenize(corpus, out, weights=str(local_weights), workers=0, batch_size=4, **ARGS)
    job = json.loads((out / ".tokenize" / "job.json").read_text())
    assert job["plan"]["num_tracks"] == 9 and len(job["plan"]["units"]) == 9


def test_the_lock_dies_with_its_holder_even_while_a_child_of_it_lives(tmp_path):
    """A process holding output_lock forks a child (as spawning a worker does, until the child execs) and is
    killed with SIGKILL: the lock is free at once although the child still runs (a BSD flock, shared
    with the child, kept the rerun out); a second lock of one folder in one process is refused too."""
    from musiclm_stab.tokenizer.lock import output_lock

    script = ("import os, sys, time\n"
              "from musiclm_stab.tokenizer.lock import output_lock\n"
              "with output_lock(sys.argv[1]):\n"
              "    pid = os.fork()\n"
              "    if pid == 0:\n"
              "        time.sleep(120)\n"
              "        os._exit(0)\n"
              "    print(pid, flush=True)\n"
              "    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert psutil.pid_exists(child)
        with output_lock(tmp_path / "out"):  # the old lock: OutputBusy until the child exits
            with pytest.raises(OutputBusy, match=f"process {os.getpid()} "):
                with output_lock(tmp_path / "out"):
                    pass
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_refused_second_lock_in_one_process_keeps_the_first(tmp_path):
    """A second output_lock of a held folder in the same process is refused, and the first lock still keeps
    another process out afterwards (closing the refused attempt's descriptor dropped it)."""
    from musiclm_stab.tokenizer.lock import output_lock

    out = tmp_path / "out"
    other = ("import sys\n"
             "from musiclm_stab.tokenizer.lock import OutputBusy, output_lock\n"
             "try:\n"
             "    with output_lock(sys.argv[1]):\n"
             "        print('acquired')\n"
             "except OutputBusy as e:\n"
             "    print('busy:', e)\n")

    def other_process() -> str:
        return subprocess.run([sys.executable, "-c", other, str(out)], capture_output=True, text=True,
                              check=True).stdout

    with output_lock(out):
        for _ in range(2):
            with pytest.raises(OutputBusy, match=f"being written by process {os.getpid()} "):
                with output_lock(out):
                    pass
        assert other_process().startswith(f"busy: {out} is being written by process {os.getpid()} ")
    assert other_process() == "acquired\n"  # released when the block ended


def test_a_run_killed_before_it_wrote_its_job_is_started_afresh(corpus, reference, local_weights, tmp_path):
    """What a run killed between taking the lock and writing .tokenize/job.json leaves (the lock file,
    .tokenize/units/ and an empty parts/, as the old order of making them left) is not taken for a foreign
    folder: the same call starts afresh and ends with the reference rows."""
    out = tmp_path / "out"
    (out / ".tokenize" / "units").mkdir(parents=True)
    (out / "parts").mkdir()
    (out / ".tokenize.lock").write_text("")
    summary = tokenize(corpus, out, weights=str(local_weights), workers=0, **ARGS)
    assert (summary.num_rows, summary.num_failures) == (24, 1)
    _assert_same_rows(_rows(out), _rows(reference))


def test_a_unit_that_raises_in_a_worker_loses_no_finished_unit(corpus, reference, local_weights, tmp_path):
    """Unit 0's part file cannot be put in place (a folder holds its name), so unit 0 raises in its worker
    process: the error reaches the caller, every unit that finished meanwhile is committed (each part file
    written has its record), and once the folder is gone a rerun encodes only the units not committed."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)  # a started output (job.json) with nothing done yet
    (out / "tokenizer.json").unlink()
    for p in [*(out / ".tokenize" / "units").iterdir(), *(out / "parts").iterdir()]:
        p.unlink()
    (out / "parts" / "u000000.arrow").mkdir()
    (out / "parts" / "u000000.arrow" / "in_the_way").write_text("x")
    with pytest.raises(OutputWriteError, match=r"cannot put in place \S*u000000\.arrow: Is a directory"):
        tokenize(corpus, out, weights=str(local_weights), workers=2, **ARGS)
    records = {p.stem for p in (out / ".tokenize" / "units").glob("u*.json")}
    written = {p.stem for p in (out / "parts").glob("u*.arrow") if p.is_file()}
    assert written and written <= records  # old code: the units finishing after the error had no record
    assert "u000000" not in records
    shutil.rmtree(out / "parts" / "u000000.arrow")
    summary = tokenize(corpus, out, weights=str(local_weights), workers=0, **ARGS)
    assert summary.units_done_before == len(records) and summary.num_units == 9
    _assert_same_rows(_rows(out), _rows(reference))


def test_a_resumed_stream_starts_at_its_last_finished_unit(tmp_path, local_weights, make_music, monkeypatch):
    """A streamed job (5 parquet files, one 2-row unit each) stopped after 4 units: the rerun decodes only the
    unfinished unit's 2 rows, does not read the first two files (it resumes the stream where its last
    finished unit began, checked against that unit's audio fingerprint, and skips it) and ends with the
    rows of the uninterrupted run (file 0 is opened once, for the stream's schema). A saved position whose fingerprint does not match falls back to
    reading the stream from the start, with a warning, and the same rows."""
    import datasets

    import musiclm_stab.tokenizer.sources as sources_mod

    rows = []
    for i in range(10):
        buf = io.BytesIO()
        sf.write(buf, make_music(0.6, seed=500 + i, sr=22_050), 22_050, format="FLAC")
        rows.append({"bytes": buf.getvalue(), "path": None})
    ds = datasets.Dataset.from_dict({"audio": rows}).cast_column("audio", datasets.Audio())
    (tmp_path / "stream" / "data").mkdir(parents=True)
    files = [tmp_path / "stream" / "data" / f"train-{k:05d}-of-00005.parquet" for k in range(5)]
    for k, f in enumerate(files):
        ds.shard(5, k, contiguous=True).to_parquet(str(f))
    kw = dict(weights=str(local_weights), streaming=True, part_tracks=2, **ARGS_STREAM)
    reference = tmp_path / "reference"
    tokenize(tmp_path / "stream", reference, **kw)

    opened: list[str] = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0]))
                     if event == "open" and str(args[0]).endswith(".parquet") else None)
    datasets.load_dataset(str(tmp_path / "stream"), split="train", streaming=True)
    at_load = list(opened)  # opening a stream reads the first file's schema: nothing to do with resuming
    decoded: list[str] = []
    real_open_audio = sources_mod.open_audio
    monkeypatch.setattr(sources_mod, "open_audio",
                        lambda src, name=None: decoded.append(name) or real_open_audio(src, name))

    for case in ("resume", "fallback"):
        out = tmp_path / case
        shutil.copytree(reference, out)
        (out / "tokenizer.json").unlink()
        (out / ".tokenize" / "units" / "u000004.json").unlink()  # the run stopped before unit 4
        if case == "fallback":
            path = out / ".tokenize" / "units" / "u000003.json"
            record = json.loads(path.read_text())
            path.write_text(json.dumps({**record, "stream": {**record["stream"], "sha256": "0" * 64}}))
        opened.clear()
        decoded.clear()
        if case == "resume":
            summary = tokenize(tmp_path / "stream", out, **kw)
            assert at_load == [str(files[0])] and opened.count(str(files[0])) == 1, opened
            assert str(files[1]) not in opened, opened  # old code: every file was read again
        else:
            with pytest.warns(RuntimeWarning, match="resuming the stream .* at unit 3 failed .*from the start"):
                summary = tokenize(tmp_path / "stream", out, **kw)
        assert decoded == [f"{tmp_path / 'stream'}[8]", f"{tmp_path / 'stream'}[9]"]
        assert (summary.units_done_before, summary.num_tracks, summary.num_rows) == (4, 10, 20)
        _assert_same_rows(_rows(out), _rows(reference))
