"""The default corpus: Bach chorales from music21 rendered with TimGM6mb.sf2 (by the package's own sample
player, or by tinysoundfont, the renderer of the studies' corpora)."""

import json

import numpy as np
import pytest

sf = pytest.importorskip("soundfile")
pytest.importorskip("music21")
pytest.importorskip("pretty_midi")

from musiclm_stab import cli  # noqa: E402
from musiclm_stab.corpus import build, chorales, render, works  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Three full-length tracks, seed 0, default settings (44.1 kHz stereo FLAC)."""
    out = tmp_path_factory.mktemp("corpus")
    return out, build.build_corpus(out, num_tracks=3, seed=0, progress=False)


def test_tracks_are_real_audio_at_the_sample_rate(built):
    """Each track is 44.1 kHz stereo, chorale-length, clearly audible and peak-normalized to -1 dBFS."""
    _, paths = built
    assert [p.name[:4] for p in paths] == ["000_", "001_", "002_"]
    for p in paths:
        info = sf.info(p)
        assert (info.samplerate, info.channels, info.format, info.subtype) == (44100, 2, "FLAC", "PCM_16")
        assert 15.0 < info.duration < 240.0
        audio, _ = sf.read(p, dtype="float32")
        rms = float(np.sqrt(np.mean(audio**2)))
        assert rms > 0.02, f"{p.name}: RMS {rms:.4f}"
        assert np.abs(audio).max() == pytest.approx(10 ** (-1 / 20), abs=2e-3)


def test_instruments_vary_across_voices_and_tracks(built):
    """Neighbouring tracks use different ensembles and the corpus is not one instrument throughout."""
    out, _ = built
    rows = build.read_manifest(out)
    ensembles = [r["ensemble"] for r in rows]
    assert len(set(ensembles)) == 3
    programs = {i["program"] for r in rows for i in r["instruments"]}
    assert len(programs) >= 3
    for r in rows:
        assert [i["voice"] for i in r["instruments"]] == list(chorales.VOICES)
        assert all(i["instrument"] == render.GM_NAMES[i["program"]] for i in r["instruments"])


def test_manifest_and_corpus_json_describe_the_files(built):
    """manifest.jsonl has one row per file with source, tempo, duration and licence; corpus.json the config."""
    out, paths = built
    rows = build.read_manifest(out)
    assert [r["file"] for r in rows] == [p.name for p in paths]
    for r, p in zip(rows, paths, strict=True):
        assert r["source"].startswith("bach/") and r["source"] in chorales.chorale_sources()
        assert chorales.TEMPO_QPM[0] <= r["tempo_qpm"] <= chorales.TEMPO_QPM[1]
        assert r["seconds"] == pytest.approx(sf.info(p).duration, abs=1e-3)
        assert (r["sample_rate"], r["channels"]) == (44100, 2)
        assert "public domain" in r["licence"] and "GPL-2" in r["licence"]
    meta = json.loads((out / "corpus.json").read_text())
    assert meta["complete"] is True and meta["files"] == [p.name for p in paths]
    assert meta["config"] == {
        "num_tracks": 3,
        "seed": 0,
        "sample_rate": 44100,
        "fmt": "flac",
        "max_seconds": None,
        "version": build.CORPUS_VERSION,
        "renderer": "sampler",
    }
    assert meta["renderer"] == "sampler"


def test_same_seed_gives_identical_bytes(built, tmp_path):
    """A second build with the same seed writes byte-identical files, audio and labels (and a smaller
    corpus is a prefix)."""
    out, paths = built
    again = build.build_corpus(tmp_path, num_tracks=2, seed=0, progress=False)
    assert [p.name for p in again] == [p.name for p in paths[:2]]
    for a, b in zip(again, paths[:2], strict=True):
        assert a.read_bytes() == b.read_bytes()
        label = f"labels/{a.stem}.npz"
        assert (tmp_path / label).read_bytes() == (out / label).read_bytes()


def test_different_seed_gives_different_audio(tmp_path):
    """Seeds 0 and 1 pick different chorales and produce different audio."""
    a = build.build_corpus(tmp_path / "s0", num_tracks=2, seed=0, max_seconds=6, progress=False)
    b = build.build_corpus(tmp_path / "s1", num_tracks=2, seed=1, max_seconds=6, progress=False)
    assert {r["source"] for r in build.read_manifest(tmp_path / "s0")}.isdisjoint(
        r["source"] for r in build.read_manifest(tmp_path / "s1")
    )
    for pa, pb in zip(a, b, strict=True):
        xa, xb = sf.read(pa)[0], sf.read(pb)[0]
        assert xa.shape == xb.shape == (6 * 44100, 2)
        assert np.abs(xa - xb).mean() > 0.01


def test_rerun_with_same_config_does_not_render(built, monkeypatch):
    """Building again into a complete corpus returns its paths without rendering or touching files."""
    out, paths = built
    mtimes = [p.stat().st_mtime_ns for p in paths]

    def fail(*args, **kwargs):
        raise AssertionError("render_track called on an idempotent rerun")

    monkeypatch.setattr(build, "render_track", fail)
    assert build.build_corpus(out, num_tracks=3, seed=0, progress=False) == paths
    assert [p.stat().st_mtime_ns for p in paths] == mtimes


def test_other_config_refused_unless_overwrite(tmp_path):
    """A dir holding a different corpus is refused with a clear message; overwrite=True replaces it."""
    build.build_corpus(tmp_path, num_tracks=2, seed=0, max_seconds=3, progress=False)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        build.build_corpus(tmp_path, num_tracks=1, seed=5, max_seconds=3, progress=False)
    paths = build.build_corpus(tmp_path, num_tracks=1, seed=5, max_seconds=3, overwrite=True, progress=False)
    audio = sorted(p.name for p in tmp_path.glob("*.flac"))
    assert audio == [paths[0].name] and len(build.read_manifest(tmp_path)) == 1
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_wav_format_sample_rate_and_max_seconds(tmp_path):
    """fmt='wav', another sample rate and max_seconds give exactly that file type, rate and length."""
    (path,) = build.build_corpus(
        tmp_path, num_tracks=1, seed=3, sample_rate=22050, fmt="wav", max_seconds=4.0, progress=False
    )
    info = sf.info(path)
    assert (path.suffix, info.format, info.samplerate, info.frames) == (".wav", "WAV", 22050, 4 * 22050)
    with pytest.raises(ValueError, match="flac"):
        build.build_corpus(tmp_path / "x", num_tracks=1, fmt="mp3")


def _silent_keys(uses: dict[int, set[str]], ranges: dict[str, tuple[int, int]]) -> list[tuple[str, int]]:
    """(program name, key) of every key in the ranges a program is used for that TimGM6mb leaves silent
    (0.1 s of the note, through the sample player, below an RMS of 1e-3)."""
    from musiclm_stab.corpus.sampler import play
    from musiclm_stab.corpus.soundfont import SoundFont

    assert set(uses) <= set(render.GM_NAMES)
    sf2 = SoundFont(render.soundfont_path().read_bytes())
    silent = []
    for program, parts in sorted(uses.items()):
        lo, hi = min(ranges[r][0] for r in parts), max(ranges[r][1] for r in parts)
        for key in range(lo, hi + 1):
            audio = np.zeros(800)
            for zone in sf2.voices(program, key, 90):
                wave, left, _ = play(sf2, zone, key, 90, 800, 800, 8000)
                audio[: len(wave)] += wave * left
            if np.sqrt(np.mean(audio**2)) < 1e-3:
                silent.append((render.GM_NAMES[program], key))
    return silent


def test_every_instrument_sounds_on_every_key_its_voices_sing():
    """Each program the corpus can pick has a TimGM6mb sample for every key of its voices' chorale range."""
    chorale_range = {"Soprano": (59, 81), "Alto": (52, 74), "Tenor": (45, 69), "Bass": (33, 64)}
    uses = {}  # program -> voices it can play
    for programs in chorales.ENSEMBLES.values():
        for voice, program in zip(chorales.VOICES, programs, strict=True):
            for p in chorales.MIXED_POOLS[voice] if program < 0 else (program,):
                uses.setdefault(p, set()).add(voice)
    assert _silent_keys(uses, chorale_range) == []


