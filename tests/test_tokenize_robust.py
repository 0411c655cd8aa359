"""Bad input never stops the tokenizer: every kind is reported with its path, kind and reason; the
silence and minimum-length policies; retrying failures only on request; a track failing mid-unit."""

from __future__ import annotations

import builtins
import io
import json
import os
import struct

import numpy as np
import pytest
import soundfile as sf
import torch

import musiclm_stab.audio.reader as audio_reader
import musiclm_stab.tokenizer.units as units_mod
from musiclm_stab.audio import AudioError, open_audio, scan
from musiclm_stab.data.tokenized import load_tokenized
from musiclm_stab.tokenizer.pipeline import tokenize

SR = 24_000


def _flac_bytes(x: np.ndarray, sr: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="FLAC")
    return buf.getvalue()


def _wav_claiming_more(x: np.ndarray, claimed_frames: int) -> bytes:
    """A 16-bit mono WAV whose data chunk declares ``claimed_frames`` but holds only ``len(x)`` frames."""
    data = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, SR, SR * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", claimed_frames * 2) + data
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + body


def _failures(out) -> dict[str, dict]:
    rows = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    return {r["track"]: r for r in rows}


@pytest.fixture(scope="module")
def bad_corpus(tmp_path_factory, make_music):
    """A folder with two good tracks and one file of every bad kind."""
    synth_music = make_music
    src = tmp_path_factory.mktemp("bad") / "src"
    (src / "sub").mkdir(parents=True)
    music = synth_music(4.0, seed=1)
    sf.write(src / "good.wav", synth_music(1.5, seed=2), SR)  # 2 rows: 1 s + a 0.49 s tail
    sf.write(src / "sub" / "good_stereo44k.flac", synth_music(1.2, seed=3, sr=44_100, channels=2), 44_100)
    (src / "not_audio.wav").write_text("these are not the samples you are looking for\n")
    (src / "image.flac").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (src / "empty.ogg").write_bytes(b"")
    flac = _flac_bytes(music, SR)
    garbage = np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    (src / "corrupt.flac").write_bytes(flac[: len(flac) // 3] + garbage + flac[len(flac) // 3 + 3000 :])
    (src / "truncated.flac").write_bytes(flac[: len(flac) // 2])
    (src / "truncated.wav").write_bytes(_wav_claiming_more(music[:SR], 3 * SR))
    buf = io.BytesIO()
    sf.write(buf, music, SR, format="MP3")
    (src / "truncated.mp3").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    sf.write(src / "header_only.wav", np.zeros(0, dtype=np.float32), SR)
    sf.write(src / "silent.wav", np.zeros(2 * SR, dtype=np.float32), SR)
    sf.write(src / "quiet.wav", np.random.default_rng(0).normal(0, 1e-5, 2 * SR).astype(np.float32), SR,
             subtype="FLOAT")
    sf.write(src / "nan.wav", np.full(SR, np.nan, dtype=np.float32), SR, subtype="FLOAT")
    inf = music[:SR].copy()
    inf[100] = np.inf
    sf.write(src / "inf.wav", inf, SR, subtype="FLOAT")
    sf.write(src / "short.wav", synth_music(0.3, seed=4), SR)
    sf.write(src / "tiny8k.wav", synth_music(0.0125, seed=5, sr=8000), 8000)  # 100 samples -> 300 at 24 kHz
    os.mkfifo(src / "fifo.wav")
    (src / "broken.wav").symlink_to(src / "gone.wav")
    return src


EXPECTED_KINDS = {
    "not_audio.wav": ("not_audio", "not a readable audio file"),
    "image.flac": ("not_audio", "unknown format"),
    "empty.ogg": ("empty", "empty file (0 bytes)"),
    "corrupt.flac": ("corrupt", "corrupt or truncated data"),
    "truncated.flac": ("corrupt", "corrupt or truncated data"),  # libsndfile's FLAC decoder errors out
    "truncated.wav": ("truncated", "declares 3.00 s but the file holds 1.00 s"),
    "truncated.mp3": ("truncated", "the data ends at"),
    "header_only.wav": ("no_samples", "0 samples"),
    "silent.wav": ("silent", "peak -inf dBFS is below the silence threshold -60 dBFS"),
    "quiet.wav": ("silent", "below the silence threshold"),
    "nan.wav": ("non_finite", "24000 of 24000 samples are not finite"),
    "inf.wav": ("non_finite", "1 of 24000 samples are not finite"),
    "short.wav": ("too_short", "0.300 s < min_seconds 0.4 s"),
    "tiny8k.wav": ("too_short", "300 samples at 24 kHz after resampling from 8000 Hz, less than one 320-sample"),
    "fifo.wav": ("unreadable", "not a regular file (a FIFO)"),
    "broken.wav": ("missing", "broken symbolic link"),
}


def test_every_bad_kind_is_reported_and_the_rest_tokenized(bad_corpus, tmp_path, local_weights):
    """16 bad files each land in failures.jsonl with path, kind and reason and are counted by kind;
    the two good files give their 3 rows."""
    out = tmp_path / "out"
    s = tokenize(bad_corpus, out, weights=str(local_weights), segment_seconds=1.0, min_seconds=0.4, workers=0,
                 progress=False)
    assert (s.num_tracks, s.num_rows, s.num_failures) == (2, 3, 16)
    ds, meta = load_tokenized(out)
    assert ds["id"] == ["good.wav@0", "good.wav@24000", "sub/good_stereo44k.flac@0"]
    assert ds["num_frames"] == [75, 37, 75]
    failures = _failures(out)
    assert set(failures) == set(EXPECTED_KINDS)
    for name, (kind, words) in EXPECTED_KINDS.items():
        f = failures[name]
        assert f["kind"] == kind and words in f["reason"], (name, f)
        assert f["path"] == str(bad_corpus / name)
    expected_counts = {}
    for kind, _ in EXPECTED_KINDS.values():
        expected_counts[kind] = expected_counts.get(kind, 0) + 1
    assert s.failures_by_kind == meta["failures_by_kind"] == dict(sorted(expected_counts.items()))


def test_unreadable_file_is_reported(tmp_path, monkeypatch, make_music):
    """A file that cannot be opened (chmod 000) is kind "unreadable". Root reads it anyway, so as root
    the permission error is raised at the same open() call instead."""
    path = tmp_path / "locked.wav"
    sf.write(path, make_music(1.0, seed=6), SR)
    path.chmod(0)
    if os.geteuid() == 0:
        real_open = builtins.open

        def denying_open(file, *args, **kwargs):
            if str(file) == str(path):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(audio_reader, "open", denying_open, raising=False)
    with pytest.raises(AudioError, match="cannot open the file: Permission denied") as e:
        open_audio(path)
    assert e.value.kind == "unreadable" and e.value.path == str(path)


def test_silence_policy_keep_and_silent_segments(tmp_path, local_weights, make_music):
    """silence='skip' drops a silent track (a failure) and a silent segment inside a track (counted);
    silence='keep' tokenizes both."""
    src = tmp_path / "src"
    src.mkdir()
    gap = np.concatenate([make_music(1.0, seed=7), np.zeros(SR, np.float32), make_music(1.0, seed=8)])
    sf.write(src / "gap.wav", gap, SR)
    sf.write(src / "silent.wav", np.zeros(SR, dtype=np.float32), SR)
    kw = dict(weights=str(local_weights), segment_seconds=1.0, workers=0, progress=False)
    skip = tokenize(src, tmp_path / "skip", **kw)
    assert (skip.num_rows, skip.num_silent_segments, skip.failures_by_kind) == (2, 1, {"silent": 1})
    assert load_tokenized(tmp_path / "skip")[0]["id"] == ["gap.wav@0", "gap.wav@48000"]
    keep = tokenize(src, tmp_path / "keep", silence="keep", **kw)
    assert (keep.num_rows, keep.num_silent_segments, keep.num_failures) == (4, 0, 0)
    ds, meta = load_tokenized(tmp_path / "keep")
    assert ds["id"] == ["gap.wav@0", "gap.wav@24000", "gap.wav@48000", "silent.wav@0"]
    assert meta["silence"] == "keep" and np.abs(np.array(ds[3]["pcm"])).max() == 0.0


def test_failures_are_retried_only_on_request(tmp_path, local_weights, make_music):
    """A rerun keeps a recorded failure even after the file is fixed; --retry-failures tokenizes it and
    puts its rows in track order."""
    src = tmp_path / "src"
    src.mkdir()
    sf.write(src / "a.wav", make_music(1.0, seed=9), SR)
    (src / "b.wav").write_text("not yet")
    sf.write(src / "c.wav", make_music(1.0, seed=10), SR)
    kw = dict(weights=str(local_weights), segment_seconds=1.0, workers=0, progress=False)
    assert tokenize(src, tmp_path / "out", **kw).num_failures == 1
    sf.write(src / "b.wav", make_music(1.0, seed=11), SR)  # fixed
    rerun = tokenize(src, tmp_path / "out", **kw)
    assert (rerun.num_failures, rerun.seconds_this_run, rerun.num_rows) == (1, 0.0, 2)
    retried = tokenize(src, tmp_path / "out", retry_failures=True, **kw)
    assert (retried.num_failures, retried.num_rows, retried.seconds_this_run) == (0, 3, 3.0)
    ds, _ = load_tokenized(tmp_path / "out")
    assert ds["track"] == ["a.wav", "b.wav", "c.wav"]
    assert (tmp_path / "out" / "failures.jsonl").read_text() == ""
    assert sorted(p.name for p in (tmp_path / "out" / "parts").iterdir()) == ["u000000.arrow"]


def test_a_track_failing_after_its_rows_were_written_redoes_the_unit(tmp_path, local_weights, make_music,
                                                                      monkeypatch):
    """If a track's decoding breaks in the second pass after some of its rows were written, the unit is
    redone without it: no row of it remains, the others are all there, the failure is recorded."""
    src = tmp_path / "src"
    src.mkdir()
    for name, seed in (("a.wav", 12), ("b.wav", 13), ("c.wav", 14)):
        sf.write(src / name, make_music(2.0, seed=seed), SR)
    real = units_mod.resampled_blocks

    def flaky(reader, block_frames=None):
        for i, block in enumerate(real(reader, SR // 2)):
            if reader.name.endswith("b.wav") and i == 3:
                raise AudioError(reader.name, "disk went away", "unreadable")
            yield block

    monkeypatch.setattr(units_mod, "resampled_blocks", flaky)
    s = tokenize(src, tmp_path / "out", weights=str(local_weights), segment_seconds=0.5, min_seconds=0.1, batch_size=1,
                 workers=0, progress=False)
    ds, _ = load_tokenized(tmp_path / "out")
    assert ds["track"] == ["a.wav"] * 4 + ["c.wav"] * 4
    assert s.failures_by_kind == {"unreadable": 1} and _failures(tmp_path / "out")["b.wav"]["reason"] == \
        "disk went away"


def test_scan_measures_peak_and_length(tmp_path, make_music):
    """scan() reports the source-rate length and the peak of the down-mix; samples_24k is ceil(L * 24/44.1)."""
    x = make_music(1.0, seed=15, sr=44_100, channels=2)
    sf.write(tmp_path / "a.flac", x, 44_100, subtype="PCM_24")
    stats = scan(open_audio(tmp_path / "a.flac"))
    assert stats.frames == 44_100 and stats.samples_24k == 24_000
    assert stats.peak == pytest.approx(np.abs(x.mean(axis=1)).max(), abs=1e-5)
    assert stats.peak_dbfs == pytest.approx(20 * np.log10(stats.peak))
    assert torch.isfinite(torch.tensor(stats.peak_dbfs))


def test_silent_segments_are_counted_only_for_tracks_that_are_used(tmp_path, local_weights, make_music,
                                                                   monkeypatch):
    """num_silent_segments counts the silent segments left out of tracks that were tokenized: not those of
    a track whose only sound lies in its dropped tail (every kept segment silent: a failure), nor of a
    track that breaks in the second pass after a silent segment (a failure)."""
    src = tmp_path / "src"
    src.mkdir()
    sf.write(src / "a_gap.wav", np.concatenate([make_music(1.0, seed=16), np.zeros(SR, np.float32),
                                                make_music(1.0, seed=17)]), SR)  # 1 silent segment of 3
    tail = np.zeros(2 * SR + 7200, np.float32)
    tail[-7200:] = make_music(0.3, seed=18)  # a 0.3 s tail < min_seconds: dropped
    sf.write(src / "b_loud_tail.wav", tail, SR)  # peak above the threshold, both kept segments silent
    sf.write(src / "c_breaks.wav", np.concatenate([np.zeros(SR, np.float32), make_music(2.0, seed=19)]), SR)
    real = units_mod.resampled_blocks

    def breaking(reader, block_frames=None):
        for i, block in enumerate(real(reader, SR // 2)):
            if reader.name.endswith("c_breaks.wav") and i == 3:  # after its silent first segment
                raise AudioError(reader.name, "disk went away", "unreadable")
            yield block

    monkeypatch.setattr(units_mod, "resampled_blocks", breaking)
    s = tokenize(src, tmp_path / "out", weights=str(local_weights), segment_seconds=1.0, min_seconds=0.5,
                 workers=0, progress=False)
    assert s.failures_by_kind == {"silent": 1, "unreadable": 1}
    assert _failures(tmp_path / "out")["b_loud_tail.wav"]["reason"] == \
        "silent: every segment's peak is below -60 dBFS"
    assert (s.num_rows, s.num_silent_segments) == (2, 1)  # old code: 4 (2 of b_loud_tail, 1 of c_breaks)
    assert json.loads((tmp_path / "out" / "tokenizer.json").read_text())["num_silent_segments"] == 1


def test_warnings_about_used_inputs_are_recorded(tmp_path, local_weights, make_music):
    """What the reader finds odd but usable about a track that is tokenized (here a float WAV at 3x full
    scale, scaled down: over_full_scale) goes to warnings.jsonl with track, path, kind and reason, once,
    and is counted by kind in tokenizer.json and in the summary; a failed track adds no warning."""
    src = tmp_path / "src"
    src.mkdir()
    sf.write(src / "a.wav", make_music(1.0, seed=20), SR)
    sf.write(src / "b_loud.wav", 6 * make_music(1.0, seed=21), SR, subtype="FLOAT")  # peak 3.0
    sf.write(src / "c_loud_nan.wav", np.r_[6 * make_music(1.0, seed=22), np.nan].astype(np.float32), SR,
             subtype="FLOAT")
    s = tokenize(src, tmp_path / "out", weights=str(local_weights), segment_seconds=0.5, min_seconds=0.1, workers=0,
                 progress=False)
    assert (s.num_warnings, s.num_failures, s.num_tracks) == (1, 1, 2)
    (row,) = [json.loads(line) for line in (tmp_path / "out" / "warnings.jsonl").read_text().splitlines()]
    assert {k: row[k] for k in ("track", "path", "kind")} == \
        {"track": "b_loud.wav", "path": str(src / "b_loud.wav"), "kind": "over_full_scale"}
    assert row["reason"].startswith("peak 3 (+9.5 dBFS) is above 2")
    meta = json.loads((tmp_path / "out" / "tokenizer.json").read_text())
    assert (meta["num_warnings"], meta["warnings_by_kind"]) == (1, {"over_full_scale": 1})
    assert "1 warnings" in str(s)
