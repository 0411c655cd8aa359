"""The default corpus of real music, made offline: Bach chorales voiced for General MIDI instruments,
and (``preset="hours"``) a few hours of chorales, string quartets, madrigals, trecento polyphony and
fiddle tunes (corpus_works.py).

Why this exists: the pipeline needs real music to tokenize and pretrain on, and tests and CPU runs need
it without a network. ``music21`` ships the Bach chorales as scores; ``pretty_midi`` ships a small
General MIDI soundfont (TimGM6mb.sf2); ``tinysoundfont`` renders notes through that soundfont with no
system libraries. Everything below is deterministic in the seed, so the same seed gives byte-identical
audio files.

    plan_track(source, seed, ensemble)   music21 score -> Track (voices, instruments, timed notes)
    render_track(track, sample_rate)     Track -> float32 audio [S, 2], peak at -1 dBFS
    build_corpus(out_dir, ...)           N tracks -> {index:03d}_{name}.flac + manifest.jsonl + corpus.json
    build_corpus(out_dir, preset="hours")     the larger build; see corpus_works.PRESETS

Licences of the sources are in data/README.md.
"""

from __future__ import annotations

import argparse
import bisect
import importlib
import json
import logging
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SOUNDFONT_NAME = "TimGM6mb.sf2"  # ships inside pretty_midi's wheel
FORMATS = {"flac": "FLAC", "wav": "WAV"}  # --format -> libsndfile major format
CORPUS_VERSION = 1  # bump when a change to this module changes the audio for the same config

VOICES = ("Soprano", "Alto", "Tenor", "Bass")
VELOCITY = {"Soprano": 92, "Alto": 78, "Tenor": 78, "Bass": 86}  # melody and bass a little forward
PAN = {"Soprano": 44, "Alto": 76, "Tenor": 52, "Bass": 84}  # CC10, 64 = centre: a modest stereo image
TEMPO_QPM = (56, 96)  # quarter notes per minute, drawn per track: chorale tempi, slow to flowing
LEAD_SECONDS = 0.1  # silence before the first note
TAIL_SECONDS = 1.2  # room for the release of the last chord
# Cantata settings have instrumental interludes (not rendered here) that leave all four voices silent
# for bars, up to 44 s in bwv248.64-6: rests of LONG_REST or more are shortened to KEPT_REST.
LONG_REST_QUARTERS, KEPT_REST_QUARTERS = 4.0, 2.0
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
# Ensembles as (Soprano, Alto, Tenor, Bass) programs. Tracks cycle through a seeded shuffle of
# ENSEMBLE_CYCLE, so every ensemble comes once per cycle and the corpus is not all piano.
ENSEMBLES: dict[str, tuple[int, int, int, int]] = {
    "string quartet": (40, 40, 41, 42),
    "string orchestra": (48, 48, 48, 43),
    "woodwind quartet": (73, 68, 71, 70),
    "brass quartet": (56, 60, 57, 58),
    "saxophone quartet": (64, 64, 66, 67),  # not Alto Sax (65): TimGM6mb has no sample for its E4
    "choir": (52, 53, 53, 52),
    "church organ": (19, 19, 19, 19),
    "reed organ": (20, 20, 20, 20),
    "piano": (0, 0, 0, 0),
    "harpsichord": (6, 6, 6, 6),
    "guitars": (24, 24, 24, 25),
    "harp": (46, 46, 46, 46),
    "mixed": (-1, -1, -1, -1),  # each voice drawn from MIXED_POOLS
}
ENSEMBLE_CYCLE = [*ENSEMBLES, "mixed"]  # "mixed" twice: its colours vary most, so it gets two slots
MIXED_POOLS = {  # instruments whose range suits each voice
    "Soprano": (40, 73, 68, 71, 56, 64, 74, 52),
    "Alto": (41, 71, 69, 60, 40, 53),
    "Tenor": (42, 70, 57, 66, 60, 41, 52),
    "Bass": (43, 42, 58, 70, 57, 67),
}

