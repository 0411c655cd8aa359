"""The format of a tokenized dataset: the files the tokenizer writes, the errors a reader raises about them,
and reading tokenizer.json and the file names in it.

    OUT/tokenizer.json     the tokenizer (weights sha256, rates, device) and the dataset's counts and
                           per-codebook usage; written last, so its presence means the output is complete
    OUT/failures.jsonl     one row per input not tokenized: track, path, kind, reason
    OUT/warnings.jsonl     one row per warning about an input that was tokenized: track, path, kind, reason
    OUT/state.json, dataset_info.json, parts/*.arrow   an HF dataset of rows ``FEATURES``
    OUT/.tokenize/         resume state (job.json, one record per committed unit)

The tokenizer writes with these constants and the read side (data/tokenized.py, the door) reads with them, so
both sides name the files the same way. Every file name read from tokenizer.json or state.json must stay
inside the dataset's folder (``inside``): datasets and shards come from other machines, so they are untrusted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
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
