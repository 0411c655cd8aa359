"""Assembling a corpus of real music, made offline: the default (Bach chorales) and the ``hours`` preset.

    build_corpus(out_dir, ...)                N tracks -> {index:03d}_{name}.flac + manifest.jsonl + corpus.json
                                              + labels.jsonl + labels/{index:03d}_{name}.npz (labels.py)
    build_corpus(out_dir, preset="hours")     chorales, string quartets, madrigals, trecento, fiddle tunes

Why this exists: the pipeline needs real music to tokenize and pretrain on, and tests and CPU runs need
it without a network. Scores come from ``music21``'s corpus (``chorales.py``, ``works.py``) and are rendered
through a General MIDI soundfont (``render.py``: the package's own sample player by default, or
tinysoundfont, the renderer of the corpora made before it); the same seed and renderer give byte-identical
audio files.
Licences of the sources are in data/README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from musiclm_stab.corpus import chorales, works
from musiclm_stab.corpus.labels import (
    LABELS_DIR,
    LABELS_FILE,
    LABELS_VERSION,
    labels_complete,
    track_labels,
    write_labels_file,
    write_track_labels,
)
from musiclm_stab.corpus.render import (
    DEFAULT_RENDERER,
    FORMATS,
    RENDERERS,
    SOUNDFONT_NAME,
    MissingPackage,
    num_samples,
    render_track,
    require,
    soundfont_path,
    write_audio,
)
from musiclm_stab.removal import remove_own

log = logging.getLogger(__name__)

CORPUS_VERSION = 1  # bump when a change to the corpus modules changes the audio for the same config

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
    renderer: str = "tinysoundfont"  # what a corpus.json without the key was rendered with

    def as_dict(self) -> dict:
        """For corpus.json; the default preset and the renderer tinysoundfont are left out, so corpora built
        before presets, or before there was a choice of renderer, still match."""
        d = asdict(self)
        if d["preset"] == "default":
            del d["preset"]
        if d["renderer"] == "tinysoundfont":
            del d["renderer"]
        return d


# ---------------------------------------------------------------------------------------------------
# Presets: which collections, how many tracks of each

PRESETS: dict[str, dict[str, int]] = {
    "default": {"chorales": 24},
    # a few hours of music, tracks cut at 3 min: see data/README.md for what seed 0 gives
    "hours": {"chorales": 80, "string_quartets": 20, "madrigals": 24, "trecento": 36, "fiddle_tunes": 96},
}
PRESET_MAX_SECONDS = {"default": None, "hours": 180.0}


def preset_order(preset: str, seed: int) -> list[tuple[str, int]]:
    """(collection, quota) slots interleaved so any prefix mixes the collections in proportion."""
    quotas = PRESETS[preset]
    taken = dict.fromkeys(quotas, 0)
    order = []
    for _ in range(sum(quotas.values())):
        name = min((n for n in quotas if taken[n] < quotas[n]), key=lambda n: ((taken[n] + 0.5) / quotas[n], n))
        order.append((name, taken[name]))
        taken[name] += 1
    return order


def _chorale_plans(seed: int):
    """Planned chorales in corpus order; unusable sources are skipped with a logged reason."""
    sources = chorales.chorale_sources()
    random.Random(seed).shuffle(sources)
    ensembles = list(chorales.ENSEMBLE_CYCLE)
    random.Random(f"{seed}:ensembles").shuffle(ensembles)
    k = 0
    for source in sources:
        try:
            track = chorales.plan_track(source, seed, ensembles[k % len(ensembles)])
        except Exception as e:
            chorales.log.warning("skipping %s: %s: %s", source, type(e).__name__, e)
            continue
        k += 1
        yield track


def _work_plans(name: str, seed: int):
    sources = works.collection_sources(name)
    random.Random(f"{seed}:{name}").shuffle(sources)
    ensembles = list(works.COLLECTIONS[name].ensembles)
    random.Random(f"{seed}:{name}:ensembles").shuffle(ensembles)
    k = 0
    for source in sources:
        try:
            track = works.plan_work(source, seed, name, ensembles[k % len(ensembles)])
        except Exception as e:
            log.warning("skipping %s: %s: %s", source, type(e).__name__, e)
            continue
        k += 1
        yield track


def plans(preset: str, seed: int, num_tracks: int):
    """(collection, Track) in corpus order: the preset's collections interleaved in proportion."""
    if preset == "default":
        for track in _chorale_plans(seed):
            yield "chorales", track
        return
    streams = {}
    for name, _ in preset_order(preset, seed)[:num_tracks]:
        if name not in streams:
            streams[name] = _chorale_plans(seed) if name == "chorales" else _work_plans(name, seed)
        track = next(streams[name], None)
        if track is not None:
            yield name, track


