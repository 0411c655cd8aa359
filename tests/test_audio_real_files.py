"""Real audio that decodes whole is never rejected: Ogg Vorbis clips copied out of a longer stream, small
header/data length mismatches (kept, with a warning), float audio far above full scale (normalized, with
a warning); real truncation still fails. Every odd file is written here by the test itself: Ogg pages
are parsed and rewritten with their own CRCs (RFC 3533), nothing binary comes from elsewhere.

Each file is read as the tokenizer reads it: ``open_audio`` -> ``scan`` -> ``resampled_blocks``.
"""

from __future__ import annotations

import io
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as AF

from musiclm_stab.audio import (
    MAX_PEAK,
    WARNING_KINDS,
    AudioError,
    AudioFileWarning,
    AudioStats,
    load_audio,
    open_audio,
    resampled_blocks,
    scan,
)

SR = 24_000
SRC_SR = 44_100  # released soundtracks: 44.1 kHz stereo


# ---------------------------------------------------------------------------------------------------
# Ogg pages (RFC 3533): parse and rewrite


def _crc_table() -> list[int]:
    table = []
    for i in range(256):  # CRC-32, polynomial 0x04C11DB7, MSB first, no reflection, init 0, no final xor
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else r << 1
        table.append(r & 0xFFFFFFFF)
    return table


_CRC_TABLE = _crc_table()


def _ogg_crc(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _CRC_TABLE[(crc >> 24) ^ byte]
    return crc


@dataclass(frozen=True)
class Page:
    flags: int  # 1: continues a packet, 2: beginning of stream, 4: end of stream
    granule: int  # samples decodable up to the last packet that ends on this page; -1: none ends here
    serial: int
    lacing: bytes  # segment table: a value < 255 ends a packet
    body: bytes


def ogg_pages(data: bytes) -> list[Page]:
    """The pages of an Ogg stream, in order."""
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos : pos + 5] == b"OggS\x00", f"no Ogg page at byte {pos}"
        flags = data[pos + 5]
        granule, serial, _seq, _crc, n = struct.unpack("<qIIIB", data[pos + 6 : pos + 27])
        lacing = data[pos + 27 : pos + 27 + n]
        start = pos + 27 + n
        pages.append(Page(flags, granule, serial, lacing, data[start : start + sum(lacing)]))
        pos = start + sum(lacing)
    return pages


def ogg_bytes(pages: list[Page]) -> bytes:
    """An Ogg stream of ``pages``, numbered 0, 1, ... in order, each with its CRC."""
    out = []
    for seq, p in enumerate(pages):
        head = b"OggS\x00" + bytes([p.flags]) + struct.pack("<qIIIB", p.granule, p.serial, seq, 0, len(p.lacing))
        raw = head + p.lacing + p.body
        out.append(raw[:22] + struct.pack("<I", _ogg_crc(raw)) + raw[26:])
    return b"".join(out)


def vorbis_bytes(x: np.ndarray, sr: int) -> bytes:
    """``x`` [S, C] encoded as Ogg Vorbis by libsndfile, written 1 s at a time: one write call of about
    60 s of 44.1 kHz stereo crashes libsndfile 1.2.2's Vorbis encoder (segfault, measured)."""
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", sr, x.shape[1], format="OGG", subtype="VORBIS") as f:
        for i in range(0, len(x), sr):
            f.write(x[i : i + sr])
    return buf.getvalue()


def header_page_count(pages: list[Page]) -> int:
    """Pages before the first audio page: Vorbis header pages carry granule position 0."""
    return next(i for i, p in enumerate(pages) if p.granule > 0)


def stream_copied_clip(pages: list[Page], first: int, count: int) -> bytes:
    """A clip copied out of a longer stream without re-encoding: the header pages, then audio pages
    ``first`` .. ``first + count - 1`` with their granules moved so the clip's timeline starts at 0.

    The granules are moved one long block further, so the clip's first page decodes to more samples
    than its granule counts (Vorbis start trimming). libsndfile counts a page's samples without its
    first packet's overlap with the page before (at most half a long block), so the start it computes
    is negative by at least half a long block: the state in which its seek(0) fails.
    """
    long_block = 2 ** (pages[0].body[28] >> 4)  # Vorbis identification header: blocksize_1 exponent
    base = pages[first - 1].granule + long_block
    audio = [replace(p, granule=p.granule - base if p.granule >= 0 else -1)
             for p in pages[first : first + count]]
    audio[-1] = replace(audio[-1], flags=audio[-1].flags | 4)
    assert audio[0].granule > 0 and not audio[0].flags & 1, "the clip must start on a whole packet"
    return ogg_bytes(pages[: header_page_count(pages)] + audio)


