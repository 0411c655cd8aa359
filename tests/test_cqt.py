"""Tests for musiclm_stab.model.cqt: shapes, bin placement, scale, agreement with librosa and a direct evaluation."""

from __future__ import annotations

import librosa
import numpy as np
import pytest
import torch

import musiclm_stab.model.cqt as cqt_module
from musiclm_stab.model.cqt import CQT, relative_bandwidth

SR, HOP = 24_000, 320


@pytest.fixture(scope="module")
def cqt() -> CQT:
    return CQT()  # reference settings: fmin 32.7 Hz, 336 bins, 48 per octave


def music_like(seconds: float, seed: int = 0) -> np.ndarray:
    """Overlapping harmonic notes with attack/decay envelopes over a -60 dB noise floor; 50 ms of
    leading silence, so a half-hop shift for librosa's frame convention loses nothing."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    t = np.arange(n) / SR
    y = 1e-3 * rng.standard_normal(n)
    for _ in range(int(seconds * 4)):
        onset, dur = rng.uniform(0, seconds - 0.3), rng.uniform(0.2, 1.5)
        f0 = 440 * 2 ** ((rng.integers(33, 90) - 69) / 12)
        on = (t >= onset) & (t < onset + dur)
        tt = t[on] - onset
        env = np.minimum(tt / 0.01, 1) * np.exp(-tt * rng.uniform(1, 6)) * np.minimum((dur - tt) / 0.02, 1)
        for h in range(1, 9):
            if h * f0 < 5000:
                y[on] += rng.uniform(0.2, 1) / h * env * np.sin(2 * np.pi * h * f0 * tt + rng.uniform(0, 6.3))
    y[: SR // 20] = 0
    return (0.3 * y / np.abs(y).max()).astype(np.float32)


def direct_cqt(y: np.ndarray, frames: list[int], module: CQT) -> np.ndarray:
    """The same kernels evaluated at the full rate in float64, at the given frames: ``[len(frames), n_bins]``."""
    freqs = module.frequencies
    lengths = SR / relative_bandwidth(module.bins_per_octave) / freqs
    out = np.zeros((len(frames), len(freqs)))
    for k, (f, length) in enumerate(zip(freqs, lengths)):
        half = length / 2
        for j, t in enumerate(frames):
            centre = t * HOP + HOP / 2
            idx = np.arange(int(np.floor(centre - half)), int(np.ceil(centre + half)) + 1)
            tau = idx - centre
            window = np.where(np.abs(tau) < half, 0.5 + 0.5 * np.cos(np.pi * tau / half), 0.0)
            seg = np.where((idx >= 0) & (idx < len(y)), y[np.clip(idx, 0, len(y) - 1)], 0.0)
            z = np.sum(window * seg * np.exp(2j * np.pi * f / SR * tau)) / window.sum() * np.sqrt(length)
            out[j, k] = abs(z)
    return out


def log_mag_corr(a: np.ndarray, b: np.ndarray, floor_db: float = -80.0) -> float:
    """Correlation of log-magnitudes, both floored at ``floor_db`` below the reference's maximum."""
    floor = b.max() * 10 ** (floor_db / 20)
    return float(
        np.corrcoef(np.log(np.maximum(a, floor)).ravel(), np.log(np.maximum(b, floor)).ravel())[0, 1]
    )


@pytest.mark.parametrize("n_samples", [0, 319, 320, 321, 6_400, 24_007, 120_000])
def test_shape_and_frame_count(cqt: CQT, n_samples: int) -> None:
    """Output is float32 [B, S // hop, n_bins] for lengths on and off the frame grid."""
    out = cqt(torch.randn(2, n_samples))
    assert out.shape == (2, n_samples // HOP, 336)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_sinusoid_peaks_at_its_bin(cqt: CQT) -> None:
    """A sinusoid at the frequency of bin k peaks at bin k in every frame away from the edges."""
    bins = [0, 1, 30, 47, 48, 100, 148, 149, 200, 250, 292, 293, 334, 335]
    t = np.arange(3 * SR) / SR
    wav = np.stack([np.cos(2 * np.pi * cqt.frequencies[k] * t) for k in bins])
    out = cqt(torch.from_numpy(wav).float())
    interior = slice(80, 145)  # the lowest bin's kernel (2.1 s) reaches 79 frames either side
    peaks = out[:, interior].argmax(dim=-1)
    assert (peaks == torch.tensor(bins)[:, None]).all()


def test_sinusoid_reads_librosa_scale(cqt: CQT) -> None:
    """A unit sinusoid at bin k reads sqrt(L_k) / 2 (L1-normalized kernels times sqrt(length), librosa's scale)."""
    bins = [0, 60, 160, 260, 335]
    t = np.arange(3 * SR) / SR
    wav = np.stack([np.cos(2 * np.pi * cqt.frequencies[k] * t) for k in bins])
    out = cqt(torch.from_numpy(wav).float())[:, 80:145]
    lengths = SR / relative_bandwidth(48) / cqt.frequencies[bins]
    expected = torch.tensor(np.sqrt(lengths) / 2, dtype=torch.float32)[:, None].expand(-1, 65)
    got = out[torch.arange(len(bins)), :, torch.tensor(bins)]  # (bins, frames)
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=0)


def test_matches_direct_full_rate_evaluation(cqt: CQT) -> None:
    """Multi-rate output equals the same kernels evaluated at 24 kHz in float64 (interior frames)."""
    y = np.random.default_rng(1).standard_normal(3 * SR)
    frames = [80, 112, 144]
    ours = cqt(torch.from_numpy(y).float()[None])[0, frames].double().numpy()
    ref = direct_cqt(y, frames, cqt)
    bin_rms = np.sqrt((ref**2).mean(axis=0))
    assert np.abs(ours - ref).max(axis=0).max() < 2e-3 * bin_rms.min()
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 2e-4


