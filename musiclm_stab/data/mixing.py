"""Tokenized folders used together: what they must share, and what they must not repeat or leave out.

Two datasets (or a dataset and a model) mix only when tokenized with the same EnCodec weights and settings
(``check_same_tokenizer``: TokenizerMismatch otherwise); data tokenized on different device types is used
with a DeviceMixWarning (the codes are not bit-identical). Folders loaded together must not hold the same rows
(``check_no_duplicates``), and the shards of a ``--shard i/n`` tokenization come all together or not at all
(``check_complete_shards``), so that training never silently uses part of the data, or some of it twice.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from musiclm_stab.data.tokenized_format import STATE_DIR

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
