"""Reading a tokenized dataset: the one door from the training side to the tokenizer's output.

Training, evaluation, feature extraction and probes read tokenized data through this module only (never
musiclm_stab.tokenizer, which loads EnCodec); the tokenizer takes the format's constants from here. This
module loads a dataset (``load_tokenized``) and hashes its codes (``codes_sha256``); it hands on the names of
the parts it is made of, so that a caller imports everything from here:

    tokenized_format.py  the files and columns of the format, its errors, reading tokenizer.json (``read_info``)
                         and the file names in it (``inside``)
    part_checks.py       each part file is what the tokenizer wrote (``check_parts``), checked once per version
    mixing.py            folders used together: same tokenizer, device types, no repeated rows, all shards

Checks at load (``load_tokenized``): every file name read from tokenizer.json or state.json must stay inside
the dataset's folder (``inside``), and every part file must be what the tokenizer wrote (``check_parts``).
Datasets written before parts carried hashes load with an ``UncheckedData`` warning: only their arrow
structure, codes and audio are checked.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from musiclm_stab.data.mixing import (
    IDENTITY_KEYS,
    DeviceMixWarning,
    DuplicateRows,
    IncompleteShards,
    TokenizerMismatch,
    check_complete_shards,
    check_no_duplicates,
    check_same_tokenizer,
    device_of,
    warn_mixed_devices,
)
from musiclm_stab.data.part_checks import (
    CHECK_VERSION,
    PCM_LIMIT,
    check_parts,
    damaged_parts,
    dataset_fingerprint,
    file_sha256,
    part_digest,
    redo_advice,
    verified_cache_dir,
)
from musiclm_stab.data.tokenized_format import (
    FAILURES_FILE,
    FEATURES,
    METADATA_FILE,
    PARTS_DIR,
    RESTORED_KEY,
    RESTORING_KEY,
    STATE_DIR,
    WARNINGS_FILE,
    DamagedData,
    UncheckedData,
    UnsafePath,
    _data_files,
    _state_files,
    codebook_usage,
    inside,
    job_units,
    read_info,
    unit_groups,
)

__all__ = ["CHECK_VERSION", "FAILURES_FILE", "FEATURES", "IDENTITY_KEYS", "METADATA_FILE", "PARTS_DIR", "PCM_LIMIT",
           "RESTORED_KEY", "RESTORING_KEY", "STATE_DIR", "WARNINGS_FILE", "DamagedData", "DeviceMixWarning",
           "DuplicateRows", "IncompleteShards", "TokenizerMismatch", "UncheckedData", "UnsafePath",
           "check_complete_shards", "check_no_duplicates", "check_parts", "check_same_tokenizer", "codebook_usage",
           "codes_sha256", "damaged_parts", "dataset_fingerprint", "device_of", "file_sha256", "inside", "job_units",
           "load_tokenized", "part_digest", "read_info", "redo_advice", "sha256_of_codes", "unit_groups",
           "verified_cache_dir", "warn_mixed_devices"]


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
