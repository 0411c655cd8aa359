"""Tokenizing music: audio files, a manifest or an HF dataset -> EnCodec codes, saved as an HF dataset.

Each track is decoded to 24 kHz mono, cut into segments of ``segment_seconds`` (a multiple of the
320-sample hop; a shorter tail is kept if it lasts at least ``min_seconds``), and every segment is
encoded with EnCodec at 6 kbps into ``codes`` [8, T] with T = samples / 320. One row per segment:

    id (str "{track}@{start_sample}"), track (str), start (float s), pcm (float32 [S]),
    codes (int16 [8, T]), num_frames (int T)

``tokenizer.json`` in the output folder identifies the tokenizer (weights sha256, bandwidth, rates) and
records the device type it ran on; ``check_same_tokenizer`` refuses to mix data made with different
tokenizers, and data made on different device types (same tokenizer, codes not bit-identical) is
merged or loaded together with a DeviceMixWarning. TF32 is off wherever the encoder runs.

A real corpus as it comes:
- bad inputs (missing, unreadable, empty, not audio, corrupt, truncated, NaN, silent, too short) never
  stop the run: each goes to ``failures.jsonl`` with its path, ``kind`` and reason, and is counted;
  odd but usable ones (a length mismatch, float audio above full scale) are kept and reported in
  ``warnings.jsonl``; silence (``silence``, ``silence_db``) and short clips (``min_seconds``) follow an
  explicit policy; failures are retried only when asked (``retry_failures``); a folder the walk cannot
  read is such a failure too (``list_audio_files``);
- an error writing the output (a full disk, a file size limit, a read-only disk) is no input's failure:
  it stops the run with one line naming the path (``OutputWriteError``), the committed units stay, and
  rerunning the same command continues;
- the work is cut into units of consecutive tracks, each committed atomically as it finishes: a run
  killed at any point (kill -9 included) and started again with the same command finishes the job with
  the rows an uninterrupted run would have written; other weights or settings are refused; one run at
  a time writes an output (an OS lock; a second run fails at once);
- tracks are read and resampled in blocks and encoded segment by segment, so memory does not grow
  with track length; a long lossless track is cut into pieces (units of its segments) so that all
  workers share it; units run in worker processes (``workers``); ``shard="i/n"`` takes every n-th
  unit (every n-th track for pieces), and ``merge_shards`` / ``load_tokenized([...])`` put the shards
  back together. A resumed streaming run starts reading at its last finished unit.

The job; its command line (``musiclm-stab tokenize``) is tokenizer/cli.py, the parts are in the package's
other modules (see musiclm_stab/tokenizer/__init__.py). ``tokenizer.json`` also records each codebook's
usage over the dataset (codes used, perplexity), printed in the summary.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from musiclm_stab.constants import HOP_LENGTH, SAMPLE_RATE
from musiclm_stab.data.tokenized import IDENTITY_KEYS, METADATA_FILE, STATE_DIR, job_units
from musiclm_stab.output_errors import OutputWriteError, check_folder_path, writing
from musiclm_stab.spawned import workers_for
from musiclm_stab.threads import one_thread
from musiclm_stab.tokenizer.encode import full_fp32
from musiclm_stab.tokenizer.lock import check_not_busy, output_lock
from musiclm_stab.tokenizer.plan import (
    PIECE_SECONDS,
    arrange,
    names_sha256,
    plan_units,
    relist,
    split_long_tracks,
)
from musiclm_stab.tokenizer.policy import SILENCE_POLICIES, UnitSettings
from musiclm_stab.tokenizer.segments import Piece
from musiclm_stab.tokenizer.sources import TokenizeError, list_tracks, source_spec, stream_units
from musiclm_stab.tokenizer.store import (
    STATE_VERSION,
    OutputDir,
    OutputMismatch,
    check_output_folder,
    job_sha256,
)
from musiclm_stab.tokenizer.weights import load_encodec, prepare_for_inference
from musiclm_stab.tokenizer.workers import run_units


@dataclass
class TokenizeSummary:
    out_dir: str
    num_tracks: int  # tracks with at least one row
    num_rows: int
    total_seconds: float  # audio in the rows
    num_failures: int
    seconds_taken: float  # by this call
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    num_silent_segments: int = 0
    seconds_this_run: float = 0.0  # audio tokenized by this call (less than total_seconds after a resume)
    units_done_before: int = 0  # work units found committed by an earlier run
    num_units: int = 0
    num_warnings: int = 0  # inputs tokenized with a warning (warnings.jsonl)
    # per codebook: codes used (of 1024) and perplexity over the dataset's rows (None: an older output)
    codebook_usage: list[dict[str, float]] | None = None

    @property
    def realtime_factor(self) -> float:
        """Seconds of audio tokenized by this call per second of wall time."""
        return self.seconds_this_run / max(self.seconds_taken, 1e-9)

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.failures_by_kind.items())
        resumed = f"; {self.units_done_before} of {self.num_units} units were already done" \
            if self.units_done_before else ""
        return (
            f"tokenized {self.num_tracks} tracks into {self.num_rows} segments "
            f"({self.total_seconds / 3600:.3f} h of audio); this run: {self.seconds_this_run:.1f} s of audio in "
            f"{self.seconds_taken:.1f} s ({self.realtime_factor:.1f}x real time){resumed}; "
            f"{self.num_failures} failed{f' ({kinds})' if kinds else ''}"
            f"{f', {self.num_warnings} warnings' if self.num_warnings else ''} -> {self.out_dir}"
        ) + (("\n  codebook usage (codes used of 1024 / perplexity) per level: " + "  ".join(
            f"{u['codes_used']}/{u['perplexity']:.0f}" for u in self.codebook_usage)) if self.codebook_usage else "")


def _default_note(info: dict[str, Any]) -> str | None:
    if info["weights"] == "pretrained":
        return None
    prov = info.get("weights_provenance")
    if prov:
        return (f"local weights {info['weights_file']} made by {prov.get('made_by')} (seed {prov.get('seed')}, "
                f"fitted on {prov.get('seconds_used')} s of audio): a random encoder with fitted codebooks, "
                "not the pretrained EnCodec model")
    return f"local weights file {info['weights_file']}"


_ENCODER_CACHE: dict[tuple, tuple[Any, dict]] = {}


def _encoder(weights: str | Path | None) -> tuple[Any, dict[str, Any]]:
    """``load_encodec`` + ``prepare_for_inference``, remembered for the last weights file (by path, size
    and mtime): repeated calls in one process (tests, notebooks) skip rebuilding and hashing the model.
    The model is only read (inference mode), so sharing it is safe."""
    if weights is None:
        key: tuple = ("pretrained",)
    else:
        st = Path(weights).stat() if Path(weights).is_file() else None
        key = (str(Path(weights).resolve()), st.st_size, st.st_mtime_ns) if st else (str(weights),)
    if key not in _ENCODER_CACHE:
        model, info = load_encodec(None if weights is None else str(weights))
        _ENCODER_CACHE.clear()
        _ENCODER_CACHE[key] = (prepare_for_inference(model), info)
    model, info = _ENCODER_CACHE[key]
    return model, dict(info)


def parse_shard(shard: str | tuple[int, int] | None) -> tuple[int, int]:
    """'i/n' (or (i, n)) -> (i, n) with 0 <= i < n; None -> (0, 1)."""
    if shard is None:
        return 0, 1
    try:
        i, n = (int(v) for v in (shard.split("/") if isinstance(shard, str) else shard))
    except (ValueError, TypeError):
        raise ValueError(f"shard={shard!r}: expected 'i/n', e.g. 0/4") from None
    if not 0 <= i < n:
        raise ValueError(f"shard={shard!r}: need 0 <= i < n")
    return i, n


def _stops_on_output_errors(fn: Callable[..., TokenizeSummary]) -> Callable[..., TokenizeSummary]:
    """An OutputWriteError (the output's disk is full, a file size limit, a read-only or failing disk...)
    stops the run: raised again with what was kept and how to go on, in one line. Committed units stay,
    and the unit being written is not committed, so a rerun of the same command continues."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> TokenizeSummary:
        try:
            return fn(*args, **kwargs)
        except OutputWriteError as e:
            out_dir = signature.bind(*args, **kwargs).arguments["out_dir"]
            try:
                done: int | None = len(OutputDir(out_dir).done_units())
            except OSError:
                done = None
            if done == 0:
                then = f"Tokenizing stopped before any unit was committed: {e.advice()}, then rerun the same command"
            else:
                then = (f"Tokenizing stopped; the {'' if done is None else f'{done} '}units committed so far are "
                        f"kept: {e.advice()}, then rerun the same command to continue with the rest")
            raise OutputWriteError(f"{e}. {then}", e.path, e.errno) from None
    return wrapper


@contextmanager
def _locked(out_dir: str | Path) -> Iterator[None]:
    """``output_lock``, its failure to create the folder or the lock file being an OutputWriteError."""
    with ExitStack() as stack:
        with writing(out_dir, "create the output folder"):
            stack.enter_context(output_lock(out_dir))
        yield


@_stops_on_output_errors
def tokenize(
    src: str | Path,
    out_dir: str | Path,
    weights: str | Path | None = None,
    segment_seconds: float = 10.0,
    min_seconds: float = 1.0,
    batch_size: int = 8,
    device: str = "cpu",
    weights_note: str | None = None,
    audio_column: str = "audio",
    split: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    silence: str = "skip",
    silence_db: float = -60.0,
    workers: int | None = None,
    shard: str | tuple[int, int] | None = None,
    retry_failures: bool = False,
    streaming: bool = False,
    part_mb: float | None = None,
    part_tracks: int = 64,
    piece_seconds: float | None = PIECE_SECONDS,
) -> TokenizeSummary:
    """Tokenize a folder of audio (recursive), a manifest, or an HF dataset into ``out_dir``.

    ``weights=None`` uses the pretrained EnCodec model (raises WeightsUnavailable offline); a file
    path uses local weights (see ``musiclm-stab make-weights``). ``weights_note`` is free text stored
    in tokenizer.json (a note is derived for locally made weights when none is given).
    An unfinished ``out_dir`` of the same job is resumed, a finished one returned as it is; one made
    with other weights or settings raises OutputMismatch (``overwrite=True`` starts over). The
    folder is locked while a run writes it: a second run on it raises OutputBusy.
    ``silence``: "skip" (tracks, and segments, whose peak is below ``silence_db`` dBFS are left out,
    tracks reported as failures of kind "silent") or "keep". ``workers``: encoder processes (0: this
    process; None: on CPU one per core, at most one per unit to do; on GPU 0); workers are spawned
    processes, which import the calling script again: a script that calls this outside
    ``if __name__ == "__main__":`` gets one warning and the work done in this process (musiclm_stab.spawned).
    ``part_mb`` and ``part_tracks`` size the work units (source MB / tracks per unit); ``part_mb=None``
    sizes them from the source: 1/64 of its bytes, within 4-64 MB, so that small corpora still
    split into enough units to keep every worker busy. A lossless file longer than two
    ``piece_seconds`` is cut into units of that much audio, so that one long track uses every
    worker (None or 0: never split). The unit plan of the first run stays in force; with ``retry_failures``,
    inputs that failed and are now folders of audio (a folder that could not be read) add units of their
    files after the others (``plan.relist``). A finished output is checked first: a unit whose record was lost
    is redone, as is one whose part file is damaged.
    ``device`` is recorded in tokenizer.json; TF32 is off wherever the encoder runs.
    An OS error writing ``out_dir`` raises OutputWriteError (one line: the path, the reason, the units kept,
    what to do); it is never recorded as an input's failure, and a rerun continues.
    """
    t0 = time.perf_counter()
    segment_samples = int(round(segment_seconds * SAMPLE_RATE)) // HOP_LENGTH * HOP_LENGTH
    min_samples = math.ceil(min_seconds * SAMPLE_RATE)
    if segment_samples < HOP_LENGTH:
        raise ValueError(f"segment_seconds={segment_seconds} is shorter than one frame ({HOP_LENGTH} samples)")
    if not 0 <= min_seconds <= segment_seconds:
        raise ValueError(f"min_seconds={min_seconds} must be in [0, segment_seconds={segment_seconds}]")
    min_samples = min(min_samples, segment_samples)  # the segment is rounded down to whole frames
    if batch_size < 1 or part_tracks < 1 or (part_mb is not None and part_mb <= 0):
        raise ValueError(f"batch_size, part_tracks and part_mb must be positive, got {batch_size}, "
                         f"{part_tracks}, {part_mb}")
    if silence not in SILENCE_POLICIES:
        raise ValueError(f"silence={silence!r}: choose one of {', '.join(SILENCE_POLICIES)}")
    shard_i, shard_n = parse_shard(shard)
    spec = source_spec(src, audio_column, split, streaming)
    refs = None if streaming else list_tracks(spec)
    if refs is not None and not refs:
        raise TokenizeError(f"no audio found in {src}")
    check_folder_path(out_dir)  # before loading anything: a file in the way, or a folder that is not ours,
    with writing(out_dir, "read the output folder"):  # is refused at once, as is a folder another writer holds
        check_not_busy(out_dir)
        check_output_folder(out_dir)

    model, info = _encoder(weights)
    with _locked(out_dir):
        if part_mb is not None:
            part_bytes: int | str = int(part_mb * 2**20)
            unit_bytes = part_bytes
        else:  # "auto": the first run's units are kept in job.json, so a later change of sizes changes nothing
            part_bytes = "auto"
            unit_bytes = min(64 * 2**20, max(4 * 2**20, sum(r.size for r in refs or []) // 64))
        # a resumed job keeps the plan (units, batching) of its first run: no need to look at the files again
        earlier = _earlier_plan(out_dir, overwrite)
        extended = None  # an earlier plan extended to files found in a folder that failed (plan.relist)
        if refs is None:
            plan: dict[str, Any] = {"streaming": True, "batching": "track"}
            if earlier is not None and earlier.get("streaming"):
                plan = earlier
        else:
            plan = {"num_tracks": len(refs), "names_sha256": names_sha256(refs)}
            if earlier is not None and earlier.get("names_sha256") == plan["names_sha256"] and "units" in earlier:
                plan, refs = earlier, arrange(refs, earlier.get("relisted", []))
            elif retry_failures and spec.kind == "folder" and earlier is not None and (extended := relist(
                    refs, earlier, _failed_inputs(out_dir), unit_bytes, part_tracks, segment_samples, piece_seconds,
                    batch_size)) is not None:
                plan, refs = earlier, extended[1]  # the job is opened as it was, then its plan extended (below)
            else:
                plan["units"] = split_long_tracks(refs, plan_units(refs, unit_bytes, part_tracks), segment_samples,
                                                  piece_seconds, batch_size)
                plan["batching"] = "track"
        job = {
            "format": STATE_VERSION,
            "tokenizer": {k: info[k] for k in IDENTITY_KEYS},
            "settings": {"segment_samples": segment_samples, "min_samples": min_samples, "silence": silence,
                         "silence_db": float(silence_db), "part_bytes": part_bytes, "part_tracks": part_tracks},
            # float results, and so a few codes at near-ties, depend on the batch and the device: a resumed
            # run must encode like the first one (one thread per encoder on CPU, whatever --workers says)
            "encode": {"batch_size": batch_size, "device": torch.device(device).type},
            "source": spec.describe(),
            "plan": plan,
            "shard": [shard_i, shard_n],
        }
        with writing(out_dir):  # every write to the output: an OS error there stops the run (not an input's fault)
            out = OutputDir.prepare(out_dir, job, overwrite, sources=_sources(src, refs) if overwrite else ())
        if extended is not None:
            with writing(out_dir):
                out.replan(extended[0])
        job = out.job()  # an earlier run's unit plan stays in force (file sizes may have changed since)
        # outputs started before per-track batching keep batching across the tracks of a unit
        settings = UnitSettings(segment_samples, min_samples, silence, float(silence_db), batch_size,
                                job["plan"].get("batching", "unit"))
        if retry_failures:
            with writing(out_dir):
                out.reopen_failed()
        with writing(out_dir):
            out.reopen_damaged()  # a part damaged since it was committed is redone (data/tokenized.py check_parts)
            out.reopen_missing(job_units(job))  # so is a unit whose record was lost, in a finished output
        meta = {
            **info,
            "segment_seconds": segment_samples / SAMPLE_RATE,
            "segment_samples": segment_samples,
            "min_seconds": min_seconds,
            "silence": silence,
            "silence_db": float(silence_db),
            "weights_note": weights_note if weights_note is not None else _default_note(info),
            "source": spec.path,
            "source_kind": spec.kind,
            "shard": f"{shard_i}/{shard_n}" if shard_n > 1 else None,
            "job_sha256": job_sha256(job),
            "device": job["encode"]["device"],
        }
        done_before = out.done_units()
        if out.is_complete():
            return _summary(out, job, t0, 0.0, len(done_before))
        todo_units = job_units(job)

        audio_done, failed = [0], [0]
        stream_resume: dict[int, dict] = {}  # streaming: where each unit handed out starts in the stream
        bar = tqdm(desc="tokenizing", unit="unit", disable=not progress,
                   total=None if todo_units is None else len(set(todo_units) - done_before))

        def on_done(record: dict) -> None:
            if record["unit"] in stream_resume:
                record["stream"] = stream_resume.pop(record["unit"])
            with writing(out_dir):
                out.commit(record)
            audio_done[0] += record["num_samples"]
            failed[0] += len(record["failures"]) + bool(record.get("piece", {}).get("failure"))
            bar.update(1)
            bar.set_postfix(failed=failed[0], audio_h=f"{audio_done[0] / SAMPLE_RATE / 3600:.2f}")

        if refs is not None:
            units = job["plan"]["units"]
            work: Any = [(k, refs[units[k][0] : units[k][0] + units[k][1]],
                          Piece(units[k][2], units[k][3]) if len(units[k]) > 2 else None)
                         for k in todo_units if k not in done_before]
        else:
            work = _stream_work(spec, job, out, done_before, shard_i, shard_n, stream_resume)
        if workers is None:  # on CPU, worker processes even for one unit: they run faster (see keep_freed_memory)
            workers = 0 if device != "cpu" or (refs is not None and not work) else (os.cpu_count() or 1)
        if refs is not None:
            workers = min(workers, len(work))
        workers = workers_for("tokenize", workers)  # 0 when spawned workers would run the caller's script again
        if workers > 0:  # each worker loads its own: this process keeps none
            del model
            model = None
            _ENCODER_CACHE.clear()
        else:
            model.to(torch.device(device))
        with one_thread(), full_fp32():  # the same float arithmetic in this process as in a worker
            run_units(work, spec, settings, str(out.out), on_done, model, workers,
                      weights=None if weights is None else str(weights), device=device, sha256=info["weights_sha256"])
        bar.close()
        job = out.job()
        with writing(out_dir):
            out.finalize(job_units(job), meta)
        return _summary(out, job, t0, audio_done[0] / SAMPLE_RATE, len(done_before))


def _sources(src: str | Path, refs: list | None) -> list[str]:
    """What a job reads on this machine (the source, the files a folder or a manifest names), which
    ``--overwrite`` must never remove."""
    found = [str(src)] if Path(src).exists() else []
    return found + [r.payload for r in refs or [] if isinstance(r.payload, str)]


def _earlier_plan(out_dir: str | Path, overwrite: bool) -> dict | None:
    """The unit plan of an earlier run on this output, if it has one (and is not to be overwritten)."""
    path = Path(out_dir) / STATE_DIR / "job.json"
    if overwrite or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["plan"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: OutputDir.prepare reports it


def _failed_inputs(out_dir: str | Path) -> set[str]:
    """The names of the inputs that the committed units of an output recorded as failures."""
    out = OutputDir(out_dir)
    return {f["track"] for k in out.done_units() for f in (out.record(k) or {}).get("failures", [])}


def _stream_work(spec, job: dict, out: OutputDir, done: set[int], shard_i: int, shard_n: int,
                 resume: dict[int, dict]) -> Iterator[tuple[int, list]]:
    """Units of a streaming source that this run must do; records the stream's length at its end.

    A resumed run starts reading at its last finished unit before the first unfinished one (see
    ``stream_units``); ``resume`` receives, for each unit handed out, where it starts in the stream.
    """
    def own(k: int) -> bool:
        return k % shard_n == shard_i

    first_todo = shard_i
    while first_todo in done:
        first_todo += shard_n
    start = None
    if first_todo - shard_n >= 0:
        record = out.record(first_todo - shard_n)
        if record and record.get("stream"):
            start = {"unit": first_todo - shard_n, **record["stream"]}
    last, rows = -1, 0
    for u in stream_units(spec, job["settings"]["part_tracks"], wanted=lambda k: own(k) and k not in done,
                          start=start):
        last, rows = u.k, u.rows_before + u.num_rows
        if u.refs is not None:
            resume[u.k] = u.resume
            yield u.k, u.refs
    if last < 0:
        raise TokenizeError(f"the stream {spec.path} (split {spec.split}) has no rows")
    end = {"num_units": last + 1, "num_tracks": rows}
    if job.get("stream_end") not in (None, end):
        raise OutputMismatch(f"the stream {spec.path} has changed since this output was started: "
                             f"{job['stream_end']} then, {end} now")
    with writing(out.out):
        out.update_job(stream_end=end)


def _summary(out: OutputDir, job: dict, t0: float, seconds_this_run: float, done_before: int) -> TokenizeSummary:
    meta = json.loads((out.out / METADATA_FILE).read_text())
    units = job_units(job)
    return TokenizeSummary(
        out_dir=str(out.out), num_tracks=meta["num_tracks"], num_rows=meta["num_rows"],
        total_seconds=meta["total_seconds"], num_failures=meta["num_failures"],
        seconds_taken=time.perf_counter() - t0, failures_by_kind=meta.get("failures_by_kind", {}),
        num_silent_segments=meta.get("num_silent_segments", 0), seconds_this_run=seconds_this_run,
        units_done_before=done_before, num_units=len(units), num_warnings=meta.get("num_warnings", 0),
        codebook_usage=meta.get("codebook_usage"),
    )
