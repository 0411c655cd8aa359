"""Resuming: a tokenizer killed with SIGKILL mid-run and started again ends with exactly the output of an
uninterrupted run; debris of a kill is cleaned up; other weights against a partial output are refused."""

from __future__ import annotations

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

from musiclm_stab.tokenize import OutputMismatch, load_tokenized, tokenize

SR = 24_000
# tiny tracks, one per work unit, so that a kill lands between commits
ARGS = dict(segment_seconds=0.5, min_seconds=0.1, part_tracks=1, progress=False)
CLI_ARGS = ["--segment-seconds", "0.5", "--min-seconds", "0.1", "--part-tracks", "1", "--no-progress"]


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


def test_sigkill_mid_run_then_rerun_equals_uninterrupted_run(corpus, reference, local_weights, tmp_path):
    """`musiclm-stab tokenize` (2 worker processes) killed with SIGKILL after some units are committed
    leaves no process behind and no tokenizer.json; the same command again finishes with the reference
    rows (ids, codes, pcm) exactly once each and the same failures."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "musiclm_stab.cli", "tokenize", str(corpus), str(out),
           "--weights", str(local_weights), "--workers", "2", *CLI_ARGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    units = out / ".tokenize" / "units"
    deadline, family = time.monotonic() + 600, set()
    while time.monotonic() < deadline and proc.poll() is None:
        family |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        if units.is_dir() and len(list(units.glob("u*.json"))) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"finished or failed before the kill: {proc.stderr.read().decode()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(units.glob("u*.json")))
    assert 3 <= done < 9 and not (out / "tokenizer.json").exists()
    deadline = time.monotonic() + 30  # the workers die with their parent (PR_SET_PDEATHSIG)
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                              for p in family):
        time.sleep(0.1)
    assert family and not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in family)

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
