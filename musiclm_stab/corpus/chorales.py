"""Bach chorales from music21's corpus, voiced for four General MIDI instruments (the default corpus).

    plan_track(source, seed, ensemble)   music21 score -> Track (voices, instruments, timed notes)

Tempo, the "mixed" ensemble's instruments, legato and velocity jitter are seeded by (seed, source).
"""

from __future__ import annotations

import bisect
import logging
import random
from pathlib import Path

from musiclm_stab.corpus.labels import score_key
from musiclm_stab.corpus.render import LEAD_SECONDS, Track, Voice, long_rest_cuts, require

log = logging.getLogger(__name__)

VOICES = ("Soprano", "Alto", "Tenor", "Bass")
VELOCITY = {"Soprano": 92, "Alto": 78, "Tenor": 78, "Bass": 86}  # melody and bass a little forward
PAN = {"Soprano": 44, "Alto": 76, "Tenor": 52, "Bass": 84}  # CC10, 64 = centre: a modest stereo image
TEMPO_QPM = (56, 96)  # quarter notes per minute, drawn per track: chorale tempi, slow to flowing
# Cantata settings have instrumental interludes (not rendered here) that leave all four voices silent
# for bars, up to 44 s in bwv248.64-6: rests of 4 quarters or more are shortened to 2.
LONG_REST_QUARTERS, KEPT_REST_QUARTERS = 4.0, 2.0

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
def chorale_sources() -> list[str]:
    """music21 corpus paths of the Bach chorales (``bach/*.mxl|xml``), sorted.

    The three Humdrum files (bach/*.krn) are left out: they duplicate chorales that are also there as
    MusicXML, and their CCARH encoding reserves "rights to all derivative electronic formats".
    """
    corpus = require("music21.corpus")
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
    corpus, expressions = require("music21.corpus"), require("music21.expressions")
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
    start, cut = long_rest_cuts(spans, LONG_REST_QUARTERS, KEPT_REST_QUARTERS)

    def seconds(offset: float, holds_fermata: bool) -> float:
        # every fermata before `offset` has added a beat; a note ending on a fermata holds through it
        n_holds = (bisect.bisect_right if holds_fermata else bisect.bisect_left)(fermata_ends, offset)
        return LEAD_SECONDS + (offset - start - cut(offset) + n_holds) * beat

    programs = ENSEMBLES[ensemble]
    voices = []
    for voice_name, program, notes in zip(VOICES, programs, notes_per_part, strict=True):
        if program < 0:
            program = rng.choice(MIXED_POOLS[voice_name])
        voice = Voice(voice_name, program, pan=PAN[voice_name])
        for n in notes:
            on = float(n.offset)
            off = on + float(n.quarterLength)
            t_on, t_off = seconds(on, False), seconds(off, True)
            t_off = t_on + max(0.05, (t_off - t_on) * legato)
            for pitch in n.pitches:
                velocity = min(127, max(1, VELOCITY[voice_name] + rng.randint(-6, 6)))
                voice.notes.append((t_on, t_off, int(pitch.midi), velocity))
        voices.append(voice)
    played = require("music21.stream").Score()  # the key of what is heard: the four voices, repeats expanded
    for part in parts:
        played.insert(0, part)
    return Track(source=source, ensemble=ensemble, tempo_qpm=tempo, voices=voices,
                 key=score_key(played, score, source))
