"""Constant-Q transform in torch: the musical stream's regression target, computed on the training device.

``CQT()(wav)`` maps a batch of 24 kHz waveforms ``[B, S]`` to CQT magnitudes ``[B, T, n_bins]`` with
``T = S // hop_length``, one row per model frame.

Frame convention
    Frame ``t`` is centred at sample ``t * hop_length + hop_length / 2``: the centre of the hop window
    ``[t * hop_length, (t + 1) * hop_length)`` that the conv frontend (total stride 320) turns into
    frame ``t``. (``librosa.cqt`` centres its frame ``t`` at sample ``t * hop_length`` instead; our
    frame ``t`` equals librosa's frame ``t`` of ``wav[hop_length // 2:]`` when ``hop_length`` is even.)
    Samples outside the waveform are taken as zeros, like ``librosa.cqt(pad_mode="constant")``.

Filters and scale (matched to ``librosa.cqt`` defaults: ``filter_scale=1, norm=1, scale=True``)
    Bin ``k`` has frequency ``f_k = fmin * 2 ** (k / bins_per_octave)``, quality factor
    ``Q = 1 / alpha`` with ``alpha = (r**2 - 1) / (r**2 + 1)``, ``r = 2 ** (1 / bins_per_octave)``, and a
    Hann-windowed complex exponential of ``L_k = Q * sample_rate / f_k`` samples. Each kernel is divided
    by the sum of its window (L1 norm 1, so a sinusoid of amplitude ``A`` at ``f_k`` gives ``A / 2``) and
    the response is multiplied by ``sqrt(L_k)`` (librosa's ``scale=True``). So a full-scale sinusoid at
    ``f_k`` reads ``sqrt(L_k) / 2``: about 113 at 32.7 Hz and 10 at 4.1 kHz with the reference settings,
    the same as librosa. Measured against ``librosa.cqt`` (0.11) on 30 s of a music-like signal with
    frames aligned: log-magnitude correlation 0.997 (floor 80 dB below the maximum), median relative
    error of magnitudes 0.5%; with librosa's pruning of its filter spectra turned off (``sparsity=0``)
    1.000 and 0.2%, so most of the difference is that pruning (``benchmarks/README.md``).

Multi-rate design (why it is fast)
    A single-rate bank needs a ~50,000-tap kernel for 32.7 Hz at 48 bins per octave (~25 GFLOP per 5 s
    as one conv1d with every kernel padded to that length). Instead each bin is computed at the lowest
    rate ``sample_rate / D`` (``D`` a power of two dividing ``hop_length``) whose Nyquist frequency
    leaves room for the bin's band: ``f_k * (1 + 0.75 / Q)`` at most ``PASSBAND_FRACTION`` of it. The
    waveform is low-passed and decimated by 2 repeatedly (a zero-phase half-band Kaiser-windowed sinc,
    90 dB stop band, run as two small matmuls over blocks), so every kernel has a few hundred taps at
    its rate. With the reference settings (hop 320 = 5 * 2**6) the top ~0.9 octave runs at 12 kHz,
    the next four octaves at 6, 3, 1.5 and 0.75 kHz, and the lowest ~2 octaves at 375 Hz. The frame
    centre may fall between decimated samples (2.5 samples into the 5-sample hop at 375 Hz); the
    kernels are sampled at that fractional offset. Each rate then takes one of two routes:
    - frame matmuls, where frames overlap little (top three rates): the frames ``x[t * stride + start :
      ... + width]`` (``unfold``, ``stride = hop_length / D``) times ``[n_taps, 2K]`` matrices of real
      and imaginary kernels, in octave-wide banks so short kernels are not padded to the longest;
    - FFT blocks, where frames overlap ``SPECTRAL_MIN_OVERLAP``-fold or more (stride 20, 10 and 5 at
      the lowest rates): overlap-save blocks of ``P * stride`` samples, the product with each
      kernel's spectrum restricted to the band where it is within ``SPECTRAL_BAND_DB`` (100 dB) of its
      peak, folded to P bins and inverse-transformed: the responses at all frame positions of the
      block at once, where the matmul route would copy each sample into up to 160 overlapping frames.
    Both routes give the same numbers (to ~1e-5; tested), and away from the signal's ends the result
    equals a direct full-rate evaluation of the same kernels to ~1e-4 (float32). Within half a kernel
    of an end (up to ~1 s for the lowest bin) the hard cut to zero is broadband, and the decimation
    filters remove the part of it that a full-rate kernel's side lobes would pick up, as in librosa's
    own multi-rate implementation.

The transform is a target only: ``forward`` runs under ``torch.no_grad()`` and outside autocast
(always float32). Kernels are computed in float64, stored float32 as non-persistent buffers (never in
checkpoints), and follow the module to its device. No Python loop runs over frames, no host syncs.
On CUDA the matmuls follow torch's float32 matmul precision: with TF32 enabled by the trainer the
magnitudes carry ~1e-3 relative error (harmless for an MSE target; quiet bins lose log precision).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

HANN_BANDWIDTH = 1.5  # equivalent noise bandwidth of the Hann window in DFT bins (librosa's window_bandwidth)
PASSBAND_FRACTION = 0.75  # a bin's band edge may reach this fraction of its working rate's Nyquist
ANTIALIAS_DB = 90.0  # stop-band attenuation of the decimation low-pass filter
SPECTRAL_MIN_OVERLAP = 16  # rates whose frames overlap this much (taps / stride) use FFT blocks
SPECTRAL_BAND_DB = 100.0  # FFT blocks keep each kernel's spectrum down to this far below its peak
SPECTRAL_BLOCK_WIDTHS = 4  # FFT blocks span at least this many frame widths (a power-of-2 P frames)


def cqt_frequencies(n_bins: int, fmin: float, bins_per_octave: int) -> np.ndarray:
    """Centre frequency of each bin in Hz, ``[n_bins]`` float64, ascending."""
    return fmin * 2.0 ** (np.arange(n_bins, dtype=np.float64) / bins_per_octave)


def relative_bandwidth(bins_per_octave: int) -> float:
    """``alpha``: bandwidth over centre frequency of one bin (``Q = 1 / alpha``), as in librosa's CQT."""
    r2 = 2.0 ** (2.0 / bins_per_octave)
    return (r2 - 1.0) / (r2 + 1.0)