def test_matmul_and_fft_paths_agree(monkeypatch: pytest.MonkeyPatch, cqt: CQT) -> None:
    """Every rate computed by frame matmuls, or every rate by FFT blocks, gives the default's output."""
    wav = torch.from_numpy(music_like(2.0, seed=5))[None]
    ref = cqt(wav)
    for overlap in (10**9, 0):  # never / always the FFT path
        monkeypatch.setattr(cqt_module, "SPECTRAL_MIN_OVERLAP", overlap)
        module = CQT()
        assert ("fft" in repr(module)) == (overlap == 0)
        torch.testing.assert_close(module(wav), ref, rtol=1e-4, atol=1e-5 * ref.max().item())


@pytest.mark.parametrize(
    ("sparsity", "min_corr", "max_median_rel"),
    [(0.01, 0.99, 0.02), (0.0, 0.999, 0.005)],  # measured: 0.995 / 0.6% and 0.9994 / 0.24%
)
def test_agrees_with_librosa_on_music_like_signal(
    cqt: CQT, sparsity: float, min_corr: float, max_median_rel: float
) -> None:
    """Log-magnitudes correlate with librosa.cqt and magnitudes agree (closer still without its sparsity)."""
    y = music_like(3.0)
    ours = cqt(torch.from_numpy(y)[None])[0].numpy()  # (T, n_bins), frame t centred at t*320 + 160
    # librosa centres frame t at sample t*320: shifting the input by half a hop aligns the frames.
    lib = librosa.cqt(
        y[HOP // 2 :], sr=SR, hop_length=HOP, fmin=32.7, n_bins=336, bins_per_octave=48, sparsity=sparsity
    )
    lib = np.abs(lib).T[: ours.shape[0]]
    assert lib.shape == ours.shape
    assert log_mag_corr(ours, lib) >= min_corr
    loud = lib > lib.max() * 1e-3  # within 60 dB of the maximum
    rel = np.abs(ours - lib)[loud] / lib[loud]
    assert np.median(rel) < max_median_rel
    assert np.linalg.norm(ours - lib) / np.linalg.norm(lib) < 2 * max_median_rel


def test_tiny_recipe_settings_agree_with_librosa() -> None:
    """84 bins at 12 per octave: right shape, and log-magnitudes correlate >= 0.99 with librosa.cqt."""
    module = CQT(n_bins=84, bins_per_octave=12)
    y = music_like(2.0, seed=3)
    ours = module(torch.from_numpy(y)[None])[0].numpy()
    assert ours.shape == (150, 84)
    lib = np.abs(librosa.cqt(y[HOP // 2 :], sr=SR, hop_length=HOP, fmin=32.7, n_bins=84, bins_per_octave=12))
    assert log_mag_corr(ours, lib.T[:150]) >= 0.99


@pytest.mark.parametrize(("n_bins", "bins_per_octave"), [(100, 24), (84, 12), (7, 12), (1, 12)])
def test_partial_octaves_peak_at_their_bin(n_bins: int, bins_per_octave: int) -> None:
    """Bin counts that are not a whole number of octaves still place a sinusoid at its own bin."""
    module = CQT(fmin=55.0, n_bins=n_bins, bins_per_octave=bins_per_octave)
    bins = sorted({0, n_bins // 2, n_bins - 1})
    t = np.arange(2 * SR) / SR
    wav = np.stack([np.cos(2 * np.pi * module.frequencies[k] * t) for k in bins])
    out = module(torch.from_numpy(wav).float())
    assert out.shape == (len(bins), 150, n_bins)
    assert (out[:, 60:90].argmax(dim=-1) == torch.tensor(bins)[:, None]).all()


def test_batch_items_are_independent(cqt: CQT) -> None:
    """Item i of a batch equals the CQT of that item alone."""
    wav = torch.randn(3, 2 * SR)
    batch = cqt(wav)
    for i in range(3):
        torch.testing.assert_close(
            batch[i : i + 1], cqt(wav[i : i + 1]), rtol=1e-5, atol=1e-5 * batch.max().item()
        )


def test_autocast_bfloat16_still_float32(cqt: CQT) -> None:
    """Under CPU bfloat16 autocast (and for bfloat16 input) the CQT runs and returns float32, unchanged."""
    wav = torch.randn(2, SR)
    ref = cqt(wav)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cqt(wav)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    out_bf16_input = cqt(wav.bfloat16())
    assert out_bf16_input.dtype == torch.float32
    torch.testing.assert_close(out_bf16_input, cqt(wav.bfloat16().float()))


def test_no_gradient_and_no_checkpoint_state(cqt: CQT) -> None:
    """The output carries no graph, the kernels stay out of state_dict, and .double() keeps it working."""
    wav = torch.randn(1, SR, requires_grad=True)
    assert not cqt(wav).requires_grad
    assert cqt.state_dict() == {}
    assert len(list(cqt.buffers())) > 0
    torch.testing.assert_close(CQT().double()(wav.detach()), cqt(wav.detach()))


def test_rejects_bad_input_and_settings() -> None:
    """A waveform without a batch dimension, or bins above the Nyquist frequency, fail clearly."""
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        CQT(n_bins=12, bins_per_octave=12)(torch.randn(SR))
    with pytest.raises(ValueError, match="Nyquist"):
        CQT(n_bins=420, bins_per_octave=48)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(cqt: CQT) -> None:
    """On CUDA (also under fp16 autocast) the CQT matches the CPU result."""
    wav = torch.randn(4, 5 * SR)
    ref = cqt(wav)
    module = CQT().cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        out = module(wav.cuda())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-3, atol=1e-3 * ref.max().item())
