"""What an audio file's container says about its length, read from the file itself (not libsndfile).

libsndfile shortens a cut file to what is on disk without a word for WAV (RIFF, RIFX, WAVE_FORMAT_EXTENSIBLE),
RF64, W64, AIFF and AU, and plays an Ogg stream cut short to where it stops. The containers say how long they
were meant to be, so ``read_container`` reads that from the header: only the chunk headers it needs, seeking
past every other chunk however large (cover art, metadata), never the audio itself.

- WAV/RF64/W64/AIFF/AU: the bytes of audio data the header declares (the data/SSND chunk's size; RF64's
  ds64 size) against the bytes the file holds after the data starts.
- Ogg: whether the stream ends properly: one of the pages in its last 128 KiB carries the end-of-stream
  flag (a stream cut short has none). Pages are checked by their CRC, so bytes inside a packet that
  happen to read ``OggS`` are not taken for a page.
- FLAC: nothing to compare at open (the STREAMINFO sample count is checked against the decoded length by
  ``AudioReader.blocks``), except that a count of 0 means "not known" (pipe encoders cannot seek back to
  write it); libsndfile then reports an endless stream and fails at its end, so the count is taken from
  the last frame's header and handed to libsndfile in place of the 0 (``Container.patch``).
- A streamed WAV/RF64 whose data size is 0 (the writer could not seek back either) likewise gets the size
  of the data on disk in place of the 0; libsndfile would otherwise see no samples.

MP3 has no container length: its length check is the decoder's (``AudioReader.blocks``).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import soundfile as sf

_W64_TAIL = bytes.fromhex("f3acd3118cd100c04f8edb8a")  # the last 12 bytes of W64's wave/fmt/data GUIDs
_W64_RIFF = b"riff" + bytes.fromhex("2e91cf11a5d628db04c10000")
_OGG_TAIL = 2 * 65_307  # two pages of the largest size (27 + 255 + 255 * 255 bytes)
_FLAC_TAIL = 4 << 20  # the last frame of a FLAC stream lies in its last 4 MiB (a frame is at most ~2 MiB)
_FLAC_TRIES = 3  # frame headers tried from the end before a FLAC is taken not to end with a whole frame
# WAVE format tags whose block_align is one sample frame: PCM, IEEE float, A-law, mu-law.
_WAV_FRAME_TAGS = (1, 3, 6, 7)
_AU_SAMPLE_BYTES = {1: 1, 2: 1, 3: 2, 4: 3, 5: 4, 6: 4, 7: 8, 27: 1}  # AU encoding -> bytes per sample
_AIFC_UNCOMPRESSED = (b"NONE", b"twos", b"sowt", b"fl32", b"FL32", b"fl64", b"FL64", b"in24", b"in32",
                      b"raw ")


@dataclass(frozen=True)
class Container:
    """A container's own statement of its length, and what the file holds.

    ``declared`` is None when the header does not state a length (a streamed file, or a format without
    one); ``frame_bytes`` is 0 when a sample frame has no fixed size (compressed data).
    """

    format: str  # as messages name it: "WAV", "RF64", "W64", "AIFF", "AU", "Ogg", "FLAC"
    declared: int | None = None  # bytes of audio data the header declares
    present: int = 0  # bytes of audio data in the file
    frame_bytes: int = 0  # bytes per sample frame (uncompressed PCM)
    unended: bool = False  # an Ogg stream with no end-of-stream page: cut short
    patch: tuple[int, bytes] | None = None  # (offset, bytes) libsndfile reads instead of the file's
    patched: str = ""  # what the patch fills in, for messages
    problem: str = ""  # why the header cannot be used (the file is then refused as corrupt)

    @property
    def short_by(self) -> int:
        """Bytes (whole frames where frames have a size) the data falls short of the declared length."""
        if self.declared is None or self.declared <= self.present:
            return 0
        if self.frame_bytes:
            return (self.declared // self.frame_bytes - self.present // self.frame_bytes) * self.frame_bytes
        return self.declared - self.present


def read_container(f: BinaryIO, size: int) -> Container | None:
    """The container of the file open as ``f`` (``size`` bytes), or None for formats without a length
    (MP3) and headers this does not understand (libsndfile then judges the file alone)."""
    f.seek(0)
    head = f.read(40)
    try:
        if head[:4] in (b"RIFF", b"RIFX", b"RF64", b"BW64") and head[8:12] == b"WAVE":
            return _riff(f, size, head)
        if head[:16] == _W64_RIFF and head[24:28] == b"wave" and head[28:40] == _W64_TAIL:
            return _w64(f, size)
        if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
            return _aiff(f, size, head[8:12] == b"AIFC")
        if head[:4] in (b".snd", b"dns."):
            return _au(head, size)
        if head[:4] == b"fLaC":
            return _flac(f, size)
        if head[:4] == b"OggS":
            return _ogg(f, size)
    except (struct.error, ValueError, IndexError):
        return None  # a header too damaged to read: libsndfile says what it makes of it
    return None


def _chunks(f: BinaryIO, size: int, start: int, order: str):
    """(id, size field, position) of each RIFF/AIFF-style chunk from ``start``, seeking past the bodies."""
    pos = start
    while pos + 8 <= size:
        f.seek(pos)
        cid, n = struct.unpack(order + "4sI", f.read(8))
        yield cid, n, pos
        pos += 8 + n + (n & 1)


def _riff(f: BinaryIO, size: int, head: bytes) -> Container | None:
    order = ">" if head[:4] == b"RIFX" else "<"
    name = "RF64" if head[:4] in (b"RF64", b"BW64") else "WAV"
    ds64_data, ds64_at, frame_bytes = None, None, 0
    for cid, n, pos in _chunks(f, size, 12, order):
        if cid == b"ds64":
            ds64_at = pos + 16  # riffSize (8 bytes), then dataSize (8 bytes)
            ds64_data = struct.unpack("<Q", f.read(16)[8:])[0]
        elif cid == b"fmt ":
            frame_bytes = _wav_frame_bytes(f.read(min(n, 26)), order)
        elif cid == b"data":
            start = pos + 8
            present = max(0, size - start)
            if n == 0xFFFFFFFF and name == "RF64" and ds64_data:
                return Container(name, ds64_data, present, frame_bytes)
            if n == 0xFFFFFFFF and name == "WAV":  # streamed: libsndfile reads to the end of the file
                return Container(name, None, present, frame_bytes)
            zero = ds64_data == 0 if (n == 0xFFFFFFFF and ds64_at is not None) else n == 0
            if zero and present >= max(frame_bytes, 1) and not _chunk_follows(f, start, size, order):
                have = present - present % frame_bytes if frame_bytes else present
                at, field = (ds64_at, struct.pack("<Q", have)) if n == 0xFFFFFFFF else \
                    (pos + 4, struct.pack(order + "I", min(have, 0xFFFFFFFE)))
                return Container(name, None, present, frame_bytes, patch=(at, field),
                                 patched="its data size (0, as streamed) taken from the file size")
            return Container(name, n if n != 0xFFFFFFFF else ds64_data, present, frame_bytes)
        elif n == 0xFFFFFFFF:
            return None  # a 64-bit chunk size other than data's: not followed here
    return None


def _wav_frame_bytes(fmt: bytes, order: str) -> int:
    """Bytes per sample frame from a WAVE fmt chunk's body (its block_align), 0 if the data is compressed."""
    tag, block_align = struct.unpack(order + "H", fmt[:2])[0], struct.unpack(order + "H", fmt[12:14])[0]
    if tag == 0xFFFE and len(fmt) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the real tag opens the sub-format GUID
        tag = struct.unpack(order + "H", fmt[24:26])[0]
    return block_align if tag in _WAV_FRAME_TAGS else 0


