"""A SoundFont sample player of our own: timed notes -> stereo audio, with numpy and scipy only.

The default corpus is rendered through the General MIDI soundfont that ships in pretty_midi's wheel. The
renderer it used first, ``tinysoundfont``, declares ``pyaudio`` (live playback), which builds only where the
PortAudio headers are installed: ``pip install "musiclm_stab[corpus]"`` could not bring it in cleanly. This
player needs nothing beyond the package's own dependencies. Per note it plays each zone's sample
(``soundfont.py`` resolves them) the way the SF2 2.01 specification describes the basic voice:

- pitch: the sample resampled by linear interpolation at 2^(cents / 1200) x its rate / the output rate, the
  cents from the key, root key, scale tuning, coarse and fine tune and the sample's correction; looping
  samples loop between their loop points (also through the release);
- volume envelope: delay, attack (linear in amplitude), hold, decay (linear in dB, 100 dB per decay time) to
  the sustain level, and from the note-off the release (100 dB per release time), hold and decay scaled by
  key; the zone's initial attenuation, and the velocity as (velocity / 127)^2 in amplitude (the
  specification's default velocity-to-attenuation curve, 40 dB at its foot, approximately);
- a second-order low-pass at the zone's initial filter cutoff and resonance, held still;
- pan: the zone's pan plus the channel's (MIDI CC10), constant power.

Left out, and so not heard: the modulation envelope and both LFOs (vibrato, filter sweeps), reverb and chorus
sends, exclusive classes. The result is deterministic: the same notes give the same samples. It is not
tinysoundfont's sound (other interpolation, envelope and filter details): a corpus records which renderer
made it (``CorpusConfig.renderer``) and the two never mix.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.signal import lfilter

from musiclm_stab.corpus.soundfont import (
    ATTACK,
    ATTENUATION,
    COARSE_TUNE,
    DECAY,
    DELAY,
    END_COARSE,
    END_OFFSET,
    FILTER_FC,
    FILTER_Q,
    FINE_TUNE,
    HOLD,
    KEY_TO_DECAY,
    KEY_TO_HOLD,
    LOOP_END_COARSE,
    LOOP_END_OFFSET,
    LOOP_START_COARSE,
    LOOP_START_OFFSET,
    PAN,
    RELEASE,
    ROOT_KEY,
    SAMPLE_MODES,
    SCALE_TUNING,
    START_COARSE,
    START_OFFSET,
    SUSTAIN,
    SoundFont,
    Voice,
)

SILENT_DB = 100.0  # the envelope's floor: a voice ends when its release has fallen this far
CONTROL = 32  # the envelope is computed every CONTROL output samples and interpolated between


def _seconds(timecents: float) -> float:
    return 2.0 ** (timecents / 1200.0)


def _bounds(voice: Voice) -> tuple[int, int, int, int]:
    """(start, end, loop start, loop end) of the voice's sample in the sample data, offsets applied."""
    s, g = voice.sample, voice.get
    start = s.start + g(START_OFFSET) + 32768 * g(START_COARSE)
    end = s.end + g(END_OFFSET) + 32768 * g(END_COARSE)
    loop_start = s.loop_start + g(LOOP_START_OFFSET) + 32768 * g(LOOP_START_COARSE)
    loop_end = s.loop_end + g(LOOP_END_OFFSET) + 32768 * g(LOOP_END_COARSE)
    return start, end, loop_start, loop_end


