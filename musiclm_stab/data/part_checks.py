"""Checking the part files of a tokenized dataset: each is what its tokenizer wrote, or DamagedData names it.

A part file must be what the tokenizer recorded (``check_parts``, ``damaged_parts``): the size tokenizer.json
records, on every load; its sha256, codes in [0, codebook_size) with the recorded shape, and finite audio
within ``PCM_LIMIT``, once per version of the file (its size, mtime, ctime and inode), remembered in this
process and under the user's cache folder (``verified_cache_dir``), never in the dataset (which may be
read-only). The tokenizer records a part with ``part_digest`` and ``dataset_fingerprint`` from here, so the
writer and the checks agree on what a part is.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from musiclm_stab.constants import CODEBOOK_SIZE
from musiclm_stab.data.tokenized_format import METADATA_FILE, RESTORED_KEY, STATE_DIR, DamagedData

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
