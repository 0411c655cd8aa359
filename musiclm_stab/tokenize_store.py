"""The tokenizer's output folder: committed work units, resume state, the final HF dataset, merging.

    OUT/
      tokenizer.json                  the tokenizer and the dataset's counts; written last, so its presence
                                      means the output is complete
      failures.jsonl                  one row per input not tokenized: track, path, kind, reason
      state.json, dataset_info.json   an HF dataset (``datasets.load_from_disk(OUT)`` works) whose data
      parts/u000000.arrow ...         files are the committed units' rows, in unit order (no copy at the end)
      .tokenize/job.json              what this output is: weights, settings, source, plan, shard
      .tokenize/units/u000000.json    a unit's commit record (rows, failures), written after its part file

A unit's part file is written under a temporary name and renamed; its record is written the same way
afterwards, and only a record makes a unit done. A run killed at any moment leaves whole units and
at most some debris (temporary files, a part without a record), which the next run overwrites or
deletes. Unit contents depend only on the unit's tracks and the settings, so a resumed run writes the
same rows as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import datasets

from musiclm_stab import __version__
from musiclm_stab.tokenize_sources import TokenizeError

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
STATE_DIR = ".tokenize"
PARTS_DIR = "parts"
STATE_VERSION = 2  # bump when a change alters the rows made from the same input and settings
# Fields that must agree for two tokenized datasets (or a dataset and a model) to be mixed.
IDENTITY_KEYS = ("weights_sha256", "model", "bandwidth", "sample_rate", "frame_rate", "hop_length",
                 "num_codebooks", "codebook_size")
_COMPARED = ("format", "tokenizer", "settings", "encode", "source", "plan", "shard")  # job.json keys a rerun must match


class TokenizerMismatch(ValueError):
    """Two datasets (or a dataset and a model) were tokenized with different EnCodec weights/settings."""


class OutputMismatch(ValueError):
    """An existing output was started with other weights, settings, source or shard than this run."""


def atomic_write(path: Path, text: str) -> None:
    """Write a file so that it is either absent, the old version, or complete: never half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def job_differences(old: dict, new: dict) -> list[str]:
    """Human-readable differences between two jobs, over the keys a rerun must match."""
    a = _flatten({k: old.get(k) for k in _COMPARED})
    b = _flatten({k: new.get(k) for k in _COMPARED})
    lines = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            va, vb = a.get(key), b.get(key)
            if isinstance(va, list) and len(str(va)) > 60:  # the unit plan: say how it differs, briefly
                va, vb = f"{len(va)} units", f"{len(vb) if isinstance(vb, list) else vb} units"
            lines.append(f"  {key}: {va!r} (existing output) != {vb!r} (this run)")
    return lines


def job_sha256(job: dict) -> str:
    """Identity of a job regardless of shard: shards of one job share it."""
    keyed = {k: job.get(k) for k in _COMPARED if k != "shard"}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()


def job_units(job: dict) -> list[int] | None:
    """The unit indices this job (this shard) must complete; None while a stream's length is unknown."""
    i, n = job["shard"]
    if "units" in job["plan"]:
        total = len(job["plan"]["units"])
    elif job.get("stream_end"):
        total = job["stream_end"]["num_units"]
    else:
        return None
    return [k for k in range(total) if k % n == i]


def _is_tokenizer_output(path: Path) -> bool:
    """A folder this tokenizer wrote: resume state, or a tokenizer.json naming its weights. (A plain HF
    dataset saved with save_to_disk is not one, so --overwrite never deletes it.)"""
    if (path / STATE_DIR).is_dir():
        return True
    try:
        return "weights_sha256" in json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


