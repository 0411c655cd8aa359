"""Exact labels of a rendered corpus, aligned to the model's 75 Hz frames (written by ``build_corpus``).

    labels.jsonl            one row per track: key, key signature, instruments per voice, tempo, frames
    labels/{stem}.npz       per track: pitch [T, 128] bool, voice_active [T, V] bool, notes [N, 5] float64

Frame t of a track covers [t/75, (t+1)/75) s of the track: the same frames as the tokenizer's (24 kHz
samples [320t, 320t+320)) and the model's. The rule for "active": a note is active in frame t when the
frame's centre, (t + 0.5)/75 s, lies in [on, off), with on and off the samples at which the note-on and
note-off were sent to the synth (``render.note_samples``; the tail of the release after a note-off is
not labelled). A note therefore covers the frames whose larger half it sounds in, and its first and last
active frames are within one frame of the frames holding its note-on and note-off. Where a track is cut
at ``max_seconds``, notes that start after the cut are dropped and the others end at the cut.
The schema is documented in data/README.md; ``read_labels`` reads it back.
"""

from __future__ import annotations

import io
import json
import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from musiclm_stab.constants import FRAME_RATE
from musiclm_stab.corpus.render import Track, note_samples, num_samples, require

log = logging.getLogger(__name__)

LABELS_VERSION = 1  # bump when the labels' content or schema changes
LABELS_FILE = "labels.jsonl"
LABELS_DIR = "labels"
NUM_PITCHES = 128  # MIDI keys 0-127
PITCH_CLASSES = ("C", "C#", "D", "Eb", "E", "F", "F#", "G", "Ab", "A", "Bb", "B")
KEY_NAMES = tuple(f"{pc} major" for pc in PITCH_CLASSES) + tuple(f"{pc} minor" for pc in PITCH_CLASSES)
KEY_METHOD = "music21 Stream.analyze('key'): Aarden-Essen key profiles over the whole score as played"
GM_FAMILIES = (  # General MIDI program families of 8 programs: family = program // 8
    "Piano", "Chromatic Percussion", "Organ", "Guitar", "Bass", "Strings", "Ensemble", "Brass",
    "Reed", "Pipe", "Synth Lead", "Synth Pad", "Synth Effects", "Ethnic", "Percussive", "Sound Effects",
)


# ------------------------------------------------------------------------------------------ the key


def key_index(tonic_pc: int, mode: str) -> int:
    """0-11: C major .. B major, 12-23: C minor .. B minor (the key classes of the probe)."""
    if mode not in ("major", "minor"):
        raise ValueError(f"mode {mode!r}: only major and minor keys have a class")
    return tonic_pc % 12 + (12 if mode == "minor" else 0)


def score_key(played, score=None, source: str = "") -> dict | None:
    """``key_facts``, or None (with a logged warning) for a score music21 cannot analyse: a label must
    never change which tracks a corpus holds."""
    try:
        return key_facts(played, score)
    except Exception as e:  # music21 raises many kinds; the track is still rendered, without a key
        log.warning("%s: no key label (%s: %s)", source, type(e).__name__, e)
        return None


def key_facts(played, score=None) -> dict:
    """The key of a score as played, and its written key signature, for the labels.

    ``played``: the music21 stream of what is rendered (the voices used); ``score``: where to look for the
    first key signature (default: ``played``). The key is music21's analysis (``KEY_METHOD``); the key
    signature is given as written (sharps, negative for flats), with the mode the encoding states, if any:
    chorale encodings often write a minor key with one flat fewer (Dorian notation), and their stated
    modes disagree with the music in several files, which is why the analysis is the label.
    """
    key_mod = require("music21.key")
    analysed = played.analyze("key")
    tonic_pc = int(analysed.tonic.pitchClass)
    facts: dict = {
        "tonic": PITCH_CLASSES[tonic_pc],
        "tonic_pc": tonic_pc,
        "mode": analysed.mode,
        "name": f"{PITCH_CLASSES[tonic_pc]} {analysed.mode}",
        "index": key_index(tonic_pc, analysed.mode) if analysed.mode in ("major", "minor") else None,
        "correlation": round(float(analysed.correlationCoefficient), 4),
        "method": KEY_METHOD,
    }
    signatures = list((score if score is not None else played).recurse().getElementsByClass(key_mod.KeySignature))
    first = signatures[0] if signatures else None
    facts["signature"] = None if first is None else {
        "sharps": int(first.sharps),
        "encoded_mode": first.mode if isinstance(first, key_mod.Key) else None,
    }
    return facts


