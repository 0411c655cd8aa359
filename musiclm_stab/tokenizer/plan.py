"""The unit plan of a listed source: which tracks (or which part of one long track) each work unit holds.

A work unit is a run of consecutive tracks, closed once it holds ``part_bytes`` of source files or
``part_tracks`` tracks (dataset rows count 0 bytes). Units are what gets committed, resumed, retried and
split into shards, so the plan is fixed at the first run (job.json); a retry of failures that finds a
folder readable now adds units for its files after the others (``relist``). A long lossless file
(``split_long_tracks``) is taken out of its unit and cut into pieces of its segments, units of their
own, so that several workers encode one track at once (segments.piece_rows reads a piece).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

import soundfile as sf

from musiclm_stab.audio.reader import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE
from musiclm_stab.audio.stream import AudioStats
from musiclm_stab.constants import SAMPLE_RATE
from musiclm_stab.tokenizer.sources import Relisted, TrackRef

# Formats libsndfile decodes exactly from any frame it seeks to (a piece of a long track starts mid-file).
# Lossy formats (mp3, ogg) are not split: their decoders' output after a seek is not guaranteed equal.
# Integer PCM only: float audio may exceed full scale, and its gain (audio.MAX_PEAK) depends on the
# whole track's peak, which no piece sees.
SEEKABLE_FORMATS = ("WAV", "WAVEX", "W64", "RF64", "FLAC", "AIFF", "AU")

INTEGER_SUBTYPES = ("PCM_S8", "PCM_U8", "PCM_16", "PCM_24", "PCM_32")

PIECE_SECONDS = 300.0  # audio per piece of a long track (whole segments); tracks of 2 pieces or more are split

# Files smaller than 2 pieces at this many bytes per second are not opened to look for a long track:
# lossless music is well above it (FLAC of 8 kHz mono 16-bit is ~10 kB/s), so only real candidates are.
_MIN_LOSSLESS_BYTES_PER_S = 8_000
# libsndfile reports 2**63 - 1 frames for a header that states no length (a pipe-encoded FLAC's sample
# count 0); the reader takes the count from the last frame (audio.container), so such a track is one unit.
_NO_LENGTH = 2**62


def names_sha256(refs: list[TrackRef]) -> str:
    """Fingerprint of a source's track list (names in order)."""
    return _sha256_of_names(r.name for r in refs)


def _sha256_of_names(names: Iterable[str]) -> str:
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\n")
    return h.hexdigest()


def _under(name: str, folders: Sequence[str]) -> bool:
    return any(name.startswith(f"{folder}/") for folder in folders)


def arrange(refs: list[TrackRef], relisted: Sequence[Sequence[str]]) -> list[TrackRef]:
    """A folder's listing ``refs`` in the order of a unit plan that ``relist`` extended: ``relisted`` names,
    per retry, the inputs then listed as what they hold. Each retry's order is the order before it with those
    inputs kept in place as Relisted (no rows), then the files under them, in listing order; ``index`` is the
    position in that order. Without ``relisted``, ``refs`` as they are."""
    if not relisted:
        return refs
    gone = list(relisted[-1])
    moved = [r for r in refs if _under(r.name, gone)]
    kept = [r for r in refs if not _under(r.name, gone)] + [TrackRef(0, g, g, 0, Relisted()) for g in gone]
    ordered = [*arrange(sorted(kept, key=lambda r: r.name), relisted[:-1]), *moved]
    return [dataclasses.replace(r, index=i) for i, r in enumerate(ordered)]


