"""Making local EnCodec weights (``musiclm-stab make-weights``): a seeded random encoder whose 8 residual
codebooks are fitted by k-means (kmeans.py) to encoder frames of the given audio. See weights.py.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from musiclm_stab.audio import AudioError, list_audio_files, load_audio, open_audio
from musiclm_stab.constants import CODEBOOK_SIZE, HOP_LENGTH, NUM_CODEBOOKS, SAMPLE_RATE
from musiclm_stab.data.tokenized import codebook_usage as usage_from_counts
from musiclm_stab.output_errors import OutputWriteError, check_folder_path, writing
from musiclm_stab.spawned import workers_for
from musiclm_stab.tokenizer.kmeans import exact_grid, held_out_residual, kmeans, snap
from musiclm_stab.tokenizer.weights import BANDWIDTH, _sidecar, model_info, seeded_random_model


def _duration(source: str | Path | torch.Tensor) -> tuple[int, dict | None]:
    """(length in 24 kHz samples, from the header for files; why the source is unusable, or None).

    Files are opened with the decoder's own checks (``open_audio``: sample rate, truncation, no samples),
    so that a bad file is skipped here and takes no chunks from the good ones.
    """
    if isinstance(source, torch.Tensor):
        return source.numel(), None
    try:
        with open_audio(source) as reader:
            return int(reader.frames * SAMPLE_RATE / reader.sample_rate), None
    except Exception as e:  # noqa: BLE001 - this one file's failure, recorded with its kind and reason
        return 0, _skipped(source, e)


def _skipped(source: str | Path, e: Exception) -> dict:
    """The provenance record of a source left out: path, kind (audio.FAILURE_KINDS) and reason. An error
    that is not an AudioError is kind ``error`` with its type, as the tokenizer reports it."""
    if isinstance(e, AudioError):
        return {"path": e.path, "kind": e.kind, "reason": e.reason}
    return {"path": str(source), "kind": "error", "reason": f"{type(e).__name__}: {e}"}


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
    except Exception as e:  # noqa: BLE001 - one file's failure never ends the run: it is recorded
        return [], [], _skipped(src, e)
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


def _encoder_frames(model: torch.nn.Module, seed: int, srcs: list, slots: list[tuple[int, int]], chunk: int,
                    skipped: list[dict], workers: int, progress: bool) -> tuple[list[torch.Tensor], int, str]:
    """Float64 encoder frames [T, D] of each (source, start) chunk in ``slots``, in order; the samples
    used; a sha256 of the 24 kHz float32 audio that went in. ``workers`` processes (0: this one, with the
    encoder of ``model``, ``seeded_random_model(seed)``, in float64 for the while: drawing the model costs
    ~1 s, so a make draws it once; a worker draws its own)."""
    starts: dict[int, list[int]] = {}
    for i, start in slots:
        starts.setdefault(i, []).append(start)
    tasks = [(srcs[i], s, chunk) for i, s in starts.items()]
    bar = tqdm(total=len(slots), desc="encoder frames", unit="chunk", disable=not progress)
    if workers == 0:
        encoder = model.encoder.double()  # back to float32 below: float32 -> float64 -> float32 is exact
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
    model.encoder.float()  # the drawn values again (a no-op when the workers drew their own)
    bar.close()
    return frames, used_samples, audio_hash.hexdigest()


def codebook_usage(codes: torch.Tensor) -> list[dict[str, float]]:
    """Per codebook of codes [K, T]: the codes used and the perplexity exp(H) of their distribution
    (1024 = every code equally often; 1 = one code only); see data.tokenized.codebook_usage."""
    counts = torch.stack([torch.bincount(row.reshape(-1).long(), minlength=CODEBOOK_SIZE) for row in codes])
    return usage_from_counts(counts.numpy())


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
    unread: Sequence[AudioError] = (),
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
    for a handful of chunks); the result does not depend on their number. ``unread``: what the walk that
    found the sources could not read (``list_audio_files``' problems), recorded with the skipped sources.
    """
    import encodec

    t0 = time.perf_counter()
    out_file = Path(out_file)
    srcs = [s if isinstance(s, (str, Path)) else torch.as_tensor(s, dtype=torch.float32) for s in sources]
    if any(isinstance(s, torch.Tensor) and s.dim() != 1 for s in srcs):
        raise ValueError("make_local_weights: waveforms must be 24 kHz mono [S]; decode files with load_audio")
    chunk = int(chunk_seconds * SAMPLE_RATE) // HOP_LENGTH * HOP_LENGTH
    durations = [_duration(s) for s in srcs]
    skipped = [_skipped(e.path, e) for e in unread] + [why for _, why in durations if why]
    slots = [(i, start) for i, (n, _) in enumerate(durations) for start in range(0, n, chunk)]
    g = torch.Generator().manual_seed(seed)
    max_chunks = max(1, int(max_seconds * SAMPLE_RATE) // chunk)
    if len(slots) > max_chunks:
        slots = sorted(slots[j] for j in torch.randperm(len(slots), generator=g)[:max_chunks].tolist())

    if workers is None:  # a process pays a few seconds to start: worth it from a few chunks per core on
        workers = min(os.cpu_count() or 1, len(slots) // 4)
        workers = workers if workers > 1 else 0
    workers = workers_for("make-weights' encoder", workers)  # 0 when spawned workers would rerun the script
    model = seeded_random_model(seed)
    frames, used_samples, audio_sha256 = _encoder_frames(model, seed, srcs, slots, chunk, skipped, workers,
                                                         progress)
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

    buffer = io.BytesIO()  # saving to a file would put its name into the zip: same weights, other bytes
    torch.save(model.state_dict(), buffer)
    with writing(out_file):  # a full disk is no fault of the audio: OutputWriteError, one line
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_bytes(buffer.getvalue())
    info = model_info(model, "local", out_file)
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
    with writing(_sidecar(out_file)):
        _sidecar(out_file).write_text(json.dumps(info, indent=2) + "\n")
    return info


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="musiclm-stab make-weights",
        description="Make local EnCodec 24 kHz weights for offline use: a seeded random encoder whose 8 "
        "codebooks are fitted by k-means to your audio. Not the pretrained model; tokenized data records "
        "the weights' sha256.",
        epilog="Reference: docs/TOKENIZING.md (offline: musiclm-stab docs TOKENIZING)",
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
    try:
        check_folder_path(out, "write")
    except OutputWriteError as e:
        p.error(str(e))
    unread: list[AudioError] = []  # folders and links the walk could not read: reported, never dropped
    try:
        files = list_audio_files(src, unread)
    except AudioError as e:
        p.error(f"cannot read {e.path}: {e.reason}")
    if not files:
        p.error(f"no audio files under {src}" + "".join(f"; {e.path}: {e.reason}" for e in unread[:3]))
    try:
        info = make_local_weights(files, out, seed=args.seed, max_seconds=args.max_seconds, iters=args.iters,
                                  unread=unread)
    except (ValueError, OutputWriteError) as e:
        print(f"make-weights: {e}", file=sys.stderr)
        return 1
    prov = info["provenance"]
    print(f"wrote {out} (sha256 {info['weights_sha256']})")
    print(f"  fitted on {prov['seconds_used']:.0f} s of audio from {len(files)} files "
          f"({len(prov['skipped_sources'])} unreadable, folders included), {prov['num_frames']} frames, "
          f"in {prov['seconds_taken']:.1f} s")
    for skip in prov["skipped_sources"]:
        print(f"  skipped {skip['path']}: {skip['kind']}: {skip['reason']}")
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
