"""More real music for the corpus: string quartets, madrigals, trecento polyphony and fiddle tunes from
music21's corpus, voiced for General MIDI instruments by register (the ``hours`` preset of ``build.py``).

Where corpus.py voices Bach chorales (four named voices), this works for any score with 1-8 pitched
parts: parts are ordered top to bottom by median pitch and each gets an instrument that suits its
register, from an ensemble drawn per track (strings, winds, brass, saxophones, keyboard, plucked,
choir, or mixed). Tempo comes from the score's first metronome mark when it has a usable one, else
from a seeded draw in the collection's range. Everything is seeded by (seed, source).

Sources are chosen with their licences in mind (data/README.md): files whose embedded notice
reserves rights (CCARH's Humdrum encodings, a publisher's copyright) are never used.
"""

from __future__ import annotations

import functools
import logging
import random
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from musiclm_stab.corpus.labels import score_key
from musiclm_stab.corpus.render import LEAD_SECONDS, Track, Voice, long_rest_cuts, require

log = logging.getLogger(__name__)

# Notices that keep a file out of the corpus: CCARH's Humdrum "rights reserved", a modern edition's
# copyright (Ut Orpheus Edizioni), any MusicXML <rights> claiming copyright (even with no holder named).
EXCLUDING_NOTICES = re.compile(
    rb"Rights to all derivative electronic formats reserved|UT\s*ORPHEUS|<rights>[^<]*(?:copyright|\xc2\xa9)", re.I)
MAX_PARTS = 8  # MIDI channels 0-8 (9 is the GM drum channel)
# Rests in every part of 8 quarters or more are shortened to 2 (the chorales shorten from 4: their cantata
# interludes leave the voices silent for bars; in these works a rest of 4-8 quarters is written music).
LONG_REST_QUARTERS, KEPT_REST_QUARTERS = 8.0, 2.0

# GM programs per register (median MIDI pitch of a part: high >= 67 > mid >= 55 > low), per family.
FAMILIES: dict[str, dict[str, tuple[int, ...]]] = {
    "strings": {"high": (40,), "mid": (41,), "low": (42, 43)},
    "string orchestra": {"high": (48,), "mid": (48,), "low": (48, 43)},
    "woodwinds": {"high": (73, 68), "mid": (71, 69), "low": (70,)},
    "brass": {"high": (56,), "mid": (60,), "low": (57, 58)},
    "saxophones": {"high": (64,), "mid": (66,), "low": (67,)},  # no alto sax (65): TimGM6mb lacks its E4
    "recorders and lute": {"high": (74, 73), "mid": (24, 74), "low": (24, 32)},
    "choir": {"high": (52,), "mid": (53,), "low": (52,)},
    "piano": {"high": (0,), "mid": (0,), "low": (0,)},
    "harpsichord": {"high": (6,), "mid": (6,), "low": (6,)},
    "church organ": {"high": (19,), "mid": (19,), "low": (19,)},
    "harp": {"high": (46,), "mid": (46,), "low": (46,)},
    "mixed": {"high": (40, 73, 68, 71, 56, 74, 64, 52), "mid": (41, 71, 69, 60, 40, 53, 24, 46),
              "low": (42, 70, 57, 58, 67, 43, 32)},
}
SOLO = (40, 110, 73, 74, 75, 79, 68, 71, 21, 22, 105, 109, 24, 46, 0)  # one-part tunes: fiddle, flutes, ...


@dataclass(frozen=True)
class Collection:
    """A group of music21 corpus files rendered alike."""

    name: str
    prefixes: tuple[str, ...]  # music21 corpus directories
    suffixes: tuple[str, ...]
    ensembles: tuple[str, ...]  # cycled per track (seeded); a family of FAMILIES, or "solo"
    tempo_qpm: tuple[int, int]  # when the score has no usable metronome mark
    licence: str  # short note; the full story is in data/README.md


COLLECTIONS: dict[str, Collection] = {c.name: c for c in (
    Collection("string_quartets", ("mozart/", "haydn/", "beethoven/"), (".mxl",),
               ("strings", "strings", "string orchestra", "woodwinds", "piano", "mixed", "saxophones"), (80, 132),
               "Mozart, Haydn, Beethoven: public domain; music21 corpus MusicXML encodings (no rights notice). "
               "Rendered with TimGM6mb.sf2 (GPL-2). See data/README.md."),
    Collection("madrigals", ("monteverdi/",), (".mxl",),
               ("choir", "strings", "recorders and lute", "brass", "church organ", "mixed"), (60, 96),
               "Monteverdi: public domain; music21 corpus MusicXML encodings without a rights notice (files naming "
               "Ut Orpheus Edizioni are left out). Rendered with TimGM6mb.sf2 (GPL-2). See data/README.md."),
    Collection("trecento", ("trecento/", "ciconia/", "luca/"), (".xml", ".mxl"),
               ("recorders and lute", "harp", "church organ", "woodwinds", "strings", "mixed"), (60, 100),
               "14th-century polyphony: public domain; music21 corpus encodings of the PMFC edition (files with a "
               "copyright notice left out; Ciconia and Luca encodings (c) M. S. Cuthbert, CC-BY-SA 3.0). "
               "Rendered with TimGM6mb.sf2 (GPL-2). See data/README.md."),
    Collection("fiddle_tunes", ("ryansMammoth/",), (".abc",), ("solo",), (84, 120),
               "Ryan's Mammoth Collection (1883): public domain; abc transcriptions contributed to the "
               "music21 corpus. Rendered with TimGM6mb.sf2 (GPL-2). See data/README.md."),
)}