def decimation_lowpass() -> np.ndarray:
    """Zero-phase half-band low-pass FIR for decimation by 2, ``[N]`` float64, unit DC gain.

    A Kaiser-windowed sinc cut at 0.25 cycles/sample: pass band up to ``PASSBAND_FRACTION / 4``, stop
    band (``ANTIALIAS_DB``) from ``0.5 - PASSBAND_FRACTION / 4``, which is all that would alias into the
    pass band after dropping every other sample.
    """
    transition = 0.5 - PASSBAND_FRACTION / 2  # cycles per sample
    n_taps = int(math.ceil((ANTIALIAS_DB - 7.95) / (2.285 * 2 * math.pi * transition))) + 1
    n_taps += (3 - n_taps) % 4  # 4m + 3: the outermost taps are not zeros of the half-band sinc
    beta = 0.1102 * (ANTIALIAS_DB - 8.7)
    n = np.arange(n_taps, dtype=np.float64) - (n_taps - 1) / 2
    h = 0.5 * np.sinc(0.5 * n) * np.kaiser(n_taps, beta)
    return h / h.sum()


def _blocked_decimation(lowpass: np.ndarray, block: int) -> np.ndarray:
    """``[2, 2P, P]``: output ``r`` of a block of P takes ``lowpass[n]`` from input ``2r + n`` of 4P."""
    weights = np.zeros((4 * block, block))
    for r in range(block):
        weights[2 * r : 2 * r + len(lowpass), r] = lowpass
    return weights.reshape(2, 2 * block, block)


@dataclass(frozen=True)
class _Bank:
    """Bins ``[first_bin, first_bin + n_bins)``, taps ``[start, start + n_taps)`` from a frame's start."""

    first_bin: int
    n_bins: int
    start: int  # in working samples; negative: before the frame's hop window
    n_taps: int
    first_chunk: int = 0  # FFT path only: spectrum kept, FFT bins [first_chunk * P, last_chunk * P)
    last_chunk: int = 0


@dataclass(frozen=True)
class _Rate:
    """The bins computed at ``sample_rate / decimation``, and how (one matmul per bank, or FFT blocks)."""

    decimation: int
    stride: int  # hop_length / decimation: frame step in working samples
    banks: tuple[_Bank, ...]  # octave-wide, ascending; their taps all lie in [start, start + width)
    start: int
    width: int
    block: int = 0  # FFT path only: P outputs per FFT block of P * stride samples (0: matmul path)
    block_frames: int = 0  # valid frames per block (taps within the block)

    @property
    def first_bin(self) -> int:
        return self.banks[0].first_bin

    @property
    def n_bins(self) -> int:
        return sum(b.n_bins for b in self.banks)


