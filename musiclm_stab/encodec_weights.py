"""EnCodec 24 kHz for tokenizing: loading the pretrained model, or making and loading local weights.

The default is the pretrained model, which the ``encodec`` package downloads at first use. Offline,
``load_encodec(None)`` raises ``WeightsUnavailable`` with the ways to proceed; it never falls back.

Local weights are for offline work and tests. A fresh ``encodec_model_24khz(pretrained=False)`` has
all-zero codebooks (EnCodec fits them by k-means on the first training batch), so every code would
be 0. ``make_local_weights`` keeps the seeded random encoder and fits the 8 residual codebooks used at
6 kbps with a fast Lloyd k-means on encoder frames of the given audio. A random encoder with fitted
codebooks still yields usable self-supervised targets (cf. BEST-RQ), but they are not the pretrained
model's codes: the weights are identified by a sha256 that travels with every tokenized dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import soundfile as sf
import torch
from tqdm.auto import tqdm

from musiclm_stab import CODEBOOK_SIZE, FRAME_RATE, HOP_LENGTH, NUM_CODEBOOKS, SAMPLE_RATE
from musiclm_stab.audio import AudioError, list_audio_files, load_audio

if TYPE_CHECKING:
    from encodec import EncodecModel

BANDWIDTH = 6.0  # kbps: 8 codebooks of 1024 codes at 75 Hz
PRETRAINED_CHECKPOINT = "encodec_24khz-d7cc33bc.th"
PRETRAINED_URL = f"https://dl.fbaipublicfiles.com/encodec/v0/{PRETRAINED_CHECKPOINT}"


class WeightsUnavailable(RuntimeError):
    """The pretrained EnCodec weights could not be had (no internet and no cached checkpoint)."""


def _new_model(pretrained: bool) -> EncodecModel:
    from encodec import EncodecModel  # imported only when a model is built

    with warnings.catch_warnings():  # encodec uses the deprecated torch.nn.utils.weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        return EncodecModel.encodec_model_24khz(pretrained=pretrained)


def seeded_random_model(seed: int) -> EncodecModel:
    """The untrained EnCodec 24 kHz model drawn from ``seed``, bit for bit the same on every CPU.

    EnCodec's modules initialise themselves as torch does by default (``kaiming_uniform_`` and
    ``uniform_(-b, b)``, then weight norm's magnitudes as float32 norms), and those float32 kernels round
    differently on AVX2, AVX-512 and plain CPUs. So every parameter is drawn again here with the same
    distributions, in float64 arithmetic that rounds the same everywhere (one IEEE operation at a time),
    and rounded to float32 once: convolutions U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases,
    the LSTM U(-1/sqrt(hidden), 1/sqrt(hidden)), and weight norm's magnitudes ``weight_g`` = |weight_v|.
    The caller's RNG state is left untouched.
    """
    with torch.random.fork_rng(devices=[]):  # EnCodec's own init draws from the global RNG: leave it be
        model = _new_model(pretrained=False)
    g = torch.Generator().manual_seed(seed)

    def uniform(p: torch.Tensor, bound: float) -> None:
        u = torch.rand(p.shape, dtype=torch.float64, generator=g)
        p.copy_((u * 2.0 - 1.0) * bound)

    drawn: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                v = getattr(module, "weight_v", None)
                weight = v if v is not None else module.weight
                fan_in = weight.shape[1] * math.prod(weight.shape[2:])  # as torch's default conv init
                uniform(weight, fan_in**-0.5)
                drawn.add(id(weight))
                if module.bias is not None:
                    uniform(module.bias, fan_in**-0.5)
                    drawn.add(id(module.bias))
                if v is not None:  # weight_norm(dim=0): one magnitude per output channel
                    v64 = v.double()
                    module.weight_g.copy_(v64.pow(2).sum(dim=tuple(range(1, v.dim())), keepdim=True).sqrt())
                    drawn.add(id(module.weight_g))
            elif isinstance(module, torch.nn.LSTM):
                for p in module.parameters():
                    uniform(p, module.hidden_size**-0.5)
                    drawn.add(id(p))
    missed = [name for name, p in model.named_parameters() if id(p) not in drawn]
    assert not missed, f"parameters of EnCodec not drawn by seeded_random_model: {missed}"
    return model.eval()


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict: key names, dtypes, shapes and raw bytes, in sorted key order.

    Identical weights give the identical hash wherever they came from (download, file, memory).
    """
    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _info(model: EncodecModel, weights: str, weights_file: str | Path | None) -> dict[str, Any]:
    return {
        "model": "encodec_24khz",
        "weights": weights,
        "weights_file": Path(weights_file).name if weights_file else None,
        "weights_sha256": weights_sha256(model.state_dict()),
        "bandwidth": BANDWIDTH,
        "sample_rate": SAMPLE_RATE,
        "frame_rate": FRAME_RATE,
        "hop_length": HOP_LENGTH,
        "num_codebooks": NUM_CODEBOOKS,
        "codebook_size": CODEBOOK_SIZE,
    }