def late_granule_ogg(pages: list[Page], excess: int) -> bytes:
    """The stream with its last granule ``excess`` samples past what the last page can decode.

    The encoder's last granule trims the final block's padding; libsndfile plays up to the granule,
    so the granule is first set far past the end to measure everything the page decodes.
    """
    probe = sf.read(io.BytesIO(ogg_bytes(pages[:-1] + [replace(pages[-1], granule=pages[-1].granule + 10**5)])))
    decodable = len(probe[0])  # the stream starts at granule 0, so this is the last page's full end
    return ogg_bytes(pages[:-1] + [replace(pages[-1], granule=decodable + excess)])


@pytest.fixture(scope="module")
def soundtrack(make_music) -> tuple[bytes, list[Page]]:
    """12 s of 44.1 kHz stereo music as Ogg Vorbis: (the file's bytes, its pages)."""
    data = vorbis_bytes(make_music(12.0, seed=21, sr=SRC_SR, channels=2), SRC_SR)
    return data, ogg_pages(data)


def read_as_tokenizer(source: Path | bytes, name: str | None = None) -> tuple[AudioStats, torch.Tensor]:
    """(scan's stats, the 24 kHz waveform [S]) exactly as the tokenizer reads a track: two passes."""
    with open_audio(source, name) as reader:
        stats = scan(reader)
        wave = torch.cat(list(resampled_blocks(reader)))
    return stats, wave


def whole_read(path: Path) -> np.ndarray:
    """What soundfile.read gives, down-mixed: the reference every decoder here must match. [S]"""
    y, _ = sf.read(path, dtype="float32", always_2d=True)  # (S, C)
    return y.mean(axis=1)


# ---------------------------------------------------------------------------------------------------
# Tests


def test_ogg_page_writer_reproduces_libsndfile_bytes(soundtrack):
    """Parsing the pages and writing them again gives libsndfile's file byte for byte (CRCs included)."""
    data, pages = soundtrack
    assert len(pages) > 20 and ogg_bytes(pages) == data