LICENCE_NOTE = (
    "Composition: J. S. Bach, public domain. Score encoding: music21 corpus (most files credit "
    "(c) 2004 Margaret Greentree, jsbchorales.net; see music21/corpus/license.txt). Rendered with "
    "TimGM6mb.sf2 (Tim Brechbill, GPL-2) from pretty_midi. See data/README.md."
)
INSTALL_HINT = {
    "music21": "pip install 'musiclm_stab[corpus]'",
    "pretty_midi": "pip install 'musiclm_stab[corpus]'",
    "tinysoundfont": "pip install --no-deps tinysoundfont  (its pyaudio dependency is only for playback)",
}


def _require(module: str):
    """Import an optional dependency of the corpus builder, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        raise ImportError(
            f"building the corpus needs {package}: {INSTALL_HINT.get(package, f'pip install {package}')}"
        ) from e


@dataclass
class Voice:
    """One chorale voice on one MIDI channel; ``notes`` are (start_s, end_s, key, velocity)."""

    name: str
    program: int
    notes: list[tuple[float, float, int, int]] = field(default_factory=list)
    pan: int | None = None  # CC10; None: the chorale voice's PAN

    @property
    def pan_cc(self) -> int:
        return self.pan if self.pan is not None else PAN[self.name]

    @property
    def instrument(self) -> str:
        return GM_NAMES[self.program]


@dataclass
class Track:
    """A chorale, voiced and timed, ready to render."""

    source: str  # music21 corpus path, e.g. "bach/bwv1.6.mxl"
    ensemble: str
    tempo_qpm: int
    voices: list[Voice]
    title: str | None = None  # file name stem; default: the source's stem

    @property
    def name(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", self.title or Path(self.source).stem)

    @property
    def seconds(self) -> float:
        return max(end for v in self.voices for _, end, _, _ in v.notes) + TAIL_SECONDS


@dataclass(frozen=True)
class CorpusConfig:
    """What makes two corpora the same; recorded in corpus.json."""

    num_tracks: int
    seed: int
    sample_rate: int
    fmt: str
    max_seconds: float | None
    version: int = CORPUS_VERSION
    preset: str = "default"

    def as_dict(self) -> dict:
        """For corpus.json; the default preset is left out, so corpora built before presets still match."""
        d = asdict(self)
        if d["preset"] == "default":
            del d["preset"]
        return d


def soundfont_path() -> Path:
    """TimGM6mb.sf2 from pretty_midi's package directory (no system fluidsynth, no network)."""
    path = Path(_require("pretty_midi").__file__).parent / SOUNDFONT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{SOUNDFONT_NAME} not found in pretty_midi's package dir {path.parent}")
    return path


def chorale_sources() -> list[str]:
    """music21 corpus paths of the Bach chorales (``bach/*.mxl|xml``), sorted.

    The three Humdrum files (bach/*.krn) are left out: they duplicate chorales that are also there as
    MusicXML, and their CCARH encoding reserves "rights to all derivative electronic formats".
    """
    corpus = _require("music21.corpus")
    sources = []
    for p in corpus.getComposer("bach"):
        p = Path(str(p))
        if p.parent.name == "bach" and p.suffix in (".mxl", ".xml"):
            sources.append(f"bach/{p.name}")
    return sorted(sources)


def _pick_voices(score) -> list:
    """The Soprano, Alto, Tenor and Bass parts, found by part name ("Soprano Oboe 1 Violin1" counts).

    Every chorale in music21's corpus names its four voices; cantata settings add instrumental parts,
    which are left out. Raises ValueError when a voice is missing (e.g. bwv846, a keyboard prelude).
    """
    by_name = {}
    for part in score.parts:
        name = (part.partName or "").strip().lower()
        for voice in VOICES:
            if name.startswith(voice.lower()) and voice not in by_name and len(part.flatten().notes) > 0:
                by_name[voice] = part
    missing = [v for v in VOICES if v not in by_name]
    if missing:
        names = [p.partName for p in score.parts]
        raise ValueError(f"no {'/'.join(missing)} part among the parts {names}")
    return [by_name[v] for v in VOICES]