def _how_to() -> str:
    checkpoints = Path(torch.hub.get_dir()) / "checkpoints"
    return (
        "To proceed, do one of:\n"
        "  1. connect to the internet and run again (the checkpoint is then cached for offline use);\n"
        f"  2. place {PRETRAINED_CHECKPOINT} (from {PRETRAINED_URL}) in {checkpoints}/;\n"
        "  3. pass --weights FILE with a local EnCodec 24 kHz state dict, e.g. one made by\n"
        "     `musiclm-stab make-weights AUDIO_DIR FILE` (a random encoder with codebooks fitted to your\n"
        "     audio: NOT the pretrained model; the tokenized data records which weights were used)."
    )


def load_encodec(weights: str | Path | None = None) -> tuple[EncodecModel, dict[str, Any]]:
    """EnCodec 24 kHz at 6 kbps (8 codebooks) in eval mode on the CPU, and its tokenizer info.

    ``weights=None`` loads the pretrained model (raises WeightsUnavailable when it cannot be had);
    ``weights=FILE`` loads a local state dict strictly. The info dict identifies the weights by sha256.
    """
    if weights is None:
        try:
            model = _new_model(pretrained=True)
        except OSError as e:  # URLError, timeouts, DNS failures, unwritable cache
            raise WeightsUnavailable(
                f"Could not download the pretrained EnCodec 24 kHz weights ({type(e).__name__}: {e}).\n"
                + _how_to()
            ) from e
        except Exception as e:  # a corrupt or partial checkpoint in the cache
            cached = Path(torch.hub.get_dir()) / "checkpoints" / PRETRAINED_CHECKPOINT
            raise WeightsUnavailable(
                f"Could not load the pretrained EnCodec 24 kHz weights ({type(e).__name__}: {e}); "
                f"if {cached} exists it may be corrupt: delete it.\n" + _how_to()
            ) from e
        info = _info(model, "pretrained", None)
    else:
        path = Path(weights)
        if not path.is_file():
            raise FileNotFoundError(f"EnCodec weights file {path} does not exist")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{path} is not a readable torch state dict: {e}") from None
        model = _new_model(pretrained=False)
        try:
            model.load_state_dict(state, strict=True)
        except (RuntimeError, TypeError, AttributeError) as e:
            raise ValueError(f"{path} is not an EnCodec 24 kHz state dict: {e}") from None
        for k, layer in enumerate(model.quantizer.vq.layers[:NUM_CODEBOOKS]):
            if not layer._codebook.embed.any():
                raise ValueError(
                    f"{path}: codebook {k} is all zeros, so every code would be 0; make weights with "
                    "`musiclm-stab make-weights AUDIO_DIR FILE`"
                )
        info = _info(model, "local", path)
        sidecar = _sidecar(path)  # written by make_local_weights; trusted only if it describes these weights
        if sidecar.is_file():
            made = json.loads(sidecar.read_text())
            if made.get("weights_sha256") == info["weights_sha256"] and made.get("provenance"):
                info["weights_provenance"] = made["provenance"]
    model.set_target_bandwidth(BANDWIDTH)
    return model.eval(), info


