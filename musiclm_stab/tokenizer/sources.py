"""Where the tokenizer's tracks come from, in a fixed order (the unit plan is in plan.py).

Sources (``Source.open`` picks one from the path):
- a folder of audio files, searched recursively; tracks named by their path relative to the folder; a
  folder or link the walk cannot read (``list_audio_files``) is an input of its own that fails (so it
  is in ``failures.jsonl``, never silently left out); links to folders are followed, each folder once;
- a manifest, ``.csv`` (header row) or ``.jsonl``, with a ``path`` column and optionally ``id``
  (the track name; default: the path as written); relative paths are taken from the manifest's folder;
- an HF dataset saved with ``save_to_disk``, with an audio column (Audio feature, ``{bytes, path}``,
  ``{array, sampling_rate}`` or path strings); tracks named by a unique ``path`` column, else row index;
- ``streaming=True``: ``datasets.load_dataset(SRC, split=..., streaming=True)`` (e.g. a folder of
  parquet files), for corpora that do not fit on disk twice; tracks named by row index.

A stream is cut into units of ``part_tracks`` rows (sizes being unknown). A stream is read as Arrow tables of ``part_tracks`` rows, one per unit: the audio of a unit this run
does not do (another shard's, or one already done) is never turned into Python objects, let alone
decoded; and a resumed run starts reading where its last finished unit began (``datasets``' own
``state_dict``), so the data files before it are not even opened (for a remote stream: not
downloaded). That position is checked against a fingerprint of the unit's audio before it is used.
"""

from __future__ import annotations

import csv
import hashlib
import json
import pickle
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from musiclm_stab.audio.reader import AudioError, AudioReader, array_reader, list_audio_files, open_audio

MANIFEST_SUFFIXES = (".csv", ".jsonl")


class TokenizeError(RuntimeError):
    """The source gave nothing to tokenize, or cannot be read as a source at all."""


@dataclass(frozen=True)
class TrackRef:
    """One track of a source: picklable, so worker processes can open it."""

    index: int  # position in the source's order (before sharding)
    name: str  # the `track` column; ids are f"{name}@{start_sample}"
    where: str  # what a failure record names: a path, or "SRC[row]"
    size: int = 0  # bytes, for planning units (0: unknown)
    payload: Any = None  # a path (str), encoded bytes, (array, sample_rate), a row number, an AudioError, Relisted


@dataclass(frozen=True)
class Relisted:
    """The payload of an input that an earlier run listed and that is now listed as what it holds: a folder it
    could not read then, whose files are units of their own since (plan.relist). Its unit gives it no rows and
    no failure."""


@dataclass(frozen=True)
class SourceSpec:
    """Enough to reopen a source in another process."""

    path: str
    kind: str  # folder | manifest | hf_dataset | hf_streaming
    audio_column: str = "audio"
    split: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "audio_column": self.audio_column, "split": self.split}


def source_spec(src: str | Path, audio_column: str = "audio", split: str | None = None,
                streaming: bool = False) -> SourceSpec:
    """Recognise the kind of source at ``src``."""
    path = Path(src)
    if streaming:
        return SourceSpec(str(path.resolve()) if path.exists() else str(src), "hf_streaming", audio_column,
                          split or "train")
    try:
        if not path.exists():
            raise FileNotFoundError(f"source {src} does not exist")
        if path.is_file() and path.suffix.lower() in MANIFEST_SUFFIXES:
            return SourceSpec(str(path.resolve()), "manifest")
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            return SourceSpec(str(path.resolve()), "hf_dataset", audio_column, split)
    except OSError as e:  # a source folder that cannot be entered: one line, not a traceback
        if e.errno is None:  # ours, above
            raise
        raise TokenizeError(f"cannot read the source {src}: {e.strerror}") from None
    if path.is_dir():
        return SourceSpec(str(path.resolve()), "folder")
    raise TokenizeError(f"{src} is neither a folder of audio files, a manifest (.csv/.jsonl) nor a dataset "
                        "saved with save_to_disk (for a dataset to stream, pass --streaming)")


def list_tracks(spec: SourceSpec) -> list[TrackRef]:
    """All tracks of a listable source, in order (not for streaming sources)."""
    if spec.kind == "folder":
        root = Path(spec.path)
        problems: list[AudioError] = []  # folders and links the walk could not read: failures of their own
        try:
            files = list_audio_files(root, problems)
        except AudioError as e:
            raise TokenizeError(f"cannot read the source {e.path}: {e.reason}") from None
        entries: list[Path | AudioError] = [*files, *problems]
        entries.sort(key=lambda e: Path(e.path if isinstance(e, AudioError) else e).relative_to(root).as_posix())
        refs = []
        for i, entry in enumerate(entries):
            if isinstance(entry, AudioError):
                refs.append(TrackRef(i, Path(entry.path).relative_to(root).as_posix(), entry.path, 0, entry))
                continue
            try:
                size = entry.stat().st_size
            except OSError:
                size = 0
            refs.append(TrackRef(i, entry.relative_to(root).as_posix(), str(entry), size, str(entry)))
        return refs
    if spec.kind == "manifest":
        return _manifest_tracks(Path(spec.path))
    if spec.kind == "hf_dataset":
        ds = _hf_on_disk(spec)
        names = [str(i) for i in range(len(ds))]
        if "path" in ds.column_names and str(ds.features["path"]) == str(_string_feature()):
            paths = ds["path"]
            if None not in paths and len(set(paths)) == len(paths):
                names = list(paths)
        return [TrackRef(i, names[i], f"{spec.path}[{i}]", 0, i) for i in range(len(ds))]
    raise ValueError(f"list_tracks: {spec.kind} sources are iterated, not listed")


