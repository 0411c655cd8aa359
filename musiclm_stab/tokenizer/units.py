"""One work unit of the tokenizer: its tracks -> checked, segmented, encoded rows in one part file.

Per track: ``scan`` decodes it once to check it (errors, truncation, NaN, length, peak) and the policy
(silence, minimum length) decides whether it is used; a second pass streams it at 24 kHz in blocks
and cuts it into segments of ``segment_samples`` (a multiple of the 320-sample hop), so a one-hour
track never sits in memory. Segments wait in a batch: segments i*batch_size .. (i+1)*batch_size - 1
of one track (equal lengths are encoded together); rows keep track-then-start order.

A piece of a long track (``Piece``) is one unit too, its rows cut by segments.piece_rows; a piece's
record carries what it saw, and store.track_verdict judges the track when the output is finished.
The silence and length policy is in policy.py, encoding in encode.py, worker processes in workers.py.
An error reading a track is that track's failure; an error writing the part file is the output's
(``OutputWriteError``): it ends the unit uncommitted, whichever track was being written.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from datasets.arrow_writer import ArrowWriter

from musiclm_stab.audio import AudioError, AudioReader, resampled_blocks, scan
from musiclm_stab.constants import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLE_RATE
from musiclm_stab.data.tokenized import FEATURES
from musiclm_stab.durable import fsync_dir
from musiclm_stab.output_errors import OutputWriteError, writing
from musiclm_stab.removal import discard_temporary
from musiclm_stab.tokenizer.encode import encode_batch, fp32_precision
from musiclm_stab.tokenizer.policy import UnitSettings, refusal, silent_reason
from musiclm_stab.tokenizer.segments import Piece, cut_segments, piece_rows, segment_bounds
from musiclm_stab.tokenizer.sources import Relisted, SourceSpec, TrackRef, open_track
from musiclm_stab.tokenizer.store import OutputDir

if TYPE_CHECKING:
    from encodec import EncodecModel


class _RedoUnit(Exception):
    """A track failed after some of its rows were written: run the unit again without it."""

    def __init__(self, index: int, failure: dict):
        self.index, self.failure = index, failure


def _failure(ref: TrackRef, e: AudioError) -> dict[str, str]:
    # a dataset row names the row; when the reason concerns a file the row points to, name that file too
    reason = e.reason if e.path in (ref.where, "<stream>") else f"{e.path}: {e.reason}"
    return {"track": ref.name, "path": ref.where, "kind": e.kind, "reason": reason}


def _as_audio_error(ref: TrackRef, e: Exception) -> AudioError:
    return e if isinstance(e, AudioError) else AudioError(ref.where, f"{type(e).__name__}: {e}", "error")


def _track_warnings(ref: TrackRef, *sources: Any) -> list[dict[str, str]]:
    """What the readers (or their stats) found odd about a track that is used (audio.WARNING_KINDS:
    a length mismatch, float audio scaled down), from their ``warnings`` lists: rows of track, path,
    kind, reason, each (kind, reason) once."""
    rows: list[dict[str, str]] = []
    for source in sources:
        for w in getattr(source, "warnings", None) or []:
            row = {"track": ref.name, "path": ref.where, "kind": str(getattr(w, "kind", "warning")),
                   "reason": str(getattr(w, "reason", w))}
            if row not in rows:
                rows.append(row)
    return rows


def count_codes(codes: torch.Tensor) -> torch.Tensor:
    """How often each code occurs per codebook: codes [B, K, T] -> counts [K, 1024] (int64)."""
    K = codes.shape[1]
    flat = codes.long() + torch.arange(K)[None, :, None] * CODEBOOK_SIZE  # codebook k's codes at k*1024..
    return torch.bincount(flat.reshape(-1), minlength=K * CODEBOOK_SIZE).view(K, CODEBOOK_SIZE)


class _Part:
    """A unit's rows: segments wait for codes in ``pending``, are encoded in batches (equal lengths
    together) and appended to the unit's temporary part file; ``commit`` renames it into place."""

    def __init__(self, out: OutputDir, k: int, model: EncodecModel, s: UnitSettings):
        self.out, self.k, self.model, self.s = out, k, model, s
        self.tmp = out.temp_part_file(k)
        self.writer: ArrowWriter | None = None
        self.pending: list[tuple[str, int, torch.Tensor]] = []  # (track, start, pcm (S,)) waiting for codes
        self.written: dict[str, int] = defaultdict(int)  # rows already in the part file, per track
        self.rows = self.samples = 0
        # how often each code of each codebook occurs in the rows written: (K, 1024), summed over the
        # dataset's units when it is finished (tokenizer.json's codebook_usage)
        self.code_counts = torch.zeros(NUM_CODEBOOKS, CODEBOOK_SIZE, dtype=torch.int64)
        self._batch: tuple[str, int] | None = None  # "track" batching: (track, segment index // batch_size)

    def add(self, track: str, start: int, pcm: torch.Tensor) -> None:
        if self.s.batching == "track":
            batch = (track, start // self.s.segment_samples // self.s.batch_size)
            if self.pending and batch != self._batch:
                self.flush()
            self._batch = batch
        self.pending.append((track, start, pcm))
        if len(self.pending) >= self.s.batch_size:
            self.flush()

    def drop(self, track: str) -> None:
        """Forget the rows of ``track`` still waiting (none of it may have been written)."""
        self.pending[:] = [p for p in self.pending if p[0] != track]

    def flush(self) -> None:
        pending, s = self.pending, self.s
        if not pending:
            return
        codes: list[torch.Tensor | None] = [None] * len(pending)
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, (_, _, pcm) in enumerate(pending):
            by_length[len(pcm)].append(i)
        for idx in by_length.values():  # equal lengths share a batch
            for j in range(0, len(idx), s.batch_size):
                part = idx[j : j + s.batch_size]
                for i, c in zip(part, encode_batch(self.model, torch.stack([pending[i][2] for i in part]))):
                    codes[i] = c  # (K, T)
        with writing(self.tmp):  # a full disk is the output's fault, never the track's: see OutputWriteError
            if self.writer is None:
                self.writer = ArrowWriter(features=FEATURES, path=str(self.tmp),
                                          writer_batch_size=max(8, s.batch_size))
            self.writer.write_batch({
                "id": [f"{t}@{st}" for t, st, _ in pending],
                "track": [t for t, _, _ in pending],
                "start": [st / SAMPLE_RATE for _, st, _ in pending],
                "pcm": [p.numpy() for _, _, p in pending],
                "codes": [c.numpy() for c in codes],
                "num_frames": [c.shape[1] for c in codes],
            })
        for c in codes:
            self.code_counts += count_codes(c[None])
        for t, _, p in pending:
            self.written[t] += 1
            self.rows += 1
            self.samples += len(p)
        pending.clear()

    def commit(self) -> str | None:
        """Encode what is left, put the part file in place; its path relative to the output (None: no rows)."""
        self.flush()
        if self.writer is None:
            return None
        with writing(self.tmp):
            self.writer.finalize()
            with open(self.tmp, "rb") as f:  # on disk before the rename makes it count
                os.fsync(f.fileno())
        with writing(self.out.part_file(self.k), "put in place"):  # e.g. a folder in the way: named as itself
            os.replace(self.tmp, self.out.part_file(self.k))
            fsync_dir(self.out.parts_dir)  # the rename too, before the unit's record makes it count
        return self.out.part_file(self.k).relative_to(self.out.out).as_posix()

    def discard(self) -> None:
        """After a failed attempt: close the writer and drop its file."""
        if self.tmp.exists():
            if self.writer is not None:
                try:
                    self.writer.close()
                except Exception:  # already closed, or never opened its stream
                    pass
            # a failing disk: the error being raised says so; finalize deletes the debris later
            discard_temporary(self.tmp, ignore_errors=True)


def run_unit(spec: SourceSpec, k: int, refs: list[TrackRef], model: EncodecModel, settings: UnitSettings,
             out_dir: str, piece: Piece | None = None) -> dict[str, Any]:
    """Tokenize unit ``k`` (tracks ``refs``, or the ``piece`` of the one track ``refs[0]``) into its part
    file; returns the unit's commit record."""
    known_bad: dict[int, dict] = {}
    while True:
        try:
            if piece is not None:
                record = _run_piece_once(spec, k, refs[0], piece, model, settings, OutputDir(out_dir), known_bad)
            else:
                record = _run_unit_once(spec, k, refs, model, settings, OutputDir(out_dir), known_bad)
            record["fp32_precision"] = fp32_precision()  # as the encoder ran (TF32 off: all "ieee")
            record["pid"] = os.getpid()  # the process that encoded it
            return record
        except _RedoUnit as redo:
            known_bad[redo.index] = redo.failure


def _run_unit_once(spec: SourceSpec, k: int, refs: list[TrackRef], model: EncodecModel, s: UnitSettings,
                   out: OutputDir, known_bad: dict[int, dict]) -> dict[str, Any]:
    threshold = 10 ** (s.silence_db / 20)
    part = _Part(out, k, model, s)
    failures: list[dict] = []
    notes: list[dict] = []
    tracks = silent_total = 0
    try:
        for ref in refs:
            if ref.index in known_bad:
                failures.append(known_bad[ref.index])
                continue
            if isinstance(ref.payload, Relisted):  # listed as what it holds now, in units of their own
                continue
            kept = silent = 0
            try:
                with open_track(spec, ref) as reader:
                    stats = scan(reader)  # pass 1: decode errors, truncation, NaN, length, peak
                    bounds = segment_bounds(stats.samples_24k, s.segment_samples, s.min_samples)
                    refused = refusal(ref, stats, bounds, s)
                    if refused:
                        raise refused
                    for start, pcm in cut_segments(resampled_blocks(reader), bounds):  # pass 2
                        if s.silence == "skip" and float(pcm.abs().max()) < threshold:
                            silent += 1
                            continue
                        part.add(ref.name, start, pcm)
                        kept += 1
                    if kept == 0:
                        raise AudioError(ref.where, silent_reason(stats.peak, s.silence_db, kept=0), "silent")
                    track_notes = _track_warnings(ref, reader, stats)
                # counted once the track is used: a track that fails leaves no rows and no silent segments
                tracks += 1
                silent_total += silent
                notes += track_notes
            except OutputWriteError:  # the output's fault, not the track's: the run stops (units committed stay)
                raise
            except Exception as e:  # a failure of this one input, whatever it is, is recorded as its failure
                failure = _failure(ref, _as_audio_error(ref, e))
                if part.written[ref.name]:
                    raise _RedoUnit(ref.index, failure) from None
                part.drop(ref.name)
                failures.append(failure)
        file = part.commit()
    finally:
        part.discard()
    return {"unit": k, "first": refs[0].index, "count": len(refs), "file": file, "num_rows": part.rows,
            "num_samples": part.samples, "num_tracks": tracks, "silent_segments": silent_total,
            "failures": failures, "warnings": notes, "code_counts": part.code_counts.tolist()}


def _run_piece_once(spec: SourceSpec, k: int, ref: TrackRef, piece: Piece, model: EncodecModel, s: UnitSettings,
                    out: OutputDir, known_bad: dict[int, dict]) -> dict[str, Any]:
    threshold = 10 ** (s.silence_db / 20)
    part = _Part(out, k, model, s)
    seen = {"track": ref.name, "path": ref.where, "segments": [piece.first, piece.stop], "peak": 0.0, "kept": 0,
            "failure": known_bad.get(ref.index)}
    silent = 0
    notes: list[dict] = []
    views: list[AudioReader] = []
    try:
        if seen["failure"] is None:
            try:
                with open_track(spec, ref) as reader:
                    seen["peak"], rows = piece_rows(reader, str(ref.payload), piece, s, views)
                    for start, pcm in rows:
                        if s.silence == "skip" and float(pcm.abs().max()) < threshold:
                            silent += 1
                            continue
                        part.add(ref.name, start, pcm)
                        seen["kept"] += 1
                    notes = _track_warnings(ref, reader, *views)
            except OutputWriteError:  # the output's fault, not the track's: the run stops
                raise
            except Exception as e:  # this piece's failure is the track's (judged with the other pieces)
                e = _as_audio_error(ref, e)
                last = "the end" if piece.stop is None else f"{piece.stop * s.segment_samples / SAMPLE_RATE:g} s"
                failure = _failure(ref, e)
                failure["reason"] += f" (in the part from {piece.first * s.segment_samples / SAMPLE_RATE:g} s to {last})"
                if part.written[ref.name]:
                    raise _RedoUnit(ref.index, failure) from None
                part.drop(ref.name)
                seen.update(failure=failure, kept=0)
                silent, notes = 0, []
        file = part.commit()
    finally:
        part.discard()
        for view in views:
            view.close()
    return {"unit": k, "first": ref.index, "count": 1, "piece": seen, "file": file, "num_rows": part.rows,
            "num_samples": part.samples, "num_tracks": 0, "silent_segments": silent, "failures": [],
            "warnings": notes, "code_counts": part.code_counts.tolist()}
