"""Decoding audio into the pipeline's one waveform format: a float32 mono tensor [S] at 24 kHz.

Decoding goes through ``soundfile`` (libsndfile, bundled in its wheel), which reads wav, flac, ogg,
mp3, aiff and au without FFmpeg. Stereo is down-mixed by averaging channels, then the signal is
resampled with ``torchaudio.functional.resample``. Anything that cannot become a usable waveform
raises ``AudioError`` naming the source and the reason, so callers can skip the file and report it.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF

from musiclm_stab import SAMPLE_RATE

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".mp3", ".aiff", ".aif", ".au")

# torchaudio's resampling kernel is (new/g) x (orig/g) for g = gcd(orig, new); a rate such as
# 44101 Hz (g = 1) would need gigabytes. Such rates are snapped to the nearest multiple of 100 Hz.
_MAX_KERNEL = 20_000_000


class AudioError(ValueError):
    """A file or buffer could not be turned into a usable 24 kHz mono waveform."""

    def __init__(self, path: str | Path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def load_audio(path: str | Path) -> torch.Tensor:
    """Decode an audio file to a float32 mono waveform [S] at 24 kHz. Raises AudioError."""
    path = Path(path)
    if not path.is_file():
        raise AudioError(path, "file does not exist")
    if path.stat().st_size == 0:
        raise AudioError(path, "empty file (0 bytes)")
    return _decode(str(path), path)


def decode_bytes(data: bytes, name: str) -> torch.Tensor:
    """Decode an encoded audio file held in memory (e.g. an HF dataset's audio bytes) to [S] at 24 kHz.

    ``name`` identifies the source in error messages (a path or a row id).
    """
    if not data:
        raise AudioError(name, "empty audio bytes (0 bytes)")
    return _decode(io.BytesIO(data), name)


def from_array(array: np.ndarray | torch.Tensor, sample_rate: int, name: str = "<array>") -> torch.Tensor:
    """Turn a waveform already in memory into float32 mono [S] at 24 kHz.

    ``array`` is [S], or 2-D with channels on the shorter axis ([S, C] as soundfile returns it, or
    [C, S] as torch code usually holds it). Integer PCM is scaled to [-1, 1].
    """
    wave = torch.as_tensor(np.asarray(array))
    if wave.dtype in (torch.int16, torch.int32, torch.int8, torch.uint8):
        wave = _int_to_float(wave)
    wave = wave.to(torch.float32)
    if wave.dim() == 2:
        channel_axis = 0 if wave.shape[0] < wave.shape[1] else 1
        wave = wave.mean(dim=channel_axis)  # (S,)
    elif wave.dim() != 1:
        raise AudioError(name, f"expected a waveform of shape [S] or [S, C], got {tuple(wave.shape)}")
    return _to_model_rate(wave, int(sample_rate), name)


def _decode(source: str | io.BytesIO, name: str | Path) -> torch.Tensor:
    try:
        data, sample_rate = sf.read(source, dtype="float32", always_2d=True)  # (S, C)
    except (sf.SoundFileError, RuntimeError, TypeError, ValueError, EOFError) as e:
        raise AudioError(name, f"not a readable audio file (corrupt or unsupported format): {e}") from None
    wave = torch.from_numpy(data).mean(dim=1)  # (S, C) -> (S,): down-mix by averaging channels
    return _to_model_rate(wave, sample_rate, name)


def _to_model_rate(wave: torch.Tensor, sample_rate: int, name: str | Path) -> torch.Tensor:
    """Check a mono float waveform [S] and resample it to 24 kHz."""
    if wave.numel() == 0:
        raise AudioError(name, "no audio samples (0 samples)")
    if sample_rate <= 0:
        raise AudioError(name, f"invalid sample rate {sample_rate}")
    bad = int((~torch.isfinite(wave)).sum())
    if bad:
        raise AudioError(name, f"{bad} of {wave.numel()} samples are not finite (NaN or inf)")
    if sample_rate != SAMPLE_RATE:
        wave = AF.resample(wave, _usable_rate(sample_rate), SAMPLE_RATE)
    if wave.numel() == 0:
        raise AudioError(name, f"no samples left after resampling from {sample_rate} Hz to {SAMPLE_RATE} Hz")
    return wave.contiguous()


def _int_to_float(wave: torch.Tensor) -> torch.Tensor:
    if wave.dtype == torch.uint8:  # unsigned 8-bit PCM is centred on 128
        return (wave.to(torch.float32) - 128.0) / 128.0
    return wave.to(torch.float32) / float(torch.iinfo(wave.dtype).max)


def _usable_rate(rate: int) -> int:
    g = math.gcd(rate, SAMPLE_RATE)
    if (rate // g) * (SAMPLE_RATE // g) <= _MAX_KERNEL:
        return rate
    return max(100, round(rate / 100) * 100)  # at most 50 Hz off: a pitch shift of ~0.1% at 44.1 kHz


def list_audio_files(folder: str | Path) -> list[Path]:
    """All audio files under ``folder`` (recursive), sorted by their path relative to it."""
    folder = Path(folder)
    files = [p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in AUDIO_EXTENSIONS]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())