def _string_feature():
    import datasets

    return datasets.Value("string")


def _manifest_tracks(path: Path) -> list[TrackRef]:
    if path.suffix.lower() == ".csv":
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a BOM (spreadsheet exports) is dropped
            rows = list(csv.DictReader(f))
        if rows and "path" not in rows[0]:
            raise TokenizeError(f"{path}: a CSV manifest needs a 'path' column (found: {', '.join(rows[0])})")
    else:
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TokenizeError(f"{path}:{n}: not a JSON object ({e})") from None
                if not isinstance(row, dict):
                    raise TokenizeError(f"{path}:{n}: not a JSON object (a {type(row).__name__})")
                rows.append(row)
    refs, seen = [], {}
    for i, row in enumerate(rows):
        file = str(row.get("path") or "").strip()
        name = str(row.get("id") or "").strip() or file or f"row {i}"
        if name in seen:
            raise TokenizeError(f"{path}: track id {name!r} appears twice (rows {seen[name]} and {i}); "
                                "ids must be unique")
        seen[name] = i
        if not file:
            refs.append(TrackRef(i, name, f"{path}[{i}]", 0,
                                 AudioError(f"{path}[{i}]", "manifest row has no path", "bad_row")))
            continue
        full = Path(file) if Path(file).is_absolute() else path.parent / file
        try:
            size = full.stat().st_size
        except OSError:
            size = 0
        refs.append(TrackRef(i, name, str(full), size, str(full)))
    return refs


@dataclass
class StreamUnit:
    """One unit's worth of rows of a stream."""

    k: int
    rows_before: int  # rows of the stream before this unit
    num_rows: int
    refs: list[TrackRef] | None  # None: not wanted, its audio was not read
    resume: dict | None  # for a wanted unit: where it starts (data file, row in it) and its audio's sha256


def _unit_sha256(values: list[Any]) -> str:
    return hashlib.sha256(pickle.dumps(values, protocol=4)).hexdigest()


class _StreamMoved(Exception):
    """A saved stream position did not lead to the rows recorded for it."""


def stream_units(spec: SourceSpec, part_tracks: int, wanted: Callable[[int], bool] = lambda k: True,
                 start: dict | None = None) -> Iterator[StreamUnit]:
    """The units of a streaming source, ``part_tracks`` rows each, in order.

    The stream is read data file by data file (``IterableDataset.shard(num_shards, i)``: the stream's
    i-th data source) as Arrow tables; only the units ``wanted(k)`` accepts have their audio turned into
    Python objects. ``start`` ({"unit": q, "file": f, "row": r, "sha256": ...}, as recorded for a
    finished unit q) starts at unit q: data files before f are not opened, the first r rows of f are
    skipped as Arrow data, and unit q's audio must match ``sha256``; if it does not (the stream has
    changed), a warning says so and the stream is read from its start.
    """
    if start is not None:
        try:
            yield from _stream_units(spec, part_tracks, wanted, start)
            return
        except _StreamMoved as e:
            warnings.warn(f"resuming the stream {spec.path} at unit {start['unit']} failed ({e}); reading it "
                          "from the start", RuntimeWarning, stacklevel=2)
    yield from _stream_units(spec, part_tracks, wanted, None)