class OutputDir:
    """The state of one tokenizer output folder."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.state = self.out / STATE_DIR
        self.units_dir = self.state / "units"
        self.parts_dir = self.out / PARTS_DIR

    # -- opening ------------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, out: str | Path, job: dict, overwrite: bool) -> OutputDir:
        """Open ``out`` for ``job``: a new folder, or one this very job started (resume) or finished.

        Refuses (OutputMismatch) an output started with other settings, weights, source or shard, and
        (FileExistsError) a non-empty folder that is not a tokenizer output; ``overwrite`` replaces a
        tokenizer output of any kind, never anything else.
        """
        d = cls(out)
        if d.state.is_dir() and not (d.state / "job.json").is_file() and not any(d.units_dir.glob("*")) \
                and not (d.out / METADATA_FILE).exists():
            shutil.rmtree(d.state)  # a run killed before it wrote its job: nothing was done, start afresh
        if d.out.exists() and (not d.out.is_dir() or any(d.out.iterdir())):
            if not d.out.is_dir() or not _is_tokenizer_output(d.out):
                raise FileExistsError(f"refusing to use {d.out}: it exists and does not look like a tokenized "
                                      f"dataset (no {METADATA_FILE}); delete it yourself or choose another output")
            if overwrite:
                shutil.rmtree(d.out)
            elif not (d.state / "job.json").is_file():
                raise FileExistsError(f"{d.out} holds a tokenized dataset made without resume state (an older "
                                      "version); pass --overwrite (overwrite=True) to replace it")
            else:
                old = d.job()
                if "units" in job["plan"] and old["plan"].get("names_sha256") == job["plan"].get("names_sha256"):
                    # same tracks: the first run's units stay in force even if file sizes changed since
                    job = {**job, "plan": {**job["plan"], "units": old["plan"].get("units")}}
                diffs = job_differences(old, job)
                if diffs:
                    what = "finished" if d.is_complete() else "unfinished"
                    raise OutputMismatch(
                        f"{d.out} holds {'a' if what == 'finished' else 'an'} {what} tokenization made with other settings, so the two cannot be "
                        "mixed:\n" + "\n".join(diffs) + "\nRerun with the original settings to "
                        f"{'reuse' if what == 'finished' else 'finish'} it, choose another output folder, or "
                        "pass --overwrite (overwrite=True) to start over.")
                return d
        d.units_dir.mkdir(parents=True, exist_ok=True)
        d.parts_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(d.state / "job.json", json.dumps(job, indent=1) + "\n")
        return d

    def job(self) -> dict:
        return json.loads((self.state / "job.json").read_text())

    def update_job(self, **fields: Any) -> None:
        atomic_write(self.state / "job.json", json.dumps({**self.job(), **fields}, indent=1) + "\n")

    def is_complete(self) -> bool:
        return (self.out / METADATA_FILE).is_file()

    # -- units --------------------------------------------------------------------------------------

    def part_file(self, k: int) -> Path:
        return self.parts_dir / f"u{k:06d}.arrow"

    def temp_part_file(self, k: int) -> Path:
        return self.parts_dir / f".u{k:06d}.{os.getpid()}.tmp"

    def record(self, k: int) -> dict | None:
        path = self.units_dir / f"u{k:06d}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def done_units(self) -> set[int]:
        return {int(p.stem[1:]) for p in self.units_dir.glob("u*.json")}

    def commit(self, record: dict) -> None:
        """Mark a unit done; its part file (if it has rows) must already be in place."""
        if record["file"]:
            assert (self.out / record["file"]).is_file(), record
        atomic_write(self.units_dir / f"u{record['unit']:06d}.json", json.dumps(record) + "\n")

    def reopen_failed(self) -> int:
        """Forget the units that recorded failures, so they run again; returns how many.

        The completion marker goes first: from then on the output reads as unfinished until finalized.
        """
        failed = [k for k in sorted(self.done_units()) if self.record(k)["failures"]]
        if failed:
            (self.out / METADATA_FILE).unlink(missing_ok=True)
            for k in failed:
                (self.units_dir / f"u{k:06d}.json").unlink()
        return len(failed)

    # -- finishing ----------------------------------------------------------------------------------

    def summary_counts(self, units: Sequence[int]) -> dict[str, Any]:
        records = [self.record(k) for k in units]
        missing = [k for k, r in zip(units, records) if r is None]
        if missing:
            raise RuntimeError(f"{self.out}: units {missing[:5]} are not done")
        failures = [f for r in records for f in r["failures"]]
        return {
            "records": records,
            "failures": failures,
            "num_rows": sum(r["num_rows"] for r in records),
            "num_tracks": sum(r["num_tracks"] for r in records),
            "total_samples": sum(r["num_samples"] for r in records),
            "num_silent_segments": sum(r["silent_segments"] for r in records),
            "failures_by_kind": dict(sorted(Counter(f["kind"] for f in failures).items())),
        }

    def finalize(self, units: Sequence[int], meta: dict[str, Any]) -> dict[str, Any]:
        """Turn the committed units into the HF dataset + tokenizer.json + failures.jsonl; returns the
        metadata written. Raises TokenizeError when no unit has rows (failures.jsonl is still written)."""
        from musiclm_stab import SAMPLE_RATE

        c = self.summary_counts(units)
        parts = [{"unit": r["unit"], "file": r["file"], "rows": r["num_rows"]} for r in c["records"] if r["file"]]
        atomic_write(self.out / FAILURES_FILE, "".join(json.dumps(f) + "\n" for f in c["failures"]))
        if not parts and not meta.get("shard"):
            shown = "; ".join(f"{f['path']}: {f['reason']}" for f in c["failures"][:3])
            raise TokenizeError(f"every one of the {len(c['failures'])} inputs failed ({shown}); "
                                f"all reasons in {self.out / FAILURES_FILE}")
        if parts:  # a shard may finish with no rows (fewer units than shards, or all its inputs failed)
            datasets.DatasetInfo(features=FEATURES).write_to_directory(str(self.out))
            fingerprint = hashlib.sha256(json.dumps([meta.get("job_sha256"), parts]).encode()).hexdigest()[:16]
            state = {"_data_files": [{"filename": p["file"]} for p in parts], "_fingerprint": fingerprint,
                     "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                     "_output_all_columns": False, "_split": None}
            atomic_write(self.out / "state.json", json.dumps(state, indent=2) + "\n")
        keep = {Path(p["file"]).name for p in parts}
        for stray in self.parts_dir.iterdir():  # temporary files of killed runs, parts of retried units
            if stray.name not in keep:
                stray.unlink()
        meta = {
            **meta,
            "num_rows": c["num_rows"],
            "num_tracks": c["num_tracks"],
            "total_seconds": round(c["total_samples"] / SAMPLE_RATE, 6),
            "num_failures": len(c["failures"]),
            "failures_by_kind": c["failures_by_kind"],
            "num_silent_segments": c["num_silent_segments"],
            "parts": parts,
            "created_by": f"musiclm-stab tokenize {__version__}",
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        atomic_write(self.out / METADATA_FILE, json.dumps(meta, indent=2) + "\n")  # last: complete
        return meta


# ---------------------------------------------------------------------------------------------------
# Reading outputs


def read_info(path: str | Path) -> dict[str, Any]:
    """tokenizer.json of a finished output, with clear errors for anything else."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenized dataset {path} does not exist; make it with "
                                f"`musiclm-stab tokenize AUDIO_DIR {path}`")
    if not (path / METADATA_FILE).is_file():
        if (path / STATE_DIR / "job.json").is_file():
            d = OutputDir(path)
            units = job_units(d.job())
            done = f"{len(d.done_units())} of {len(units)}" if units is not None else f"{len(d.done_units())}"
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