def plan_track(source: str, seed: int, ensemble: str) -> Track:
    """Parse a chorale and turn it into timed notes for four GM instruments.

    Tempo, the "mixed" ensemble's instruments, legato and velocity jitter come from a generator seeded
    by (seed, source). Repeats are expanded where music21 can; each fermata holds for one extra beat;
    long rests in all four voices are shortened.
    Raises on scores that cannot be parsed or voiced (the caller skips them).
    """
    corpus, expressions = _require("music21.corpus"), _require("music21.expressions")
    rng = random.Random(f"{seed}:{source}")  # str seeds hash with sha512: stable across processes
    score = corpus.parse(source)
    try:
        score = score.expandRepeats()
    except Exception as e:  # badly formed repeat marks in some encodings: play them as written
        log.debug("%s: repeats not expanded (%s)", source, e)
    parts = [p.stripTies() for p in _pick_voices(score)]

    tempo = rng.randint(*TEMPO_QPM)
    beat = 60.0 / tempo
    legato = rng.uniform(0.85, 1.0)  # fraction of a note's written length that sounds
    notes_per_part = [[n for n in p.flatten().notes if n.quarterLength > 0] for p in parts]
    fermata_ends = sorted(
        {
            float(n.offset + n.quarterLength)
            for notes in notes_per_part
            for n in notes
            if any(isinstance(e, expressions.Fermata) for e in n.expressions)
        }
    )
    spans = sorted((float(n.offset), float(n.offset + n.quarterLength)) for ns in notes_per_part for n in ns)
    start, reach = spans[0]
    rest_ends, removed = [], [0.0]  # offsets where a long rest ends; quarters cut up to each of them
    for on, off in spans[1:]:
        if on - reach >= LONG_REST_QUARTERS:
            rest_ends.append(on)
            removed.append(removed[-1] + on - reach - KEPT_REST_QUARTERS)
        reach = max(reach, off)

    def seconds(offset: float, holds_fermata: bool) -> float:
        # every fermata before `offset` has added a beat; a note ending on a fermata holds through it
        n_holds = (bisect.bisect_right if holds_fermata else bisect.bisect_left)(fermata_ends, offset)
        cut = removed[bisect.bisect_right(rest_ends, offset)]
        return LEAD_SECONDS + (offset - start - cut + n_holds) * beat

    programs = ENSEMBLES[ensemble]
    voices = []
    for voice_name, program, notes in zip(VOICES, programs, notes_per_part, strict=True):
        if program < 0:
            program = rng.choice(MIXED_POOLS[voice_name])
        voice = Voice(voice_name, program)
        for n in notes:
            on = float(n.offset)
            off = on + float(n.quarterLength)
            t_on, t_off = seconds(on, False), seconds(off, True)
            t_off = t_on + max(0.05, (t_off - t_on) * legato)
            for pitch in n.pitches:
                velocity = min(127, max(1, VELOCITY[voice_name] + rng.randint(-6, 6)))
                voice.notes.append((t_on, t_off, int(pitch.midi), velocity))
        voices.append(voice)
    return Track(source=source, ensemble=ensemble, tempo_qpm=tempo, voices=voices)


def render_track(
    track: Track, sample_rate: int = 44100, max_seconds: float | None = None, soundfont: bytes | None = None
) -> np.ndarray:
    """Render a track with tinysoundfont: float32 [S, 2] (stereo), peak normalized to PEAK_DBFS.

    Notes are switched on and off at exact sample positions (``generate_simple`` between events), so
    the result does not depend on buffer sizes. A fresh synth per track keeps tracks independent.
    """
    synth = _require("tinysoundfont").Synth(samplerate=sample_rate)
    sfid = synth.sfload(soundfont if soundfont is not None else str(soundfont_path()))
    for channel, voice in enumerate(track.voices):  # at most 8 voices: never channel 9, the GM drum channel
        synth.program_select(channel, sfid, 0, voice.program)
        synth.control_change(channel, 10, voice.pan_cc)

    total = track.seconds if max_seconds is None else min(track.seconds, max_seconds)
    n_samples = int(round(total * sample_rate))
    events = []  # (sample, is_on, channel, key, velocity): note-offs sort before note-ons at a sample
    for channel, voice in enumerate(track.voices):
        for t_on, t_off, key, velocity in voice.notes:
            events.append((int(round(t_on * sample_rate)), 1, channel, key, velocity))
            events.append((int(round(t_off * sample_rate)), 0, channel, key, 0))
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

    if max_seconds is not None and track.seconds > max_seconds:
        fade = min(n_samples, int(FADE_SECONDS * sample_rate))
        audio[n_samples - fade :] *= np.linspace(1.0, 0.0, fade, dtype=np.float32)[:, None]
    peak = float(np.abs(audio).max())
    if not np.isfinite(peak) or peak < 1e-6:
        raise RuntimeError(f"{track.source}: rendered audio is silent (peak {peak:.2e})")
    return audio * np.float32(10 ** (PEAK_DBFS / 20) / peak)