def test_chorale_sources_and_skipping_a_non_chorale(tmp_path, monkeypatch, caplog):
    """Sources are the MusicXML Bach files; a score without S/A/T/B parts is skipped with a logged reason."""
    sources = chorales.chorale_sources()
    assert len(sources) == 410 and all(
        s.startswith("bach/bwv") and s.endswith((".mxl", ".xml")) for s in sources
    )
    with pytest.raises(ValueError, match="no Soprano/Alto/Tenor/Bass part"):
        chorales.plan_track("bach/bwv846.mxl", seed=0, ensemble="piano")  # a keyboard prelude, not a chorale
    monkeypatch.setattr(chorales, "chorale_sources", lambda: ["bach/bwv846.mxl", "bach/bwv1.6.mxl"])
    with caplog.at_level("WARNING", logger="musiclm_stab.corpus.chorales"):
        (path,) = build.build_corpus(tmp_path, num_tracks=1, seed=0, max_seconds=2, progress=False)
    assert path.name == "000_bwv1.6.flac"
    assert "skipping bach/bwv846.mxl: ValueError" in caplog.text


def test_cli_prints_tracks_minutes_and_time(tmp_path, capsys):
    """`musiclm-stab build-corpus` builds the corpus and reports tracks, minutes and time taken."""
    argv = ["build-corpus", str(tmp_path), "--num-tracks", "2", "--seed", "2", "--max-seconds", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 tracks, 0.1 min of audio") and out.rstrip().endswith(" s)")
    assert cli.main([*argv[:3], "1", *argv[4:]]) == 1  # a different config in the same dir is refused


