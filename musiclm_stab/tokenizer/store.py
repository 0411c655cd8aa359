"""The tokenizer's output folder as it is written: committed work units, resume state, finalizing.

    OUT/
      tokenizer.json                  the tokenizer and the dataset's counts; written last, so its presence
                                      means the output is complete
      failures.jsonl                  one row per input not tokenized: track, path, kind, reason
      warnings.jsonl                  one row per warning about an input that was tokenized: track, path,
                                      kind, reason (audio.WARNING_KINDS: odd but usable audio)
      .tokenize.lock                  held (a POSIX record lock, fcntl.lockf: lock.py) by the process writing
                                      the folder: one writer at a time
      .musiclm-stab-output            the marker (removal.py): this folder is a tokenized dataset, which
                                      ``--overwrite`` may clear; written before anything else
      state.json, dataset_info.json   an HF dataset (``datasets.load_from_disk(OUT)`` works) whose data
      parts/u000000.arrow ...         files are the committed units' rows, in unit order (no copy at the end)
      .tokenize/job.json              what this output is: weights, settings, source, plan, shard
      .tokenize/units/u000000.json    a unit's commit record (rows, failures, the part's size and sha256),
                                      written after its part file

A unit's part file is written under a temporary name and renamed; its record is written the same way
afterwards, and only a record makes a unit done. A run killed at any moment leaves whole units and
at most some debris (temporary files, a part without a record), which the next run overwrites or
deletes (removal.py: only inside a folder that carries the marker, or that an earlier version left with
its resume state). Unit contents depend only on the unit's tracks and the settings, so a resumed run writes the
same rows as an uninterrupted one.
A part's size and sha256 are taken when its unit is committed and go into tokenizer.json's ``parts``,
which the read side checks (data/tokenized.py ``check_parts``); a rerun first forgets the units whose
part no longer matches (``reopen_damaged``), so it redoes them.
The format and how to read it are in musiclm_stab/data/tokenized.py (the read side: training
imports that, never this package); the lock in lock.py, merging shards in merge.py.

A long track may be cut into several units ("pieces", each a range of its segments; see
segments.py), so that several workers encode it. A piece cannot know whether the whole track is
usable (a decode error or the silence policy may strike in another piece), so its record carries
what it saw, and ``summary_counts`` decides per track when finishing: a track refused in any piece
keeps none of its pieces' rows (a piece's part file holds rows of that one track only), exactly as an
unsplit run would have written it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from musiclm_stab.constants import SAMPLE_RATE, __version__
from musiclm_stab.data.tokenized import (
    FAILURES_FILE,
    FEATURES,
    METADATA_FILE,
    PARTS_DIR,
    STATE_DIR,
    WARNINGS_FILE,
    DamagedData,
    UnsafePath,
    codebook_usage,
    damaged_parts,
    dataset_fingerprint,
    part_digest,
    unit_groups,
)
from musiclm_stab.durable import fsync_dir, fsync_file
from musiclm_stab.removal import (
    KINDS,
    MARKER,
    TEMPORARY,
    clear_output,
    discard_temporary,
    mark_output,
    output_kind,
    remove_own,
    run_signs,
)
from musiclm_stab.tokenizer.lock import LOCK_FILE
from musiclm_stab.tokenizer.policy import silent_reason
from musiclm_stab.tokenizer.sources import TokenizeError

STATE_VERSION = 2  # bump when a change alters the rows made from the same input and settings

_COMPARED = ("format", "tokenizer", "settings", "encode", "source", "plan", "shard")  # job.json keys a rerun must match

# Codes made on a GPU and on a CPU with the same weights are the same tokenizer's codes (not bit-identical:
# float rounding differs; the agreement is not measured), so shards made on different device types may be
# merged and trained on together, with a warning. One output (a resumed run) stays on one device type.
DEVICE_KEY = "encode.device"
PART_FILE = re.compile(r"^u\d{6}\.arrow$")  # a unit's part file in parts/ (OutputDir.part_file)


class OutputMismatch(ValueError):
    """An existing output was started with other weights, settings, source or shard than this run."""


def atomic_write(path: Path, text: str) -> None:
    """Write a file so that it is either absent, the old version, or complete: never half written, also
    after a power loss (the data is fsynced before the rename, the directory after it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def job_differences(old: dict, new: dict, ignore: Sequence[str] = ()) -> list[str]:
    """Human-readable differences between two jobs, over the keys a rerun must match (less ``ignore``)."""
    a = _flatten({k: old.get(k) for k in _COMPARED})
    b = _flatten({k: new.get(k) for k in _COMPARED})
    lines = []
    for key in sorted(set(a) | set(b)):
        if key in ignore:
            continue
        if a.get(key) != b.get(key):
            va, vb = a.get(key), b.get(key)
            if isinstance(va, list) and len(str(va)) > 60:  # the unit plan: say how it differs, briefly
                va, vb = f"{len(va)} units", f"{len(vb) if isinstance(vb, list) else vb} units"
            lines.append(f"  {key}: {va!r} (existing output) != {vb!r} (this run)")
    return lines


def job_sha256(job: dict) -> str:
    """Identity of a job regardless of shard and device type: shards of one job share it."""
    keyed = {k: job.get(k) for k in _COMPARED if k != "shard"}
    keyed["encode"] = {k: v for k, v in (keyed.get("encode") or {}).items() if k != "device"}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()


def _entries(path: Path) -> list[Path]:
    """What a folder holds, less the lock file (which a run creates before anything else) and the marker
    (also while it is being written, under a temporary name: another run may be writing the folder)."""
    return [p for p in path.iterdir() if p.name != LOCK_FILE and not p.name.startswith(MARKER)]


def check_output_folder(out: str | Path) -> None:
    """Refuse (FileExistsError) an output path that exists and is not a folder this tokenizer wrote:
    nothing is created in it, not even the lock file. A folder holding a training run is refused by name
    (a run directory holds a copy of its data's tokenizer.json: never taken for a tokenized dataset)."""
    out = Path(out)
    if not out.exists():
        return
    signs = run_signs(out) if out.is_dir() else []
    if signs:
        raise FileExistsError(f"refusing to use {out}: it holds a training run ({', '.join(signs)}); tokenize into "
                              "another folder")
    if out.is_dir() and (not _entries(out) or _is_tokenizer_output(out)):
        return
    if out.is_dir() and output_kind(out) is not None:
        raise FileExistsError(f"refusing to use {out}: it holds {KINDS[output_kind(out)]}, not a tokenized dataset; "
                              "tokenize into another folder")
    if out.is_dir() and (out / METADATA_FILE).is_file() and not (out / STATE_DIR).exists():
        raise FileExistsError(f"refusing to use {out}: it holds a tokenized dataset of an older version, without "
                              "resume state, which this version neither resumes nor replaces; tokenize into another "
                              "folder (or move that one away yourself)")
    raise FileExistsError(f"refusing to use {out}: it exists and does not look like a tokenized "
                          f"dataset (no {MARKER}); delete it yourself or choose another output")


def _is_tokenizer_output(path: Path) -> bool:
    """A folder this tokenizer wrote: its marker names it a tokenized dataset, or (written before markers)
    it holds the resume state of a job, or only the resume folder of a run killed before it wrote its job.
    (A run directory's copy of tokenizer.json, or a plain HF dataset saved with save_to_disk, is not one,
    so --overwrite never deletes them.)"""
    if output_kind(path) == "tokenized":
        return True
    if output_kind(path) is not None or run_signs(path):
        return False
    state = path / STATE_DIR
    if (state / "job.json").is_file():
        return True
    return state.is_dir() and {p.name for p in _entries(path)} <= {STATE_DIR, PARTS_DIR} and \
        not any((state / "units").glob("*")) and not any((path / PARTS_DIR).glob("*"))


class OutputDir:
    """The state of one tokenizer output folder."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.state = self.out / STATE_DIR
        self.units_dir = self.state / "units"
        self.parts_dir = self.out / PARTS_DIR

    # -- opening ------------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, out: str | Path, job: dict, overwrite: bool, sources: Sequence[str | Path] = ()) -> OutputDir:
        """Open ``out`` for ``job``: a new folder, or one this very job started (resume) or finished.

        Refuses (OutputMismatch) an output started with other settings, weights, source or shard, and
        (FileExistsError) a non-empty folder that is not a tokenizer output (``check_output_folder``);
        ``overwrite`` clears a tokenizer output of any kind (removal.clear_output), never anything else,
        nor one that holds any of ``sources`` (what this job reads: removal.Refused). Call it holding
        ``output_lock(out)``. The folder gets its marker first (an earlier version's output too).
        """
        d = cls(out)
        check_output_folder(d.out)
        if d.out.is_dir() and _entries(d.out):
            mark_output(d.out, "tokenized")  # ours (checked above): an earlier version's gets its marker
        if d.state.is_dir() and not (d.state / "job.json").is_file() and not any(d.units_dir.glob("*")) \
                and not (d.out / METADATA_FILE).exists():
            # a run killed before it wrote its job: nothing was done, start afresh (an empty parts/ is what
            # versions that made it before the job left)
            remove_own(d.state, d.out, "tokenized")
            if d.parts_dir.is_dir() and not any(d.parts_dir.iterdir()):
                remove_own(d.parts_dir, d.out, "tokenized")
        if d.out.exists() and _entries(d.out):
            if overwrite:
                clear_output(d.out, "tokenized", keep=(LOCK_FILE,), sources=sources)
            elif not (d.state / "job.json").is_file():
                raise FileExistsError(f"{d.out} is a tokenized dataset whose resume state "
                                      f"({d.state / 'job.json'}) is missing, so it can be neither resumed nor "
                                      "reused; pass --overwrite (overwrite=True) to start over, or choose another "
                                      "output folder")
            else:
                old = d.job()
                if "units" in job["plan"] and old["plan"].get("names_sha256") == job["plan"].get("names_sha256"):
                    # same tracks: the first run's units stay in force even if file sizes changed since
                    job = {**job, "plan": {**job["plan"], "units": old["plan"].get("units")}}
                diffs = job_differences(old, job)
                if diffs:
                    what = "finished" if d.is_complete() else "unfinished"
                    device = (" (one output is tokenized on one device type; to use another, tokenize into "
                              "another folder: shards made on different devices can be loaded or merged "
                              "together)") if any(line.startswith(f"  {DEVICE_KEY}:") for line in diffs) else ""
                    listing = ("\nThe source's file list has changed since. If the only change is that inputs "
                               "that failed (a folder that could not be read) can be read now, rerun with "
                               "--retry-failures to add their files."
                               ) if any(line.startswith("  plan.names_sha256:") for line in diffs) else ""
                    raise OutputMismatch(
                        f"{d.out} holds {'a' if what == 'finished' else 'an'} {what} tokenization made with other settings, so the two cannot be "
                        "mixed:\n" + "\n".join(diffs) + "\nRerun with the original settings to "
                        f"{'reuse' if what == 'finished' else 'finish'} it, choose another output folder, or "
                        f"pass --overwrite (overwrite=True) to start over{device}.{listing}")
                d._make_dirs()  # a run killed right after writing its job made none yet
                return d
        d.out.mkdir(parents=True, exist_ok=True)
        mark_output(d.out, "tokenized")  # first: from then on the folder is a tokenizer output
        d.state.mkdir(parents=True, exist_ok=True)
        atomic_write(d.state / "job.json", json.dumps(job, indent=1) + "\n")
        d._make_dirs()
        return d

    def _make_dirs(self) -> None:
        self.units_dir.mkdir(exist_ok=True)
        self.parts_dir.mkdir(exist_ok=True)

    def job(self) -> dict:
        return json.loads((self.state / "job.json").read_text())

    def replan(self, plan: dict) -> None:
        """Put an extended unit plan in force (plan.relist: the units done keep their tracks, new ones follow).
        The completion marker goes first: the output reads as unfinished until finalized with the new units."""
        remove_own(self.out / METADATA_FILE, self.out, "tokenized")
        self.update_job(plan=plan)

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
        """Unit ``k``'s commit record (None: not done). A record names unit ``k`` and no part file but its own
        (``part_file(k)``), else UnsafePath: records of a shard from elsewhere are not trusted, and merging or
        finishing writes and deletes by the names in them."""
        path = self.units_dir / f"u{k:06d}.json"
        if not path.is_file():
            return None
        record = json.loads(path.read_text())
        own = self.part_file(k).relative_to(self.out).as_posix()
        if record.get("unit") != k or record.get("file") not in (None, own):
            raise UnsafePath(f"{path} names unit {record.get('unit')!r} and file {record.get('file')!r}, not unit {k} "
                             f"and its part file {own!r}; refused: a unit record names only its own part file (a "
                             "shard from elsewhere is not trusted)")
        return record

    def done_units(self) -> set[int]:
        return {int(p.stem[1:]) for p in self.units_dir.glob("u*.json")}

    def commit(self, record: dict) -> None:
        """Mark a unit done; its part file (if it has rows) must already be in place. The record gets the
        part's size and sha256; a record that has them already (a shard's, merging) must match the file
        (DamagedData)."""
        if record["file"]:
            file = self.out / record["file"]
            assert file.is_file(), record
            digest = part_digest(file)
            if record.get("sha256") is not None and (record["sha256"], record.get("bytes")) != \
                    (digest["sha256"], digest["bytes"]):
                raise DamagedData(f"{file}: {digest['bytes']} bytes of sha256 {digest['sha256']}, its unit record "
                                  f"says {record.get('bytes')} bytes of sha256 {record['sha256']}")
            record = {**record, **digest}
        atomic_write(self.units_dir / f"u{record['unit']:06d}.json", json.dumps(record) + "\n")

    def reopen_failed(self) -> int:
        """Forget the units that recorded failures (for a long track cut into pieces: all its pieces), so
        they run again; returns how many.

        The completion marker goes first: from then on the output reads as unfinished until finalized.
        """
        done = sorted(self.done_units())
        records = {k: self.record(k) for k in done}
        failed = {k for k in done if records[k]["failures"]}
        plan = self.job()["plan"].get("units")
        groups = unit_groups(plan) if plan else list(range(max(done, default=-1) + 1))
        settings = self.job()["settings"]
        for g, ks in _pieces_by_group(records, groups).items():
            complete = len(ks) == groups.count(g)
            if any(records[k]["piece"]["failure"] for k in ks) or \
                    (complete and track_verdict([records[k]["piece"] for k in ks], settings)):
                failed.update(ks)
        if failed:
            remove_own(self.out / METADATA_FILE, self.out, "tokenized")
            for k in sorted(failed):
                remove_own(self.units_dir / f"u{k:06d}.json", self.out, "tokenized")
        return len(failed)

    def reopen_damaged(self) -> list[str]:
        """Forget the done units whose part file is missing or no longer the one committed (size, sha256 of
        its record; arrow structure and codes: data/tokenized.py ``check_parts``), so that this run redoes
        them; returns their part files. Warns naming them. The completion marker goes first.

        Cheap when nothing changed: a part checked before and unchanged since is not read again.
        """
        info = self.job().get("tokenizer") or {}
        records = {k: self.record(k) for k in sorted(self.done_units())}
        parts = [(self.out / r["file"], {"bytes": r.get("bytes"), "sha256": r.get("sha256"), "rows": r["num_rows"]})
                 for r in records.values() if r["file"]]
        units = {self.out / r["file"]: k for k, r in records.items() if r["file"]}
        damaged = damaged_parts(self.out, parts, info, where="its unit record")
        if damaged:
            warnings.warn(f"{self.out}: redoing {len(damaged)} work unit(s) whose part file is damaged: "
                          + "; ".join(f"{file.relative_to(self.out)}: {why}" for file, why in damaged), stacklevel=2)
            remove_own(self.out / METADATA_FILE, self.out, "tokenized")
            for file, _ in damaged:
                remove_own(self.units_dir / f"u{units[file]:06d}.json", self.out, "tokenized")
        return [str(file.relative_to(self.out)) for file, _ in damaged]

    def reopen_missing(self, units: Sequence[int] | None) -> list[int]:
        """The planned ``units`` of a finished output that have no record (lost since: deleted, or a copy that
        left it out), so that this run redoes them and finishes the output again; warns naming them. The
        completion marker goes first: from then on the output reads as unfinished until finalized."""
        if units is None or not self.is_complete():
            return []
        missing = sorted(set(units) - self.done_units())
        if missing:
            warnings.warn(f"{self.out}: redoing {len(missing)} work unit(s) whose record is missing: "
                          + ", ".join(str(self.units_dir.relative_to(self.out) / f"u{k:06d}.json") for k in missing),
                          stacklevel=2)
            remove_own(self.out / METADATA_FILE, self.out, "tokenized")
        return missing

    # -- finishing ----------------------------------------------------------------------------------

    def summary_counts(self, units: Sequence[int]) -> dict[str, Any]:
        """Counts, failures, warnings and part files of the committed ``units`` (all must be done).

        The pieces of a long track are judged together (``track_verdict``): a track refused in any
        piece contributes one failure and none of its pieces' rows.
        """
        records = [self.record(k) for k in units]
        missing = [k for k, r in zip(units, records) if r is None]
        if missing:
            raise RuntimeError(f"{self.out}: units {missing[:5]} are not done")
        settings = self.job()["settings"]
        used, failures, warns = [], [], []
        i = 0
        while i < len(records):
            r = records[i]
            if "piece" not in r:
                used.append(r)
                failures += r["failures"]
                warns += r.get("warnings", [])
                i += 1
                continue
            j = i + 1  # the pieces of one track are consecutive units
            while j < len(records) and "piece" in records[j] and records[j]["first"] == r["first"]:
                j += 1
            pieces = records[i:j]
            failure = track_verdict([p["piece"] for p in pieces], settings)
            if failure:
                failures.append(failure)
            else:
                used += pieces
                for w in (w for p in pieces for w in p.get("warnings", [])):
                    if w not in warns:  # a warning about the whole file may come from every piece
                        warns.append(w)
            i = j
        precisions = [r.get("fp32_precision") for r in records]
        counts = [r.get("code_counts") for r in used if r["num_rows"]]
        usage = None  # units of an older version did not count their codes
        if counts and None not in counts:
            usage = codebook_usage(np.sum(np.asarray(counts, dtype=np.int64), axis=0))
        return {
            "records": records,
            "parts": [{"unit": r["unit"], "file": r["file"], "rows": r["num_rows"], "bytes": r.get("bytes"),
                       "sha256": r.get("sha256")} for r in used if r["file"]],
            "failures": failures,
            "warnings": warns,
            "num_rows": sum(r["num_rows"] for r in used),
            "num_tracks": sum(r["num_tracks"] for r in used) + len({r["first"] for r in used if "piece" in r}),
            "total_samples": sum(r["num_samples"] for r in used),
            "num_silent_segments": sum(r["silent_segments"] for r in used),
            "failures_by_kind": dict(sorted(Counter(f["kind"] for f in failures).items())),
            "warnings_by_kind": dict(sorted(Counter(w["kind"] for w in warns).items())),
            # whether the encoder ran with TF32 (None: not recorded, units of an older version)
            "tf32": None if None in precisions else any("tf32" in p.values() for p in precisions),
            "codebook_usage": usage,
        }

    def finalize(self, units: Sequence[int], meta: dict[str, Any]) -> dict[str, Any]:
        """Turn the committed units into the HF dataset + tokenizer.json + failures.jsonl + warnings.jsonl;
        returns the metadata written. Raises TokenizeError when no unit has rows (failures.jsonl is
        still written)."""
        c = self.summary_counts(units)
        parts = c["parts"]
        for p in parts:  # a unit committed by a version before part hashes (a resumed run): hashed now
            if p["sha256"] is None:
                p.update(part_digest(self.out / p["file"]))
        atomic_write(self.out / FAILURES_FILE, "".join(json.dumps(f) + "\n" for f in c["failures"]))
        atomic_write(self.out / WARNINGS_FILE, "".join(json.dumps(w) + "\n" for w in c["warnings"]))
        if not parts and not meta.get("shard"):
            shown = "; ".join(f"{f['path']}: {f['reason']}" for f in c["failures"][:3])
            raise TokenizeError(f"every one of the {len(c['failures'])} inputs failed ({shown}); "
                                f"all reasons in {self.out / FAILURES_FILE}")
        if parts:  # a shard may finish with no rows (fewer units than shards, or all its inputs failed)
            datasets.DatasetInfo(features=FEATURES).write_to_directory(str(self.out))
            fsync_file(self.out / "dataset_info.json")  # its directory entry: with tokenizer.json's, below
            state = {"_data_files": [{"filename": p["file"]} for p in parts],
                     "_fingerprint": dataset_fingerprint(meta.get("job_sha256"), parts),
                     "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                     "_output_all_columns": False, "_split": None}
            atomic_write(self.out / "state.json", json.dumps(state, indent=2) + "\n")
        # part files of every record stay (a refused long track's pieces too: merging links them)
        keep = {Path(r["file"]).name for r in c["records"] if r["file"]}
        for stray in self.parts_dir.iterdir():  # temporary files of killed runs, parts of retried units
            if TEMPORARY.match(stray.name):
                discard_temporary(stray)
            elif PART_FILE.match(stray.name) and stray.name not in keep:
                remove_own(stray, self.out, "tokenized")
        meta = {
            **meta,
            "num_rows": c["num_rows"],
            "num_tracks": c["num_tracks"],
            "total_seconds": round(c["total_samples"] / SAMPLE_RATE, 6),
            "num_failures": len(c["failures"]),
            "failures_by_kind": c["failures_by_kind"],
            "num_silent_segments": c["num_silent_segments"],
            "num_warnings": len(c["warnings"]),
            "warnings_by_kind": c["warnings_by_kind"],
            "tf32": c["tf32"],
            "codebook_usage": c["codebook_usage"],
            "parts": parts,
            "created_by": f"musiclm-stab tokenize {__version__}",
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        atomic_write(self.out / METADATA_FILE, json.dumps(meta, indent=2) + "\n")  # last: complete
        return meta


def _pieces_by_group(records: dict[int, dict], groups: Sequence[int]) -> dict[int, list[int]]:
    """The done units that are pieces of a long track, by group (track)."""
    out: dict[int, list[int]] = {}
    for k, r in sorted(records.items()):
        if "piece" in r:
            out.setdefault(groups[k], []).append(k)
    return out


def track_verdict(pieces: Sequence[dict], settings: dict) -> dict | None:
    """The failure of a long track cut into pieces, judged from what each piece saw; None if it is used.

    ``pieces``: each piece's ``piece`` record (in segment order) with ``failure`` (an error seen in its
    part of the track, or None), ``peak`` (max |x| of its part at the source rate), ``kept`` rows.
    Mirrors an unsplit unit: any error; a whole-track peak below the silence threshold; no segment
    above it.
    """
    for p in pieces:
        if p["failure"]:
            return p["failure"]
    first = pieces[0]
    where = {"track": first["track"], "path": first["path"]}
    peak = max(p["peak"] for p in pieces)
    if settings["silence"] == "skip":
        reason = silent_reason(peak, settings["silence_db"], sum(p["kept"] for p in pieces))
        if reason:
            return {**where, "kind": "silent", "reason": reason}
    return None