def _chunk_follows(f: BinaryIO, pos: int, size: int, order: str) -> bool:
    """Whether the bytes at ``pos`` are another chunk's header (4 printable ASCII bytes and a size that
    fits the file), i.e. an empty data chunk really is empty rather than streamed."""
    f.seek(pos)
    raw = f.read(8)
    if len(raw) < 8:
        return False
    n = struct.unpack(order + "I", raw[4:])[0]
    return all(32 <= b < 127 for b in raw[:4]) and pos + 8 + n <= size


def _w64(f: BinaryIO, size: int) -> Container | None:
    pos, frame_bytes = 40, 0
    while pos + 24 <= size:
        f.seek(pos)
        guid, n = struct.unpack("<16sQ", f.read(24))  # a W64 chunk size counts its own 24-byte header
        if guid[4:] != _W64_TAIL or n < 24:
            return None
        if guid[:4] == b"fmt ":
            frame_bytes = _wav_frame_bytes(f.read(min(n - 24, 26)), "<")
        elif guid[:4] == b"data":
            return Container("W64", n - 24, max(0, size - pos - 24), frame_bytes)
        pos += (n + 7) // 8 * 8
    return None


def _aiff(f: BinaryIO, size: int, aifc: bool) -> Container | None:
    frame_bytes = 0
    for cid, n, pos in _chunks(f, size, 12, ">"):
        if cid == b"COMM":
            comm = f.read(min(n, 22))
            channels, bits = struct.unpack(">H", comm[:2])[0], struct.unpack(">H", comm[6:8])[0]
            compression = comm[18:22] if aifc else b"NONE"
            frame_bytes = channels * ((bits + 7) // 8) if compression in _AIFC_UNCOMPRESSED else 0
        elif cid == b"SSND":
            offset = struct.unpack(">I", f.read(4))[0]  # then blockSize (4 bytes), offset bytes, the data
            start = pos + 16 + offset
            return Container("AIFF", max(0, n - 8 - offset) if n else None, max(0, size - start), frame_bytes)
    return None


def _au(head: bytes, size: int) -> Container | None:
    order = ">" if head[:4] == b".snd" else "<"
    offset, n, encoding, _rate, channels = struct.unpack(order + "5I", head[4:24])
    frame_bytes = _AU_SAMPLE_BYTES.get(encoding, 0) * channels
    return Container("AU", None if n == 0xFFFFFFFF else n, max(0, size - offset), frame_bytes)


# ---------------------------------------------------------------------------------------------------
# Ogg and FLAC: CRCs (MSB first, initial value 0), pages and frames


def _crc_table(poly: int, width: int) -> list[int]:
    top, mask, table = 1 << (width - 1), (1 << width) - 1, []
    for i in range(256):
        r = i << (width - 8)
        for _ in range(8):
            r = ((r << 1) ^ poly) if r & top else r << 1
        table.append(r & mask)
    return table


_CRC32 = _crc_table(0x04C11DB7, 32)  # Ogg pages
_CRC16 = _crc_table(0x8005, 16)  # FLAC frames
_CRC8 = _crc_table(0x07, 8)  # FLAC frame headers


def _crc(table: list[int], width: int, data: bytes) -> int:
    crc, shift, mask = 0, width - 8, (1 << width) - 1
    for byte in data:
        crc = ((crc << 8) & mask) ^ table[(crc >> shift) ^ byte]
    return crc


def _ogg(f: BinaryIO, size: int) -> Container:
    """Whether one of the pages in the last ``_OGG_TAIL`` bytes ends the stream (flag 4)."""
    start = max(0, size - _OGG_TAIL)
    f.seek(start)
    tail = f.read(size - start)
    pos = tail.rfind(b"OggS")  # from the end: the last page is the one that usually ends the stream
    while pos >= 0:
        if tail[pos + 5 : pos + 6] and tail[pos + 5] & 4 and _ogg_page_end(tail, pos):
            return Container("Ogg")
        pos = tail.rfind(b"OggS", 0, pos)
    return Container("Ogg", unended=True)


def _ogg_page_end(buf: bytes, pos: int) -> int:
    """The end of the whole, CRC-checked Ogg page at ``pos`` in ``buf``, or 0."""
    if pos + 27 > len(buf) or buf[pos + 4] != 0:
        return 0
    segments = buf[pos + 26]
    lacing = buf[pos + 27 : pos + 27 + segments]
    end = pos + 27 + segments + sum(lacing)
    if len(lacing) < segments or end > len(buf):
        return 0
    page = buf[pos + 22 : pos + 26]
    checked = buf[pos : pos + 22] + b"\0\0\0\0" + buf[pos + 26 : end]
    return end if _crc(_CRC32, 32, checked) == struct.unpack("<I", page)[0] else 0


def _flac(f: BinaryIO, size: int) -> Container:
    f.seek(4)
    block_header = f.read(4)
    if block_header[0] & 0x7F != 0:  # STREAMINFO comes first
        return Container("FLAC")
    info = f.read(34)
    min_block = struct.unpack(">H", info[:2])[0]
    packed = struct.unpack(">Q", info[10:18])[0]  # rate 20 bits, channels 3, bits per sample 5, samples 36
    if packed & ((1 << 36) - 1):
        return Container("FLAC")  # the count is stated: AudioReader.blocks checks the decoded length
    total = _flac_samples_from_last_frame(f, size, min_block)
    if total is None:
        return Container("FLAC", problem="its STREAMINFO states no sample count (0, as pipe encoders write) "
                         "and the file does not end with a whole frame to count them from (cut short, or "
                         "damaged at its end)")
    return Container("FLAC", patch=(18, struct.pack(">Q", packed | total)),
                     patched=f"its sample count (0 in STREAMINFO, as pipe encoders write) taken from the "
                     f"last frame: {total} samples")


def _flac_samples_from_last_frame(f: BinaryIO, size: int, fixed_block: int) -> int | None:
    """Samples in a FLAC stream: the last frame's first sample plus its block size, or None if the file
    does not end with a whole frame. The last frame is the last frame header (CRC-8) from which the bytes
    to the end of the file are one frame (CRC-16). Bytes inside a frame pass the header check about once
    in 2**24 positions, so after _FLAC_TRIES headers whose frame is not whole the search gives up: those
    are the real last frames, and the file is cut or damaged."""
    start = max(0, size - _FLAC_TAIL)
    f.seek(start)
    tail = f.read(size - start)
    pos, tries = len(tail) - 2, 0
    while tries < _FLAC_TRIES:
        pos = tail.rfind(b"\xff", 0, pos + 1)
        if pos < 0:
            return None
        if tail[pos + 1 : pos + 2] in (b"\xf8", b"\xf9"):
            frame = _flac_frame_header(tail, pos, fixed_block)
            if frame is not None:
                if _crc(_CRC16, 16, tail[pos:]) == 0:
                    return frame[0] + frame[1]
                tries += 1
        pos -= 1
    return None


def _flac_frame_header(buf: bytes, pos: int, fixed_block: int) -> tuple[int, int] | None:
    """(first sample, block size) of the FLAC frame whose header starts at ``pos``, or None if the bytes
    there are no valid frame header (reserved codes, bad coded number, CRC-8 mismatch)."""
    h = buf[pos : pos + 16]
    if len(h) < 6:
        return None
    size_code, rate_code, channels, depth = h[2] >> 4, h[2] & 15, h[3] >> 4, (h[3] >> 1) & 7
    if size_code == 0 or rate_code == 15 or channels > 10 or depth == 3 or h[3] & 1:
        return None
    lead = next((i for i in range(8) if not (h[4] << i) & 0x80), 8)  # UTF-8-style coded number
    if lead == 1 or lead > 7:
        return None
    length = max(1, lead)
    number = h[4] & (0x7F >> lead)
    for b in h[5 : 4 + length]:
        if b & 0xC0 != 0x80:
            return None
        number = number << 6 | b & 0x3F
    i = 4 + length
    if size_code == 1:
        block = 192
    elif size_code <= 5:
        block = 576 << (size_code - 2)
    elif size_code <= 7:
        extra = 1 if size_code == 6 else 2
        block = int.from_bytes(h[i : i + extra], "big") + 1
        i += extra
    else:
        block = 256 << (size_code - 8)
    i += 1 if rate_code == 12 else 2 if rate_code in (13, 14) else 0
    if i >= len(h) or _crc(_CRC8, 8, h[:i]) != h[i]:
        return None
    variable = h[1] & 1
    return (number if variable else number * fixed_block), block


class PatchedFile(io.RawIOBase):
    """A read-only binary file that reads as ``raw`` does except for ``patch`` (offset, bytes): what
    libsndfile is given to read a file whose header left a length unstated (see ``Container.patch``)."""

    def __init__(self, raw: BinaryIO, patch: tuple[int, bytes]):
        self._raw, (self._at, self._bytes) = raw, patch
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = self._raw.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        self._raw.seek(self._pos)
        n = self._raw.readinto(buffer)
        lo, hi = max(self._pos, self._at), min(self._pos + n, self._at + len(self._bytes))
        if lo < hi:
            memoryview(buffer)[lo - self._pos : hi - self._pos] = self._bytes[lo - self._at : hi - self._at]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


class PatchedSoundFile(sf.SoundFile):
    """A SoundFile reading the file at ``path`` with ``patch`` applied (``PatchedFile``), which it closes
    with itself."""

    def __init__(self, path: Path, patch: tuple[int, bytes]):
        raw = PatchedFile(open(path, "rb"), patch)  # noqa: SIM115 - closed by close() below
        try:
            super().__init__(raw)
        except BaseException:
            raw.close()
            raise
        self._raw = raw

    def close(self) -> None:
        super().close()
        self._raw.close()