def collection_sources(name: str) -> list[str]:
    """Corpus paths of a collection, sorted, without files whose notice reserves rights."""
    return list(_collection_sources(name))


@functools.cache
def _collection_sources(name: str) -> tuple[str, ...]:
    c = COLLECTIONS[name]
    corpus = require("music21.corpus")
    root = Path(str(corpus.getComposer("bach")[0])).parent.parent  # music21/corpus
    out = []
    for prefix in c.prefixes:
        for p in sorted((root / prefix).rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.suffix in c.suffixes and not _has_excluding_notice(p):
                out.append(rel)
    return tuple(sorted(out))


def _has_excluding_notice(path: Path, head: int = 1 << 17) -> bool:
    """Whether the start of the file (where MusicXML keeps <rights> and title-page credits) carries a
    notice that keeps it out. Humdrum files, whose notices sit at the end, are never used."""
    if path.suffix == ".mxl":
        with zipfile.ZipFile(path) as z:
            data = b"".join(z.open(n).read(head) for n in z.namelist() if not n.startswith("META-INF"))
    else:
        with open(path, "rb") as f:
            data = f.read(head)
    return bool(EXCLUDING_NOTICES.search(data))


def _register(pitches: list[int]) -> str:
    median = sorted(pitches)[len(pitches) // 2]
    return "high" if median >= 67 else "mid" if median >= 55 else "low"


def plan_work(source: str, seed: int, collection: str, ensemble: str) -> Track:
    """Parse a score and turn its parts (top to bottom) into timed notes for GM instruments."""
    corpus, tempo = require("music21.corpus"), require("music21.tempo")
    rng = random.Random(f"{seed}:{source}")
    score = corpus.parse(source)
    if not hasattr(score, "parts"):  # an abc file holding several tunes: the first one
        score = score.scores[0]
    try:
        score = score.expandRepeats()
    except Exception as e:  # badly formed repeat marks: play them as written
        log.debug("%s: repeats not expanded (%s)", source, e)
    parts = []
    for part in score.parts:
        notes = [n for n in part.stripTies().flatten().notes if n.quarterLength > 0 and n.pitches]
        if notes:
            parts.append((part.partName or f"Part {len(parts) + 1}", notes))
    if not parts:
        raise ValueError("no pitched notes")
    if len(parts) > MAX_PARTS:
        raise ValueError(f"{len(parts)} parts, more than {MAX_PARTS}")
    parts.sort(key=lambda p: -sorted(x.pitches[0].midi for x in p[1])[len(p[1]) // 2])  # top part first

    marks = [m.getQuarterBPM() for m in score.flatten().getElementsByClass(tempo.MetronomeMark)
             if m.number is not None]
    qpm = round(marks[0]) if marks and 40 <= marks[0] <= 200 else rng.randint(*COLLECTIONS[collection].tempo_qpm)
    beat = 60.0 / qpm
    legato = rng.uniform(0.85, 1.0)

    spans = sorted((float(n.offset), float(n.offset + n.quarterLength)) for _, ns in parts for n in ns)
    start, cut = long_rest_cuts(spans, LONG_REST_QUARTERS, KEPT_REST_QUARTERS)

    def seconds(offset: float) -> float:
        return LEAD_SECONDS + (offset - start - cut(offset)) * beat

    voices = []
    for i, (name, notes) in enumerate(parts):
        if ensemble == "solo":
            program = rng.choice(SOLO)
        else:
            program = rng.choice(FAMILIES[ensemble][_register([p.midi for n in notes for p in n.pitches])])
        base = 86 if i == 0 else 82 if i == len(parts) - 1 else 76  # melody and bass a little forward
        pan = 64 if len(parts) == 1 else round(40 + 48 * i / (len(parts) - 1))
        voice = Voice(name, program, pan=pan)
        for n in notes:
            on, off = seconds(float(n.offset)), seconds(float(n.offset + n.quarterLength))
            off = on + max(0.05, (off - on) * legato)
            for p in n.pitches:
                voice.notes.append((on, off, int(p.midi), min(127, max(1, base + rng.randint(-6, 6)))))
        voices.append(voice)
    title = re.sub(r"\.(mxl|xml|abc|musicxml)$", "", source).replace("/", "-")
    return Track(source=source, ensemble=ensemble, tempo_qpm=qpm, voices=voices, title=title,
                 key=score_key(score, source=source))