def envelope(voice: Voice, key: int, n_on: int, n: int, rate: int, gain: float = 1.0) -> np.ndarray:
    """The volume envelope's amplitude [n] of a note held ``n_on`` output samples, then released, times ``gain``."""
    g = voice.get
    delay, attack = _seconds(g(DELAY)), _seconds(g(ATTACK))
    hold = _seconds(g(HOLD) + (60 - key) * g(KEY_TO_HOLD))
    decay = _seconds(g(DECAY) + (60 - key) * g(KEY_TO_DECAY))
    sustain_db = min(max(g(SUSTAIN), 0), 1000) / 10.0
    release = _seconds(g(RELEASE))
    # control points, in output samples; the note-off is one, so that nothing before it hears the release
    points = np.arange(0, n + CONTROL, CONTROL, dtype=np.float64)
    if n_on % CONTROL and n_on < n:
        points = np.insert(points, n_on // CONTROL + 1, float(n_on))
    t = points / rate
    db = np.clip((t - delay - attack - hold) / decay * SILENT_DB, 0.0, sustain_db)
    amp = np.clip((t - delay) / attack, 0.0, 1.0) * 10.0 ** (-db / 20.0)
    if n_on < n:  # the release, from the level at the note-off
        t_off = n_on / rate
        db_off = np.clip((t_off - delay - attack - hold) / decay * SILENT_DB, 0.0, sustain_db)
        level = min(max((t_off - delay) / attack, 0.0), 1.0) * 10.0 ** (-db_off / 20.0)
        start_db = -20.0 * math.log10(level) if level > 0 else SILENT_DB
        released = points >= n_on
        rel_db = start_db + (t[released] - t_off) / release * SILENT_DB
        amp[released] = np.where(rel_db < SILENT_DB, 10.0 ** (-rel_db / 20.0), 0.0)
    return np.interp(np.arange(n, dtype=np.float64), points, amp * gain)


def release_samples(voice: Voice, rate: int) -> int:
    """Output samples a release takes to fall silent from full level."""
    return int(math.ceil(_seconds(voice.get(RELEASE)) * rate))


def play(sf: SoundFont, voice: Voice, key: int, velocity: int, n_on: int, n_max: int, rate: int,
         channel_pan: int = 64) -> tuple[np.ndarray, float, float]:
    """One voice of a note held ``n_on`` samples: (float64 [n] mono, left gain, right gain) with n <= ``n_max``
    (the note-off plus the release, or the end of a sample that does not loop)."""
    start, end, loop_start, loop_end = _bounds(voice)
    g, s = voice.get, voice.sample
    root = g(ROOT_KEY) if g(ROOT_KEY) >= 0 else s.original_key
    cents = (key - root) * g(SCALE_TUNING) + 100 * g(COARSE_TUNE) + g(FINE_TUNE) + s.correction
    step = 2.0 ** (cents / 1200.0) * s.rate / rate  # sample positions per output sample
    n = min(n_max, n_on + release_samples(voice, rate))
    pos = np.arange(n, dtype=np.float64)
    pos *= step  # (n,) position in the sample, from its start: increasing
    looping = g(SAMPLE_MODES) in (1, 3) and start <= loop_start < loop_end <= end
    if looping:  # past the loop's end, wrap into the loop (in place, on the tail of pos only)
        first, length = loop_start - start, loop_end - loop_start
        tail = pos[int(np.searchsorted(pos, first + length)):]
        tail -= first
        np.fmod(tail, length, out=tail)
        tail += first
    else:
        n = min(n, int(np.searchsorted(pos, end - start - 1)))
        pos = pos[:n]
    if n == 0:
        return np.zeros(0), 0.0, 0.0
    index = pos.astype(np.intp)
    pos -= index  # the fraction between two samples
    index += start
    wave = sf.data[index]
    index += 1
    np.minimum(index, end - 1, out=index)
    wave += (sf.data[index] - wave) * pos  # (n,) linear interpolation
    cutoff = 8.176 * 2.0 ** (g(FILTER_FC) / 1200.0)  # Hz (cents above MIDI key 0)
    if cutoff < 0.45 * rate:
        wave = lfilter(*_lowpass(cutoff, g(FILTER_Q), rate), wave)
    gain = 10.0 ** (-g(ATTENUATION) / 200.0) * (velocity / 127.0) ** 2
    wave *= envelope(voice, key, n_on, n, rate, gain)
    pan = min(max(g(PAN) + (channel_pan - 64) * 500 / 64, -500), 500)
    angle = (pan / 1000.0 + 0.5) * math.pi / 2
    return wave, math.cos(angle), math.sin(angle)


def _lowpass(cutoff: float, q_cb: int, rate: int) -> tuple[np.ndarray, np.ndarray]:
    """A second-order low-pass (the audio EQ cookbook's), resonance ``q_cb`` centibels: (b, a)."""
    w = 2.0 * math.pi * cutoff / rate
    q = 10.0 ** (max(q_cb, 0) / 200.0) / math.sqrt(2.0)  # 0 cB: Butterworth
    alpha = math.sin(w) / (2.0 * q)
    cos = math.cos(w)
    b = np.array([(1 - cos) / 2, 1 - cos, (1 - cos) / 2])
    a = np.array([1 + alpha, -2 * cos, 1 - alpha])
    return b / a[0], a / a[0]
