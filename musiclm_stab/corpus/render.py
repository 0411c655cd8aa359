"""Rendering building blocks: timed notes for General MIDI instruments -> audio through a soundfont.

Notes are rendered through TimGM6mb.sf2, the small General MIDI soundfont that ships in ``pretty_midi``'s
wheel, by one of two renderers (``RENDERERS``): ``sampler``, the package's own sample player
(``sampler.py``: numpy and scipy, nothing to install), the default; or ``tinysoundfont``, the renderer of
every corpus made before it (the studies' among them: their committed codes are of that audio), an
optional package installed with ``pip install --no-deps tinysoundfont`` (it declares pyaudio, which only
plays sound live and needs PortAudio's headers to build). The two sound different; both are deterministic
(same notes, same bytes), and a corpus records which one made it.
The score-specific planning lives in ``chorales.py`` (Bach chorales) and ``works.py`` (other collections);
``build.py`` assembles a corpus from them.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SOUNDFONT_NAME = "TimGM6mb.sf2"  # ships inside pretty_midi's wheel
FORMATS = {"flac": "FLAC", "wav": "WAV"}  # --format -> libsndfile major format
LEAD_SECONDS = 0.1  # silence before the first note
TAIL_SECONDS = 1.2  # room for the release of the last chord
FADE_SECONDS = 0.05  # fade-out when a track is cut at max_seconds (no click)
PEAK_DBFS = -1.0

# General MIDI programs (0-based) used here, with their standard names.
GM_NAMES = {
    0: "Acoustic Grand Piano",
    6: "Harpsichord",
    19: "Church Organ",
    20: "Reed Organ",
    21: "Accordion",
    22: "Harmonica",
    24: "Acoustic Guitar (nylon)",
    25: "Acoustic Guitar (steel)",
    32: "Acoustic Bass",
    40: "Violin",
    41: "Viola",
    42: "Cello",
    43: "Contrabass",
    46: "Orchestral Harp",
    48: "String Ensemble 1",
    52: "Choir Aahs",
    53: "Voice Oohs",
    56: "Trumpet",
    57: "Trombone",
    58: "Tuba",
    60: "French Horn",
    64: "Soprano Sax",
    66: "Tenor Sax",
    67: "Baritone Sax",
    68: "Oboe",
    69: "English Horn",
    70: "Bassoon",
    71: "Clarinet",
    73: "Flute",
    74: "Recorder",
    75: "Pan Flute",
    79: "Ocarina",
    105: "Banjo",
    109: "Bagpipe",
    110: "Fiddle",
}
INSTALL_HINT = {
    "music21": "pip install 'musiclm_stab[corpus]'",
    "pretty_midi": "pip install 'musiclm_stab[corpus]'",
    "tinysoundfont": "pip install --no-deps tinysoundfont  (its pyaudio dependency is only for playback; or "
                     "render with the default renderer, sampler)",
}
RENDERERS = ("sampler", "tinysoundfont")  # the package's own sample player (the default); the earlier one
DEFAULT_RENDERER = "sampler"


class MissingPackage(ImportError):
    """An optional package the corpus builder needs is not installed; the message (one line) names the install."""


def require(module: str):
    """Import an optional dependency of the corpus builder, or raise MissingPackage saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        raise MissingPackage(
            f"building the corpus needs {package}: {INSTALL_HINT.get(package, f'pip install {package}')}"
        ) from e


@dataclass
class Voice:
    """One part on one MIDI channel; ``notes`` are (start_s, end_s, key, velocity)."""

    name: str
    program: int
    notes: list[tuple[float, float, int, int]] = field(default_factory=list)
    pan: int = 64  # CC10, 64 = centre

    @property
    def instrument(self) -> str:
        return GM_NAMES[self.program]


