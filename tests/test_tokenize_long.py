"""Long recordings: a long lossless track is cut into pieces (units of its segments) that several workers
encode, with the rows, order, failures and counts of an unsplit run, and an exact resume after kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import soundfile as sf

import musiclm_stab.audio.reader as audio_reader
from musiclm_stab.data.tokenized import load_tokenized
from musiclm_stab.tokenizer.merge import merge_shards
from musiclm_stab.tokenizer.pipeline import tokenize

# batches of 2 segments: pieces hold whole batches, so pieces of 1 s and more fit these short tracks
KW = dict(segment_seconds=0.5, min_seconds=0.1, batch_size=2, progress=False)


def _rows(path) -> dict[str, list]:
    ds, _ = load_tokenized(path)
    return {c: ds[c] for c in ("id", "track", "start", "num_frames", "codes", "pcm")}


def _assert_same_rows(a: dict, b: dict) -> None:
    """The same rows in the same order: ids, starts, and pcm and codes bit for bit."""
    assert a["id"] == b["id"] and len(set(a["id"])) == len(a["id"])
    assert a["track"] == b["track"] and a["start"] == b["start"] and a["num_frames"] == b["num_frames"]
    for x, y in zip(a["codes"], b["codes"], strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(a["pcm"], b["pcm"], strict=True):
        np.testing.assert_array_equal(np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.float32))


def _plan(out) -> list[list]:
    return json.loads((out / ".tokenize" / "job.json").read_text())["plan"]["units"]


@pytest.fixture(scope="module")
def rates_src(tmp_path_factory, make_music):
    """4.2 s stereo tracks at rates whose resampler frames do and do not divide the decode block, a 24 kHz
    one (no resampling), a float WAV (not split: its gain depends on the whole track) and a short track
    (not split). With the test's 0.7 s blocks, int(0.7 * rate) frames: 44101 Hz (resampled as 44.1 kHz, 147
    frames in, 80 out) has blocks of 30870 = 210 x 147 frames, so its pieces read from the block before
    theirs; 44.1 and 22.05 kHz have blocks of 30869 and 15434 frames (0.7 * rate rounds down), not whole
    resampler frames, so theirs read from the start of the track."""
    src = tmp_path_factory.mktemp("rates") / "src"
    src.mkdir()
    for name, sr in (("a44k.flac", 44_100), ("b22k.flac", 22_050), ("c44101.wav", 44_101), ("d24k.wav", 24_000)):
        sf.write(src / name, make_music(4.2, seed=sr % 101, sr=sr, channels=2), sr)
    sf.write(src / "e_float.wav", make_music(4.2, seed=7), 24_000, subtype="FLOAT")
    sf.write(src / "f_short.flac", make_music(1.3, seed=8), 24_000)
    return src


def test_pieces_read_from_mid_file_give_the_rows_of_an_unsplit_run(rates_src, local_weights, tmp_path,
                                                                  monkeypatch):
    """With 0.7 s decode blocks, pieces of 1 s start mid-file (seek) at every sample rate; their rows equal
    an unsplit run's bit for bit, in the same order and with the same counts; the float and the short
    track stay whole units; shards (which take whole tracks) and their merge give the same rows."""
    monkeypatch.setattr(audio_reader, "BLOCK_SECONDS", 0.7)  # in this process: workers=0
    kw = dict(weights=str(local_weights), workers=0, **KW)
    whole = tokenize(rates_src, tmp_path / "whole", piece_seconds=None, **kw)
    split = tokenize(rates_src, tmp_path / "split", piece_seconds=1.0, **kw)
    plan = _plan(tmp_path / "split")
    # 8 segments + a tail; the pieces start in decode blocks 1, 2 and 4 from 0 (0.99, 1.97 and 2.96 s)
    assert plan[:4] == [[0, 1, 0, 2], [0, 1, 2, 4], [0, 1, 4, 6], [0, 1, 6, None]]
    assert [u for u in plan if u[0] >= 4] == [[4, 2]]  # the float WAV and the short track: one unit
    assert (split.num_units, whole.num_units) == (17, 1)
    _assert_same_rows(_rows(tmp_path / "split"), _rows(tmp_path / "whole"))
    assert (split.num_rows, split.num_tracks, split.total_seconds) == \
        (whole.num_rows, whole.num_tracks, whole.total_seconds)

    for i in range(2):
        tokenize(rates_src, tmp_path / f"shard{i}", piece_seconds=1.0, shard=f"{i}/2", **kw)
    shards = [tmp_path / f"shard{i}" for i in range(2)]
    for out in shards:  # whole tracks per shard: every piece of track 0 in shard 0, of track 1 in shard 1
        tracks = {json.loads(p.read_text())["first"] for p in (out / ".tokenize" / "units").iterdir()}
        assert tracks in ({0, 2, 4}, {1, 3})
    _assert_same_rows(_rows(shards), _rows(tmp_path / "whole"))
    merge_shards(tmp_path / "merged", shards)
    _assert_same_rows(_rows(tmp_path / "merged"), _rows(tmp_path / "whole"))


@pytest.fixture(scope="module")
def long_src(tmp_path_factory, make_music):
    """One 16 s 44.1 kHz stereo FLAC: with 3 s pieces, 5 units, the last read from mid-file (10 s decode
    blocks: it starts in block 2, at 11.8 s, so it reads from block 1 on)."""
    src = tmp_path_factory.mktemp("long") / "src"
    src.mkdir()
    sf.write(src / "concert.flac", make_music(16.0, seed=33, sr=44_100, channels=2), 44_100)
    return src


@pytest.fixture(scope="module")
def unsplit(long_src, local_weights, tmp_path_factory):
    """The track tokenized as one unit, in this process."""
    out = tmp_path_factory.mktemp("unsplit") / "out"
    tokenize(long_src, out, weights=str(local_weights), workers=0, piece_seconds=None, **KW)
    return out


def test_kill_9_while_a_long_track_is_in_pieces_then_rerun_equals_unsplit(long_src, unsplit, local_weights,
                                                                          tmp_path):
    """One long track, 2 worker processes: it becomes 5 units (pieces), each encoded in a worker process.
    `musiclm-stab tokenize --workers 2 --piece-seconds 3` killed with SIGKILL after some pieces are
    committed, then run again (here in this process, with 2 worker processes again), ends with the rows of
    the unsplit run exactly once each. (Which worker gets which piece is the scheduler's choice: a worker
    still loading its model may get none, so the test does not require two distinct pids.)"""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "musiclm_stab.cli", "tokenize", str(long_src), str(out), "--weights",
           str(local_weights), "--workers", "2", "--segment-seconds", "0.5", "--min-seconds", "0.1",
           "--piece-seconds", "3", "--batch-size", "2", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    units = out / ".tokenize" / "units"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None and \
            not (units.is_dir() and len(list(units.glob("u*.json"))) >= 2):
        time.sleep(0.05)
    assert proc.poll() is None, f"finished or failed before the kill: {proc.stderr.read().decode()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(units.glob("u*.json")))
    assert 2 <= done < 5 and not (out / "tokenizer.json").exists()
    s = tokenize(long_src, out, weights=str(local_weights), workers=2, piece_seconds=3.0, **KW)
    assert _plan(out) == [[0, 1, 0, 6], [0, 1, 6, 12], [0, 1, 12, 18], [0, 1, 18, 24], [0, 1, 24, None]]
    records = [json.loads(p.read_text()) for p in units.glob("u*.json")]
    assert (s.units_done_before, s.num_units, len(records)) == (done, 5, 5)  # old code: one unit, one process
    assert all(r["pid"] not in (os.getpid(), proc.pid) for r in records)  # the killed run's workers, then ours
    _assert_same_rows(_rows(out), _rows(unsplit))


def test_a_long_track_is_judged_whole_from_its_pieces(tmp_path, local_weights, make_music):
    """The track-level verdicts of an unsplit run hold for a track in pieces: a track damaged in one part
    gives one failure and no rows (the other pieces' rows are left out), a silent track and one whose only
    sound is in its dropped tail fail as silent with the unsplit run's reasons; the rest of the output
    and its counts are the unsplit run's."""
    src = tmp_path / "src"
    src.mkdir()
    music = make_music(3.2, seed=40)  # 6 segments and a tail: 3 pieces of 1 s
    # "silent" files hold noise at -80 dBFS: FLACs of digital silence are too small to be looked at as long
    floor = np.random.default_rng(0).normal(0, 1e-4, len(music)).astype(np.float32)
    sf.write(src / "a_good.flac", music, 24_000)
    sf.write(src / "b_silent.flac", floor, 24_000)
    seg = 11_840  # 0.5 s rounded down to whole 320-sample frames
    tail = floor[: 6 * seg + 960].copy()  # 6 silent segments, then a 0.04 s tail < min_seconds
    tail[-960:] = music[:960]
    sf.write(src / "c_loud_tail.flac", tail, 24_000)
    gap = music.copy()
    gap[3 * seg : 5 * seg] = floor[: 2 * seg]  # segments 3 and 4 silent: left out
    sf.write(src / "d_gap.flac", gap, 24_000)
    flac = (src / "a_good.flac").read_bytes()
    cut = len(flac) * 2 // 3
    (src / "e_damaged.flac").write_bytes(flac[:cut] + bytes(3000) + flac[cut + 3000:])
    kw = dict(weights=str(local_weights), workers=0, **KW)
    whole = tokenize(src, tmp_path / "whole", piece_seconds=None, **kw)
    split = tokenize(src, tmp_path / "split", piece_seconds=1.0, **kw)
    assert split.num_units == 15  # 5 tracks of 3 pieces
    _assert_same_rows(_rows(tmp_path / "split"), _rows(tmp_path / "whole"))
    for key in ("num_rows", "num_tracks", "num_failures", "failures_by_kind", "num_silent_segments"):
        assert getattr(split, key) == getattr(whole, key), key
    assert split.failures_by_kind == {"corrupt": 1, "silent": 2} and split.num_silent_segments == 2

    def failures(out) -> dict[str, dict]:
        return {f["track"]: f for f in map(json.loads, (out / "failures.jsonl").read_text().splitlines())}

    a, b = failures(tmp_path / "whole"), failures(tmp_path / "split")
    assert list(a) == list(b) == ["b_silent.flac", "c_loud_tail.flac", "e_damaged.flac"]
    assert a["b_silent.flac"] == b["b_silent.flac"] and a["c_loud_tail.flac"] == b["c_loud_tail.flac"]
    assert b["e_damaged.flac"]["kind"] == "corrupt" and "(in the part from" in b["e_damaged.flac"]["reason"]

    (src / "e_damaged.flac").write_bytes(flac)  # repaired: --retry-failures runs all its pieces again
    retried = tokenize(src, tmp_path / "split", piece_seconds=1.0, retry_failures=True, **kw)
    assert retried.failures_by_kind == {"silent": 2} and retried.num_tracks == whole.num_tracks + 1
    ids = load_tokenized(tmp_path / "split")[0]["id"]
    assert ids[-7:] == [f"e_damaged.flac@{i * 11_840}" for i in range(7)]  # 6 segments and the tail
