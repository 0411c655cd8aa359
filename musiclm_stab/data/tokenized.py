"""Reading a tokenized dataset: the format the tokenizer writes, and the checks on it.

    OUT/tokenizer.json     the tokenizer (weights sha256, rates, device) and the dataset's counts and
                           per-codebook usage; written last, so its presence means the output is complete
    OUT/failures.jsonl     one row per input not tokenized: track, path, kind, reason
    OUT/warnings.jsonl     one row per warning about an input that was tokenized: track, path, kind, reason
    OUT/state.json, dataset_info.json, parts/*.arrow   an HF dataset of rows ``FEATURES``
    OUT/.tokenize/         resume state (job.json, one record per committed unit)

This is the data side of the tokenizer: training, evaluation, feature extraction and probes read
tokenized data through this module only (never musiclm_stab.tokenizer, which loads EnCodec); the
tokenizer takes the format's constants from here.

Checks at load (``load_tokenized``): every file name read from tokenizer.json or state.json must stay
inside the dataset's folder (``inside``; datasets and shards come from other machines: untrusted), and
every part file must be what the tokenizer wrote (``check_parts``): the size tokenizer.json records, on
every load; its sha256, codes in [0, codebook_size) with the recorded shape, and finite audio within
``PCM_LIMIT``, once per version of the file (its size, mtime, ctime and inode), remembered in this process
and under the user's cache folder (``verified_cache_dir``), never in the dataset (which may be read-only).
Datasets written before parts carried hashes load with an ``UncheckedData`` warning: only their arrow
structure, codes and audio are checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from musiclm_stab.constants import CODEBOOK_SIZE

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "track": datasets.Value("string"),
        "start": datasets.Value("float64"),
        "pcm": datasets.List(datasets.Value("float32")),  # (S,)
        "codes": datasets.List(datasets.List(datasets.Value("int16"))),  # (K, T)
        "num_frames": datasets.Value("int32"),
    }
)

METADATA_FILE = "tokenizer.json"

FAILURES_FILE = "failures.jsonl"

WARNINGS_FILE = "warnings.jsonl"

STATE_DIR = ".tokenize"

PARTS_DIR = "parts"

# Fields that must agree for two tokenized datasets (or a dataset and a model) to be mixed.
IDENTITY_KEYS = ("weights_sha256", "model", "bandwidth", "sample_rate", "frame_rate", "hop_length",
                 "num_codebooks", "codebook_size")


class TokenizerMismatch(ValueError):
    """Two datasets (or a dataset and a model) were tokenized with different EnCodec weights/settings."""


class DeviceMixWarning(UserWarning):
    """Data tokenized on different device types (CPU, GPU) is merged or used together."""


class DuplicateRows(ValueError):
    """Folders loaded together hold the same rows (one folder twice, a merged output and one of its shards)."""


class IncompleteShards(ValueError):
    """The shards of a ``--shard i/n`` tokenization are loaded without all n of them."""


class DamagedData(ValueError):
    """A part file of a tokenized dataset is not what its tokenizer wrote: missing, of another size or sha256
    than recorded, not readable as arrow data, or holding codes out of range or of another shape, or audio
    that no tokenizer writes (not finite, or beyond PCM_LIMIT)."""


class UnsafePath(ValueError):
    """A file name read from a dataset (tokenizer.json, state.json, a unit record) leads outside its folder."""


class UncheckedData(UserWarning):
    """A tokenized dataset whose tokenizer.json records no sha256 of its parts (an older version wrote it)."""


RESTORED_KEY = "codes_restored"  # tokenizer.json's record of a finished `musiclm-stab codes restore`
# tokenizer.json's record of a `musiclm-stab codes restore` under way (data/codes_file.py): while it is there,
# the dataset is refused, and the restore, run again, accepts each part as it was before or after it
RESTORING_KEY = "codes_restoring"


def unit_groups(units: Sequence[Sequence[Any]]) -> list[int]:
    """The group of each planned unit: the pieces of one track share a group, other units have their own.

    A unit is [first track, number of tracks], or [track, 1, first segment, stop segment] for a piece;
    a piece starting at segment 0 opens a group, later pieces continue it. Shards take whole groups,
    so that a track's pieces, which are judged together, end up in one shard.
    """
    groups, g = [], -1
    for u in units:
        if len(u) < 3 or u[2] == 0:
            g += 1
        groups.append(g)
    return groups


def job_units(job: dict) -> list[int] | None:
    """The unit indices this job (this shard) must complete; None while a stream's length is unknown."""
    i, n = job["shard"]
    if "units" in job["plan"]:
        return [k for k, g in enumerate(unit_groups(job["plan"]["units"])) if g % n == i]
    if job.get("stream_end"):
        return [k for k in range(job["stream_end"]["num_units"]) if k % n == i]
    return None


