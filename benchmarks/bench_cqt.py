"""Time musiclm_stab.cqt.CQT against librosa.cqt on the same audio, and measure how well they agree.

    .venv/bin/python benchmarks/bench_cqt.py --seconds 30 --repeats 5

Both run with the reference settings (24 kHz, hop 320, fmin 32.7 Hz, 336 bins, 48 per octave) on one
synthetic music-like clip (harmonic notes with envelopes over a -60 dB noise floor). Runs alternate
(ours, librosa, ours, ...) so that load from other jobs hits both alike; each is warmed up once first
(librosa builds and caches its filters on the first call). On a machine shared with other busy
processes, use ``--threads 1`` (or ``OMP_WAIT_POLICY=PASSIVE``): torch's OpenMP threads spin-wait at
every op, and when a core is taken by another process each op waits for a time slice, which made our
2-thread runs 20-50x slower here while librosa (single-threaded) was barely affected. Agreement is
measured on frames aligned by a half-hop shift (librosa centres frame t at t*hop, ours at
t*hop + hop/2). nnAudio's CQT1992v2 is timed too when it is importable (it is not a dependency).
"""

from __future__ import annotations

import argparse
import statistics
import time

import librosa
import numpy as np
import torch

from musiclm_stab.model.cqt import CQT

SR, HOP, FMIN, N_BINS, BPO = 24_000, 320, 32.7, 336, 48


def music_like(seconds: float, seed: int = 0) -> np.ndarray:
    """Overlapping harmonic notes (attack, decay, release) over a -60 dB noise floor, 50 ms of silence first."""
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


def agreement(ours: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Log-magnitude correlation (floored 80 dB and 60 dB below the reference's maximum), and relative
    errors of magnitudes: median over bins within 60 dB of the maximum, and the overall ratio of norms."""
    out = {}
    for db in (80, 60):
        floor = ref.max() * 10 ** (-db / 20)
        a, b = np.log(np.maximum(ours, floor)), np.log(np.maximum(ref, floor))
        out[f"log_mag_corr_{db}dB"] = float(np.corrcoef(a.ravel(), b.ravel())[0, 1])
    loud = ref > ref.max() * 1e-3
    out["median_rel_err"] = float(np.median(np.abs(ours - ref)[loud] / ref[loud]))
    out["rel_err_norm"] = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the test clip")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each implementation")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="device for our CQT (cpu, cuda)")
    parser.add_argument("--batch", type=int, default=8, help="batch size for the 5 s crop throughput line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    y = music_like(args.seconds)
    module = CQT(SR, HOP, FMIN, N_BINS, BPO).to(device)
    wav = torch.from_numpy(y)[None].to(device)

    def synced(fn):
        def run():
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return out

        return run

    ours = synced(lambda: module(wav))

    def theirs() -> np.ndarray:
        return librosa.cqt(y, sr=SR, hop_length=HOP, fmin=FMIN, n_bins=N_BINS, bins_per_octave=BPO)

    runners = {"ours": ours, "librosa": theirs}
    try:
        from nnAudio.features import CQT1992v2  # optional, not a dependency

        nn_cqt = CQT1992v2(sr=SR, hop_length=HOP, fmin=FMIN, n_bins=N_BINS, bins_per_octave=BPO).to(device)
        runners["nnAudio"] = synced(lambda: nn_cqt(wav))
    except Exception as err:  # any failure only means "not compared"
        print(f"nnAudio: not compared ({type(err).__name__}: {err})")

    for fn in runners.values():
        fn()  # warm-up: librosa's filter cache, torch's kernels
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, fn in runners.items():
            times[name].append(timed(fn))

    print(
        f"{args.seconds:g} s of audio at {SR} Hz, hop {HOP}, {N_BINS} bins ({BPO}/octave) from {FMIN} Hz; "
        f"torch {torch.__version__} on {device} ({torch.get_num_threads()} threads), librosa {librosa.__version__}"
    )
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"{name:>8}: median {med[name]:.4f} s, min {min(ts):.4f} s over {len(ts)} runs")
    print(
        f"speed ratio librosa / ours: {med['librosa'] / med['ours']:.1f}x (median), "
        f"{min(times['librosa']) / min(times['ours']):.1f}x (min)"
    )

    # Throughput on a training-shaped batch (crops of 5 s), ours only.
    crops = torch.from_numpy(np.stack([music_like(5.0, seed=i) for i in range(args.batch)])).to(device)
    batch_run = synced(lambda: module(crops))
    batch_run()
    batch_s = statistics.median(timed(batch_run) for _ in range(args.repeats))
    print(
        f"    ours on a batch of {args.batch} x 5 s: {batch_s:.4f} s "
        f"({args.batch * 5 / batch_s:.0f} audio-s/s)"
    )

    # Agreement, frames aligned: librosa's frame t of y[hop/2:] is centred where our frame t is.
    # sparsity=0 turns off librosa's pruning of 1% of each filter's spectrum (its default is 0.01).
    mag = module(wav)[0].cpu().numpy()  # (T, n_bins)
    for sparsity in (0.01, 0.0):
        ref = librosa.cqt(
            y[HOP // 2 :],
            sr=SR,
            hop_length=HOP,
            fmin=FMIN,
            n_bins=N_BINS,
            bins_per_octave=BPO,
            sparsity=sparsity,
        )
        stats = agreement(mag, np.abs(ref).T[: mag.shape[0]])
        print(
            f"agreement with librosa (sparsity={sparsity}): "
            + ", ".join(f"{k} {v:.4f}" for k, v in stats.items())
        )


if __name__ == "__main__":
    main()