@dataclass
class Track:
    """A score, voiced and timed, ready to render."""

    source: str  # music21 corpus path, e.g. "bach/bwv1.6.mxl"
    ensemble: str
    tempo_qpm: int
    voices: list[Voice]
    title: str | None = None  # file name stem; default: the source's stem
    key: dict | None = None  # the score's key, for the labels (labels.key_facts); never affects the audio

    @property
    def name(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", self.title or Path(self.source).stem)

    @property
    def seconds(self) -> float:
        return max(end for v in self.voices for _, end, _, _ in v.notes) + TAIL_SECONDS


def soundfont_path() -> Path:
    """TimGM6mb.sf2 from pretty_midi's package directory (no system fluidsynth, no network)."""
    path = Path(require("pretty_midi").__file__).parent / SOUNDFONT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{SOUNDFONT_NAME} not found in pretty_midi's package dir {path.parent}")
    return path


def long_rest_cuts(spans: list[tuple[float, float]], long_quarters: float, kept_quarters: float
                   ) -> tuple[float, Callable[[float], float]]:
    """Shortening of rests during which every part is silent: a rest of ``long_quarters`` or more becomes
    ``kept_quarters`` long. ``spans``: sorted (on, off) offsets in quarters of every note of every part.

    Returns (the first note's offset, cut) where ``cut(offset)`` is the number of quarters removed before
    ``offset``: a note at ``offset`` then starts ``offset - start - cut(offset)`` quarters into the track.
    """
    start, reach = spans[0]
    rest_ends, removed = [], [0.0]  # offsets where a long rest ends; quarters cut up to each of them
    for on, off in spans[1:]:
        if on - reach >= long_quarters:
            rest_ends.append(on)
            removed.append(removed[-1] + on - reach - kept_quarters)
        reach = max(reach, off)
    return start, lambda offset: removed[bisect.bisect_right(rest_ends, offset)]


def num_samples(track: Track, sample_rate: int, max_seconds: float | None = None) -> int:
    """Length of the rendered audio in samples: the track with its tail, cut at ``max_seconds``."""
    total = track.seconds if max_seconds is None else min(track.seconds, max_seconds)
    return int(round(total * sample_rate))


def note_samples(seconds: float, sample_rate: int) -> int:
    """The sample at which a note event at ``seconds`` is sent to the synth."""
    return int(round(seconds * sample_rate))


def render_track(
    track: Track, sample_rate: int = 44100, max_seconds: float | None = None, soundfont: bytes | None = None,
    renderer: str = DEFAULT_RENDERER,
) -> np.ndarray:
    """Render a track: float32 [S, 2] (stereo), peak normalized to PEAK_DBFS, with ``renderer`` (RENDERERS).

    Notes are switched on and off at exact sample positions, so the result does not depend on buffer sizes;
    every track starts from silence (a fresh synth), so tracks are independent.
    """
    if renderer not in RENDERERS:
        raise ValueError(f"renderer={renderer!r}: choose one of {', '.join(RENDERERS)}")
    sf2 = soundfont if soundfont is not None else soundfont_path().read_bytes()
    n_samples = num_samples(track, sample_rate, max_seconds)
    if renderer == "sampler":
        audio = _render_sampler(track, sample_rate, n_samples, sf2)
    else:
        audio = _render_tinysoundfont(track, sample_rate, n_samples, sf2)
    if max_seconds is not None and track.seconds > max_seconds:
        fade = min(n_samples, int(FADE_SECONDS * sample_rate))
        audio[n_samples - fade :] *= np.linspace(1.0, 0.0, fade, dtype=np.float32)[:, None]
    peak = float(np.abs(audio).max())
    if not np.isfinite(peak) or peak < 1e-6:
        raise RuntimeError(f"{track.source}: rendered audio is silent (peak {peak:.2e})")
    return audio * np.float32(10 ** (PEAK_DBFS / 20) / peak)


@functools.lru_cache(maxsize=2)
def _parsed(soundfont: bytes):
    from musiclm_stab.corpus.soundfont import SoundFont

    return SoundFont(soundfont)


def _render_sampler(track: Track, sample_rate: int, n_samples: int, soundfont: bytes) -> np.ndarray:
    """The package's own sample player (sampler.py): each note's voices added in score order."""
    from musiclm_stab.corpus.sampler import play

    sf = _parsed(soundfont)
    left, right = np.zeros(n_samples), np.zeros(n_samples)  # (S,) each: contiguous to add into
    for voice in track.voices:
        for t_on, t_off, key, velocity in voice.notes:
            on = note_samples(t_on, sample_rate)
            if on >= n_samples:
                continue
            held = max(note_samples(t_off, sample_rate) - on, 0)
            for zone in sf.voices(voice.program, key, velocity):
                wave, to_left, to_right = play(sf, zone, key, velocity, held, n_samples - on, sample_rate, voice.pan)
                left[on : on + len(wave)] += wave * to_left
                right[on : on + len(wave)] += wave * to_right
    return np.stack([left, right], axis=1).astype(np.float32)  # (S, 2)


def _render_tinysoundfont(track: Track, sample_rate: int, n_samples: int, soundfont: bytes) -> np.ndarray:
    """tinysoundfont (``generate_simple`` between events, at exact sample positions): the renderer of every
    corpus made before the sample player, kept so that those corpora can be made again byte for byte."""
    synth = require("tinysoundfont").Synth(samplerate=sample_rate)
    sfid = synth.sfload(soundfont)
    for channel, voice in enumerate(track.voices):  # at most 8 voices: never channel 9, the GM drum channel
        synth.program_select(channel, sfid, 0, voice.program)
        synth.control_change(channel, 10, voice.pan)

    events = []  # (sample, is_on, channel, key, velocity): note-offs sort before note-ons at a sample
    for channel, voice in enumerate(track.voices):
        for t_on, t_off, key, velocity in voice.notes:
            events.append((note_samples(t_on, sample_rate), 1, channel, key, velocity))
            events.append((note_samples(t_off, sample_rate), 0, channel, key, 0))
    events.sort()

    audio = np.zeros((n_samples, 2), dtype=np.float32)  # (S, 2) interleaved, as tinysoundfont writes
    buffer = memoryview(audio).cast("B")
    frame_bytes = 2 * 4  # stereo float32
    pos = 0
    for sample, is_on, channel, key, velocity in events:
        if sample >= n_samples:
            break
        if sample > pos:
            synth.generate_simple(sample - pos, buffer=buffer[pos * frame_bytes : sample * frame_bytes])
            pos = sample
        if is_on:
            synth.noteon(channel, key, velocity)
        else:
            synth.noteoff(channel, key)
    if pos < n_samples:
        synth.generate_simple(n_samples - pos, buffer=buffer[pos * frame_bytes :])
    return audio


def write_audio(path: Path, audio: np.ndarray, sample_rate: int, fmt: str) -> None:
    """16-bit PCM, quantized here (not by libsndfile) so the bytes depend only on the samples."""
    import soundfile as sf

    pcm = np.clip(np.round(audio * 32767.0), -32768, 32767).astype(np.int16)
    partial = path.with_name(f".{path.name}.partial")
    sf.write(partial, pcm, sample_rate, format=FORMATS[fmt], subtype="PCM_16")
    os.replace(partial, path)  # atomic: a file with the final name is always complete