def prepare_for_inference(model: EncodecModel) -> EncodecModel:
    """Fold weight norm into plain conv weights, in place: the same outputs, bit for bit, without
    recomputing every weight at every forward (~0.2 s per call on a CPU). Compute the weights' sha256
    before this (``load_encodec`` does): the state dict's keys change."""
    for module in model.modules():
        if hasattr(module, "weight_g") and hasattr(module, "weight_v"):
            torch.nn.utils.remove_weight_norm(module)
    return model.eval()


def _sidecar(weights_file: Path) -> Path:
    return weights_file.with_name(weights_file.name + ".json")


# ---------------------------------------------------------------------------------------------------
# Making local weights: seeded random encoder + residual codebooks fitted by k-means.


def _assign(x: torch.Tensor, centroids: torch.Tensor, block: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of each row of x [N, D] among centroids [K, D] -> (index [N], squared dist [N])."""
    c_sq = centroids.pow(2).sum(1)  # (K,)
    ct = centroids.t().contiguous()  # (D, K)
    index, dist = [], []
    for xb in x.split(block):
        # |c|^2 - 2 x.c: |x|^2 is the same for every centroid, so it is added only to the minimum
        d = torch.addmm(c_sq, xb, ct, alpha=-2)  # (n, K)
        m, i = d.min(dim=1)
        index.append(i)
        dist.append((m + xb.pow(2).sum(1)).clamp_min(0))
    return torch.cat(index), torch.cat(dist)


GRID_BITS = 21  # exact k-means: values on a grid of 2^21 steps per sign, see exact_grid


def exact_grid(x: torch.Tensor) -> float:
    """A power-of-two step on which the values of x (float64) take at most 2^21 steps either side of 0.

    On such a grid k-means is exact in float64 whatever the CPU: a distance |c|^2 - 2 x.c over D = 128
    dimensions is at most 3 * 128 * 2^42 < 2^53 steps^2, so every product and every partial sum is an
    integer number of steps^2 that float64 holds exactly, in any summation order (BLAS blocking, AVX2 or
    AVX-512, threads). Ties are then real ties, broken alike everywhere (lowest index).
    """
    peak = float(x.abs().max())
    if peak == 0.0:  # nothing left to fit (fewer frames than codes): any fine grid will do
        return 2.0**-60
    return 2.0 ** (math.frexp(peak)[1] - GRID_BITS)  # peak < 2^e, so |x| / step < 2^21


def snap(x: torch.Tensor, step: float) -> torch.Tensor:
    """x rounded to the nearest multiple of ``step`` (a power of two: each operation is exact or one
    IEEE rounding, so the result is the same on every CPU)."""
    return torch.round(x / step) * step


def kmeans(
    x: torch.Tensor, k: int, iters: int, generator: torch.Generator, tol: float = 1e-3, step: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded Lloyd k-means of x [N, D] -> (centroids [k, D], assignment [N], cluster sizes [k]).

    Initialised from k distinct points chosen at random; a cluster left empty is re-seeded with one
    of the points farthest from its centroid, so all k codes stay in use when N >= k. Stops after
    ``iters`` updates, or earlier once at most a ``tol`` share of the points change cluster.
    Works in x's dtype. With ``step`` (x float64 on that grid, see ``exact_grid``) every centroid is kept
    on the grid too, so the result is the same bit for bit on every CPU (``make_local_weights``).
    """
    n, d = x.shape
    distinct = torch.unique(x, dim=0)  # sorted, so the choice below is deterministic
    perm = torch.randperm(len(distinct), generator=generator)
    # Copies of points get a tiny jitter (a few grid steps), so that no two centroids coincide: a point
    # alone in its cluster must have a next-nearest centroid other than its own (held_out_residual).
    jitter_scale = 4 * step if step is not None else float(x.std()) * 1e-3 + 1e-12

    def jittered(points: torch.Tensor) -> torch.Tensor:
        return points + torch.randn(points.shape, generator=generator, dtype=x.dtype) * jitter_scale

    if len(distinct) >= k:
        centroids = distinct[perm[:k]].clone()
    else:  # fewer distinct frames than codes: repeat them with a tiny jitter
        extra = distinct[torch.randint(len(distinct), (k - len(distinct),), generator=generator)]
        centroids = torch.cat([distinct[perm], jittered(extra)])
    if step is not None:
        centroids = snap(centroids, step)
    previous = None
    for _ in range(iters):
        assign, dist = _assign(x, centroids)
        if previous is not None and (assign != previous).sum() <= tol * n:
            break
        previous = assign
        counts = torch.bincount(assign, minlength=k)  # (k,)
        sums = torch.zeros(k, d, dtype=x.dtype).index_add_(0, assign, x)  # (k, D)
        centroids = torch.where((counts > 0)[:, None], sums / counts.clamp_min(1)[:, None], centroids)
        if step is not None:
            centroids = snap(centroids, step)
        empty = (counts == 0).nonzero().squeeze(1)
        if len(empty):
            far = dist.topk(min(len(empty), n)).indices
            centroids[empty[: len(far)]] = jittered(x[far])
            if step is not None:
                centroids = snap(centroids, step)
    assign, _ = _assign(x, centroids)
    return centroids, assign, torch.bincount(assign, minlength=k)


def held_out_residual(
    x: torch.Tensor, centroids: torch.Tensor, assign: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Residual [N, D] each row of x [N, D] would have had it not been part of the k-means fit.

    Subtracting the centroid that a frame itself helped fit leaves too small a residual (zero for a
    cluster of one), so on a small sample the next codebooks get fitted to zeros and the deep levels
    collapse. Without frame i its cluster's centroid is (n c - x_i) / (n - 1), so the residual is
    (x_i - c) n / (n - 1); a frame alone in its cluster falls to its next-nearest centroid instead.
    """
    n = counts[assign].to(x.dtype)[:, None]  # (N, 1)
    residual = (x - centroids[assign]) * n / (n - 1).clamp_min(1)  # (N, D)
    alone = (counts[assign] == 1).nonzero().squeeze(1)
    if len(alone):
        d = torch.addmm(centroids.pow(2).sum(1), x[alone], centroids.t(), alpha=-2)  # (n_alone, K)
        d[torch.arange(len(alone)), assign[alone]] = float("inf")
        residual[alone] = x[alone] - centroids[d.argmin(dim=1)]
    return residual


def _duration(source: str | Path | torch.Tensor) -> tuple[int, str | None]:
    """(length in 24 kHz samples, estimated from the header for files; why it is unusable or None)."""
    if isinstance(source, torch.Tensor):
        return source.numel(), None
    try:
        meta = sf.info(str(source))
    except Exception as e:
        return 0, f"not a readable audio file: {e}"
    return int(meta.frames * SAMPLE_RATE / max(meta.samplerate, 1)), None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one CPU thread inside the block. Float results (so k-means and codes at near-ties)
    depend on the thread count, and on a busy 2-core machine one thread is also the faster: scatter
    adds and small LSTM steps spend most of their time synchronising threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_WORKER_ENCODER: torch.nn.Module | None = None  # a worker process's float64 encoder (_init_frames_worker)


def _init_frames_worker(seed: int) -> None:
    global _WORKER_ENCODER
    torch.set_num_threads(1)  # one process per core; float64 results do not depend on threads anyway
    _WORKER_ENCODER = seeded_random_model(seed).double().encoder


def _frames_in_worker(src: str | Path | torch.Tensor, starts: list[int], chunk: int):
    return _source_frames(_WORKER_ENCODER, src, starts, chunk)


def _source_frames(encoder: torch.nn.Module, src: str | Path | torch.Tensor, starts: list[int], chunk: int
                   ) -> tuple[list[torch.Tensor], list[bytes], dict | None]:
    """Float64 encoder frames [T, D] of the chunks of one source starting at ``starts``, the sha256 of
    each chunk's 24 kHz float32 samples, and the reason the source is unusable (or None)."""
    try:
        wav = src if isinstance(src, torch.Tensor) else load_audio(src)  # (S,) float32, 24 kHz
    except AudioError as e:
        return [], [], {"path": e.path, "reason": e.reason}
    frames, hashes = [], []
    with torch.inference_mode():
        for start in starts:
            piece = wav[start : start + chunk]
            piece = piece[: len(piece) // HOP_LENGTH * HOP_LENGTH]
            if len(piece) < HOP_LENGTH:
                continue
            hashes.append(hashlib.sha256(piece.contiguous().numpy().tobytes()).digest())
            frames.append(encoder(piece.double().view(1, 1, -1))[0].t())  # (1, D, T) -> (T, D)
    return frames, hashes, None


def _encoder_frames(seed: int, srcs: list, slots: list[tuple[int, int]], chunk: int, skipped: list[dict],
                    workers: int, progress: bool) -> tuple[list[torch.Tensor], int, str]:
    """Float64 encoder frames [T, D] of each (source, start) chunk in ``slots``, in order; the samples
    used; a sha256 of the 24 kHz float32 audio that went in. ``workers`` processes (0: this one)."""
    starts: dict[int, list[int]] = {}
    for i, start in slots:
        starts.setdefault(i, []).append(start)
    tasks = [(srcs[i], s, chunk) for i, s in starts.items()]
    bar = tqdm(total=len(slots), desc="encoder frames", unit="chunk", disable=not progress)
    if workers == 0:
        encoder = seeded_random_model(seed).double().encoder
        results = (_source_frames(encoder, *task) for task in tasks)
        pool = contextlib.nullcontext()
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_frames_worker, initargs=(seed,))
        results = pool.map(_frames_in_worker, *zip(*tasks)) if tasks else iter(())
    frames, audio_hash, used_samples = [], hashlib.sha256(), 0
    with pool:
        for (_, task_starts, _), (fr, hashes, why) in zip(tasks, results):
            if why is not None:
                skipped.append(why)
            frames += fr
            for digest in hashes:
                audio_hash.update(digest)
            used_samples += sum(f.shape[0] for f in fr) * HOP_LENGTH
            bar.update(len(task_starts))
    bar.close()
    return frames, used_samples, audio_hash.hexdigest()


def codebook_usage(codes: torch.Tensor) -> list[dict[str, float]]:
    """Per codebook of codes [K, T]: the codes used and the perplexity exp(H) of their distribution
    (1024 = every code equally often; 1 = one code only)."""
    usage = []
    for row in codes:
        counts = torch.bincount(row.reshape(-1).long(), minlength=CODEBOOK_SIZE).double()
        p = counts[counts > 0] / counts.sum()
        usage.append({"codes_used": int((counts > 0).sum()), "perplexity": round(float((-(p * p.log()).sum()).exp()), 1)})
    return usage


# What a made weights file is a function of. With the CPU's float arithmetic taken out (float64 encoder
# and k-means, see make_local_weights), nothing else enters: not the CPU, its vector instructions or the
# thread count (tests/test_encodec_weights.py checks ATEN_CPU_CAPABILITY=default against the machine's best).
SHA256_DEPENDS_ON = ("seed", "audio_sha256 (the 24 kHz float32 samples used)", "kmeans_iters", "chunk_seconds",
                     "encodec_version", "torch_version (its RNG and EnCodec's init)")


def make_local_weights(
    sources: Sequence[str | Path | torch.Tensor | np.ndarray],
    out_file: str | Path,
    seed: int = 0,
    max_seconds: float = 600.0,
    iters: int = 15,
    chunk_seconds: float = 10.0,
    progress: bool = True,
    workers: int | None = None,
) -> dict[str, Any]:
    """Make EnCodec 24 kHz weights with a seeded random encoder and fitted codebooks; save them.

    ``sources`` are audio files or 24 kHz mono waveforms [S]. Up to ``max_seconds`` of them, in
    ``chunk_seconds`` chunks chosen at random (seeded) when there is more, are run through the encoder;
    its frames [N, 128] fit the 8 residual codebooks level by level (k-means, 1024 codes each), each
    level on the leave-one-out residuals of the previous one (see ``held_out_residual``).

    Same inputs and seed give the same file, byte for byte, on any CPU. Float32 kernels round differently
    on AVX2, AVX-512 and plain CPUs, and k-means turns last-bit differences into other centroids at
    (near-)ties, so: the random model is drawn in float64 (``seeded_random_model``); the encoder runs in
    float64 (its results then differ across CPUs by ~1e-16 relative only) and its frames are rounded to a
    grid of 2^-21 of their peak; k-means and the residuals stay on such grids, where float64 arithmetic
    is exact (``exact_grid``). Grid values fit float32 exactly, so EnCodec's buffers hold them as they are. Writes ``out_file`` (the full
    state dict, loadable with ``load_encodec(out_file)``) and ``out_file.json`` (provenance, with the
    codebook usage on the fitting audio); returns the info dict. The float64 encoder costs ~0.5 s per
    second of audio on one core, so ``workers`` processes share the chunks (default: one per core, none
    for a handful of chunks); the result does not depend on their number.
    """
    import encodec

    t0 = time.perf_counter()
    out_file = Path(out_file)
    srcs = [s if isinstance(s, (str, Path)) else torch.as_tensor(s, dtype=torch.float32) for s in sources]
    if any(isinstance(s, torch.Tensor) and s.dim() != 1 for s in srcs):
        raise ValueError("make_local_weights: waveforms must be 24 kHz mono [S]; decode files with load_audio")
    chunk = int(chunk_seconds * SAMPLE_RATE) // HOP_LENGTH * HOP_LENGTH
    durations = [_duration(s) for s in srcs]
    skipped = [{"path": str(s), "reason": why} for s, (_, why) in zip(srcs, durations) if why]
    slots = [(i, start) for i, (n, _) in enumerate(durations) for start in range(0, n, chunk)]
    g = torch.Generator().manual_seed(seed)
    max_chunks = max(1, int(max_seconds * SAMPLE_RATE) // chunk)
    if len(slots) > max_chunks:
        slots = sorted(slots[j] for j in torch.randperm(len(slots), generator=g)[:max_chunks].tolist())

    if workers is None:  # a process pays a few seconds to start: worth it from a few chunks per core on
        workers = min(os.cpu_count() or 1, len(slots) // 4)
        workers = workers if workers > 1 else 0
    frames, used_samples, audio_sha256 = _encoder_frames(seed, srcs, slots, chunk, skipped, workers, progress)
    model = seeded_random_model(seed)
    if not frames:
        raise ValueError("make_local_weights: no usable audio in the sources" +
                         (f" ({len(skipped)} unreadable, e.g. {skipped[0]})" if skipped else ""))
    x = torch.cat(frames)  # (N, D), float64
    variance = (x - x.mean(0)).pow(2).sum()  # residual energies below are relative to this

    residual, rel_error = snap(x, exact_grid(x)), []
    for k in tqdm(range(NUM_CODEBOOKS), desc="fitting codebooks", unit="level", disable=not progress):
        layer = model.quantizer.vq.layers[k]
        assert isinstance(layer.project_in, torch.nn.Identity), "codebook dim must equal encoder dim"
        gk = torch.Generator().manual_seed(seed * 1_000_003 + k)
        step = exact_grid(residual)
        centroids, assign, counts = kmeans(residual, CODEBOOK_SIZE, iters, gk, step=step)  # (K, D), (N,), (K,)
        cb = layer._codebook
        with torch.no_grad():  # same buffers EnCodec's own k-means init sets (float32: rounded once, here)
            cb.embed.copy_(centroids)
            cb.embed_avg.copy_(centroids)
            cb.cluster_size.copy_(counts.float())
            cb.inited.fill_(1.0)
        residual = held_out_residual(residual, centroids, assign, counts)  # (N, D)
        residual = snap(residual, exact_grid(residual))  # onto the next level's grid
        rel_error.append(float(residual.pow(2).sum() / variance))

    # How the fitted quantizer uses its codes on the fitting frames, quantized as tokenizing does (float32).
    model.set_target_bandwidth(BANDWIDTH)
    with torch.inference_mode():
        fit_codes = model.quantizer.encode(x.t().float().unsqueeze(0), model.frame_rate, BANDWIDTH)[:, 0]  # (K, N)
    usage = codebook_usage(fit_codes)

    out_file.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()  # saving to a file would put its name into the zip: same weights, other bytes
    torch.save(model.state_dict(), buffer)
    out_file.write_bytes(buffer.getvalue())
    info = _info(model, "local", out_file)
    # provenance goes to a side file: seconds_taken differs between runs, the weights file must not
    info["provenance"] = {
        "made_by": "musiclm-stab make-weights",
        "note": "random seeded EnCodec encoder + 8 codebooks fitted by k-means; not the pretrained model",
        "seed": seed,
        "max_seconds": max_seconds,
        "chunk_seconds": chunk_seconds,
        "seconds_used": round(used_samples / SAMPLE_RATE, 3),
        "audio_sha256": audio_sha256,
        "num_frames": int(x.shape[0]),
        "num_sources": len(srcs),
        "skipped_sources": skipped,
        "kmeans_iters": iters,
        "encodec_version": getattr(encodec, "__version__", "unknown"),
        "torch_version": torch.__version__.split("+")[0],
        "sha256_depends_on": list(SHA256_DEPENDS_ON),
        "arithmetic": "encoder and k-means in float64 on the CPU, rounded to float32 once (no TF32: never on a GPU)",
        "residual_variance_per_level": [round(e, 6) for e in rel_error],
        "codebook_usage_on_fitting_audio": usage,
        "seconds_taken": round(time.perf_counter() - t0, 2),
    }
    _sidecar(out_file).write_text(json.dumps(info, indent=2) + "\n")
    return info


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="musiclm-stab make-weights",
        description="Make local EnCodec 24 kHz weights for offline use: a seeded random encoder whose 8 "
        "codebooks are fitted by k-means to your audio. Not the pretrained model; tokenized data records "
        "the weights' sha256.",
    )
    p.add_argument("src", help="folder of audio files (searched recursively)")
    p.add_argument("out_file", help="where to write the weights (a torch state dict)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=600.0, help="audio used for fitting (default 600)")
    p.add_argument("--iters", type=int, default=15, help="k-means iterations per codebook (default 15)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_FILE")
    args = p.parse_args(argv)

    src, out = Path(args.src), Path(args.out_file)
    if not src.is_dir():
        p.error(f"{src} is not a folder")
    if out.exists() and not args.overwrite:
        p.error(f"{out} exists; pass --overwrite to replace it")
    files = list_audio_files(src)
    if not files:
        p.error(f"no audio files under {src}")
    try:
        info = make_local_weights(files, out, seed=args.seed, max_seconds=args.max_seconds, iters=args.iters)
    except ValueError as e:
        print(f"make-weights: {e}", file=sys.stderr)
        return 1
    prov = info["provenance"]
    print(f"wrote {out} (sha256 {info['weights_sha256']})")
    print(f"  fitted on {prov['seconds_used']:.0f} s of audio from {len(files)} files "
          f"({len(prov['skipped_sources'])} unreadable), {prov['num_frames']} frames, "
          f"in {prov['seconds_taken']:.1f} s")
    print("  residual / variance of the frames after each codebook: "
          + " ".join(f"{e:.3f}" for e in prov["residual_variance_per_level"]))
    usage = prov["codebook_usage_on_fitting_audio"]
    print("  codebook usage on the fitting audio, perplexity (of 1024) per level: "
          + " ".join(f"{u['perplexity']:.0f}" for u in usage)
          + "; codes used: " + " ".join(str(u["codes_used"]) for u in usage))
    print(f"next: musiclm-stab tokenize AUDIO_DIR OUT_DIR --weights {out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