def test_hours_preset_interleaves_collections_with_licences(tmp_path):
    """The "hours" preset's first tracks come from several collections in the planned order, each with
    its source, instruments and licence; a smaller build with the same seed is a byte-identical prefix."""
    paths = build.build_corpus(tmp_path / "a", num_tracks=3, seed=0, preset="hours", max_seconds=3, progress=False)
    rows = build.read_manifest(tmp_path / "a")
    planned = [name for name, _ in build.preset_order("hours", 0)[:3]]  # fiddle tunes, chorales, trecento
    assert [r["collection"] for r in rows] == planned and len(set(planned)) >= 3
    for r, p in zip(rows, paths, strict=True):
        assert "public domain" in r["licence"] and "GPL-2" in r["licence"]
        assert r["instruments"] and all(i["instrument"] == render.GM_NAMES[i["program"]] for i in r["instruments"])
        assert sf.info(p).duration == pytest.approx(3.0, abs=1e-3)
    config = json.loads((tmp_path / "a" / "corpus.json").read_text())["config"]
    assert (config["preset"], config["max_seconds"]) == ("hours", 3)
    labels = corpus_labels.read_labels(tmp_path / "a")
    for r, p in zip(rows, paths, strict=True):  # labels stop at the cut: 3 s = 225 frames
        row, arrays = labels.row(p.name), labels.arrays(p.name)
        assert (row["collection"], row["num_frames"], arrays["pitch"].shape[0]) == (r["collection"], 225, 225)
        assert arrays["notes"][:, 1].max() <= 3.0 and arrays["pitch"][-1].any()
        assert [v["program"] for v in row["voices"]] == [i["program"] for i in r["instruments"]]
    again = build.build_corpus(tmp_path / "b", num_tracks=2, seed=0, preset="hours", max_seconds=3, progress=False)
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in paths[:2]]
    with pytest.raises(ValueError, match="at most 256"):
        build.build_corpus(tmp_path / "c", num_tracks=1000, preset="hours")


def test_sources_whose_notice_reserves_rights_are_left_out():
    """Collections skip files with a reserved-rights notice (Ut Orpheus' madrigal editions, CCARH Humdrum
    files) and have enough music for the preset's quotas."""
    madrigals = works.collection_sources("madrigals")
    assert len(madrigals) == 47 and all(m.endswith(".mxl") for m in madrigals)  # 49 in music21, 2 excluded
    for name, quota in build.PRESETS["hours"].items():
        sources = chorales.chorale_sources() if name == "chorales" else works.collection_sources(name)
        assert len(sources) >= quota, name
        assert not any(s.endswith(".krn") or s.startswith("palestrina/") for s in sources)


