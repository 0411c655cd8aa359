"""What is done with a reader's blocks: check a whole track, resample it to 24 kHz, or decode it whole.

``scan`` checks a whole track in one pass (length, peak, non-finite samples, truncation) and applies the
peak policy (``MAX_PEAK``). ``resampled_blocks`` streams the track as float32 mono at 24 kHz: the
signal is resampled with ``torchaudio``'s kernel, block by block, and equals a whole-track
``torchaudio.functional.resample`` up to float rounding (see ``StreamResampler``). ``load_audio``,
``decode_bytes`` and ``from_array`` give the whole waveform at once; they raise ``AudioError`` as the
reader does, and report its ``AudioWarning``s under the ``warnings`` category ``AudioFileWarning``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torchaudio.transforms

from musiclm_stab.audio.reader import AudioError, AudioReader, AudioWarning, array_reader, open_audio
from musiclm_stab.constants import SAMPLE_RATE

# Float peaks up to 2.0 are kept as they are: lossy decoders overshoot 1.0 on loud masters. Above it the
# scale is wrong (PCM stored as unscaled float, a gain bug upstream), and EnCodec expects [-1, 1].
MAX_PEAK = 2.0

# torchaudio's resampling kernel is (new/g) x (orig/g) for g = gcd(orig, new); a rate such as
# 44101 Hz (g = 1) would need gigabytes. Such rates are snapped to the nearest multiple of 100 Hz.
_MAX_KERNEL = 20_000_000
_LOWPASS_WIDTH, _ROLLOFF = 6, 0.99  # torchaudio.functional.resample's defaults, used below


class AudioFileWarning(UserWarning):
    """The ``warnings`` category under which the whole-waveform helpers (``load_audio``,
    ``decode_bytes``, ``from_array``) report an ``AudioWarning``; the tokenizer records them instead."""


# ---------------------------------------------------------------------------------------------------
# Scanning a whole track, and resampling it in blocks


@dataclass
class AudioStats:
    """What one pass over a track found (at its own sample rate, after the down-mix)."""

    frames: int
    sample_rate: int
    peak: float  # max |x| as decoded (before ``gain``)
    non_finite: int  # NaN or inf samples
    gain: float = 1.0  # the scale resampled_blocks applies: 1/peak above MAX_PEAK, else 1
    warnings: list[AudioWarning] = field(default_factory=list)  # odd but usable: record them

    @property
    def peak_dbfs(self) -> float:
        return 20 * math.log10(self.peak) if self.peak > 0 else -math.inf

    @property
    def samples_24k(self) -> int:
        """Length after resampling to 24 kHz (the resampler's rule: ceil(frames * new / orig))."""
        orig = _usable_rate(self.sample_rate)
        g = math.gcd(orig, SAMPLE_RATE)
        return -(-self.frames * (SAMPLE_RATE // g) // (orig // g))


def scan(reader: AudioReader) -> AudioStats:
    """Decode a track once, in blocks, and check it: raises AudioError for decode errors, truncation,
    no samples or non-finite samples; returns its length, peak and warnings.

    Peak policy: a peak above ``MAX_PEAK`` sets ``reader.gain`` to 1/peak, so ``resampled_blocks``
    gives the track at a peak of 1.0, and records the warning ``over_full_scale``.
    """
    frames, peak, bad = 0, 0.0, 0
    for block in reader.blocks():
        finite = np.isfinite(block)
        n_bad = int(block.size - np.count_nonzero(finite))
        bad += n_bad
        if block.size - n_bad:
            peak = max(peak, float(np.abs(block if not n_bad else block[finite]).max()))
        frames += len(block)
    if frames == 0:
        raise AudioError(reader.name, "no audio samples (0 samples)", "no_samples")
    if bad:
        raise AudioError(reader.name, f"{bad} of {frames} samples are not finite (NaN or inf)", "non_finite")
    reader.gain = 1.0 / peak if peak > MAX_PEAK else 1.0
    if peak > MAX_PEAK:
        reader.warn("over_full_scale", f"peak {peak:.4g} ({20 * math.log10(peak):+.1f} dBFS) is above "
                    f"{MAX_PEAK:g}: scaled by 1/{peak:.4g} to a peak of 1.0")
    return AudioStats(frames, reader.sample_rate, peak, bad, reader.gain, list(reader.warnings))


class StreamResampler:
    """Resample a long signal block by block to 24 kHz, equal to one whole-signal resample.

    ``torchaudio.functional.resample`` works in frames of o input samples -> n output samples (o, n the
    rates divided by their gcd); output frame f is a fixed filter over inputs [f*o - w, f*o + o + w)
    with zeros outside the signal, where w is the filter's half-width. So each call here resamples a
    window that starts on a frame boundary with at least w samples of real context on each side
    (zeros only where the signal really ends) and keeps the frames whose inputs were all present: the
    kept outputs are the whole-signal outputs, up to float rounding of the conv over another length.
    The total length is ceil(L * n / o), computed exactly in integers.
    """

    def __init__(self, sample_rate: int):
        self.orig = _usable_rate(sample_rate)
        g = math.gcd(self.orig, SAMPLE_RATE)
        self.o, self.n = self.orig // g, SAMPLE_RATE // g
        width = math.ceil(_LOWPASS_WIDTH * self.o / (min(self.o, self.n) * _ROLLOFF))
        self.context = self.o * (width // self.o + 2)  # >= w + o, a whole number of frames
        # the kernel once, as resample() would build it at every call (float32, its default settings)
        self._resample = torchaudio.transforms.Resample(self.orig, SAMPLE_RATE, dtype=torch.float32)
        self._buf = torch.zeros(0)  # input from global sample self._buf_start on
        self._buf_start = 0
        self._next_frame = 0  # first output frame not yet emitted
        self._seen = 0  # input samples received

    def process(self, block: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Feed the next input block [m]; returns the 24 kHz output [k] that is now final."""
        if self.orig == SAMPLE_RATE:
            self._seen += len(block)
            return block
        self._buf = torch.cat([self._buf, block]) if len(self._buf) else block
        self._seen += len(block)
        end = self._seen
        if last:
            total = -(-end * self.n // self.o)  # ceil(L n / o)
            ready = -(-total // self.n)  # frames needed to cover it
        else:  # frame f is final once inputs up to f*o + o + w have arrived
            ready = max(self._next_frame, (end - self.context) // self.o)
            total = ready * self.n
        if ready == self._next_frame:
            return torch.zeros(0)
        first = self._next_frame
        a = max(0, first * self.o - self.context)  # window start: on a frame boundary
        assert a >= self._buf_start and a % self.o == 0
        b = end if last else min(end, ready * self.o + self.context)
        window = self._buf[a - self._buf_start : b - self._buf_start]
        y = self._resample(window)  # frames of the window, from global frame a/o (= AF.resample's result)
        lo = (first - a // self.o) * self.n
        out = y[lo : lo + min(total, ready * self.n) - first * self.n]
        self._next_frame = ready
        keep_from = max(0, ready * self.o - self.context)  # the next window starts at or after this
        self._buf = self._buf[keep_from - self._buf_start :]
        self._buf_start = keep_from
        return out


def resampled_blocks(reader: AudioReader, block_frames: int | None = None) -> Iterator[torch.Tensor]:
    """The track as float32 mono 24 kHz blocks [k] (lengths vary; their concatenation is the track),
    scaled by ``reader.gain`` (which ``scan`` sets)."""
    resampler = StreamResampler(reader.sample_rate)
    pending = None
    for block in reader.blocks(block_frames):
        if pending is not None:
            out = resampler.process(pending)
            if len(out):
                yield out
        pending = torch.from_numpy(np.ascontiguousarray(block, dtype=np.float32))
        if reader.gain != 1.0:
            pending = pending * reader.gain  # a new tensor: the block may be the caller's array
    if pending is not None:
        out = resampler.process(pending, last=True)
        if len(out):
            yield out


# ---------------------------------------------------------------------------------------------------
# Whole-waveform helpers


def load_audio(path: str | Path) -> torch.Tensor:
    """Decode an audio file to a float32 mono waveform [S] at 24 kHz. Raises AudioError."""
    with open_audio(path) as reader:
        return _read_all(reader)


def decode_bytes(data: bytes, name: str) -> torch.Tensor:
    """Decode an encoded audio file held in memory (e.g. an HF dataset's audio bytes) to [S] at 24 kHz.

    ``name`` identifies the source in error messages (a path or a row id).
    """
    with open_audio(data, name) as reader:
        return _read_all(reader)


def from_array(array: np.ndarray | torch.Tensor, sample_rate: int, name: str = "<array>") -> torch.Tensor:
    """Turn a waveform already in memory into float32 mono [S] at 24 kHz (layouts as ``array_reader``)."""
    return _read_all(array_reader(array, sample_rate, name))


def _read_all(reader: AudioReader) -> torch.Tensor:
    for w in scan(reader).warnings:  # these helpers return a tensor only: say it where it will be seen
        warnings.warn(str(w), AudioFileWarning, stacklevel=3)
    blocks = list(resampled_blocks(reader))
    if not blocks:
        raise AudioError(reader.name, f"no samples left after resampling to {SAMPLE_RATE} Hz", "too_short")
    return torch.cat(blocks).contiguous()


def _usable_rate(rate: int) -> int:
    g = math.gcd(rate, SAMPLE_RATE)
    if (rate // g) * (SAMPLE_RATE // g) <= _MAX_KERNEL:
        return rate
    return max(100, round(rate / 100) * 100)  # at most 50 Hz off: a pitch shift of ~0.1% at 44.1 kHz