def _corpus_files(out_dir: Path) -> list[Path]:
    """Files a previous build wrote here (audio, manifest, corpus.json, leftovers of an interrupted run)."""
    pattern = re.compile(r"^\.?\d{3,}_.+\.(flac|wav)(\.partial)?$")
    names = {"manifest.jsonl", "corpus.json", LABELS_FILE, f".{LABELS_FILE}.partial"}
    found = [p for p in out_dir.iterdir() if p.is_file() and (p.name in names or pattern.match(p.name))]
    labels_pattern = re.compile(r"^\.?\d{3,}_.+\.npz(\.partial)?$")
    if (out_dir / LABELS_DIR).is_dir():
        found += [p for p in (out_dir / LABELS_DIR).iterdir() if p.is_file() and labels_pattern.match(p.name)]
    return found


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
    own = set(_corpus_files(out_dir))  # by name, precisely: other files in the folder are left alone
    for f in own:
        remove_own(f, out_dir, recognised=own.__contains__)
    labels = out_dir / LABELS_DIR
    if labels.is_dir() and not labels.is_symlink() and not any(labels.iterdir()):
        remove_own(labels, out_dir, recognised=lambda p: p == labels)
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
    renderer: str = DEFAULT_RENDERER,
) -> list[Path]:
    """Render the corpus into ``out_dir``; return the audio paths in track order.

    ``preset="default"``: ``num_tracks`` (default 24) Bach chorales. ``preset="hours"``: a few hours of
    chorales, string quartets, madrigals, trecento polyphony and fiddle tunes, interleaved, each track
    cut at ``max_seconds`` (default 180 s); ``num_tracks`` takes the first tracks of it. ``renderer``: "sampler"
    (the package's own, nothing to install) or "tinysoundfont" (the studies' corpora; an optional package):
    the two sound different, and a corpus records which one made it.
    Writes ``{index:03d}_{name}.{fmt}`` (stereo, 16-bit, ``sample_rate`` Hz; 44.1 kHz by default so
    that the tokenizer's resampling is exercised), ``manifest.jsonl`` (one row per track, with its
    source, instruments and licence), the labels (``labels.jsonl`` and ``labels/{index:03d}_{name}.npz``:
    pitches per 75 Hz frame, key, instruments, tempo; see labels.py) and ``corpus.json`` (the config;
    written last, so its "complete" flag means every file is there). Deterministic in ``seed``; the
    first k tracks of a larger corpus with the same seed and preset are the same tracks. Returns at once
    if out_dir already holds this corpus; a corpus built before labels existed gets its labels added
    (the scores are planned again, nothing is rendered).
    """
    from tqdm import tqdm

    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: choose one of {sorted(PRESETS)}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: choose one of {sorted(FORMATS)}")
    if renderer not in RENDERERS:
        raise ValueError(f"renderer={renderer!r}: choose one of {', '.join(RENDERERS)}")
    total = sum(PRESETS[preset].values())
    num_tracks = total if num_tracks is None else num_tracks
    if num_tracks < 1 or (preset != "default" and num_tracks > total):
        raise ValueError(f"num_tracks={num_tracks}: must be at least 1" + (f" and at most {total} for preset "
                                                                           f"{preset!r}" if preset != "default" else ""))
    max_seconds = PRESET_MAX_SECONDS[preset] if max_seconds is None else max_seconds
    out_dir = Path(out_dir)
    config = CorpusConfig(num_tracks, seed, sample_rate, fmt, max_seconds, preset=preset, renderer=renderer)
    done = _check_out_dir(out_dir, config, overwrite)
    if done is not None:
        if labels_complete(out_dir, [p.name for p in done]):
            log.info("%s already holds this corpus (%d tracks): nothing to do", out_dir, len(done))
        else:
            _add_labels(out_dir, config, done, progress)
        return done
    for package in ("music21", "pretty_midi", *(["tinysoundfont"] if renderer == "tinysoundfont" else [])):
        require(package)  # before anything is written: one line naming what to install
    out_dir.mkdir(parents=True, exist_ok=True)

    meta = {
        "config": config.as_dict(),
        "complete": False,
        "files": [],
        "music21_version": require("music21").__version__,
        "soundfont": SOUNDFONT_NAME,
        "renderer": renderer,
    }
    (out_dir / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
    soundfont = soundfont_path().read_bytes()

    paths, rows, label_rows = [], [], []
    bar = tqdm(total=num_tracks, desc="rendering", unit="track", disable=not progress)
    t0 = time.perf_counter()
    for collection, track in plans(preset, seed, num_tracks):
        if len(paths) == num_tracks:
            break
        index = len(paths)
        t1 = time.perf_counter()
        audio = render_track(track, sample_rate, max_seconds, soundfont, renderer)
        path = out_dir / f"{index:03d}_{track.name}.{fmt}"
        write_audio(path, audio, sample_rate, fmt)
        label_rows.append(write_track_labels(out_dir, path.name, track_labels(track, sample_rate, max_seconds),
                                             collection))
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
                "licence": chorales.LICENCE_NOTE if collection == "chorales" else _collection_licence(collection),
            }
        )
        bar.update(1)
    bar.close()
    if len(paths) < num_tracks:
        raise RuntimeError(f"only {len(paths)} tracks could be rendered; asked for {num_tracks}")

    with open(out_dir / "manifest.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    write_labels_file(out_dir, label_rows)
    meta.update(complete=True, files=[p.name for p in paths], labels_version=LABELS_VERSION)
    (out_dir / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
    return paths


def _add_labels(out_dir: Path, config: CorpusConfig, paths: list[Path], progress: bool) -> None:
    """Write the labels of a complete corpus built without them (before labels existed): the scores are
    planned again with the corpus's config (the same plans its audio was rendered from; nothing is
    rendered), and each plan is checked against its file's name and length."""
    import soundfile as sf
    from tqdm import tqdm

    log.info("%s: adding labels to a corpus built without them", out_dir)
    label_rows = []
    planned = plans(config.preset, config.seed, config.num_tracks)
    for path in tqdm(paths, desc="labelling", unit="track", disable=not progress):
        collection, track = next(planned)
        expected = f"{len(label_rows):03d}_{track.name}.{config.fmt}"
        n = num_samples(track, config.sample_rate, config.max_seconds)
        frames = sf.info(path).frames
        if path.name != expected or frames != n:
            raise RuntimeError(
                f"{path}: the corpus's config plans {expected} with {n} samples, the file has {frames}: it was "
                "made by another version of the corpus code; rebuild it (--overwrite) to get labels"
            )
        label_rows.append(write_track_labels(out_dir, path.name, track_labels(track, config.sample_rate,
                                                                                config.max_seconds), collection))
    write_labels_file(out_dir, label_rows)
    meta_path = out_dir / "corpus.json"
    meta = json.loads(meta_path.read_text())
    meta["labels_version"] = LABELS_VERSION
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")


def _collection_licence(name: str) -> str:
    return works.COLLECTIONS[name].licence


def read_manifest(out_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``out_dir/manifest.jsonl``."""
    with open(Path(out_dir) / "manifest.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def cli_main(argv: list[str] | None = None) -> int:
    """``musiclm-stab build-corpus OUT_DIR [--num-tracks 24] [--seed 0] ...``"""
    parser = argparse.ArgumentParser(
        prog="musiclm-stab build-corpus",
        description="Render music from music21's corpus with a General MIDI soundfont (offline).",
        epilog="Reference: docs/TOKENIZING.md (offline: musiclm-stab docs TOKENIZING)",
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
    parser.add_argument("--renderer", choices=RENDERERS, default=DEFAULT_RENDERER,
                        help="sampler: the package's own SoundFont player (nothing to install); tinysoundfont: "
                        "the renderer of the studies' corpora (pip install --no-deps tinysoundfont)")
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
            renderer=args.renderer,
        )
    except (FileExistsError, MissingPackage) as e:
        print(f"musiclm-stab build-corpus: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    minutes = sum(row["seconds"] for row in read_manifest(args.out_dir)) / 60
    print(f"{len(paths)} tracks, {minutes:.1f} min of audio in {args.out_dir} ({elapsed:.1f} s)")
    return 0