def load_tokenized(path: str | Path | Sequence[str | Path], streaming: bool = False):
    """A tokenized dataset and its tokenizer info (the contents of tokenizer.json).

    ``path`` is one output folder, or several (e.g. the shards of a ``--shard i/n`` run, which come back
    in the order a single run would have written them; other folders are concatenated in the order
    given, after checking they share a tokenizer). Returns an indexable, memory-mapped
    ``datasets.Dataset``, or with ``streaming=True`` a ``datasets.IterableDataset`` over the same rows.
    """
    paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    if not paths:
        raise ValueError("load_tokenized: no paths given")
    infos = [read_info(p) for p in paths]
    for p, info in zip(paths[1:], infos[1:]):
        check_same_tokenizer(infos[0], info, str(paths[0]), str(p))
    files: list[tuple[int | None, Path]] = []
    for p, info in zip(paths, infos):
        files += _data_files(p, info)
    shards = [tuple(i.get("shard") or (0, 1)) for i in infos]
    if len(paths) > 1 and len({i.get("job_sha256") for i in infos}) == 1 and len(set(shards)) == len(shards) \
            and None not in {u for u, _ in files}:  # shards of one job: restore the single-run order
        files.sort(key=lambda f: f[0])
    if not files:
        raise ValueError(f"{', '.join(str(p) for p in paths)}: no rows (an empty shard); load it with the other shards")
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
        for key in ("num_rows", "num_tracks", "num_failures", "num_silent_segments"):
            info[key] = sum(i.get(key, 0) for i in infos)
        info["total_seconds"] = round(sum(i["total_seconds"] for i in infos), 6)
    return ds, info


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