def device_of(path: str | Path, info: dict) -> str | None:
    """The device type an output was tokenized on: tokenizer.json's ``device``, else (outputs of an older
    version) its job's ``encode.device``, else None."""
    if info.get("device"):
        return info["device"]
    try:
        return json.loads((Path(path) / STATE_DIR / "job.json").read_text())["encode"]["device"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def warn_mixed_devices(devices: dict[str, str | None], what: str) -> str | None:
    """Warn (DeviceMixWarning) when outputs were tokenized on different device types; returns the message.

    ``devices``: output folder -> its device type ("mixed" for a merge of several).
    """
    known = {d for d in devices.values() if d}
    if len(known) < 2 and "mixed" not in known:
        return None
    by = ", ".join(f"{p}: {d or 'unknown'}" for p, d in devices.items())
    msg = (f"{what} data tokenized on different device types ({by}). The codes are the same tokenizer's "
           "but not bit-identical (float rounding differs between devices; how many frames differ between a "
           "GPU and a CPU has not been measured: benchmarks/bench_tokenize.py devices measures it). Tokenize "
           "on one device type for bit-identical data.")
    warnings.warn(msg, DeviceMixWarning, stacklevel=3)
    return msg


def codebook_usage(counts: np.ndarray) -> list[dict[str, float]]:
    """Per codebook, from how often each code occurs (counts [K, 1024]): the number of codes used and the
    perplexity exp(H) of their distribution (1024: every code equally often; 1: one code only)."""
    usage = []
    for row in np.asarray(counts, dtype=np.float64):
        p = row[row > 0] / row.sum()
        usage.append({"codes_used": int((row > 0).sum()), "perplexity": round(float(np.exp(-(p * np.log(p)).sum())), 1)})
    return usage


def read_info(path: str | Path) -> dict[str, Any]:
    """tokenizer.json of a finished output, with clear errors for anything else."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenized dataset {path} does not exist; make it with "
                                f"`musiclm-stab tokenize AUDIO_DIR {path}`")
    if not (path / METADATA_FILE).is_file():
        if (path / STATE_DIR / "job.json").is_file():
            units = job_units(json.loads((path / STATE_DIR / "job.json").read_text()))
            n = len(list((path / STATE_DIR / "units").glob("u*.json")))  # a unit's record makes it done
            done = f"{n} of {len(units)}" if units is not None else f"{n}"
            raise ValueError(f"{path} is an unfinished tokenization ({done} work units done); rerun the same "
                             "`musiclm-stab tokenize` command to finish it")
        raise ValueError(f"{path} is not a tokenized dataset: {METADATA_FILE} is missing "
                         f"(make one with `musiclm-stab tokenize AUDIO_DIR OUT_DIR`)")
    return json.loads((path / METADATA_FILE).read_text())


def inside(root: Path, name: Any, where: Path) -> Path:
    """``root / name`` for a file ``name`` that the file ``where`` lists; UnsafePath unless it stays inside the
    folder ``root``: a relative path without '..', and no link leading out of ``root``. A dataset (a shard)
    may come from another machine, so the names in it are not trusted."""
    reason = None
    if not isinstance(name, str) or not name or "\0" in name:
        reason = "not a file name"
    elif PurePosixPath(name).is_absolute() or Path(name).is_absolute():
        reason = "an absolute path"
    elif ".." in PurePosixPath(name).parts or ".." in Path(name).parts:
        reason = "it goes up with '..'"
    else:
        real = (root / name).resolve()
        if not real.is_relative_to(root.resolve()):
            reason = f"{root / name} is a link to {real}"
    if reason:
        raise UnsafePath(f"{where} names {name!r}, which is outside the dataset folder {root} ({reason}); "
                         "refused: a dataset's files must lie inside it (a dataset or shard from elsewhere is "
                         "not trusted)")
    return root / name


def _data_files(path: Path, info: dict) -> list[tuple[int | None, Path]]:
    """(unit, arrow file) of an output, in order; unit None for outputs written by save_to_disk. Each file
    checked to lie inside ``path`` (UnsafePath)."""
    if "parts" in info:
        return [(p["unit"], inside(path, p["file"], path / METADATA_FILE)) for p in info["parts"]]
    return [(None, f) for f in _state_files(path)]


def _state_files(path: Path) -> list[Path]:
    """The data files state.json lists (what ``datasets.load_from_disk`` reads), each checked to lie inside
    ``path``."""
    state_file = path / "state.json"
    try:
        names = [f["filename"] for f in json.loads(state_file.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedData(f"{state_file}: not the state.json of a saved dataset ({type(e).__name__}: {e})") from e
    return [inside(path, name, state_file) for name in names]


def _shard_of(info: dict) -> tuple[int, int] | None:
    """(i, n) of a ``--shard i/n`` output (tokenizer.json's ``shard``, "i/n"); None for a whole output."""
    shard = info.get("shard")
    if not shard:
        return None
    i, n = (int(x) for x in (shard.split("/") if isinstance(shard, str) else shard))
    return (i, n) if n > 1 else None


def check_no_duplicates(paths: Sequence[Path], infos: Sequence[dict], files: Sequence[tuple[int | None, Path]],
                        owners: Sequence[Path]) -> None:
    """Raise DuplicateRows when two of the folders hold the same rows: one folder given twice (by any
    path), the same data file twice (a merge hard-links its shards' files), or the same work unit of one
    tokenization (a merged output and one of its shards, or a copy of a shard)."""
    seen: dict[Path, Path] = {}
    for p in paths:
        real = p.resolve()
        if real in seen:
            also = "" if seen[real] == p else f" (as {seen[real]} and {p}, the same folder)"
            raise DuplicateRows(f"{seen[real]} is given twice{also}; its rows would be loaded twice")
        seen[real] = p
    by_key: dict[tuple, tuple[Path, int | None]] = {}
    job = {p: i.get("job_sha256") for p, i in zip(paths, infos)}
    for (unit, f), owner in zip(files, owners):
        st = f.stat()
        keys = [("file", st.st_dev, st.st_ino)]
        if unit is not None and job[owner]:
            keys.append(("unit", job[owner], unit))
        for key in keys:
            first = by_key.setdefault(key, (owner, unit))
            if first[0] != owner:
                what = f"work unit {unit} of tokenization {job[owner][:12]}" if key[0] == "unit" else f"data file {f.name}"
                raise DuplicateRows(f"{first[0]} and {owner} hold the same rows ({what}): a merged output and one "
                                    "of its shards, or one output twice; load each shard once, or the merged "
                                    "output alone")


def check_complete_shards(paths: Sequence[Path], infos: Sequence[dict]) -> None:
    """Raise IncompleteShards unless, for every ``--shard i/n`` tokenization among the folders, all n
    shards are there (a merged output counts as all of them)."""
    groups: dict[str | None, tuple[int, set[int], list[Path]]] = {}
    for p, info in zip(paths, infos):
        shard = _shard_of(info)
        if shard is None:
            continue
        n, have, where = groups.setdefault(info.get("job_sha256"), (shard[1], set(), []))
        have.add(shard[0])
        where.append(p)
    merged = {i.get("job_sha256") for i in infos if _shard_of(i) is None}
    for job, (n, have, where) in groups.items():
        missing = sorted(set(range(n)) - have)
        if missing and job not in merged:
            raise IncompleteShards(
                f"{', '.join(map(str, where))}: shard(s) {', '.join(f'{i}/{n}' for i in sorted(have))} of a "
                f"tokenization in {n} shards, without {', '.join(f'{i}/{n}' for i in missing)}: "
                f"{len(missing)} of {n} parts of the data would be left out. Load all {n} shard folders "
                "together (or their merge, `musiclm-stab tokenize --merge OUT SHARD...`), or pass "
                "partial_shards=True to load_tokenized to use a part on purpose")


# -- integrity of the part files --------------------------------------------------------------------------

CHECK_VERSION = 2  # bump when the checks change: parts checked before are checked again (2: the audio's range)

# The largest |pcm| a tokenizer writes, with room: float audio is kept unscaled up to audio.MAX_PEAK (2.0), and
# resampling it to 24 kHz can overshoot by the sum of the filter's |taps| (at most 1.87 at common rates:
# tests/test_data_integrity.py). A part holding more, or a value that is not finite, is damaged or forged.
PCM_LIMIT = 4.0
_VERIFIED: set[str] = set()  # keys (``_part_key``) of the part files this process has checked
_WARNED_CACHE: set[str] = set()  # cache folders this process could not write (warned once each)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def part_digest(path: str | Path) -> dict[str, Any]:
    """What tokenizer.json and a unit record give of a part file: {"bytes": size, "sha256": hex}."""
    return {"bytes": os.stat(path).st_size, "sha256": file_sha256(path)}


def dataset_fingerprint(job_sha256: str | None, parts: Sequence[dict]) -> str:
    """state.json's ``_fingerprint`` (the datasets library's cache key) of a tokenizer output: its job and
    its parts (names, rows, sizes and hashes), so that other bytes give another fingerprint."""
    return hashlib.sha256(json.dumps([job_sha256, list(parts)]).encode()).hexdigest()[:16]


def verified_cache_dir() -> Path:
    """Where the part files checked are remembered: ``$XDG_CACHE_HOME/musiclm_stab/verified`` (default
    ``~/.cache``). One small JSON file per dataset folder; deleting it only costs hashing again."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "musiclm_stab" / "verified"


def _part_key(file: Path, st: os.stat_result, expect: dict, limits: tuple[int, int | None]) -> str:
    """The identity of one check of one version of a part file: any change of its bytes changes its ctime
    (which no user can set back), its size or its inode, so a key seen before means this very file passed."""
    ident = [CHECK_VERSION, str(file.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
             st.st_dev, expect.get("sha256"), expect.get("rows"), *limits]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32]


def _cache_file(root: Path) -> Path:
    return verified_cache_dir() / f"{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]}.json"


def _remembered(root: Path) -> dict[str, str]:
    """Part file (relative to ``root``) -> key of its last passed check, as remembered in the user cache."""
    try:
        data = json.loads(_cache_file(root).read_text())
        return data["parts"] if data.get("dataset") == str(root.resolve()) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or unreadable: check again
        return {}


def _remember(root: Path, passed: dict[str, str]) -> None:
    """Add ``passed`` (part file -> key) to the user cache of ``root``; a cache that cannot be written costs
    a warning (once per folder and process) and hashing again at the next load, nothing else."""
    cache = _cache_file(root)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"dataset": str(root.resolve()), "parts": {**_remembered(root), **passed}}))
        os.replace(tmp, cache)  # whole or absent: loads running at the same time read one or the other
    except OSError as e:
        if str(cache.parent) not in _WARNED_CACHE:
            _WARNED_CACHE.add(str(cache.parent))
            warnings.warn(f"could not remember the checked parts of {root} in {cache.parent} ({e}); the data is "
                          "fine, but its parts are hashed again at the next load", stacklevel=4)


def _codes_problem(file: Path, rows: int | None, limits: tuple[int, int | None], where: str) -> str | None:
    """Why ``file`` does not hold valid rows: unreadable arrow data, missing columns, codes out of
    [0, codebook_size), a row whose codes have another number of codebooks or frames than ``num_frames``,
    audio that is not finite or beyond PCM_LIMIT, another number of rows than recorded. None when it holds
    valid rows. Reads the ``codes``, ``num_frames`` and ``pcm`` columns (memory-mapped)."""
    size, levels = limits
    try:
        with pa.memory_map(str(file)) as source:
            buffer = source.read_buffer()
            try:  # the tokenizer and save_to_disk write the stream format; the file format is read as well
                batches = list(pa.ipc.open_stream(buffer))
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(buffer)
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            first = 0
            for batch in batches:
                problem = _batch_codes_problem(batch, first, size, levels)
                if problem:
                    return problem
                first += batch.num_rows
    except (OSError, ValueError) as e:  # pa.ArrowInvalid is a ValueError
        return "not readable arrow data (" + " ".join(str(e).split()) + ")"
    if rows is not None and first != rows:
        return f"{first} rows, {where} says {rows}"
    return None


def _batch_codes_problem(batch: pa.RecordBatch, first: int, size: int, levels: int | None) -> str | None:
    missing = [c for c in ("codes", "num_frames") if c not in batch.schema.names]
    if missing:
        return f"no column {', '.join(missing)}"
    codes, frames = batch.column("codes"), batch.column("num_frames")
    codes.validate(full=True)  # offsets inside their buffers, before anything follows them
    frames.validate(full=True)
    if not pa.types.is_list(codes.type) and not pa.types.is_large_list(codes.type) or \
            not pa.types.is_list(codes.type.value_type) and not pa.types.is_large_list(codes.type.value_type):
        return f"codes of type {codes.type}, not lists of lists of integers"
    inner = codes.flatten()
    values = inner.flatten()
    if codes.null_count or inner.null_count or values.null_count or frames.null_count:
        return "missing codes (nulls)"
    k = pc.list_value_length(codes).to_numpy(zero_copy_only=False)
    if levels and len(k) and (k != levels).any():
        i = int(np.flatnonzero(k != levels)[0])
        return f"its row {first + i} has codes of {k[i]} codebooks, not {levels}"
    t = pc.list_value_length(inner).to_numpy(zero_copy_only=False)
    want = np.repeat(frames.to_numpy(zero_copy_only=False), k)
    if (t != want).any():
        j = int(np.flatnonzero(t != want)[0])
        row = int(pc.list_parent_indices(codes)[j].as_py())
        return f"its row {first + row} has codes of {t[j]} frames, its num_frames says {want[j]}"
    if len(values):
        low, high = (x.as_py() for x in pc.min_max(values).values())
        if low < 0 or high >= size:
            v = values.to_numpy(zero_copy_only=False)
            bad = int(np.flatnonzero((v < 0) | (v >= size))[0])
            row = int(pc.list_parent_indices(codes)[pc.list_parent_indices(inner)[bad].as_py()].as_py())
            return f"code {int(v[bad])} in its row {first + row}: codes must be in [0, {size})"
    return _pcm_problem(batch, first)


def _pcm_problem(batch: pa.RecordBatch, first: int) -> str | None:
    """Why the audio of a batch of rows is not what a tokenizer writes: a value that is not finite, or beyond
    PCM_LIMIT (what training would read as audio: a part with forged hashes trained on 2.4e24). None if fine."""
    if "pcm" not in batch.schema.names:
        return None
    pcm = batch.column("pcm")
    pcm.validate(full=True)
    if not pa.types.is_list(pcm.type) and not pa.types.is_large_list(pcm.type):
        return f"pcm of type {pcm.type}, not lists of numbers"
    values = pcm.flatten()
    if pcm.null_count or values.null_count:
        return "missing audio samples (nulls)"
    v = values.to_numpy(zero_copy_only=False)
    inside = (v >= -PCM_LIMIT) & (v <= PCM_LIMIT)  # False for NaN too
    if inside.all():
        return None
    bad = int(np.flatnonzero(~inside)[0])
    row = int(pc.list_parent_indices(pcm)[bad].as_py())
    return (f"audio sample {float(v[bad]):g} in its row {first + row}: audio must be finite and within "
            f"[-{PCM_LIMIT:g}, {PCM_LIMIT:g}] (what a tokenizer writes)")


def redo_advice(root: Path, info: dict) -> str:
    """How to get a damaged part of the dataset at ``root`` back."""
    if not (root / STATE_DIR / "job.json").is_file():
        return (f"{root} has no resume state ({STATE_DIR}/) to redo one work unit: copy the dataset again from "
                "where it came from, or tokenize its source again into a new folder")
    again = f", then `musiclm-stab codes restore {root} {info[RESTORED_KEY]['file']}` again" \
        if info.get(RESTORED_KEY) else ""
    return (f"redo it: rerun the `musiclm-stab tokenize` command that made {root} (same source and settings; "
            f"it redoes the damaged work unit only){again}, or copy the dataset again from where it came from")


def check_parts(root: Path, parts: Sequence[tuple[Path, dict]], info: dict, where: str = METADATA_FILE) -> None:
    """Raise DamagedData, naming the file, the reason and how to redo it, for the first of ``parts`` that is
    not what the tokenizer wrote (``damaged_parts``)."""
    for file, reason in damaged_parts(root, parts, info, where)[:1]:
        raise DamagedData(f"{file}: damaged part of the tokenized dataset {root}: {reason}; {redo_advice(root, info)}")


def damaged_parts(root: Path, parts: Sequence[tuple[Path, dict]], info: dict, where: str = METADATA_FILE
                  ) -> list[tuple[Path, str]]:
    """(file, reason) of each of ``parts`` that is not what the tokenizer wrote. ``parts``: (file, what
    ``where`` records of it: ``bytes``, ``sha256``, ``rows``, each where known; ``bytes`` and ``sha256`` may
    be lists of acceptable values). ``info``: tokenizer.json's, for ``codebook_size`` and ``num_codebooks``.

    Sizes are compared at every call (a stat); the sha256, the arrow structure and the codes (in
    [0, codebook_size), the recorded shape) once per version of the file: a file that passed before,
    unchanged since (``_part_key``), is not read again. Several files are hashed at once (threads: hashing
    releases the GIL)."""
    limits = (int(info.get("codebook_size") or CODEBOOK_SIZE), info.get("num_codebooks"))

    def accepts(recorded: Any, value: Any) -> bool:
        options = recorded if isinstance(recorded, list) else [recorded]
        return None in options or value in options

    remembered, todo, found = None, [], {}
    for i, (file, expect) in enumerate(parts):
        try:
            st = file.stat()
        except FileNotFoundError:
            found[i] = "it is missing"
            continue
        except OSError as e:
            found[i] = f"it cannot be read ({e.strerror or e})"
            continue
        if not accepts(expect.get("bytes"), st.st_size):
            found[i] = f"{st.st_size} bytes, {where} says {_shown(expect['bytes'])}"
            continue
        key = _part_key(file, st, expect, limits)
        if key in _VERIFIED:
            continue
        if remembered is None:
            remembered = _remembered(root)
        name = os.path.relpath(file, root)
        if remembered.get(name) == key:
            _VERIFIED.add(key)
        else:
            todo.append((i, file, expect, name, key))

    def problem(item: tuple[int, Path, dict, str, str]) -> str | None:
        _, file, expect, _, _ = item
        if expect.get("sha256") is not None:
            got = file_sha256(file)
            if not accepts(expect["sha256"], got):
                return f"sha256 {got}, {where} says {_shown(expect['sha256'])}"
        return _codes_problem(file, expect.get("rows"), limits, where)

    reasons = []
    if todo:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(todo))) as pool:
            reasons = list(pool.map(problem, todo))
    passed = {}
    for (i, _, _, name, key), reason in zip(todo, reasons):
        if reason:
            found[i] = reason
        else:
            _VERIFIED.add(key)
            passed[name] = key
    if passed:
        _remember(root, passed)
    return [(parts[i][0], found[i]) for i in sorted(found)]


def _shown(recorded: Any) -> str:
    return " or ".join(map(str, recorded)) if isinstance(recorded, list) else str(recorded)


def _check_dataset(path: Path, info: dict, files: Sequence[tuple[int | None, Path]]) -> None:
    """The checks of one dataset folder at load: no restore under way, its parts as recorded (``check_parts``);
    an UncheckedData warning when tokenizer.json records no hashes (an older version wrote it)."""
    restoring = info.get(RESTORING_KEY)
    if restoring:
        raise DamagedData(f"{path}: a `musiclm-stab codes restore` of {restoring.get('file')} stopped half-way; run "
                          f"`musiclm-stab codes restore {path} {restoring.get('file')}` again to finish it")
    entries = info.get("parts") or [{} for _ in files]
    if any(e.get("sha256") is None for e in entries):
        warnings.warn(f"{path}: {METADATA_FILE} records no sha256 of its part files (written before parts carried "
                      "hashes): only their arrow structure and codes are checked, not their audio; tokenize it "
                      "again to have every byte checked", UncheckedData, stacklevel=3)
    check_parts(path, [(f, e) for (_, f), e in zip(files, entries)], info)


def load_tokenized(path: str | Path | Sequence[str | Path], streaming: bool = False, partial_shards: bool = False,
                   check: bool = True):
    """A tokenized dataset and its tokenizer info (the contents of tokenizer.json).

    ``path`` is one output folder, or several (e.g. the shards of a ``--shard i/n`` run, which come back
    in the order a single run would have written them; other folders are concatenated in the order
    given, after checking they share a tokenizer). Returns an indexable, memory-mapped
    ``datasets.Dataset``, or with ``streaming=True`` a ``datasets.IterableDataset`` over the same rows.
    Folders tokenized on different device types (or a merge of such) load with a DeviceMixWarning.

    Folders that would repeat rows (one given twice, a merged output with one of its shards) are refused
    (DuplicateRows), as is a shard without the other shards of its tokenization (IncompleteShards):
    silently training on part of the data, or on some of it twice, changes the experiment. A part on
    purpose: ``partial_shards=True``.

    File names in tokenizer.json and state.json that lead outside their folder are refused (UnsafePath),
    and so is a part file that is not what the tokenizer wrote (DamagedData: missing, other size or sha256,
    codes out of range; ``check_parts``), naming it and how to redo it. ``check=False``: the caller checks
    the parts itself (a codes restore under way).
    """
    paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    if not paths:
        raise ValueError("load_tokenized: no paths given")
    infos = [read_info(p) for p in paths]
    for p, info in zip(paths[1:], infos[1:]):
        check_same_tokenizer(infos[0], info, str(paths[0]), str(p))
    devices = {str(p): device_of(p, i) for p, i in zip(paths, infos)}
    warn_mixed_devices(devices, "Loading")
    files: list[tuple[int | None, Path]] = []
    owners: list[Path] = []
    for p, info in zip(paths, infos):
        own = _data_files(p, info)
        if not streaming and len(paths) == 1 and own:  # load_from_disk reads state.json's list
            state = _state_files(p)
            if state != [f for _, f in own]:
                raise DamagedData(f"{p / 'state.json'} lists other data files than {p / METADATA_FILE} "
                                  f"({', '.join(map(str, state))} against {', '.join(str(f) for _, f in own)}); "
                                  f"{redo_advice(p, info)}")
        if check:
            _check_dataset(p, info, own)
        files += own
        owners += [p] * (len(files) - len(owners))
    check_no_duplicates(paths, infos, files, owners)
    shards = [tuple(i.get("shard") or (0, 1)) for i in infos]
    if len(paths) > 1 and len({i.get("job_sha256") for i in infos}) == 1 and len(set(shards)) == len(shards) \
            and None not in {u for u, _ in files}:  # shards of one job: restore the single-run order
        files.sort(key=lambda f: f[0])
    if not files:
        raise ValueError(f"{', '.join(str(p) for p in paths)}: no rows (an empty shard); load it with the other shards")
    if not partial_shards:
        check_complete_shards(paths, infos)
    if streaming:
        ds = datasets.load_dataset("arrow", data_files=[str(f) for _, f in files], split="train", streaming=True)
        ds = ds.cast(FEATURES)
    elif len(paths) == 1:
        ds = datasets.load_from_disk(str(paths[0]))
    else:
        ds = datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for _, f in files])
    missing = set(FEATURES) - set(ds.column_names if not streaming else ds.features)
    if missing:
        raise ValueError(f"{paths[0]} is not a tokenized dataset: columns {sorted(missing)} are missing")
    info = infos[0]
    if len(paths) > 1:
        info = {**info, "shard": None, "sources": [str(p) for p in paths]}
        info["codebook_usage"] = None  # per folder in each folder's tokenizer.json; not combined
        for key in ("num_rows", "num_tracks", "num_failures", "num_silent_segments", "num_warnings"):
            info[key] = sum(i.get(key, 0) for i in infos)
        known = {d for d in devices.values() if d}
        info["device"] = known.pop() if len(known) == 1 else "mixed" if known else None
        info["total_seconds"] = round(sum(i["total_seconds"] for i in infos), 6)
    return ds, info


def codes_sha256(path: str | Path | Sequence[str | Path]) -> str:
    """sha256 of a tokenized dataset's codes: each row's track, the shape of its codes and the codes
    (little-endian int16), in the dataset's order. Equal for two tokenizations exactly when they give every
    row the same codes (the shape delimits the rows), whatever the audio column or the folder layout; a
    study carried between machines checks it (experiments/study.py)."""
    hf, _ = load_tokenized(path)
    rows = hf.select_columns(["track", "codes"]).with_format("numpy")
    return sha256_of_codes(pair for i in range(0, len(rows), 256)
                           for pair in zip(rows[i : i + 256]["track"], rows[i : i + 256]["codes"]))


def sha256_of_codes(rows: Iterable[tuple[str, Any]]) -> str:
    """``codes_sha256`` of rows given as (track, codes [K, T]) in the dataset's order."""
    digest = hashlib.sha256()
    for track, codes in rows:
        codes = np.asarray(codes, dtype="<i2")
        digest.update(f"{track}\0{'x'.join(map(str, codes.shape))}\0".encode())
        digest.update(codes.tobytes())
    return digest.hexdigest()


def check_same_tokenizer(info_a: dict[str, Any], info_b: dict[str, Any], what_a: str = "A",
                         what_b: str = "B") -> None:
    """Raise TokenizerMismatch unless both sides used the same EnCodec weights and settings."""
    diffs = [k for k in IDENTITY_KEYS if info_a.get(k) != info_b.get(k)]
    if not diffs:
        return
    lines = [f"  {k}: {info_a.get(k)!r} ({what_a}) != {info_b.get(k)!r} ({what_b})" for k in diffs]
    sources = (f"  weights: {info_a.get('weights')} {info_a.get('weights_file') or ''} ({what_a}) vs "
               f"{info_b.get('weights')} {info_b.get('weights_file') or ''} ({what_b})")
    raise TokenizerMismatch(
        f"{what_a} and {what_b} were tokenized with different EnCodec tokenizers, so their codes mean "
        "different things and cannot be mixed:\n" + "\n".join(lines) + "\n" + sources +
        "\nRe-tokenize one of them with the other's weights (musiclm-stab tokenize ... --weights FILE)."
    )