def _kernels(
    freqs: np.ndarray,
    lengths: np.ndarray,
    decimation: int,
    start: int,
    n_taps: int,
    sample_rate: int,
    hop_length: int,
) -> np.ndarray:
    """Kernels sampled at rate ``sample_rate / decimation``, ``[n_taps, 2K]`` float64: K real parts
    then K imaginary parts; tap n multiplies the sample ``start + n`` after the frame's start."""
    centre = hop_length / (2 * decimation)  # frame centre from the frame start, in working samples
    tau = start + np.arange(n_taps, dtype=np.float64) - centre  # (n_taps,) tap time from the centre
    half = lengths[:, None] / (2 * decimation)  # (K, 1) half-length of each kernel in working samples
    window = np.where(np.abs(tau) < half, 0.5 + 0.5 * np.cos(np.pi * tau / half), 0.0)  # (K, n_taps)
    phase = 2 * np.pi * freqs[:, None] * decimation / sample_rate * tau  # (K, n_taps)
    gain = np.sqrt(lengths)[:, None] / window.sum(axis=1, keepdims=True)  # L1 norm 1, times sqrt(L_k)
    kernels = np.concatenate([window * gain * np.cos(phase), window * gain * np.sin(phase)])  # (2K, n_taps)
    return kernels.T


def _spectral_weights(kernels: np.ndarray, stride: int, block: int) -> tuple[np.ndarray, int, int]:
    """Kernels ``[n_taps, 2K]`` as block-FFT weights ``[P, 2n, 2K]`` and the chunks ``[first, last)`` kept.

    With ``U`` the FFT of a block of ``N = P * stride`` samples, the response at frame ``s`` of the
    block is ``ifft_P(sum_r U[r P + p] G[r P + p])[s]`` where ``G = N * ifft(conj(kernel)) / stride``:
    a correlation sampled every ``stride`` samples, folded to P bins. Only the ``n`` chunks of P bins
    holding each kernel's spectrum down to ``SPECTRAL_BAND_DB`` below its peak are kept. The weights
    act on ``[Re U, Im U]`` of those chunks and give interleaved ``(re, im)`` per bin.
    """
    n_fft, n_bins = block * stride, kernels.shape[1] // 2
    conj = kernels[:, :n_bins] - 1j * kernels[:, n_bins:]  # same magnitudes; energy at positive freqs
    spectrum = n_fft * np.fft.ifft(conj, n=n_fft, axis=0) / stride  # (N, K)
    mag = np.abs(spectrum)
    kept = np.flatnonzero((mag >= mag.max(axis=0) * 10 ** (-SPECTRAL_BAND_DB / 20)).any(axis=1))
    first, last = int(kept[0]) // block, int(kept[-1]) // block + 1
    g = spectrum[first * block : last * block].reshape(last - first, block, n_bins).transpose(1, 0, 2)
    weights = np.stack(  # (P, 2, n, K, 2): [from Re U | from Im U] x chunk x bin x [to re | to im]
        [np.stack([g.real, g.imag], axis=-1), np.stack([-g.imag, g.real], axis=-1)], axis=1
    )
    return weights.reshape(block, 2 * (last - first), 2 * n_bins), first, last