# ---------------------------------------------------------------------------------------------------
# Merging shards


def merge_shards(out: str | Path, shard_dirs: Sequence[str | Path]) -> dict[str, Any]:
    """Merge the finished outputs of ``--shard 0/n`` ... ``--shard n-1/n`` into one output at ``out``.

    The result is the output a single run would have made (same rows, same order, same resume state):
    part files are hard-linked (copied across file systems), records copied, then finalized.
    Returns its tokenizer.json contents.
    """
    dirs = [OutputDir(p) for p in shard_dirs]
    for d in dirs:
        read_info(d.out)  # finished, or a clear error
        if not (d.state / "job.json").is_file():
            raise ValueError(f"{d.out} has no resume state ({STATE_DIR}/job.json), so it is not a shard output")
    jobs = [d.job() for d in dirs]
    n = jobs[0]["shard"][1]
    for d, job in zip(dirs[1:], jobs[1:]):
        diffs = job_differences({**jobs[0], "shard": None}, {**job, "shard": None})
        if diffs:
            raise OutputMismatch(f"{dirs[0].out} and {d.out} are not shards of one tokenization:\n" + "\n".join(diffs))
    have = sorted(job["shard"][0] for job in jobs)
    if {job["shard"][1] for job in jobs} != {n} or have != list(range(n)):
        raise ValueError(f"merging needs each of the shards 0/{n} .. {n - 1}/{n} once; got "
                         + ", ".join(f"{j['shard'][0]}/{j['shard'][1]}" for j in jobs))
    merged = {**jobs[0], "shard": [0, 1]}
    if any(j.get("stream_end") for j in jobs):
        ends = {json.dumps(j.get("stream_end"), sort_keys=True) for j in jobs}
        if len(ends) != 1:
            raise OutputMismatch("the shards saw streams of different lengths: " + ", ".join(sorted(ends)))
    target = OutputDir.prepare(out, merged, overwrite=False)
    if target.done_units():
        raise FileExistsError(f"{target.out} already holds units; merge into a new folder")
    for d, job in zip(dirs, jobs):
        for k in job_units(job):
            record = d.record(k)
            if record["file"]:
                dst = target.out / record["file"]
                dst.unlink(missing_ok=True)
                try:
                    os.link(d.out / record["file"], dst)
                except OSError:
                    shutil.copyfile(d.out / record["file"], dst)
            target.commit(record)
    meta = {k: v for k, v in read_info(dirs[0].out).items() if k not in ("parts",)}
    meta.update(shard=None, job_sha256=job_sha256(merged), merged_from=[str(d.out) for d in dirs])
    return target.finalize(job_units(merged), meta)