# --------------------------------------------------------------------------------------- the frames


def frame_range(on_sample: int, off_sample: int, sample_rate: int) -> tuple[int, int]:
    """Frames [first, stop) of a note sounding over samples [on_sample, off_sample) at ``sample_rate``:
    those whose centre (t + 0.5) / 75 s lies in [on, off). Integer arithmetic, so no rounding at edges."""

    def first_centre_at_or_after(sample: int) -> int:  # smallest t with (2t + 1) * sr >= 2 * 75 * sample
        return max(0, -((sample_rate - 2 * FRAME_RATE * sample) // (2 * sample_rate)))

    return first_centre_at_or_after(on_sample), first_centre_at_or_after(off_sample)


def num_frames(samples: int, sample_rate: int) -> int:
    """Frames that hold any sample of audio ``samples`` long: ceil(samples * 75 / sample_rate)."""
    return -(-samples * FRAME_RATE // sample_rate)


@dataclass
class TrackLabels:
    """The labels of one track: the arrays of its .npz and its row of labels.jsonl."""

    pitch: np.ndarray  # bool [T, 128]: MIDI pitch active in frame t (any voice)
    voice_active: np.ndarray  # bool [T, V]: voice v has a note active in frame t
    notes: np.ndarray  # float64 [N, 5]: on_s, off_s (as rendered, cut at the end), midi, velocity, voice
    row: dict

    def arrays(self) -> dict[str, np.ndarray]:
        return {"pitch": self.pitch, "voice_active": self.voice_active, "notes": self.notes}


def track_labels(track: Track, sample_rate: int, max_seconds: float | None = None) -> TrackLabels:
    """Labels of a track as ``render_track(track, sample_rate, max_seconds)`` renders it.

    The row (without ``file``/``labels``, which the caller adds) holds everything piece-level: see
    data/README.md for the schema.
    """
    n = num_samples(track, sample_rate, max_seconds)
    T = num_frames(n, sample_rate)
    pitch = np.zeros((T, NUM_PITCHES), dtype=bool)
    voice_active = np.zeros((T, len(track.voices)), dtype=bool)
    notes = []
    for v, voice in enumerate(track.voices):
        for t_on, t_off, key, velocity in voice.notes:
            on, off = note_samples(t_on, sample_rate), note_samples(t_off, sample_rate)
            if on >= n:  # the renderer stops sending events at the cut
                continue
            off = min(off, n)
            first, stop = frame_range(on, off, sample_rate)
            pitch[first:stop, key] = True
            voice_active[first:stop, v] = True
            notes.append((on / sample_rate, off / sample_rate, key, velocity, v))
    notes_arr = np.array(sorted(notes), dtype=np.float64).reshape(-1, 5)
    voices = [
        {"voice": v.name, "program": v.program, "instrument": v.instrument, "family": v.program // 8,
         "family_name": GM_FAMILIES[v.program // 8], "num_notes": int((notes_arr[:, 4] == i).sum())}
        for i, v in enumerate(track.voices)
    ]
    row = {
        "labels_version": LABELS_VERSION,
        "source": track.source,
        "frame_rate": FRAME_RATE,
        "num_frames": T,
        "seconds": round(n / sample_rate, 6),
        "tempo_qpm": track.tempo_qpm,
        "key": track.key,
        "voices": voices,
        "top_family": voices[0]["family"],  # the top voice (soprano / highest part): the instrument probe's class
        "pitch_range": [int(notes_arr[:, 2].min()), int(notes_arr[:, 2].max())] if len(notes_arr) else None,
    }
    return TrackLabels(pitch, voice_active, notes_arr, row)


# --------------------------------------------------------------------------------------- the files


def labels_path(audio_name: str) -> str:
    """Where the arrays of an audio file's labels live, relative to the corpus folder."""
    return f"{LABELS_DIR}/{Path(audio_name).stem}.npz"


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An uncompressed-format .npz (read by ``np.load``) with fixed zip timestamps, written atomically:
    the same arrays give the same bytes (``np.savez`` stamps the current time)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, arr in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, member.getvalue())
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(buf.getvalue())
    os.replace(partial, path)


def write_track_labels(out_dir: Path, audio_name: str, labels: TrackLabels, collection: str) -> dict:
    """Write ``labels/{stem}.npz`` for the audio file ``audio_name``; return its labels.jsonl row."""
    rel = labels_path(audio_name)
    write_npz(out_dir / rel, labels.arrays())
    return {"file": audio_name, "labels": rel, "collection": collection, **labels.row}


def write_labels_file(out_dir: Path, rows: list[dict]) -> None:
    partial = out_dir / f".{LABELS_FILE}.partial"
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(partial, out_dir / LABELS_FILE)


class CorpusLabels:
    """The labels of a corpus folder: ``rows[file]`` (labels.jsonl) and the arrays on demand.

    ``file`` is the audio file's name, which is also its ``track`` in a dataset tokenized from the folder
    (the path relative to the folder).
    """

    def __init__(self, corpus_dir: str | os.PathLike):
        self.dir = Path(corpus_dir)
        path = self.dir / LABELS_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{self.dir} has no {LABELS_FILE}: it is not a corpus built with labels. Build it with "
                "`musiclm-stab build-corpus` (a corpus built before labels existed gets them when the same "
                "command is run again on it)"
            )
        self.rows: dict[str, dict] = {}
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                self.rows[row["file"]] = row
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}, line {i + 1}: not a labels row ({type(e).__name__}: {e})") from e
        self._cache: dict[str, dict[str, np.ndarray]] = {}

    def row(self, track: str) -> dict:
        if track not in self.rows:
            raise KeyError(f"{self.dir / LABELS_FILE} has no labels for track {track!r} (it has "
                           f"{len(self.rows)} tracks, e.g. {next(iter(self.rows), None)!r})")
        return self.rows[track]

    def arrays(self, track: str) -> dict[str, np.ndarray]:
        """{"pitch": bool [T, 128], "voice_active": bool [T, V], "notes": float64 [N, 5]} of a track."""
        if track not in self._cache:
            path = self.dir / self.row(track)["labels"]
            try:
                with np.load(path, allow_pickle=False) as z:
                    self._cache[track] = {k: z[k] for k in ("pitch", "voice_active", "notes")}
            except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
                raise ValueError(f"{path}: unreadable labels ({type(e).__name__}: {e})") from e
        return self._cache[track]

    def segment_pitch(self, track: str, start_seconds: float, frames: int) -> np.ndarray:
        """bool [frames, 128]: the pitch labels of a tokenized segment starting ``start_seconds`` into the
        track (its frame t is track frame start*75 + t). Frames past the labelled end are silent."""
        first = start_seconds * FRAME_RATE
        if abs(first - round(first)) > 1e-6:
            raise ValueError(f"{track}: segment start {start_seconds} s is not on a frame boundary")
        first = round(first)
        pitch = self.arrays(track)["pitch"]
        out = np.zeros((frames, pitch.shape[1]), dtype=bool)
        part = pitch[first : first + frames]
        out[: len(part)] = part
        return out


def read_labels(corpus_dir: str | os.PathLike) -> CorpusLabels:
    """The labels of a corpus folder built by ``build_corpus``."""
    return CorpusLabels(corpus_dir)


def labels_complete(out_dir: Path, files: list[str]) -> bool:
    """Whether out_dir holds labels of this version for every audio file in ``files``."""
    path = out_dir / LABELS_FILE
    if not path.is_file():
        return False
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as e:
            log.warning("%s: unreadable row (%s): the labels are written again", path, e)
            return False
        if isinstance(row, dict):
            rows[row.get("file")] = row
    return all(
        f in rows and rows[f].get("labels_version") == LABELS_VERSION and (out_dir / rows[f]["labels"]).is_file()
        for f in files
    )