def _write_audio(path: Path, audio: np.ndarray, sample_rate: int, fmt: str) -> None:
    """16-bit PCM, quantized here (not by libsndfile) so the bytes depend only on the samples."""
    import soundfile as sf

    pcm = np.clip(np.round(audio * 32767.0), -32768, 32767).astype(np.int16)
    partial = path.with_name(f".{path.name}.partial")
    sf.write(partial, pcm, sample_rate, format=FORMATS[fmt], subtype="PCM_16")
    os.replace(partial, path)  # atomic: a file with the final name is always complete


def _corpus_files(out_dir: Path) -> list[Path]:
    """Files a previous build wrote here (audio, manifest, corpus.json, leftovers of an interrupted run)."""
    pattern = re.compile(r"^\.?\d{3,}_.+\.(flac|wav)(\.partial)?$")
    names = {"manifest.jsonl", "corpus.json"}
    return [p for p in out_dir.iterdir() if p.is_file() and (p.name in names or pattern.match(p.name))]


def _check_out_dir(out_dir: Path, config: CorpusConfig, overwrite: bool) -> list[Path] | None:
    """The paths of a complete corpus with this config already in out_dir, else None.

    Refuses (FileExistsError) a non-empty dir holding anything else, unless overwrite=True, in which
    case the previous corpus's files are deleted (other files are left alone).
    """
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return None
    meta_path = out_dir / "corpus.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if meta is not None and meta.get("config") == config.as_dict():
        files = [out_dir / f for f in meta.get("files", [])]
        if meta.get("complete") and all(f.is_file() for f in files):
            return files
        log.info("%s holds an unfinished corpus with the same config: building it again", out_dir)
    elif not overwrite:
        found = f"a corpus with config {meta.get('config')}" if meta else "files but no corpus.json"
        raise FileExistsError(
            f"{out_dir} is not empty: it holds {found}, and this build's config is {config.as_dict()}. "
            "Choose another directory, or pass overwrite=True (--overwrite) to replace that corpus."
        )
    for f in _corpus_files(out_dir):
        f.unlink()
    return None