def _stream_units(spec: SourceSpec, part_tracks: int, wanted: Callable[[int], bool],
                  start: dict | None) -> Iterator[StreamUnit]:
    import pyarrow as pa

    ds = _hf_stream(spec)
    files = ds.num_shards
    k, first_file, skip = (start["unit"], start["file"], start["row"]) if start else (0, 0, 0)
    if first_file >= max(files, 1):
        raise _StreamMoved(f"the stream has {files} data files, fewer than {first_file + 1}")
    pending: list[pa.Table] = []  # rows of unit k read so far
    where = (first_file, skip)  # data file and row in it where unit k starts

    def emit(table: pa.Table) -> StreamUnit:
        rows_before = k * part_tracks  # every unit but the last is full
        check = start is not None and k == start["unit"]
        if spec.audio_column not in table.column_names:
            raise TokenizeError(f"{spec.path}: rows {rows_before}.. have no column {spec.audio_column!r} "
                                f"(columns: {', '.join(table.column_names)}); name it with --audio-column")
        refs, resume = None, None
        if wanted(k) or check:
            values = table.column(spec.audio_column).to_pylist()
            digest = _unit_sha256(values)
            if check and digest != start["sha256"]:
                raise _StreamMoved(f"the rows found there are not unit {k}'s")
            if wanted(k):
                refs = [TrackRef(i, str(i), f"{spec.path}[{i}]", 0, _row_payload(v, f"{spec.path}[{i}]"))
                        for i, v in enumerate(values, rows_before)]
                resume = {"file": where[0], "row": where[1], "sha256": digest}
        return StreamUnit(k, rows_before, table.num_rows, refs, resume)

    for f in range(first_file, files):
        row = 0  # rows of data file f read so far
        part = ds if files == 1 else ds.shard(num_shards=files, index=f, contiguous=True)
        for table in part.iter(batch_size=max(1, part_tracks)):
            if f == first_file and row < skip:  # before the resumed unit: dropped as Arrow data
                drop = min(skip - row, table.num_rows)
                table, row = table.slice(drop), row + drop
            while table.num_rows:
                take = part_tracks - sum(t.num_rows for t in pending)
                pending.append(table.slice(0, take))
                table, row = table.slice(take), row + min(take, table.num_rows)
                if sum(t.num_rows for t in pending) == part_tracks:
                    yield emit(pa.concat_tables(pending))
                    pending, k, where = [], k + 1, (f, row)
        if f == first_file and row < skip:
            raise _StreamMoved(f"data file {f} has {row} rows, fewer than the {skip} expected")
        if not pending and (f, row) == where:
            where = (f + 1, 0)  # the next unit starts in the next file
    if pending:
        yield emit(pa.concat_tables(pending))


_HF_CACHE: dict[SourceSpec, Any] = {}


def _hf_on_disk(spec: SourceSpec):
    """The dataset's audio column, with Audio features read as {bytes, path} (decoding through
    ``datasets`` needs torchcodec and FFmpeg). Cached per process."""
    if spec in _HF_CACHE:
        return _HF_CACHE[spec]
    import datasets

    ds = datasets.load_from_disk(spec.path)
    if isinstance(ds, datasets.DatasetDict):
        split = spec.split
        if split is None and len(ds) == 1:
            split = next(iter(ds))
        if split not in ds:
            raise TokenizeError(f"{spec.path} has splits {', '.join(ds)}; choose one with --split")
        ds = ds[split]
    if spec.audio_column not in ds.column_names:
        raise TokenizeError(f"{spec.path} has no column {spec.audio_column!r} (columns: "
                            f"{', '.join(ds.column_names)}); name the audio column with --audio-column")
    if isinstance(ds.features[spec.audio_column], datasets.Audio):
        ds = ds.cast_column(spec.audio_column, datasets.Audio(decode=False))
    _HF_CACHE[spec] = ds
    return ds


def _hf_stream(spec: SourceSpec):
    """The stream's audio column as Arrow tables (``with_format("arrow")``: no row is decoded or turned
    into Python objects until asked)."""
    import datasets

    try:
        ds = datasets.load_dataset(spec.path, split=spec.split, streaming=True)
    except Exception as e:
        raise TokenizeError(f"cannot stream {spec.path} (split {spec.split}): {type(e).__name__}: {e}") from None
    features = ds.features or {}
    if features and spec.audio_column not in features:
        raise TokenizeError(f"{spec.path} has no column {spec.audio_column!r} (columns: {', '.join(features)}); "
                            "name the audio column with --audio-column")
    if features:
        ds = ds.select_columns([spec.audio_column])
    return ds.with_format("arrow")


def _row_payload(value: Any, where: str) -> Any:
    """What a worker needs to open a dataset row's audio: bytes, (array, rate) or a path."""
    if isinstance(value, dict) and value.get("bytes"):
        return bytes(value["bytes"])
    if isinstance(value, dict) and value.get("array") is not None:
        return (np.asarray(value["array"]), int(value["sampling_rate"]))
    path = value.get("path") if isinstance(value, dict) else value
    if not path:
        return AudioError(where, "row has no audio (neither bytes nor a path)", "bad_row")
    return str(path)


def open_track(spec: SourceSpec, ref: TrackRef) -> AudioReader:
    """Open a track for block reading. Raises AudioError."""
    payload = ref.payload
    if isinstance(payload, int) and spec.kind == "hf_dataset":
        ds = _hf_on_disk(spec)
        payload = _row_payload(ds[payload][spec.audio_column], ref.where)
        if isinstance(payload, str):  # a relative path: the working directory, else the dataset folder
            p = Path(payload)
            if not p.is_absolute() and not p.exists() and (Path(spec.path) / p).exists():
                payload = str(Path(spec.path) / p)
    if isinstance(payload, AudioError):
        raise payload
    if isinstance(payload, bytes):
        return open_audio(payload, ref.where)
    if isinstance(payload, tuple):
        return array_reader(payload[0], payload[1], ref.where)
    if isinstance(payload, str):
        return open_audio(payload)
    raise AudioError(ref.where, f"no audio for this track ({type(payload).__name__})", "bad_row")
