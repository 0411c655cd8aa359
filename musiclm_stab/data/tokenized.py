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
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np

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


def _data_files(path: Path, info: dict) -> list[tuple[int | None, Path]]:
    """(unit, arrow file) of an output, in order; unit None for outputs written by save_to_disk."""
    if "parts" in info:
        return [(p["unit"], path / p["file"]) for p in info["parts"]]
    state = json.loads((path / "state.json").read_text())
    return [(None, path / f["filename"]) for f in state["_data_files"]]


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


def load_tokenized(path: str | Path | Sequence[str | Path], streaming: bool = False, partial_shards: bool = False):
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
        files += _data_files(p, info)
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