def build_corpus(
    out_dir: str | os.PathLike,
    num_tracks: int | None = None,
    seed: int = 0,
    sample_rate: int = 44100,
    fmt: str = "flac",
    max_seconds: float | None = None,
    overwrite: bool = False,
    progress: bool = True,
    preset: str = "default",
) -> list[Path]:
    """Render the corpus into ``out_dir``; return the audio paths in track order.

    ``preset="default"``: ``num_tracks`` (default 24) Bach chorales. ``preset="hours"``: a few hours of
    chorales, string quartets, madrigals, trecento polyphony and fiddle tunes, interleaved, each track
    cut at ``max_seconds`` (default 180 s); ``num_tracks`` takes the first tracks of it.
    Writes ``{index:03d}_{name}.{fmt}`` (stereo, 16-bit, ``sample_rate`` Hz; 44.1 kHz by default so
    that the tokenizer's resampling is exercised), ``manifest.jsonl`` (one row per track, with its
    source, instruments and licence) and ``corpus.json`` (the config; written last, so its "complete"
    flag means every file is there). Deterministic in ``seed``; the first k tracks of a larger corpus
    with the same seed and preset are the same tracks. Returns at once if out_dir already holds this corpus.
    """
    from tqdm import tqdm

    from musiclm_stab.corpus_works import PRESET_MAX_SECONDS, PRESETS, plans

    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: choose one of {sorted(PRESETS)}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: choose one of {sorted(FORMATS)}")
    total = sum(PRESETS[preset].values())
    num_tracks = total if num_tracks is None else num_tracks
    if num_tracks < 1 or (preset != "default" and num_tracks > total):
        raise ValueError(f"num_tracks={num_tracks}: must be at least 1" + (f" and at most {total} for preset "
                                                                           f"{preset!r}" if preset != "default" else ""))
    max_seconds = PRESET_MAX_SECONDS[preset] if max_seconds is None else max_seconds
    out_dir = Path(out_dir)
    config = CorpusConfig(num_tracks, seed, sample_rate, fmt, max_seconds, preset=preset)
    done = _check_out_dir(out_dir, config, overwrite)
    if done is not None:
        log.info("%s already holds this corpus (%d tracks): nothing to do", out_dir, len(done))
        return done
    out_dir.mkdir(parents=True, exist_ok=True)

    meta = {
        "config": config.as_dict(),
        "complete": False,
        "files": [],
        "music21_version": _require("music21").__version__,
        "soundfont": SOUNDFONT_NAME,
    }
    (out_dir / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
    soundfont = soundfont_path().read_bytes()

    paths, rows = [], []
    bar = tqdm(total=num_tracks, desc="rendering", unit="track", disable=not progress)
    t0 = time.perf_counter()
    for collection, track in plans(preset, seed, num_tracks):
        if len(paths) == num_tracks:
            break
        index = len(paths)
        t1 = time.perf_counter()
        audio = render_track(track, sample_rate, max_seconds, soundfont)
        path = out_dir / f"{index:03d}_{track.name}.{fmt}"
        _write_audio(path, audio, sample_rate, fmt)
        t2 = time.perf_counter()
        seconds = audio.shape[0] / sample_rate
        log.info("%s: %.1f s of audio; parse %.2f s, render+write %.2f s", path.name, seconds, t1 - t0, t2 - t1)
        t0 = t2
        paths.append(path)
        rows.append(
            {
                "file": path.name,
                "source": track.source,
                "collection": collection,
                "ensemble": track.ensemble,
                "instruments": [
                    {"voice": v.name, "program": v.program, "instrument": v.instrument} for v in track.voices
                ],
                "tempo_qpm": track.tempo_qpm,
                "seconds": round(seconds, 3),
                "sample_rate": sample_rate,
                "channels": 2,
                "licence": LICENCE_NOTE if collection == "chorales" else _collection_licence(collection),
            }
        )
        bar.update(1)
    bar.close()
    if len(paths) < num_tracks:
        raise RuntimeError(f"only {len(paths)} tracks could be rendered; asked for {num_tracks}")

    with open(out_dir / "manifest.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    meta.update(complete=True, files=[p.name for p in paths])
    (out_dir / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
    return paths


def _collection_licence(name: str) -> str:
    from musiclm_stab.corpus_works import COLLECTIONS

    return COLLECTIONS[name].licence


def read_manifest(out_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``out_dir/manifest.jsonl``."""
    with open(Path(out_dir) / "manifest.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def cli_main(argv: list[str] | None = None) -> int:
    """``musiclm-stab build-corpus OUT_DIR [--num-tracks 24] [--seed 0] ...``"""
    parser = argparse.ArgumentParser(
        prog="musiclm-stab build-corpus",
        description="Render music from music21's corpus with a General MIDI soundfont (offline).",
    )
    parser.add_argument("out_dir", help="directory for the audio files, manifest.jsonl and corpus.json")
    parser.add_argument("--preset", choices=["default", "hours"], default="default",
                        help="default: 24 Bach chorales (~22 min); hours: chorales, string quartets, madrigals, "
                        "trecento polyphony and fiddle tunes (a few hours; see data/README.md)")
    parser.add_argument("--num-tracks", type=int, default=None, help="default: 24, or all of the preset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-rate", type=int, default=44100)
    parser.add_argument("--format", dest="fmt", choices=sorted(FORMATS), default="flac")
    parser.add_argument("--max-seconds", type=float, default=None, help="cut each track to this length")
    parser.add_argument("--overwrite", action="store_true", help="replace a different corpus in OUT_DIR")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    t0 = time.perf_counter()
    try:
        paths = build_corpus(
            args.out_dir,
            num_tracks=args.num_tracks,
            seed=args.seed,
            sample_rate=args.sample_rate,
            fmt=args.fmt,
            max_seconds=args.max_seconds,
            overwrite=args.overwrite,
            preset=args.preset,
        )
    except FileExistsError as e:
        print(f"musiclm-stab build-corpus: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    minutes = sum(row["seconds"] for row in read_manifest(args.out_dir)) / 60
    print(f"{len(paths)} tracks, {minutes:.1f} min of audio in {args.out_dir} ({elapsed:.1f} s)")
    return 0
