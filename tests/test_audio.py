"""Decoding audio to float32 mono 24 kHz: formats, down-mixing, resampling, and clear errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as AF

from musiclm_stab.audio import AudioError, decode_bytes, from_array, list_audio_files, load_audio

SR = 24_000


def test_wav_at_24k_passes_through_unchanged(tmp_path, make_music):
    """A 24 kHz mono float wav comes back as the same samples, float32, shape [S]."""
    x = make_music(2.0, seed=1)
    sf.write(tmp_path / "a.wav", x, SR, subtype="FLOAT")
    wave = load_audio(tmp_path / "a.wav")
    assert wave.dtype == torch.float32 and wave.shape == (len(x),)
    torch.testing.assert_close(wave, torch.from_numpy(x))


def test_stereo_44k_is_downmixed_then_resampled(tmp_path, make_music):
    """Stereo 44.1 kHz becomes the channel mean resampled to 24 kHz, 2 s -> 48000 samples."""
    x = make_music(2.0, seed=2, sr=44_100, channels=2)  # (S, 2)
    sf.write(tmp_path / "st.wav", x, 44_100, subtype="FLOAT")
    wave = load_audio(tmp_path / "st.wav")
    assert wave.shape == (48_000,)
    expected = AF.resample(torch.from_numpy(x).mean(dim=1), 44_100, SR)
    torch.testing.assert_close(wave, expected)
    assert not torch.allclose(wave, AF.resample(torch.from_numpy(x[:, 0]), 44_100, SR))  # not just left


@pytest.mark.parametrize("ext,kwargs,min_corr", [
    ("flac", {}, 0.9999),
    ("ogg", {"subtype": "VORBIS"}, 0.99),
    ("mp3", {}, 0.99),
    ("aiff", {}, 0.9999),
    ("au", {}, 0.9999),
])
def test_compressed_and_other_formats_decode(tmp_path, make_music, ext, kwargs, min_corr):
    """flac, ogg, mp3, aiff and au (written by soundfile) decode to the original signal and length."""
    x = make_music(3.0, seed=3)
    path = tmp_path / f"a.{ext}"
    sf.write(path, x, SR, **kwargs)
    wave = load_audio(path).numpy()
    if ext in ("ogg", "mp3"):
        assert abs(len(wave) - len(x)) <= 1200  # lossy codecs may pad (measured: 0 samples off here)
    else:
        assert len(wave) == len(x)  # lossless: exactly the samples written
    n = min(len(x), len(wave))
    assert np.corrcoef(x[:n], wave[:n])[0, 1] > min_corr


def test_text_file_named_wav_is_rejected(tmp_path):
    """A text file with a .wav name raises AudioError naming the file and saying it is not audio."""
    path = tmp_path / "notes.wav"
    path.write_text("these are not the samples you are looking for\n")
    with pytest.raises(AudioError, match="not a readable audio file") as e:
        load_audio(path)
    assert e.value.path == str(path) and str(path) in str(e.value)


def test_empty_and_missing_files_are_rejected(tmp_path):
    """An empty file and a missing file each raise AudioError with their own reason."""
    (tmp_path / "empty.flac").write_bytes(b"")
    with pytest.raises(AudioError, match="empty file"):
        load_audio(tmp_path / "empty.flac")
    with pytest.raises(AudioError, match="does not exist"):
        load_audio(tmp_path / "missing.wav")
    sf.write(tmp_path / "zero.wav", np.zeros(0, dtype=np.float32), SR)  # valid header, no samples
    with pytest.raises(AudioError, match="0 samples"):
        load_audio(tmp_path / "zero.wav")


def test_non_finite_samples_are_rejected(tmp_path):
    """A float wav holding NaN or inf raises AudioError counting the bad samples."""
    x = np.zeros(4800, dtype=np.float32)
    x[100:110] = np.nan
    x[200] = np.inf
    sf.write(tmp_path / "nan.wav", x, SR, subtype="FLOAT")
    with pytest.raises(AudioError, match="11 of 4800 samples are not finite"):
        load_audio(tmp_path / "nan.wav")


def test_decode_bytes_resamples_and_names_the_source(make_music):
    """Encoded bytes at 16 kHz decode to 1.5x as many 24 kHz samples; bad bytes name the source."""
    buf = io.BytesIO()
    sf.write(buf, make_music(1.0, seed=4, sr=16_000), 16_000, format="FLAC")
    assert decode_bytes(buf.getvalue(), "row 3").shape == (24_000,)
    with pytest.raises(AudioError, match="row 7"):
        decode_bytes(b"\x00garbage" * 10, "row 7")
    with pytest.raises(AudioError, match="empty audio bytes"):
        decode_bytes(b"", "row 8")


def test_from_array_accepts_both_layouts_and_int_pcm(make_music):
    """Arrays [S, C] and [C, S] give the same mono result; int16 PCM is scaled to [-1, 1]."""
    x = make_music(1.0, seed=5, sr=48_000, channels=2)  # (S, 2)
    a = from_array(x, 48_000)
    b = from_array(torch.from_numpy(x.T.copy()), 48_000)
    assert a.shape == (24_000,)
    torch.testing.assert_close(a, b)
    pcm16 = (x * 32767).astype(np.int16)
    torch.testing.assert_close(from_array(pcm16, 48_000), a, atol=1e-4, rtol=0)
    with pytest.raises(AudioError, match="not finite"):
        from_array(np.full(100, np.nan, dtype=np.float32), SR, "nan array")


def test_list_audio_files_is_recursive_sorted_and_filtered(tmp_path):
    """Audio files are found in sub-folders, sorted by relative path; other files are ignored."""
    for name in ("b/z.wav", "a.flac", "b/a.MP3", "readme.txt", "c/d.ogg"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    found = [p.relative_to(tmp_path).as_posix() for p in list_audio_files(tmp_path)]
    assert found == ["a.flac", "b/a.MP3", "b/z.wav", "c/d.ogg"]
