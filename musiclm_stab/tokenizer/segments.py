"""Cutting a track into segments: the segment grid, the cutter over a stream of blocks, and the rows of
one piece of a long track read from the middle of its file.

Long tracks (concerts, DJ mixes) are cut into several units, "pieces" of consecutive segments
(``Piece``; planned in plan.split_long_tracks), so that every worker can take part in one
track. A piece reads only its part of the file: it seeks to a decode block one block before its first
segment, so that the block-wise resampler has caught up (same windows, same float operations) by the
time its first segment starts, and its rows are bit-identical to those of an unsplit run (tested).
The checks an unsplit run makes on the whole track before writing anything (errors, peak) are made
by each piece on its own part of the file; the verdict on the track is taken when the output is
finished (store.track_verdict).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import musiclm_stab.audio.reader as audio_mod
from musiclm_stab.audio import AudioError, AudioReader, AudioStats, StreamResampler, resampled_blocks, scan
from musiclm_stab.constants import HOP_LENGTH
from musiclm_stab.tokenizer.policy import UnitSettings


@dataclass(frozen=True)
class Piece:
    """The segments [first, stop) of one long track (stop None: to the end of the track).

    Segment i starts at 24 kHz sample i * segment_samples; every segment of a piece but the last
    piece's is a full one.
    """

    first: int
    stop: int | None


def segment_bounds(num_samples: int, segment_samples: int, min_samples: int) -> list[tuple[int, int]]:
    """(start, length) of each segment of a track; lengths are multiples of the 320-sample hop.

    Full segments of ``segment_samples``; the tail is trimmed down to a multiple of the hop and
    kept only if it still has at least ``min_samples`` (and at least one frame).
    """
    bounds = []
    for start in range(0, num_samples, segment_samples):
        length = min(segment_samples, num_samples - start) // HOP_LENGTH * HOP_LENGTH
        if length >= max(min_samples, HOP_LENGTH):
            bounds.append((start, length))
    return bounds


def cut_segments(blocks: Iterable[torch.Tensor], bounds: list[tuple[int, int]]) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, pcm [length]) for each of ``bounds``, cut from a stream of consecutive blocks.

    Holds at most one block plus one segment. Raises AudioError if the stream ends too early.
    """
    buf, offset, todo = torch.zeros(0), 0, list(bounds)
    for block in blocks:
        buf = torch.cat([buf, block]) if len(buf) else block
        while todo and todo[0][0] + todo[0][1] <= offset + len(buf):
            start, length = todo.pop(0)
            yield start, buf[start - offset : start - offset + length].clone()
        drop = min(len(buf), (todo[0][0] if todo else offset + len(buf)) - offset)
        buf, offset = buf[drop:], offset + drop
        if not todo:
            return
    if todo:
        raise AudioError("<stream>", f"the decoded audio ended at {offset + len(buf)} samples, before "
                         f"the segment at {todo[0][0]}", "corrupt")


class _FromFrame:
    """A SoundFile seen from source frame ``offset`` on (and, with ``limit``, only ``limit`` frames of
    it): what ``AudioReader.blocks`` uses of a file (read, format, frames, samplerate, channels)."""

    def __init__(self, f: Any, offset: int, limit: int | None):
        self._f, self._offset = f, offset
        self.frames = max(0, f.frames - offset) if limit is None else limit
        f.seek(offset)

    def seek(self, frames: int, whence: int = 0) -> int:
        assert whence == 0, "only absolute seeks"
        return self._f.seek(self._offset + frames) - self._offset

    def tell(self) -> int:
        return self._f.tell() - self._offset

    def read(self, frames: int = -1, *args: Any, **kwargs: Any) -> np.ndarray:
        left = self.frames - self.tell()
        return self._f.read(max(0, left if frames < 0 else min(frames, left)), *args, **kwargs)

    def close(self) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _from_frame(reader: AudioReader, path: str, offset: int, limit: int | None = None) -> AudioReader:
    """The track at ``path`` (opened as ``reader``) from source frame ``offset`` on (``limit`` frames of
    it, or all) as an AudioReader of its own, whose blocks are ``reader``'s blocks from there when
    ``offset`` is a multiple of the block size. Each pass opens the file again (as AudioReader does)."""
    import soundfile as sf

    def opener() -> _FromFrame:
        return _FromFrame(sf.SoundFile(path), offset, limit)

    try:
        first = opener()
    except (sf.SoundFileError, RuntimeError, OSError) as e:
        raise AudioError(reader.name, f"cannot read the file from sample {offset} on (damaged?): {e}",
                         "corrupt") from None
    return AudioReader(reader.name, reader.sample_rate, first.frames, reader.channels, soundfile=first,
                       reopen=opener)


def piece_rows(reader: AudioReader, path: str, piece: Piece, s: UnitSettings,
               views: list[AudioReader]) -> tuple[float, Iterator[tuple[int, torch.Tensor]]]:
    """Check the piece's own part of the track and cut its segments: (peak, rows (start, pcm [length])).

    The source is decoded in blocks of B frames (audio.BLOCK_SECONDS). The piece owns the blocks from
    the one holding its first segment's start to the one holding the next piece's: it scans those
    (errors, non-finite samples, peak; the last piece to the end of the file, with its length check),
    so that the pieces of a track together scan it once. Its rows are read from one block earlier:
    the resampler's output for a block depends on its input from a block boundary on, so from the
    second block on it is the unsplit run's output, bit for bit, and the first segment lies beyond the
    first block's outputs (when B is a multiple of the resampler's input frame; otherwise the piece
    reads from the start of the track, exact but slower). The readers it opens are added to ``views``
    (their ``warnings``). Pieces are planned for integer PCM only, whose peak cannot exceed full scale,
    so no piece needs the whole track's gain (audio.MAX_PEAK). Raises AudioError.
    """
    sr, S = reader.sample_rate, s.segment_samples
    B = int(audio_mod.BLOCK_SECONDS * sr)  # the block size AudioReader.blocks uses
    rs = StreamResampler(sr)
    o, n = rs.o, rs.n  # o source samples -> n output samples
    first_block = piece.first * S * o // (n * B)
    stop_block = None if piece.stop is None else piece.stop * S * o // (n * B)
    peak, scanned = 0.0, 0
    if stop_block is None or stop_block > first_block:  # an empty share when pieces are shorter than a block
        view = _from_frame(reader, path, first_block * B, None if stop_block is None else (stop_block - first_block) * B)
        views.append(view)
        stats = scan(view)
        if stats.gain != 1.0:
            raise AudioError(reader.name, "float audio above full scale cannot be tokenized in pieces "
                             "(the file changed since the unit plan was made?)", "error")
        peak, scanned = stats.peak, stats.frames
    if piece.stop is None:  # the last piece knows the track's length: its tail follows the usual rule
        total = AudioStats(first_block * B + scanned, sr, 0.0, 0).samples_24k
        bounds = segment_bounds(total, S, s.min_samples)[piece.first:]
    else:
        bounds = [(i * S, S) for i in range(piece.first, piece.stop)]
    start_block = max(0, first_block - 1) if B % o == 0 else 0
    offset = start_block * B * n // o  # 24 kHz samples before the block read first
    view = _from_frame(reader, path, start_block * B)
    views.append(view)

    def rows() -> Iterator[tuple[int, torch.Tensor]]:
        for start, pcm in cut_segments(resampled_blocks(view), [(a - offset, length) for a, length in bounds]):
            yield start + offset, pcm

    return peak, rows()
