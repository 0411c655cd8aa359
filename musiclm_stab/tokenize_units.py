"""One work unit of the tokenizer: its tracks -> checked, segmented, encoded rows in one part file.

Per track: ``scan`` decodes it once to check it (errors, truncation, NaN, length, peak) and the policy
(silence, minimum length) decides whether it is used; a second pass streams it at 24 kHz in blocks
and cuts it into segments of ``segment_samples`` (a multiple of the 320-sample hop), so a one-hour
track never sits in memory. Segments wait in a batch of ``batch_size``; equal lengths are encoded
together; rows keep track-then-start order.

Boundary policy: every segment is encoded on its own, with no audio before or after it, so a row's
codes are the codes of the row's pcm (what training crops rely on). The 24 kHz EnCodec is causal
(convolutions and an LSTM that only look back), so against a whole-track encode only the start of a
segment differs while the encoder warms up. Measured on the default corpus (24 tracks, 95 boundaries;
benchmarks/README.md): frames 0-9 (0.13 s) agree in 0-23% of codes, frames 10-37 in 82-93%, from
0.5 s on 99.7-99.9% (the rest is float rounding), and a track's first segment 100%.
Float rounding also depends on the batch a segment shares and the thread count (with the test weights
~2% of codes differ between batch sizes at near-ties), hence one thread per encoder and a batch size
that is part of the job: a resumed or sharded run encodes exactly like an uninterrupted one.

``run_unit`` runs in the main process or in spawned worker processes (``UnitPool``), each with its own
model and one thread: on a 2-core machine two single-threaded encoders beat one two-threaded one.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from datasets.arrow_writer import ArrowWriter

from musiclm_stab import HOP_LENGTH, NUM_CODEBOOKS, SAMPLE_RATE
from musiclm_stab.audio import AudioError, resampled_blocks, scan
from musiclm_stab.tokenize_sources import SourceSpec, TrackRef, open_track
from musiclm_stab.tokenize_store import FEATURES, OutputDir

if TYPE_CHECKING:
    from encodec import EncodecModel

SILENCE_POLICIES = ("skip", "keep")


@dataclass(frozen=True)
class UnitSettings:
    """What shapes the rows (all of it is part of the job's identity, except batch_size)."""

    segment_samples: int
    min_samples: int
    silence: str  # skip: silent tracks are failures of kind "silent" and silent segments are dropped
    silence_db: float  # peak (dBFS) below which a track or segment counts as silent
    batch_size: int


def segment_bounds(num_samples: int, segment_samples: int, min_samples: int) -> list[tuple[int, int]]:
    """(start, length) of each segment of a track; lengths are multiples of the 320-sample hop.

    Full segments of ``segment_samples``; the tail is trimmed down to a multiple of the hop and
    kept only if it still has at least ``min_samples`` (and at least one frame).
    """
    bounds = []
    for start in range(0, num_samples, segment_samples):
        length = min(segment_samples, num_samples - start) // HOP_LENGTH * HOP_LENGTH
        if length >= max(min_samples, HOP_LENGTH):
            bounds.append((start, length))
    return bounds


def cut_segments(blocks: Iterable[torch.Tensor], bounds: list[tuple[int, int]]) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, pcm [length]) for each of ``bounds``, cut from a stream of consecutive blocks.

    Holds at most one block plus one segment. Raises AudioError if the stream ends too early.
    """
    buf, offset, todo = torch.zeros(0), 0, list(bounds)
    for block in blocks:
        buf = torch.cat([buf, block]) if len(buf) else block
        while todo and todo[0][0] + todo[0][1] <= offset + len(buf):
            start, length = todo.pop(0)
            yield start, buf[start - offset : start - offset + length].clone()
        drop = min(len(buf), (todo[0][0] if todo else offset + len(buf)) - offset)
        buf, offset = buf[drop:], offset + drop
        if not todo:
            return
    if todo:
        raise AudioError("<stream>", f"the decoded audio ended at {offset + len(buf)} samples, before "
                         f"the segment at {todo[0][0]}", "corrupt")


def encode_batch(model: EncodecModel, pcm: torch.Tensor) -> torch.Tensor:
    """EnCodec codes of equal-length segments: pcm [B, S] (S a multiple of 320) -> codes [B, K, T] int16."""
    B, S = pcm.shape
    device = next(model.parameters()).device
    with torch.inference_mode():
        frames = model.encode(pcm.to(device).unsqueeze(1))  # x: (B, 1, S)
    assert len(frames) == 1, "the 24 kHz model encodes a segment in one frame"
    codes = frames[0][0]  # (B, K, T)
    assert codes.shape == (B, NUM_CODEBOOKS, S // HOP_LENGTH), \
        f"EnCodec gave codes {tuple(codes.shape)} for input {(B, 1, S)}; expected {(B, NUM_CODEBOOKS, S // HOP_LENGTH)}"
    return codes.to(torch.int16).cpu()


class _RedoUnit(Exception):
    """A track failed after some of its rows were written: run the unit again without it."""

    def __init__(self, index: int, failure: dict):
        self.index, self.failure = index, failure


def _failure(ref: TrackRef, e: AudioError) -> dict[str, str]:
    # a dataset row names the row; when the reason concerns a file the row points to, name that file too
    reason = e.reason if e.path in (ref.where, "<stream>") else f"{e.path}: {e.reason}"
    return {"track": ref.name, "path": ref.where, "kind": e.kind, "reason": reason}


def _policy(ref: TrackRef, stats, bounds, s: UnitSettings) -> AudioError | None:
    """Why a readable track is not used (silence, too short), or None."""
    if s.silence == "skip" and stats.peak_dbfs < s.silence_db:
        return AudioError(ref.where, f"silent: peak {stats.peak_dbfs:.1f} dBFS is below the silence threshold "
                          f"{s.silence_db:g} dBFS (--silence keep tokenizes it anyway)", "silent")
    if not bounds:
        n = stats.samples_24k
        if n < HOP_LENGTH:
            return AudioError(ref.where, f"too short: {n} samples at 24 kHz after resampling from "
                              f"{stats.sample_rate} Hz, less than one {HOP_LENGTH}-sample frame", "too_short")
        return AudioError(ref.where, f"too short: {n / SAMPLE_RATE:.3f} s < min_seconds "
                          f"{s.min_samples / SAMPLE_RATE:g} s", "too_short")
    return None


def run_unit(spec: SourceSpec, k: int, refs: list[TrackRef], model: EncodecModel, settings: UnitSettings,
             out_dir: str) -> dict[str, Any]:
    """Tokenize unit ``k`` (tracks ``refs``) into its part file; returns the unit's commit record."""
    known_bad: dict[int, dict] = {}
    while True:
        try:
            return _run_unit_once(spec, k, refs, model, settings, OutputDir(out_dir), known_bad)
        except _RedoUnit as redo:
            known_bad[redo.index] = redo.failure


