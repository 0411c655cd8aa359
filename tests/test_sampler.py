"""The default corpus's renderers: the package's own SoundFont reader and sample player (corpus/soundfont.py,
corpus/sampler.py), tinysoundfont kept byte for byte for the studies' corpora, the renderer recorded in a
corpus, and a missing optional package said in one line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("music21")
pytest.importorskip("pretty_midi")

from musiclm_stab.corpus import build, render  # noqa: E402
from musiclm_stab.corpus.sampler import envelope, play  # noqa: E402
from musiclm_stab.corpus.soundfont import SoundFont, SoundFontError  # noqa: E402


@pytest.fixture(scope="module")
def timgm() -> SoundFont:
    return SoundFont(render.soundfont_path().read_bytes())


def test_a_file_that_is_not_a_soundfont_is_refused(timgm):
    """Bytes without the RIFF sfbk header, or with their preset data cut away, raise SoundFontError; a program
    the soundfont lacks is named."""
    with pytest.raises(SoundFontError, match="RIFF sfbk"):
        SoundFont(b"RIFF\0\0\0\0WAVEfmt ")
    data = render.soundfont_path().read_bytes()
    with pytest.raises(SoundFontError):
        SoundFont(data[: len(data) // 2])
    with pytest.raises(SoundFontError, match="bank 7, program 0"):
        timgm.voices(0, 60, 90, bank=7)


def test_a_note_sounds_at_its_pitch_for_its_length_and_its_velocity(timgm):
    """A violin A4 (440 Hz) through the player: its spectrum peaks at 440 Hz, it is silent before the note
    and after its release, and a softer velocity is quieter by (velocity ratio)^2."""
    rate, key = 24_000, 69
    (zone,) = timgm.voices(40, key, 100)
    loud, left, right = play(timgm, zone, key, 100, rate // 2, 2 * rate, rate)
    soft, *_ = play(timgm, zone, key, 50, rate // 2, 2 * rate, rate)
    assert left > 0 and right > 0 and len(loud) < 2 * rate  # released and ended before the room ran out
    spectrum = np.abs(np.fft.rfft(loud[: rate // 2] * np.hanning(rate // 2)))
    peak = np.fft.rfftfreq(rate // 2, 1 / rate)[np.argmax(spectrum)]
    assert abs(peak - 440) < 440 * (2 ** (1 / 24) - 1), peak
    assert loud[0] == 0 and np.abs(loud[-50:]).max() < 1e-4 * np.abs(loud).max()
    np.testing.assert_allclose(soft, loud * (50 / 100) ** 2, rtol=1e-12, atol=1e-15)


def test_the_envelope_releases_from_the_note_off_and_not_before(timgm):
    """The volume envelope is the same for a note held longer up to the note-off sample, and falls after it."""
    (zone,) = timgm.voices(0, 60, 90)
    short, held = envelope(zone, 60, 1001, 6000, 24_000), envelope(zone, 60, 5000, 6000, 24_000)
    np.testing.assert_array_equal(short[:1002], held[:1002])
    assert short[1100] < held[1100] and short[-1] < short[1001]


def test_same_notes_same_samples_and_tinysoundfont_keeps_the_studies_audio():
    """The sample player is deterministic; tinysoundfont (when installed) renders the first two tracks of the
    default corpus, seed 0, to the 16-bit samples the studies' corpora were made of (sha256 pinned from the
    code before the sample player existed)."""
    plans = [track for _, (_, track) in zip(range(2), build.plans("default", 0, 2))]
    sf2 = render.soundfont_path().read_bytes()
    a, b = (render.render_track(plans[0], 44100, 4.0, sf2) for _ in range(2))
    assert np.array_equal(a, b) and a.dtype == np.float32 and a.shape == (176400, 2)
    pytest.importorskip("tinysoundfont")
    pinned = {"bwv329": "6e70448f857efdaf1e4db919b755a6ae54d084862b0bff50e9bb78ec1190b722",
              "bwv271": "b5b64ab2b02d2d630fa830aacf93758c4f92c89560bd03d1cb4ae2e6c46e4cfd"}
    for track in plans:
        audio = render.render_track(track, 44100, 4.0, sf2, renderer="tinysoundfont")
        pcm = np.clip(np.round(audio * 32767.0), -32768, 32767).astype("<i2")
        assert hashlib.sha256(pcm.tobytes()).hexdigest() == pinned[track.name], track.name


def test_a_corpus_records_its_renderer_and_is_never_taken_for_the_other(tmp_path):
    """corpus.json records the renderer; a folder holding one renderer's corpus is refused for the other
    (naming both configs); a corpus.json written before the choice existed is tinysoundfont's."""
    build.build_corpus(tmp_path, num_tracks=1, seed=0, max_seconds=2, progress=False)
    meta = json.loads((tmp_path / "corpus.json").read_text())
    assert meta["renderer"] == meta["config"]["renderer"] == "sampler"
    with pytest.raises(FileExistsError, match="'renderer': 'sampler'"):
        build.build_corpus(tmp_path, num_tracks=1, seed=0, max_seconds=2, progress=False, renderer="tinysoundfont")
    assert "renderer" not in build.CorpusConfig(24, 0, 44100, "flac", None).as_dict()
    with pytest.raises(ValueError, match="sampler, tinysoundfont"):
        build.build_corpus(tmp_path / "x", num_tracks=1, renderer="fluidsynth")


def _cli_without(package: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`musiclm-stab ARGS` in a fresh interpreter in which ``package`` cannot be imported."""
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            "from musiclm_stab.cli import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_default_corpus_needs_no_tinysoundfont_and_a_missing_package_is_one_line(tmp_path):
    """Without tinysoundfont the default renderer builds the corpus; asking for tinysoundfont then, or for any
    corpus without music21 (quickstart's first stage), stops in one line that names the install: exit 1, no
    traceback, no folder made."""
    ok = _cli_without("tinysoundfont", ["build-corpus", "c", "--num-tracks", "1", "--max-seconds", "2"], tmp_path)
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr[-3000:]
    assert json.loads((tmp_path / "c" / "corpus.json").read_text())["renderer"] == "sampler"
    for package, args, install in (
            ("tinysoundfont", ["build-corpus", "t", "--renderer", "tinysoundfont"], "pip install --no-deps tinysoundfont"),
            ("music21", ["quickstart", "--work", "w", "--data-only"], "pip install 'musiclm_stab[corpus]'")):
        proc = _cli_without(package, args, tmp_path)
        lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("===")]
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
        assert f"needs {package}: {install}" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "t").exists() and not (tmp_path / "w" / "default_corpus_sampler").exists()
