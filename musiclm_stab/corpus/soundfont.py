"""Reading a SoundFont 2 file: its samples, and the zones that a preset plays for a key and velocity.

A SoundFont (SF2, a RIFF file) holds 16-bit samples and two levels of zones: a preset (bank, program) lists
zones that point to instruments, each instrument lists zones that point to samples; a zone applies to a key
and velocity range and carries generators (tuning, loop points, envelope times, attenuation, pan, filter).
``SoundFont.voices(program, key, velocity)`` resolves the two levels for one note into ``Voice`` settings,
the way the SF2 2.01 specification combines them: a level's global zone gives defaults to its other zones,
instrument values are absolute, preset values are added to them, ranges intersect. Everything here is plain
data; ``sampler.py`` turns a ``Voice`` into sound.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np

# Generator numbers of the SF2 2.01 specification (section 8.1.2), those this reader uses.
START_OFFSET, END_OFFSET, LOOP_START_OFFSET, LOOP_END_OFFSET = 0, 1, 2, 3
START_COARSE, END_COARSE, LOOP_START_COARSE, LOOP_END_COARSE = 4, 12, 45, 50
FILTER_FC, FILTER_Q, PAN = 8, 9, 17
DELAY, ATTACK, HOLD, DECAY, SUSTAIN, RELEASE, KEY_TO_HOLD, KEY_TO_DECAY = 33, 34, 35, 36, 37, 38, 39, 40
INSTRUMENT, KEY_RANGE, VEL_RANGE, ATTENUATION = 41, 43, 44, 48
COARSE_TUNE, FINE_TUNE, SAMPLE_ID, SAMPLE_MODES, SCALE_TUNING, ROOT_KEY = 51, 52, 53, 54, 56, 58
RANGES = (KEY_RANGE, VEL_RANGE)
# Defaults (section 8.1.3): envelope times -12000 timecents (1 ms), filter open (13500 cents), no root override.
DEFAULTS = {FILTER_FC: 13500, DELAY: -12000, ATTACK: -12000, HOLD: -12000, DECAY: -12000, RELEASE: -12000,
            SCALE_TUNING: 100, ROOT_KEY: -1}
# Generators that only an instrument zone may set (section 8.1.2: "non-real-time" sample parameters).
SAMPLE_ONLY = {START_OFFSET, END_OFFSET, LOOP_START_OFFSET, LOOP_END_OFFSET, START_COARSE, END_COARSE,
               LOOP_START_COARSE, LOOP_END_COARSE, SAMPLE_MODES, ROOT_KEY, 46, 47, 57}


class SoundFontError(ValueError):
    """A file that is not a SoundFont 2 this reader understands."""


@dataclass(frozen=True)
class Sample:
    """A sample header: where it lies in the sample data (in samples), its loop, rate and pitch."""

    name: str
    start: int
    end: int
    loop_start: int
    loop_end: int
    rate: int
    original_key: int
    correction: int  # cents


@dataclass(frozen=True)
class Voice:
    """What one sample plays for one note: the sample, its loop and tuning, the volume envelope and the rest,
    in the units of the specification (timecents, centibels, cents, tenths of a percent)."""

    sample: Sample
    gens: tuple[tuple[int, int], ...]  # (generator, value), instrument and preset combined

    def get(self, gen: int) -> int:
        return dict(self.gens).get(gen, DEFAULTS.get(gen, 0))


def _chunks(data: bytes, start: int, end: int) -> dict[bytes, tuple[int, int]]:
    """RIFF chunks between ``start`` and ``end``: {id (LIST chunks by their list type): (data start, end)}."""
    found, pos = {}, start
    while pos + 8 <= end:
        cid, size = struct.unpack_from("<4sI", data, pos)
        body = pos + 8
        if body + size > end:
            raise SoundFontError(f"chunk {cid!r} runs past the end of the file")
        if cid == b"LIST":
            found[data[body:body + 4]] = (body + 4, body + size)
        else:
            found[cid] = (body, body + size)
        pos = body + size + (size & 1)
    return found


def _records(data: bytes, span: tuple[int, int], fmt: str) -> list[tuple]:
    size = struct.calcsize(fmt)
    return [struct.unpack_from(fmt, data, p) for p in range(span[0], span[1] - size + 1, size)]


def _zones(bags: list[tuple], gens: list[tuple], first: int, last: int) -> list[dict[int, int]]:
    """The zones of bags ``first`` .. ``last - 1`` as {generator: value}; ranges as lo | hi << 8."""
    zones = []
    for b in range(first, last):
        zone = {}
        for g in range(bags[b][0], bags[b + 1][0]):
            oper, amount = gens[g]
            zone[oper] = amount if oper in RANGES else struct.unpack("<h", struct.pack("<H", amount))[0]
        zones.append(zone)
    return zones


def _in_range(zone: dict[int, int], gen: int, value: int) -> bool:
    r = zone.get(gen, 127 << 8)
    return (r & 0xFF) <= value <= (r >> 8)


def _split_global(zones: list[dict[int, int]], link: int) -> tuple[dict[int, int], list[dict[int, int]]]:
    """(the global zone, the others): the first zone is global when it lacks the link generator."""
    if zones and link not in zones[0]:
        return zones[0], zones[1:]
    return {}, zones


class SoundFont:
    """A parsed SoundFont 2 file (``data``: its bytes)."""

    def __init__(self, data: bytes):
        if data[:4] != b"RIFF" or data[8:12] != b"sfbk":
            raise SoundFontError("not a SoundFont 2 file (no RIFF sfbk header)")
        top = _chunks(data, 12, min(len(data), 8 + struct.unpack_from("<I", data, 4)[0]))
        if b"sdta" not in top or b"pdta" not in top:
            raise SoundFontError("no sample data (sdta) or preset data (pdta)")
        sdta, pdta = _chunks(data, *top[b"sdta"]), _chunks(data, *top[b"pdta"])
        if b"smpl" not in sdta or any(k not in pdta for k in (b"phdr", b"pbag", b"pgen", b"inst", b"ibag",
                                                              b"igen", b"shdr")):
            raise SoundFontError("a required sub-chunk (smpl, phdr, pbag, pgen, inst, ibag, igen, shdr) is missing")
        a, b = sdta[b"smpl"]
        self.data = np.frombuffer(data, dtype="<i2", count=(b - a) // 2, offset=a).astype(np.float64) / 32768.0
        self.phdr = _records(data, pdta[b"phdr"], "<20sHHHIII")
        self.pbag = _records(data, pdta[b"pbag"], "<HH")
        self.pgen = _records(data, pdta[b"pgen"], "<HH")
        self.inst = _records(data, pdta[b"inst"], "<20sH")
        self.ibag = _records(data, pdta[b"ibag"], "<HH")
        self.igen = _records(data, pdta[b"igen"], "<HH")
        self.samples = [Sample(name.split(b"\0")[0].decode("latin-1"), *rest[:7])
                        for name, *rest in _records(data, pdta[b"shdr"], "<20sIIIIIBbHH")]

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (a SoundFont lives as long as its render)
    def voices(self, program: int, key: int, velocity: int, bank: int = 0) -> tuple[Voice, ...]:
        """The voices that ``program`` of ``bank`` plays for ``key`` at ``velocity`` (empty if none)."""
        index = next((i for i, h in enumerate(self.phdr[:-1]) if (h[2], h[1]) == (bank, program)), None)
        if index is None:
            raise SoundFontError(f"no preset for bank {bank}, program {program}")
        pglobal, pzones = _split_global(_zones(self.pbag, self.pgen, self.phdr[index][3], self.phdr[index + 1][3]),
                                        INSTRUMENT)
        out = []
        for pz in pzones:
            pz = {**pglobal, **pz}
            if INSTRUMENT not in pz or not (_in_range(pz, KEY_RANGE, key) and _in_range(pz, VEL_RANGE, velocity)):
                continue
            i = pz[INSTRUMENT]
            iglobal, izones = _split_global(_zones(self.ibag, self.igen, self.inst[i][1], self.inst[i + 1][1]),
                                            SAMPLE_ID)
            for iz in izones:
                iz = {**iglobal, **iz}
                if SAMPLE_ID not in iz or not (_in_range(iz, KEY_RANGE, key) and _in_range(iz, VEL_RANGE, velocity)):
                    continue
                gens = dict(iz)
                for gen, value in pz.items():  # a preset's values add to the instrument's (section 9.4)
                    if gen not in RANGES and gen not in SAMPLE_ONLY and gen not in (INSTRUMENT, SAMPLE_ID):
                        gens[gen] = gens.get(gen, DEFAULTS.get(gen, 0)) + value
                out.append(Voice(self.samples[iz[SAMPLE_ID]], tuple(sorted(gens.items()))))
        return tuple(out)