def _run_unit_once(spec: SourceSpec, k: int, refs: list[TrackRef], model: EncodecModel, s: UnitSettings,
                   out: OutputDir, known_bad: dict[int, dict]) -> dict[str, Any]:
    tmp = out.temp_part_file(k)
    threshold = 10 ** (s.silence_db / 20)
    writer: ArrowWriter | None = None
    pending: list[tuple[str, int, torch.Tensor]] = []  # (track, start, pcm (S,)) waiting for codes
    written: dict[str, int] = defaultdict(int)  # rows already in the part file, per track
    failures: list[dict] = []
    totals = {"rows": 0, "samples": 0, "tracks": 0, "silent": 0}

    def flush() -> None:
        nonlocal writer
        if not pending:
            return
        codes: list[torch.Tensor | None] = [None] * len(pending)
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, (_, _, pcm) in enumerate(pending):
            by_length[len(pcm)].append(i)
        for idx in by_length.values():  # equal lengths share a batch
            for j in range(0, len(idx), s.batch_size):
                part = idx[j : j + s.batch_size]
                for i, c in zip(part, encode_batch(model, torch.stack([pending[i][2] for i in part]))):
                    codes[i] = c  # (K, T)
        if writer is None:
            writer = ArrowWriter(features=FEATURES, path=str(tmp), writer_batch_size=max(8, s.batch_size))
        writer.write_batch({
            "id": [f"{t}@{st}" for t, st, _ in pending],
            "track": [t for t, _, _ in pending],
            "start": [st / SAMPLE_RATE for _, st, _ in pending],
            "pcm": [p.numpy() for _, _, p in pending],
            "codes": [c.numpy() for c in codes],
            "num_frames": [c.shape[1] for c in codes],
        })
        for t, _, p in pending:
            written[t] += 1
            totals["rows"] += 1
            totals["samples"] += len(p)
        pending.clear()

    try:
        for ref in refs:
            if ref.index in known_bad:
                failures.append(known_bad[ref.index])
                continue
            kept = 0
            try:
                with open_track(spec, ref) as reader:
                    stats = scan(reader)  # pass 1: decode errors, truncation, NaN, length, peak
                    bounds = segment_bounds(stats.samples_24k, s.segment_samples, s.min_samples)
                    refused = _policy(ref, stats, bounds, s)
                    if refused:
                        raise refused
                    for start, pcm in cut_segments(resampled_blocks(reader), bounds):  # pass 2
                        if s.silence == "skip" and float(pcm.abs().max()) < threshold:
                            totals["silent"] += 1
                            continue
                        pending.append((ref.name, start, pcm))
                        kept += 1
                        if len(pending) >= s.batch_size:
                            flush()
                if kept == 0:
                    raise AudioError(ref.where, f"silent: every segment's peak is below {s.silence_db:g} dBFS",
                                     "silent")
                totals["tracks"] += 1
            except Exception as e:  # a failure of this one input, whatever it is, is recorded as its failure
                if not isinstance(e, AudioError):
                    e = AudioError(ref.where, f"{type(e).__name__}: {e}", "error")
                if written[ref.name]:
                    raise _RedoUnit(ref.index, _failure(ref, e)) from None
                pending[:] = [p for p in pending if p[0] != ref.name]
                failures.append(_failure(ref, e))
        flush()
        file = None
        if writer is not None:
            writer.finalize()
            with open(tmp, "rb") as f:  # on disk before the rename makes it count
                os.fsync(f.fileno())
            os.replace(tmp, out.part_file(k))
            file = out.part_file(k).relative_to(out.out).as_posix()
    finally:
        if tmp.exists():  # a failed attempt: close the writer and drop its file
            if writer is not None:
                try:
                    writer.close()
                except Exception:  # already closed, or never opened its stream
                    pass
            tmp.unlink()
    return {"unit": k, "first": refs[0].index, "count": len(refs), "file": file, "num_rows": totals["rows"],
            "num_samples": totals["samples"], "num_tracks": totals["tracks"], "silent_segments": totals["silent"],
            "failures": failures}