class CQT(nn.Module):
    """CQT magnitudes ``[B, T, n_bins]`` (float32, ``T = S // hop_length``) of waveforms ``[B, S]``.

    Frame ``t`` is centred at sample ``t * hop_length + hop_length / 2`` (the middle of the frame's own
    hop window), the scale is ``librosa.cqt``'s default one; see the module docstring for the details
    and the multi-rate design. No gradient flows through the output (a training target only).
    """

    keeps_fp32 = True  # a target's filterbank: stays fp32 in an fp16 model (training/precision.py)

    def __init__(
        self,
        sample_rate: int = 24_000,
        hop_length: int = 320,
        fmin: float = 32.7,
        n_bins: int = 336,
        bins_per_octave: int = 48,
    ) -> None:
        super().__init__()
        if min(sample_rate, hop_length, n_bins, bins_per_octave) <= 0 or fmin <= 0:
            raise ValueError("sample_rate, hop_length, fmin, n_bins and bins_per_octave must be positive")
        self.sample_rate = sample_rate
        self.hop_length = hop_length
        self.fmin = fmin
        self.n_bins = n_bins
        self.bins_per_octave = bins_per_octave

        freqs = cqt_frequencies(n_bins, fmin, bins_per_octave)
        q = 1.0 / relative_bandwidth(bins_per_octave)
        lengths = q * sample_rate / freqs  # L_k in samples at sample_rate
        band_edge = freqs * (1 + 0.5 * HANN_BANDWIDTH / q)
        if band_edge[-1] > sample_rate / 2:
            raise ValueError(
                f"top bin {freqs[-1]:.1f} Hz reaches {band_edge[-1]:.1f} Hz, above the Nyquist frequency "
                f"{sample_rate / 2:.1f} Hz; use fewer bins or a lower fmin"
            )

        # Decimation per bin: the largest power of two that divides the hop and keeps the bin's band
        # within PASSBAND_FRACTION of that rate's Nyquist.
        max_log2 = (hop_length & -hop_length).bit_length() - 1  # times 2 divides hop_length
        log2_d = np.floor(np.log2(PASSBAND_FRACTION * sample_rate / (2 * band_edge)))
        log2_d = np.clip(log2_d, 0, max_log2).astype(int)

        rates: list[_Rate] = []
        for d_log in sorted(set(log2_d.tolist())):
            d, group = 2**d_log, np.flatnonzero(log2_d == d_log)  # contiguous bins
            stride, centre = hop_length // d, hop_length / (2 * d)
            # Octave-wide banks, so that a bank's kernels differ in length by at most 2x (each bank's
            # kernels are zero-padded to its longest, centred on the frame centre).
            banks = []
            for part in np.array_split(group, -(-len(group) // bins_per_octave)):
                half = lengths[part[0]] / (2 * d)  # longest kernel of the bank, in working samples
                start = math.floor(centre - half)
                banks.append(_Bank(int(part[0]), len(part), start, math.ceil(centre + half) - start + 1))
            start, width = banks[0].start, banks[0].n_taps  # the lowest bank has the longest kernels
            spectral = width >= SPECTRAL_MIN_OVERLAP * stride
            block = 1 << math.ceil(math.log2(SPECTRAL_BLOCK_WIDTHS * width / stride)) if spectral else 0
            for j, bank in enumerate(banks):
                bins = slice(bank.first_bin, bank.first_bin + bank.n_bins)
                if spectral:  # every bank on the rate's common taps, so that they share the block FFT
                    kernels = _kernels(freqs[bins], lengths[bins], d, start, width, sample_rate, hop_length)
                    kernels, first, last = _spectral_weights(kernels, stride, block)  # (P, 2n, 2K)
                    banks[j] = dataclasses.replace(bank, first_chunk=first, last_chunk=last)
                else:
                    kernels = _kernels(
                        freqs[bins], lengths[bins], d, bank.start, bank.n_taps, sample_rate, hop_length
                    )  # (n_taps, 2K)
                name = f"kernels_{len(rates)}_{j}"
                self.register_buffer(name, torch.from_numpy(kernels).float(), persistent=False)
            block_frames = (block * stride - width) // stride + 1 if spectral else 0
            rates.append(_Rate(d, stride, tuple(banks), start, width, block, block_frames))
        self._rates = tuple(rates)
        self._max_decimation = rates[-1].decimation

        lowpass = decimation_lowpass()
        self._lowpass_centre = (len(lowpass) - 1) // 2
        self._block = max(32, 1 << ((len(lowpass) - 3) // 2).bit_length())  # P >= (N - 1) / 2
        blocked = torch.from_numpy(_blocked_decimation(lowpass, self._block)).float()
        self.register_buffer("decimation_blocks", blocked, persistent=False)

    @property
    def frequencies(self) -> np.ndarray:
        """Centre frequency of each bin in Hz, ``[n_bins]``."""
        return cqt_frequencies(self.n_bins, self.fmin, self.bins_per_octave)

    def extra_repr(self) -> str:
        paths = ", ".join(f"{r.decimation}:{'fft' if r.block else 'matmul'}" for r in self._rates)
        return (
            f"sample_rate={self.sample_rate}, hop_length={self.hop_length}, fmin={self.fmin}, "
            f"n_bins={self.n_bins}, bins_per_octave={self.bins_per_octave}, decimations=[{paths}]"
        )

    def _decimate(self, x: Tensor) -> Tensor:
        """Low-pass and keep every other sample, zero phase: ``[B, L] -> [B, L / 2]``, L even.

        ``y[m] = sum_n h[n] x[2m + n - c]`` as two matmuls over blocks of 2P input samples (P outputs
        each): a 1-channel ``conv1d`` is several times slower on CPU.
        """
        n_batch, n_out, p = x.shape[0], x.shape[1] // 2, self._block
        n_blocks = -(-n_out // p)
        right = (n_blocks + 1) * 2 * p - x.shape[1] - self._lowpass_centre
        blocks = F.pad(x, (self._lowpass_centre, right)).view(n_batch, n_blocks + 1, 2 * p)
        first, second = self.decimation_blocks.float()  # (2P, P) each
        y = torch.baddbmm(blocks[:, :-1] @ first, blocks[:, 1:], second.expand(n_batch, -1, -1))
        return y.view(n_batch, n_blocks * p)[:, :n_out]  # (B, L / 2)

    def _matmul_power(self, x: Tensor, index: int, rate: _Rate, n_frames: int) -> list[Tensor]:
        """Power ``[B, T, K]`` of each bank of a rate: frames ``[B, T, width]`` times kernel matrices."""
        left = max(0, -rate.start)
        right = max(0, rate.start + (n_frames - 1) * rate.stride + rate.width - x.shape[-1])
        xp = F.pad(x, (left, right))[:, rate.start + left :]  # (B, L): frame t's taps at t*stride + n
        frames = xp.unfold(-1, rate.width, rate.stride)[:, :n_frames].contiguous()  # (B, T, width)
        out = []
        for j, bank in enumerate(rate.banks):
            offset = bank.start - rate.start  # shorter kernels: a middle slice of the shared frames
            kernels = getattr(self, f"kernels_{index}_{j}").float()  # float32 even after .double()
            resp = frames[..., offset : offset + bank.n_taps] @ kernels  # (B, T, 2K)
            re, im = resp.split(bank.n_bins, dim=-1)
            out.append(torch.addcmul(re * re, im, im))
        return out

    def _spectral_power(self, x: Tensor, index: int, rate: _Rate, n_frames: int) -> list[Tensor]:
        """Power ``[B, T, K]`` of each bank of a rate through FFT blocks (see ``_spectral_weights``)."""
        n_batch, p, f = x.shape[0], rate.block, rate.block_frames
        n_fft, n_blocks = p * rate.stride, -(-n_frames // f)
        left = max(0, -rate.start)
        right = max(0, rate.start + (n_blocks - 1) * f * rate.stride + n_fft - x.shape[-1])
        xp = F.pad(x, (left, right))[:, rate.start + left :]  # (B, L)
        blocks = xp.unfold(-1, n_fft, f * rate.stride)[:, :n_blocks]  # (B, nb, N): frames bF .. bF+F-1
        spec = torch.view_as_real(torch.fft.fft(blocks)).view(n_batch * n_blocks, n_fft // p, p, 2)
        out = []
        for j, bank in enumerate(rate.banks):
            n_chunks = bank.last_chunk - bank.first_chunk
            band = spec[:, bank.first_chunk : bank.last_chunk]  # (B*nb, n, P, 2): n chunks of P bins
            band = band.permute(2, 0, 3, 1).reshape(p, n_batch * n_blocks, 2 * n_chunks)  # [Re.., Im..]
            weights = getattr(self, f"kernels_{index}_{j}").float()  # (P, 2n, 2K)
            folded = torch.bmm(band, weights).view(p, n_batch * n_blocks, bank.n_bins, 2)
            resp = torch.fft.ifft(torch.view_as_complex(folded), dim=0)[:f]  # (F, B*nb, K)
            power = torch.addcmul(resp.real * resp.real, resp.imag, resp.imag)  # (F, B*nb, K)
            power = power.view(f, n_batch, n_blocks, bank.n_bins).permute(1, 2, 0, 3)  # (B, nb, F, K)
            power = power.reshape(n_batch, n_blocks * f, bank.n_bins)  # (B, nb*F, K)
            out.append(power[:, :n_frames])
        return out

    @torch.no_grad()
    def forward(self, wav: Tensor) -> Tensor:
        """CQT magnitudes ``[B, T, n_bins]`` float32 of ``wav`` ``[B, S]``, ``T = S // hop_length``."""
        if wav.dim() != 2:
            raise ValueError(f"expected a waveform batch [B, S], got shape {tuple(wav.shape)}")
        n_batch, n_frames = wav.shape[0], wav.shape[1] // self.hop_length
        if n_frames == 0:
            return wav.new_zeros((n_batch, 0, self.n_bins), dtype=torch.float32)
        with torch.autocast(device_type=wav.device.type, enabled=False):
            # Zeros beyond the end (as outside the signal anyway) so that every decimation halves exactly.
            x = wav.float()  # (B, S)
            if x.shape[1] % self._max_decimation:
                x = F.pad(x, (0, -x.shape[1] % self._max_decimation))  # (B, S')
            d = 1
            power: list[Tensor] = []  # (B, T, K) per bank, highest bins first
            for index, rate in enumerate(self._rates):
                while d < rate.decimation:
                    x = self._decimate(x)  # (B, S' / d)
                    d *= 2
                path = self._spectral_power if rate.block else self._matmul_power
                power.extend(reversed(path(x, index, rate, n_frames)))
            return torch.cat(power[::-1], dim=-1).sqrt_()  # (B, T, n_bins)
