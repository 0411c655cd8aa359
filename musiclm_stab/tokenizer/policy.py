"""What a unit's rows depend on (``UnitSettings``) and which readable tracks are not used: silence and length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from musiclm_stab.audio.reader import AudioError
from musiclm_stab.constants import HOP_LENGTH, SAMPLE_RATE
from musiclm_stab.tokenizer.sources import TrackRef

SILENCE_POLICIES = ("skip", "keep")


@dataclass(frozen=True)
class UnitSettings:
    """What shapes the rows (all of it is part of the job's identity: settings, encode, plan)."""

    segment_samples: int
    min_samples: int
    silence: str  # skip: silent tracks are failures of kind "silent" and silent segments are dropped
    silence_db: float  # peak (dBFS) below which a track or segment counts as silent
    batch_size: int
    # "track": segments i*batch_size .. (i+1)*batch_size - 1 of one track are encoded together, so a row's
    # codes depend neither on other tracks nor on how a long track is cut into pieces (pieces start on such
    # a boundary); "unit": consecutive segments of a unit, across tracks (outputs started before pieces)
    batching: str = "track"


def silent_reason(peak: float, silence_db: float, kept: int | None = None) -> str | None:
    """Why a track is silent under ``silence="skip"``, or None: its peak (max |x| at the source rate,
    after the down-mix) is below ``silence_db`` dBFS, or none of its segments was (``kept`` == 0)."""
    peak_dbfs = 20 * math.log10(peak) if peak > 0 else -math.inf
    if peak_dbfs < silence_db:
        return (f"silent: peak {peak_dbfs:.1f} dBFS is below the silence threshold {silence_db:g} dBFS "
                "(--silence keep tokenizes it anyway)")
    if kept == 0:
        return f"silent: every segment's peak is below {silence_db:g} dBFS"
    return None


def refusal(ref: TrackRef, stats, bounds, s: UnitSettings) -> AudioError | None:
    """Why a readable track is not used (silence, too short), or None."""
    if s.silence == "skip":
        reason = silent_reason(stats.peak, s.silence_db)
        if reason:
            return AudioError(ref.where, reason, "silent")
    if not bounds:
        n = stats.samples_24k
        if n < HOP_LENGTH:
            return AudioError(ref.where, f"too short: {n} samples at 24 kHz after resampling from "
                              f"{stats.sample_rate} Hz, less than one {HOP_LENGTH}-sample frame", "too_short")
        return AudioError(ref.where, f"too short: {n / SAMPLE_RATE:.3f} s < min_seconds "
                          f"{s.min_samples / SAMPLE_RATE:g} s", "too_short")
    return None