# ---------------------------------------------------------------------------------------------------
# Worker processes

_WORKER: dict[str, Any] = {}


def _die_with_parent() -> None:
    """Ask Linux to kill this worker when its parent dies (kill -9 of the tokenizer leaves no orphans)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse instead of returning it to the kernel.

    The encoder allocates and frees hundreds of MB of activations per batch. By default glibc serves
    allocations that large with fresh mmap()s and unmaps them when freed, so every batch faults in
    (and the kernel zeroes) all of that memory again: measured here, half of a worker's time was
    spent in the kernel. With mmap and trimming thresholds of 1 GiB the heap keeps the freed blocks
    and the next batch, of the same shapes, reuses them. Linux/glibc only; returns whether it applied.
    Called in the worker processes only: it changes the allocator of the whole process.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def _worker_init(weights: str | None, device: str, sha256: str) -> None:
    from musiclm_stab.encodec_weights import load_encodec, prepare_for_inference

    _die_with_parent()
    keep_freed_memory()
    torch.set_num_threads(1)  # as in the main process: see encodec_weights.one_thread
    model, info = load_encodec(weights)
    if info["weights_sha256"] != sha256:
        raise RuntimeError(f"worker {os.getpid()} loaded weights {info['weights_sha256']}, expected {sha256}")
    _WORKER["model"] = prepare_for_inference(model).to(torch.device(device))


def _worker_run(spec: SourceSpec, k: int, refs: list[TrackRef], settings: UnitSettings, out_dir: str) -> dict:
    return run_unit(spec, k, refs, _WORKER["model"], settings, out_dir)


def run_units(work: Iterable[tuple[int, list[TrackRef]]], spec: SourceSpec, settings: UnitSettings, out_dir: str,
              on_done: Callable[[dict], None], model: EncodecModel | None, workers: int,
              weights: str | None = None, device: str = "cpu", sha256: str = "") -> None:
    """Run units in order in this process (``workers=0``, with ``model``), or in ``workers`` spawned
    processes, at most two units per worker in flight; ``on_done(record)`` runs here as each finishes."""
    if workers == 0:
        for k, refs in work:
            on_done(run_unit(spec, k, refs, model, settings, out_dir))
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # fork after torch has started threads can deadlock
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(weights, device, sha256)) as pool:
        inflight: set[Future] = set()
        todo = iter(work)
        try:
            while True:
                while len(inflight) < 2 * workers:
                    nxt = next(todo, None)
                    if nxt is None:
                        break
                    inflight.add(pool.submit(_worker_run, spec, nxt[0], nxt[1], settings, out_dir))
                if not inflight:
                    return
                done, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                for f in done:
                    on_done(f.result())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