def test_every_register_instrument_sounds_across_its_range():
    """Every GM program the works' ensembles can pick has a TimGM6mb sample for every key of its register."""
    ranges = {"high": (60, 93), "mid": (48, 79), "low": (28, 67), "solo": (55, 93)}
    uses: dict[int, set[str]] = {}
    for family in works.FAMILIES.values():
        for register, programs in family.items():
            for p in programs:
                uses.setdefault(p, set()).add(register)
    for p in works.SOLO:
        uses.setdefault(p, set()).add("solo")
    assert _silent_keys(uses, ranges) == []


# ------------------------------------------------------------------------------------------------ labels

from musiclm_stab.corpus import labels as corpus_labels  # noqa: E402

SINGLE_NOTES = [  # (GM program, MIDI key, on_s, off_s): one note per track, odd times (not on frame edges)
    (40, 72, 0.3137, 1.0413),  # violin: sustained
    (0, 64, 0.1000, 0.6071),  # piano: decaying
    (42, 45, 0.5519, 0.8530),  # cello
]


def _single_note_tracks() -> list:
    return [render.Track(source=f"test/{i}", ensemble="test", tempo_qpm=60, title=f"note{i}",
                         voices=[render.Voice("Solo", program, notes=[(on, off, key, 90)])])
            for i, (program, key, on, off) in enumerate(SINGLE_NOTES)]


def _sounds_like(audio: np.ndarray, sr: int, key: int) -> bool:
    """Whether MIDI ``key`` explains the audio's spectrum: its strongest peak is within a quarter tone of
    harmonic 1-4 of the key's frequency, and the fundamental's quarter-tone band holds at least 5% of that
    peak's magnitude (so a semitone off or an octave too low does not pass). Measured for SINGLE_NOTES: the
    fundamental's band holds 86-100% for the right key, <= 0.1% an octave below."""
    spec = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    freqs = np.fft.rfftfreq(len(audio), 1 / sr)
    f0, quarter = 440 * 2 ** ((key - 69) / 12), 2 ** (1 / 24)
    peak = freqs[np.argmax(spec)]
    at_harmonic = any(h * f0 / quarter <= peak <= h * f0 * quarter for h in range(1, 5))
    band = (freqs >= f0 / quarter) & (freqs <= f0 * quarter)
    band[np.argmin(np.abs(freqs - f0))] = True  # at least the nearest bin (short notes have coarse bins)
    return at_harmonic and spec[band].max() >= 0.05 * spec.max()


