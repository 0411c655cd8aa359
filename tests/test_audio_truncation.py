"""Audio that is cut short, damaged in its header, or legal but odd: never kept silently, never refused
when it plays whole. Every file is written here by soundfile (libsndfile) and then cut or edited by the
test; each is read as the tokenizer reads it (``open_audio`` -> ``scan`` -> ``resampled_blocks``).

libsndfile writes every format ``list_audio_files`` accepts (wav, flac, ogg, mp3, aiff/aif, au): MP3
needs libsndfile >= 1.1 built with mpeg support, which soundfile's bundled 1.2.2 has (the test checks
``available_formats`` and fails, rather than skips, if a build lacks it).
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from musiclm_stab.audio import (
    AUDIO_EXTENSIONS,
    AudioError,
    decode_bytes,
    from_array,
    list_audio_files,
    load_audio,
    open_audio,
    resampled_blocks,
    scan,
)
from musiclm_stab.audio.reader import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, loose_tolerance

SR = 24_000
SECONDS = 6.0

# (file name, soundfile format, subtype, kinds a cut file may fail as). The container formats and Ogg are
# judged from their headers (truncated, always); FLAC and MP3 by their decoders: a cut inside a frame is a
# decoding error (corrupt, "corrupt or truncated data"), a cut between frames a short decode (truncated).
FORMATS = [
    ("plain.wav", "WAV", "PCM_16", {"truncated"}),
    ("extensible.wav", "WAVEX", "PCM_24", {"truncated"}),  # WAVE_FORMAT_EXTENSIBLE: 24-bit, multichannel
    ("rf64.wav", "RF64", "PCM_16", {"truncated"}),  # RF64 files carry the .wav name (EBU Tech 3306)
    ("wave64.w64", "W64", "PCM_16", {"truncated"}),  # .w64 is not listed by list_audio_files: opened by path
    ("track.aiff", "AIFF", "PCM_16", {"truncated"}),
    ("float.aif", "AIFF", "FLOAT", {"truncated"}),  # AIFF-C (fl32)
    ("track.au", "AU", "PCM_16", {"truncated"}),
    ("vorbis.ogg", "OGG", "VORBIS", {"truncated"}),
    ("opus.ogg", "OGG", "OPUS", {"truncated", "corrupt"}),  # header pages alone: libsndfile cannot open it
    ("track.flac", "FLAC", "PCM_16", {"truncated", "corrupt"}),
    ("track.mp3", "MP3", "MPEG_LAYER_III", {"truncated", "corrupt"}),
]


def written(music: np.ndarray, fmt: str, subtype: str, sr: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, music, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def audio_start(data: bytes, fmt: str, subtype: str, sr: int) -> int:
    """Bytes of ``data`` before its first audio byte: the header (FLAC metadata blocks, Ogg header pages,
    the MP3 Xing/Info frame, or what libsndfile writes for a file of no samples)."""
    if fmt == "FLAC":
        pos = 4
        while True:
            last, n = data[pos] & 0x80, int.from_bytes(data[pos + 1 : pos + 4], "big")
            pos += 4 + n
            if last:
                return pos
    if fmt == "OGG":
        pos = 0
        while struct.unpack("<q", data[pos + 6 : pos + 14])[0] <= 0:  # header pages have granule 0
            segments = data[pos + 26]
            pos += 27 + segments + sum(data[pos + 27 : pos + 27 + segments])
        return pos
    if fmt == "MP3":
        assert data[:2] == b"\xff\xf3", "an MPEG-2 layer III frame first (24 kHz), no ID3 tag"
        kbps = [0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160][data[2] >> 4]
        return 72_000 * kbps // sr + (data[2] >> 1 & 1)
    return len(written(np.zeros((0, 2), np.float32), fmt, subtype, sr))


def read_as_tokenizer(source: Path | bytes, name: str | None = None):
    """(scan's stats, the 24 kHz waveform [S]), both passes the tokenizer makes."""
    with open_audio(source, name) as reader:
        stats = scan(reader)
        return stats, torch.cat(list(resampled_blocks(reader)))


def test_the_formats_cover_what_list_audio_files_accepts():
    """Every extension list_audio_files accepts has a format in FORMATS, and libsndfile writes them all."""
    assert {Path(name).suffix for name, *_ in FORMATS} >= set(AUDIO_EXTENSIONS)
    assert "MP3" in sf.available_formats(), "this libsndfile cannot write MP3 (needs >= 1.1 with mpeg)"


@pytest.mark.parametrize("name,fmt,subtype,kinds", FORMATS, ids=[f[0] for f in FORMATS])
def test_cut_files_are_refused_in_every_format(tmp_path, make_music, name, fmt, subtype, kinds):
    """The whole file is kept as written; cut just after its header or at 10%, 40% or 90% of its bytes it is
    refused with a kind and a reason naming the file, from a path and from bytes alike."""
    sr = 48_000 if subtype == "OPUS" else SR  # Opus runs at 48 kHz
    music = make_music(SECONDS, seed=7, sr=sr, channels=2)
    data = written(music, fmt, subtype, sr)
    whole = tmp_path / name
    whole.write_bytes(data)
    stats, wave = read_as_tokenizer(whole)
    lossless = fmt not in ("OGG", "MP3")
    assert stats.warnings == [] and (stats.frames == len(music) if lossless else
                                     abs(stats.frames - len(music)) <= loose_tolerance(len(music), sr))
    if lossless:
        torch.testing.assert_close(wave, load_audio(whole))

    start = audio_start(data, fmt, subtype, sr)
    assert 0 < start < len(data) // 10, start
    for cut in sorted({start, len(data) // 10, 4 * len(data) // 10, 9 * len(data) // 10}):
        path = tmp_path / f"cut{cut}_{name}"
        path.write_bytes(data[:cut])
        with pytest.raises(AudioError) as e:
            read_as_tokenizer(path)
        assert e.value.kind in kinds and e.value.path == str(path) in str(e.value), (cut, e.value)
        with pytest.raises(AudioError) as b:  # libsndfile opens a cut MP3 from memory less readily: corrupt
            read_as_tokenizer(data[:cut], f"row {cut}")
        assert b.value.kind in kinds and b.value.path == f"row {cut}", (cut, b.value)


def _with_chunk_before_data(wav: bytes, chunk: bytes) -> bytes:
    """A canonical RIFF WAV (fmt, then data at byte 36) with ``chunk`` inserted before its data chunk."""
    assert wav[36:40] == b"data"
    body = wav[8:36] + chunk + wav[36:]
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_wav_with_large_chunk_before_data(tmp_path, make_music):
    """A WAV whose data starts past 100 KiB of metadata (cover art) is read whole, and cut at 40% or 90%
    it is truncated: the chunks are walked by seeking, not looked for in the first 64 KiB."""
    music = make_music(SECONDS, seed=8, channels=2)
    art = b"LIST" + struct.pack("<I", 100 * 1024) + b"INFO" + bytes(100 * 1024 - 4)
    data = _with_chunk_before_data(written(music, "WAV", "PCM_16", SR), art)
    (tmp_path / "art.wav").write_bytes(data)
    stats, _ = read_as_tokenizer(tmp_path / "art.wav")
    assert stats.frames == len(music) and stats.warnings == []
    assert data.index(b"data") > 100 * 1024
    for fraction in (4, 9):
        path = tmp_path / f"art_{fraction}0.wav"
        path.write_bytes(data[: fraction * len(data) // 10])
        with pytest.raises(AudioError, match=r"WAV header declares 6\.00 s but the file holds \d\.\d\d s") \
                as e:
            read_as_tokenizer(path)
        assert e.value.kind == "truncated" and e.value.path == str(path)


def _wav_with_rate(music: np.ndarray, rate: int) -> bytes:
    """A 16-bit WAV of ``music`` whose header declares ``rate`` Hz (and the byte rate that goes with it)."""
    data = bytearray(written(music, "WAV", "PCM_16", SR))
    struct.pack_into("<II", data, 24, rate, (2 * rate) & 0xFFFFFFFF)
    return bytes(data)


@pytest.mark.parametrize("rate", [1_000_000_100, 768_001, 999, 1])
def test_sample_rate_outside_the_accepted_range_is_named(tmp_path, make_music, rate):
    """A WAV declaring 1,000,000,100 Hz (the resampler would want ~10 GB), 1 Hz (2 s of samples would
    become 13 hours) or just outside 1 kHz..768 kHz fails as bad_sample_rate naming the file and the rate."""
    path = tmp_path / f"rate_{rate}.wav"
    path.write_bytes(_wav_with_rate(make_music(0.05, seed=9), rate))
    with pytest.raises(AudioError, match=rf"sample rate {rate} Hz is outside 1000\.\.768000 Hz") as e:
        load_audio(path)
    assert (e.value.kind, e.value.path) == ("bad_sample_rate", str(path))
    with pytest.raises(AudioError) as a:
        from_array(make_music(0.05, seed=9), rate, "row 4")
    assert (a.value.kind, a.value.path) == ("bad_sample_rate", "row 4")


def test_sample_rates_at_the_bounds_are_accepted(tmp_path, make_music):
    """1 kHz and 768 kHz, the documented bounds, decode (to 24x and 1/32 as many samples at 24 kHz)."""
    assert (MIN_SAMPLE_RATE, MAX_SAMPLE_RATE) == (1_000, 768_000)
    for rate, expected in ((1_000, 1200 * 24), (768_000, -(-1200 // 32))):
        path = tmp_path / f"rate_{rate}.wav"
        path.write_bytes(_wav_with_rate(make_music(0.05, seed=9), rate))  # 1200 samples
        assert load_audio(path).shape == (expected,)


def test_streamed_wav_and_pipe_encoded_flac_decode_whole(tmp_path, make_music):
    """A WAV whose data size is 0 (written to a pipe) and a FLAC whose STREAMINFO has no sample count,
    frame sizes or MD5 (a pipe encoder's) decode to every sample written; such a FLAC cut short is corrupt,
    and an empty WAV stays no_samples."""
    music = make_music(3.0, seed=10, channels=2)
    wav = bytearray(written(music, "WAV", "PCM_16", SR))
    struct.pack_into("<I", wav, 40, 0)  # data size
    struct.pack_into("<I", wav, 4, 0)  # and RIFF size, as a streaming writer leaves them
    flac = bytearray(written(music, "FLAC", "PCM_16", SR))
    assert flac[4] & 0x7F == 0 and flac[8:12] != bytes(4)  # STREAMINFO first
    flac[12:18] = bytes(6)  # min and max frame size: unknown
    flac[21] &= 0xF0  # the 36-bit sample count ...
    flac[22:26] = bytes(4)  # ... 0: unknown
    flac[26:42] = bytes(16)  # MD5: not computed
    reference = torch.from_numpy(music.mean(axis=1))
    for name, data in (("streamed.wav", bytes(wav)), ("pipe.flac", bytes(flac))):
        (tmp_path / name).write_bytes(data)
        stats, wave = read_as_tokenizer(tmp_path / name)
        assert stats.frames == len(music) and stats.warnings == [], name
        torch.testing.assert_close(wave, reference, atol=1 / 32768, rtol=0)  # 16-bit
        assert torch.equal(decode_bytes(data, name), wave)
        with open_audio(tmp_path / name) as reader:  # later passes reopen it with the same length
            first, second = (np.concatenate(list(reader.blocks(SR))) for _ in range(2))
        assert len(first) == len(music) and np.array_equal(first, second)

    cut = bytes(flac[: 6 * len(flac) // 10])  # a pipe-encoded FLAC cut short has no length to compare
    with pytest.raises(AudioError, match="does not end with a whole frame") as e:
        decode_bytes(cut, "pipe_cut.flac")
    assert e.value.kind == "corrupt"

    empty = written(np.zeros((0, 2), np.float32), "WAV", "PCM_16", SR)
    listed = empty + b"LIST" + struct.pack("<I", 4) + b"INFO"  # a real empty data chunk, then metadata
    for data in (empty, listed):
        with pytest.raises(AudioError, match="0 samples") as e:
            decode_bytes(data, "empty.wav")
        assert e.value.kind == "no_samples"


def test_tokenizer_reads_streamed_and_pipe_encoded_files(tmp_path, local_weights, make_music):
    """The tokenizer keeps a streamed WAV and a pipe-encoded FLAC long enough to be cut into pieces; each
    is read whole (its length is known only once opened) and gives the rows of the same file with its
    length stated, which is split into pieces (2 s: two pieces of 1 s)."""
    from musiclm_stab.data.tokenized import load_tokenized
    from musiclm_stab.tokenizer.pipeline import tokenize
    from musiclm_stab.tokenizer.plan import track_pieces
    from musiclm_stab.tokenizer.sources import TrackRef

    music = make_music(2.0, seed=11)
    src = tmp_path / "src"
    src.mkdir()
    flac = bytearray(written(music, "FLAC", "PCM_16", SR))
    (src / "flac_stated.flac").write_bytes(bytes(flac))
    flac[21] &= 0xF0
    flac[22:26] = bytes(4)
    (src / "flac_pipe.flac").write_bytes(bytes(flac))
    wav = bytearray(written(music, "WAV", "PCM_16", SR))
    (src / "wav_stated.wav").write_bytes(bytes(wav))
    struct.pack_into("<I", wav, 40, 0)
    (src / "wav_streamed.wav").write_bytes(bytes(wav))
    pieces = {p.name: track_pieces(TrackRef(0, p.name, str(p), p.stat().st_size, str(p)), SR, 1.0)
              for p in src.iterdir()}
    assert pieces == {"flac_stated.flac": [(0, 1), (1, None)], "flac_pipe.flac": [],
                      "wav_stated.wav": [(0, 1), (1, None)], "wav_streamed.wav": []}
    s = tokenize(src, tmp_path / "out", weights=str(local_weights), segment_seconds=1.0, min_seconds=0.5,
                 batch_size=1, piece_seconds=1.0, workers=0, progress=False)
    assert (s.num_tracks, s.num_failures) == (4, 0)
    ds, _ = load_tokenized(tmp_path / "out")
    rows = {t: [(r["start"], r["pcm"], r["codes"]) for r in ds if r["track"] == t] for t in set(ds["track"])}
    assert len(rows["flac_stated.flac"]) == 2 and rows["flac_pipe.flac"] == rows["flac_stated.flac"]
    assert len(rows["wav_stated.wav"]) == 2 and rows["wav_streamed.wav"] == rows["wav_stated.wav"]


def test_loose_length_tolerance_is_absolute():
    """OGG/MP3 may fall short by 0.5 s at most, whatever the length, and by 5% at most below 10 s."""
    assert loose_tolerance(3600 * 44_100, 44_100) == 22_050  # one hour: 0.5 s, not 1% (36 s)
    assert loose_tolerance(10 * SR, SR) == SR // 2
    assert loose_tolerance(4 * SR, SR) == 4 * SR // 20  # 0.2 s
    assert loose_tolerance(SR // 2, SR) == SR // 40


def test_long_mp3_short_by_under_one_percent_is_truncated(tmp_path, make_music):
    """A 110 s MP3 whose last ~0.8 s (0.7%) are cut off is truncated: the old max(0.5 s, 1%) rule kept it
    (1.1 s allowed) with a length_mismatch warning."""
    sr = 8_000  # MPEG-2.5: a small, fast file; the tolerance is in seconds of the file's own rate
    data = written(make_music(110.0, seed=12, sr=sr), "MP3", "MPEG_LAYER_III", sr)
    path = tmp_path / "long.mp3"
    path.write_bytes(data[: len(data) - int(len(data) * 0.8 / 110)])
    with sf.SoundFile(path) as f:
        declared, decoded = f.frames, len(f.read(dtype="float32"))
    assert 0.6 * sr < declared - decoded < 1.0 * sr < 0.01 * declared  # premise: over 0.5 s, under 1%
    with pytest.raises(AudioError, match=r"more than the 0\.50 s allowed for MP3") as e:
        read_as_tokenizer(path)
    assert e.value.kind == "truncated"


def test_make_weights_and_features_report_a_bad_rate_and_go_on(tmp_path, make_music):
    """A WAV declaring 1,000,000,100 Hz next to a good file: make-weights and features finish with the good
    file and record the bad one (kind bad_sample_rate) instead of ending the run."""
    from musiclm_stab.config import Config
    from musiclm_stab.export.feature_files import extract_folder
    from musiclm_stab.export.features import FeatureModel
    from musiclm_stab.model import MusicMLM
    from musiclm_stab.tokenizer.fit import make_local_weights

    src = tmp_path / "src"
    src.mkdir()
    sf.write(src / "good.wav", make_music(1.0, seed=13), SR)
    (src / "bad_rate.wav").write_bytes(_wav_with_rate(make_music(2.0, seed=14), 1_000_000_100))
    files = list_audio_files(src)
    info = make_local_weights(files, tmp_path / "w.th", seed=0, max_seconds=10, iters=1, progress=False,
                              workers=0)
    [skipped] = info["provenance"]["skipped_sources"]
    assert (skipped["path"], skipped["kind"]) == (str(src / "bad_rate.wav"), "bad_sample_rate")
    assert info["provenance"]["seconds_used"] == pytest.approx(1.0, abs=0.02)

    cfg = Config()
    for key, value in dict(size="tiny", cqt_bins=84, cqt_bins_per_octave=12, final_dim=32).items():
        setattr(cfg.model, key, value)
    cfg.validate()
    torch.manual_seed(0)
    net = MusicMLM(cfg.model)
    model = FeatureModel(net, "musiclm_stab", net.cfg.num_layers, net.cfg.width, "tiny")
    summary = extract_folder(model, src, tmp_path / "features", layers=[0], chunk_seconds=2.0, progress=False)
    assert [w["output"] for w in summary.written] == ["good"]
    [failed] = summary.failed
    assert (failed["source"], failed["kind"]) == (str(src / "bad_rate.wav"), "bad_sample_rate")
    assert "1000000100 Hz" in failed["reason"]