def relist(refs: list[TrackRef], plan: dict, failed: Iterable[str], part_bytes: int, part_tracks: int,
           segment_samples: int, piece_seconds: float | None, batch_size: int = 1) -> tuple[dict, list[TrackRef]] | None:
    """An earlier run's unit ``plan`` extended to the folder listing ``refs`` in which inputs that failed
    (``failed``: their names, e.g. a folder that could not be read) are gone and the files under them appear:
    those inputs stay in the plan as Relisted (their units, run again, give neither rows nor failure) and the
    files under them are planned as units of their own after the others, so that every unit done keeps its
    tracks. Returns (the plan, ``refs`` arranged as it indexes them); None if the listing changed otherwise
    (checked against the plan's ``names_sha256``: the listing before is the one now, less the files under
    those inputs, plus the inputs)."""
    names = {r.name for r in refs}
    gone = sorted({name for name in failed if name not in names})
    if not gone or "units" not in plan:
        return None
    before = sorted([r.name for r in refs if not _under(r.name, gone)] + gone)
    if _sha256_of_names(before) != plan.get("names_sha256"):
        return None
    rounds = [*plan.get("relisted", []), gone]
    arranged = arrange(refs, rounds)
    moved = [r for r in arranged if _under(r.name, gone)]
    first = len(arranged) - len(moved)
    units = [(first + i, n) for i, n in plan_units(moved, part_bytes, part_tracks)]
    extended = split_long_tracks(arranged, units, segment_samples, piece_seconds, batch_size)
    return ({**plan, "num_tracks": len(refs), "names_sha256": names_sha256(refs),
             "units": [*plan["units"], *extended], "relisted": rounds}, arranged)


def plan_units(refs: list[TrackRef], part_bytes: int, part_tracks: int) -> list[tuple[int, int]]:
    """(first track index, number of tracks) of each unit: consecutive tracks, closed once they hold
    ``part_bytes`` bytes of source files or ``part_tracks`` tracks."""
    units, first, size = [], 0, 0
    for i, r in enumerate(refs):
        size += r.size
        if size >= part_bytes or i + 1 - first >= part_tracks:
            units.append((first, i + 1 - first))
            first, size = i + 1, 0
    if first < len(refs):
        units.append((first, len(refs) - first))
    return units


def track_pieces(ref: TrackRef, segment_samples: int, piece_seconds: float | None,
                 batch_size: int = 1) -> list[tuple[int, int | None]]:
    """(first segment, stop segment or None for the rest) of each piece of a long track, or [] when it is
    not split: not a file, not integer PCM in a seekable lossless format, shorter than two pieces, or with a
    header the reader refuses (sample rate) or completes (no length stated): those stay one unit.

    The length comes from the file's header (exact for these formats); if the data is shorter, the
    pieces that reach past it report the track truncated, as an unsplit run would. A piece holds a
    multiple of ``batch_size`` segments, so that it starts where a batch of the unsplit track starts.
    """
    if not piece_seconds or not isinstance(ref.payload, str) or \
            ref.size < 2 * piece_seconds * _MIN_LOSSLESS_BYTES_PER_S:
        return []
    try:
        info = sf.info(ref.payload)
    except Exception:  # noqa: BLE001 - not readable now: it stays one unit, whose run reports why
        return []
    if info.format not in SEEKABLE_FORMATS or info.subtype not in INTEGER_SUBTYPES \
            or not MIN_SAMPLE_RATE <= info.samplerate <= MAX_SAMPLE_RATE or not 0 < info.frames < _NO_LENGTH:
        return []
    full = AudioStats(info.frames, info.samplerate, 0.0, 0).samples_24k // segment_samples  # whole segments
    per = max(1, round(piece_seconds * SAMPLE_RATE / segment_samples))
    per = -(-per // batch_size) * batch_size  # whole batches
    count = full // per
    if count < 2:
        return []
    return [(p * per, (p + 1) * per if p < count - 1 else None) for p in range(count)]


def split_long_tracks(refs: list[TrackRef], units: list[tuple[int, int]], segment_samples: int,
                      piece_seconds: float | None, batch_size: int = 1) -> list[list[int | None]]:
    """The unit plan with every long track (``track_pieces``) taken out of its unit and cut into pieces.

    Units are [first, count] as planned by ``plan_units``; a piece is [track, 1, first segment, stop
    segment or None]. The tracks around a long one keep their order, in the units before and after it.
    """
    out: list[list[int | None]] = []
    for first, count in units:
        start = first
        for i in range(first, first + count):
            pieces = track_pieces(refs[i], segment_samples, piece_seconds, batch_size)
            if pieces:
                if i > start:
                    out.append([start, i - start])
                out += [[i, 1, a, b] for a, b in pieces]
                start = i + 1
        if start < first + count:
            out.append([start, first + count - start])
    return out