def test_a_rendered_notes_pitch_is_active_in_exactly_its_frames(tmp_path, monkeypatch):
    """build_corpus's labels mark a note's pitch active from the frame its sound starts in to the frame
    its note-off (the start of the release) falls in, each within one 75 Hz frame, and nothing else: the
    onset is the first non-zero sample of the written file, the note-off the first sample where the audio
    differs from a render with the note held longer; the pitch is what the audio's harmonics say."""
    tracks = _single_note_tracks()
    monkeypatch.setattr(build, "plans", lambda preset, seed, n: iter([("chorales", t) for t in tracks]))
    sr = 44100
    paths = build.build_corpus(tmp_path, num_tracks=len(tracks), seed=0, progress=False)
    labels = corpus_labels.read_labels(tmp_path)
    for path, track, (program, key, on, off) in zip(paths, tracks, SINGLE_NOTES, strict=True):
        audio = sf.read(path, dtype="float32")[0][:, 0]
        arrays = labels.arrays(path.name)
        active = np.flatnonzero(arrays["pitch"][:, key])
        assert arrays["pitch"].sum() == len(active) > 0  # one pitch, in one run of frames
        assert np.array_equal(active, np.arange(active[0], active[-1] + 1))
        onset = int(np.flatnonzero(audio != 0)[0])
        assert abs(active[0] - onset * 75 // sr) <= 1, (path.name, active[0], onset)

        held = render.Track(track.source, track.ensemble, 60,
                            [render.Voice("Solo", program, notes=[(on, off + 0.5, key, 90)])])
        a, b = render.render_track(track, sr)[:, 0], render.render_track(held, sr)[:, 0]
        k = onset + int(np.argmax(np.abs(b[onset:int(off * sr)])))  # both renders agree up to their peak scale
        release = onset + int(np.flatnonzero(np.abs(a[onset:] - a[k] / b[k] * b[onset:len(a)]) > 1e-4)[0])
        assert 0 <= release - round(off * sr) <= 64  # the note-off (the fall passes 1e-4 a few samples after it)
        assert abs((active[-1] + 1) - release * 75 // sr) <= 1, (path.name, active[-1], release)

        note = audio[onset:release]
        # (an octave too high is not checked: a timbre whose 2nd harmonic is its strongest would pass it)
        assert _sounds_like(note, sr, key) and not any(_sounds_like(note, sr, k) for k in (key - 12, key - 1, key + 1))
        row = labels.row(path.name)
        assert row["num_frames"] == len(arrays["pitch"]) == -(-len(audio) * 75 // sr)
        assert row["voices"][0]["program"] == program and row["top_family"] == program // 8
        assert arrays["notes"].tolist() == [[round(on * sr) / sr, round(off * sr) / sr, key, 90, 0]]


def test_labels_describe_the_chorales_of_a_built_corpus(built):
    """Each track of the default corpus has labels: a [T, 128] pitch roll over its 75 Hz frames made of
    exactly its notes' frames, the voices' GM programs and the tempo of the manifest, and a key from
    music21's analysis (one of 24) with the written key signature."""
    out, paths = built
    labels = corpus_labels.read_labels(out)
    manifest = {r["file"]: r for r in build.read_manifest(out)}
    assert list(labels.rows) == [p.name for p in paths]
    for p in paths:
        row, arrays = labels.row(p.name), labels.arrays(p.name)
        T = -(-sf.info(p).frames * 75 // 44100)
        assert row["num_frames"] == T and arrays["pitch"].shape == (T, 128) and arrays["voice_active"].shape == (T, 4)
        roll = np.zeros_like(arrays["pitch"])
        for on, off, key, _, voice in arrays["notes"]:
            first, stop = corpus_labels.frame_range(round(on * 44100), round(off * 44100), 44100)
            assert first == int(np.ceil(on * 75 - 0.5)) and stop == int(np.ceil(off * 75 - 0.5))  # centre rule
            roll[first:stop, int(key)] = True
            assert arrays["voice_active"][first:stop, int(voice)].all()
        assert np.array_equal(roll, arrays["pitch"])
        assert 30 <= row["pitch_range"][0] and row["pitch_range"][1] <= 84  # chorale voices
        assert [v["program"] for v in row["voices"]] == [i["program"] for i in manifest[p.name]["instruments"]]
        assert row["tempo_qpm"] == manifest[p.name]["tempo_qpm"]
        key = row["key"]
        assert corpus_labels.KEY_NAMES[key["index"]] == key["name"] and key["mode"] in ("major", "minor")
        assert -7 <= key["signature"]["sharps"] <= 7 and key["correlation"] > 0.5
    meta = json.loads((out / "corpus.json").read_text())
    assert meta["labels_version"] == corpus_labels.LABELS_VERSION


def test_labels_are_added_to_a_corpus_built_before_labels(tmp_path, monkeypatch):
    """build_corpus on a complete corpus without labels (as built before they existed) writes them without
    rendering anything: the same bytes a fresh build writes."""
    paths = build.build_corpus(tmp_path, num_tracks=2, seed=1, max_seconds=4, progress=False)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "labels").iterdir()}
    fresh_rows = (tmp_path / "labels.jsonl").read_text()
    import shutil

    shutil.rmtree(tmp_path / "labels")
    (tmp_path / "labels.jsonl").unlink()
    meta = json.loads((tmp_path / "corpus.json").read_text())
    del meta["labels_version"]
    (tmp_path / "corpus.json").write_text(json.dumps(meta))

    def fail(*args, **kwargs):
        raise AssertionError("render_track called while adding labels")

    monkeypatch.setattr(build, "render_track", fail)
    assert build.build_corpus(tmp_path, num_tracks=2, seed=1, max_seconds=4, progress=False) == paths
    assert {p.name: p.read_bytes() for p in (tmp_path / "labels").iterdir()} == fresh
    assert (tmp_path / "labels.jsonl").read_text() == fresh_rows