def test_stream_copied_ogg_clip_is_read_twice_in_full(soundtrack, tmp_path):
    """An Ogg Vorbis clip cut without re-encoding (libsndfile's seek(0) fails on it) decodes in every pass
    exactly as soundfile.read does, from a path and from bytes."""
    _, pages = soundtrack
    first = header_page_count(pages) + len(pages) // 3
    while pages[first].flags & 1:  # start on a page that begins with a whole packet
        first += 1
    path = tmp_path / "clip.ogg"
    path.write_bytes(stream_copied_clip(pages, first, count=len(pages) // 3))
    with sf.SoundFile(path) as f:  # the fixture reproduces the bug the reader works around
        f.read(dtype="float32")
        with pytest.raises(sf.LibsndfileError, match="malformed"):
            f.seek(0)
    reference = whole_read(path)
    assert len(reference) > 3 * SRC_SR  # a real clip: about 4 s

    with open_audio(path) as reader:
        stats = scan(reader)
        second = np.concatenate(list(reader.blocks(SRC_SR)))  # a second pass, in other blocks
        third = torch.cat(list(resampled_blocks(reader)))
    assert stats.frames == len(reference) and stats.warnings == []
    np.testing.assert_array_equal(second, reference)
    assert len(third) == stats.samples_24k
    torch.testing.assert_close(third, AF.resample(torch.from_numpy(reference), SRC_SR, SR))

    stats_b, from_bytes = read_as_tokenizer(path.read_bytes(), "row 5")  # in memory (HF dataset bytes)
    assert torch.equal(from_bytes, third) and stats_b.frames == stats.frames


def test_small_ogg_length_mismatches_are_kept_with_a_warning(soundtrack, tmp_path):
    """An end-of-stream mark one page early and a last granule 104 samples late keep the audio as decoded,
    with a length_mismatch warning whose two lengths differ in print."""
    _, pages = soundtrack
    early = pages[:-2] + [replace(pages[-2], flags=pages[-2].flags | 4), pages[-1]]
    (tmp_path / "early_eos.ogg").write_bytes(ogg_bytes(early))
    shortfall = pages[-1].granule - pages[-2].granule  # the last page, which libsndfile does not play
    # margin: measured 2800 samples (0.06 s); the OGG tolerance is 0.5 s, this asks for under 1/3 s
    assert 0 < shortfall < SRC_SR // 3, shortfall
    (tmp_path / "late_granule.ogg").write_bytes(late_granule_ogg(pages, 104))

    for name in ("early_eos.ogg", "late_granule.ogg"):
        path = tmp_path / name
        reference = whole_read(path)
        stats, wave = read_as_tokenizer(path)
        assert stats.frames == len(reference), name
        torch.testing.assert_close(wave, AF.resample(torch.from_numpy(reference), SRC_SR, SR))
        [w] = stats.warnings
        assert (w.kind, w.path) == ("length_mismatch", str(path)) and w.kind in WARNING_KINDS
        declared, ends = re.search(r"declares ([\d.]+) s but the data ends at ([\d.]+) s", w.reason).groups()
        assert declared != ends, w.reason  # never "declares 12.00 s but the data ends at 12.00 s"
        with sf.SoundFile(path) as f:
            short = f.frames - len(reference)
        assert short == {"early_eos.ogg": shortfall, "late_granule.ogg": 104}[name]
        assert f"({len(reference)} of {len(reference) + short} samples; {short} samples" in w.reason


def test_real_truncation_still_fails(soundtrack, tmp_path):
    """An Ogg stream ending half-way and a WAV 100 samples short still fail as truncated, lengths told apart."""
    _, pages = soundtrack
    half = len(pages) // 2
    marked = pages[:half] + [replace(pages[half], flags=pages[half].flags | 4)] + pages[half + 1 :]
    (tmp_path / "half.ogg").write_bytes(ogg_bytes(marked))
    with pytest.raises(AudioError, match=r"declares 12\.00 s but the data ends at \d\.\d\d s .*more than "
                       r"the 0\.50 s allowed for OGG") as e:
        read_as_tokenizer(tmp_path / "half.ogg")
    assert e.value.kind == "truncated"

    pcm = struct.pack("<2400h", *range(2400))  # 0.1 s, 16-bit mono
    fmt = struct.pack("<HHIIHH", 1, 1, SR, 2 * SR, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", 2 * 2500) + pcm
    (tmp_path / "short.wav").write_bytes(b"RIFF" + struct.pack("<I", 4 + len(body)) + body)
    with pytest.raises(AudioError, match=r"declares 0\.104 s but the file holds 0\.100 s \(2400 of 2500 "
                       r"samples\)") as e:
        read_as_tokenizer(tmp_path / "short.wav")
    assert e.value.kind == "truncated"


def test_float_audio_far_above_full_scale_is_normalized_with_a_warning(tmp_path, make_music):
    """A float peak of 40 is scaled to 1.0 with an over_full_scale warning; a peak of 1.5 is left alone."""
    x = make_music(2.0, seed=22)  # peak 0.5
    unit = x / np.abs(x).max()  # peak 1.0
    sf.write(tmp_path / "loud.wav", 40 * unit, SR, subtype="FLOAT")
    sf.write(tmp_path / "hot.wav", 1.5 * unit, SR, subtype="FLOAT")

    stats, wave = read_as_tokenizer(tmp_path / "loud.wav")
    assert stats.peak == pytest.approx(40.0) and stats.gain == pytest.approx(1 / 40)
    torch.testing.assert_close(wave, torch.from_numpy(unit))  # 24 kHz: no resampling, a gain only
    [w] = stats.warnings
    assert w.kind == "over_full_scale" and "peak 40 (+32.0 dBFS)" in w.reason and w.path.endswith("loud.wav")
    with pytest.warns(AudioFileWarning, match="loud.wav: peak 40"):
        torch.testing.assert_close(load_audio(tmp_path / "loud.wav"), torch.from_numpy(unit))

    stats, wave = read_as_tokenizer(tmp_path / "hot.wav")
    assert stats.peak == pytest.approx(1.5) and stats.peak < MAX_PEAK and stats.gain == 1.0 and stats.warnings == []
    torch.testing.assert_close(wave, torch.from_numpy(1.5 * unit))


def test_later_passes_reopen_the_file_and_read_in_blocks(soundtrack, tmp_path, monkeypatch):
    """Later passes reopen the file (no rewinding seek), reads stay one block; a file changed meanwhile is corrupt."""
    data, _ = soundtrack
    path = tmp_path / "track.ogg"
    path.write_bytes(data)
    asked: list[int] = []
    real_read = sf.SoundFile.read

    def counting_read(self, frames=-1, *args, **kwargs):
        asked.append(frames)
        return real_read(self, frames, *args, **kwargs)

    real_seek = sf.SoundFile.seek

    def no_moving_seek(self, frames, whence=sf.SEEK_SET):
        # soundfile itself calls seek(0, SEEK_CUR) for tell() and, after each read, seeks to where the
        # read ended: neither moves. Any other seek (a rewind) fails the test.
        here = real_seek(self, 0, sf.SEEK_CUR)
        assert (frames, whence) in ((0, sf.SEEK_CUR), (here, sf.SEEK_SET)), f"seek({frames}, {whence}) at {here}"
        return real_seek(self, frames, whence)

    monkeypatch.setattr(sf.SoundFile, "read", counting_read)
    monkeypatch.setattr(sf.SoundFile, "seek", no_moving_seek)
    with open_audio(path) as reader:
        first = list(reader.blocks(SRC_SR))
        second = list(reader.blocks(SRC_SR))
    assert len(first) == 12 and all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert set(asked) == {SRC_SR}  # one block per call, never the whole track

    with open_audio(path) as reader:
        scan(reader)
        sf.write(path, np.zeros((SRC_SR, 2), np.float32), SRC_SR, format="OGG", subtype="VORBIS")
        with pytest.raises(AudioError, match="the file changed while it was read") as e:
            list(resampled_blocks(reader))
    assert e.value.kind == "corrupt"


def test_tokenizer_keeps_every_file_that_decodes_whole(tmp_path, local_weights, make_music):
    """The tokenizer tokenizes a stream-copied clip, an early end-of-stream, a late granule and a peak of 40."""
    from musiclm_stab.data.tokenized import load_tokenized
    from musiclm_stab.tokenizer.pipeline import tokenize

    pages = ogg_pages(vorbis_bytes(make_music(4.0, seed=24, sr=SRC_SR, channels=2), SRC_SR))  # short: fast
    src = tmp_path / "src"
    src.mkdir()
    first = header_page_count(pages) + 2
    while pages[first].flags & 1:
        first += 1
    (src / "clip.ogg").write_bytes(stream_copied_clip(pages, first, count=6))
    early = pages[:-2] + [replace(pages[-2], flags=pages[-2].flags | 4), pages[-1]]
    (src / "early_eos.ogg").write_bytes(ogg_bytes(early))
    (src / "late_granule.ogg").write_bytes(late_granule_ogg(pages, 104))
    sf.write(src / "loud.wav", 80 * make_music(2.0, seed=23), SR, subtype="FLOAT")  # peak 40, 150 frames
    s = tokenize(src, tmp_path / "out", weights=str(local_weights), segment_seconds=5.0, min_seconds=1.0,
                 workers=0, progress=False)
    assert (s.num_tracks, s.num_failures) == (4, 0)
    ds, _ = load_tokenized(tmp_path / "out")
    assert sorted(set(ds["track"])) == ["clip.ogg", "early_eos.ogg", "late_granule.ogg", "loud.wav"]
    loud = np.concatenate([np.asarray(r["pcm"]) for r in ds if r["track"] == "loud.wav"])
    assert 0.99 < np.abs(loud).max() <= 1.0 + 1e-6  # normalized to a peak of 1.0
