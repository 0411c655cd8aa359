"""Merging the outputs of ``--shard 0/n`` .. ``n-1/n`` into the output a single run would have made.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from musiclm_stab.data.tokenized import (
    STATE_DIR,
    check_parts,
    device_of,
    inside,
    job_units,
    read_info,
    warn_mixed_devices,
)
from musiclm_stab.durable import fsync_dir, fsync_file
from musiclm_stab.output_errors import OutputWriteError, stops_on_write_errors
from musiclm_stab.removal import discard_temporary
from musiclm_stab.tokenizer.lock import check_not_busy, output_lock
from musiclm_stab.tokenizer.store import (
    DEVICE_KEY,
    OutputDir,
    OutputMismatch,
    check_output_folder,
    job_differences,
    job_sha256,
)


def _stopped(error: OutputWriteError, out: Path) -> str:
    """What a merge stopped by a full disk (or another write error) keeps, and what to do."""
    try:
        kept = f"the {len(OutputDir(out).done_units())} units merged so far are kept"
    except OSError:
        kept = "the units merged so far are kept"
    return f"Merging stopped; {kept}: {error.advice()}, then rerun the same command to finish it"


@stops_on_write_errors("out", _stopped)
def merge_shards(out: str | Path, shard_dirs: Sequence[str | Path]) -> dict[str, Any]:
    """Merge the finished outputs of ``--shard 0/n`` ... ``--shard n-1/n`` into one output at ``out``.

    The result is the output a single run would have made (same rows, same order, same resume state):
    part files are hard-linked (copied across file systems), records copied, then finalized.
    Restartable: a merge killed at any point is finished by running it again (units already copied
    are checked and kept); ``out`` is locked while merging. Shards tokenized on different device types
    merge with a DeviceMixWarning (recorded as ``device: "mixed"``). Returns its tokenizer.json contents.

    A full disk (or a quota, a file size limit, a read-only file system) stops it with an OutputWriteError of
    one line: what was kept and to rerun (which continues).

    Shards come from other machines, so they are checked before anything is written: each unit record
    names its own part file, inside the shard (UnsafePath), which is the one recorded (size, sha256, codes
    in range: DamagedData naming it).
    """
    dirs = [OutputDir(p) for p in shard_dirs]
    infos = []
    for d in dirs:
        infos.append(read_info(d.out))  # finished, or a clear error
        if not (d.state / "job.json").is_file():
            raise ValueError(f"{d.out} has no resume state ({STATE_DIR}/job.json), so it is not a shard output")
    jobs = [d.job() for d in dirs]
    n = jobs[0]["shard"][1]
    for d, job in zip(dirs[1:], jobs[1:]):
        diffs = job_differences({**jobs[0], "shard": None}, {**job, "shard": None}, ignore=(DEVICE_KEY,))
        if diffs:
            raise OutputMismatch(f"{dirs[0].out} and {d.out} are not shards of one tokenization:\n" + "\n".join(diffs))
    have = sorted(job["shard"][0] for job in jobs)
    if {job["shard"][1] for job in jobs} != {n} or have != list(range(n)):
        raise ValueError(f"merging needs each of the shards 0/{n} .. {n - 1}/{n} once; got "
                         + ", ".join(f"{j['shard'][0]}/{j['shard'][1]}" for j in jobs))
    devices = {str(d.out): device_of(d.out, i) for d, i in zip(dirs, infos)}
    known = {v for v in devices.values() if v}
    device = known.pop() if len(known) == 1 else "mixed" if known else None
    warn_mixed_devices(devices, "Merging")
    merged = {**jobs[0], "shard": [0, 1]}
    if device == "mixed":
        merged["encode"] = {**merged["encode"], "device": "mixed"}
    if any(j.get("stream_end") for j in jobs):
        ends = {json.dumps(j.get("stream_end"), sort_keys=True) for j in jobs}
        if len(ends) != 1:
            raise OutputMismatch("the shards saw streams of different lengths: " + ", ".join(sorted(ends)))
    records = {}  # (shard index, unit) -> its record, every one checked before anything is written
    for i, (d, job, info) in enumerate(zip(dirs, jobs, infos)):
        for k in job_units(job):
            record = d.record(k)  # UnsafePath unless it names its own part file
            if record is None:
                raise ValueError(f"{d.out} is finished but has no record of its unit {k} "
                                 f"({d.units_dir / f'u{k:06d}.json'}); tokenize that shard again")
            records[i, k] = record
        parts = [(inside(d.out, r["file"], d.units_dir / f"u{k:06d}.json"),
                  {"bytes": r.get("bytes"), "sha256": r.get("sha256"), "rows": r["num_rows"]})
                 for (j, k), r in records.items() if j == i and r["file"]]
        check_parts(d.out, parts, info, where="its unit record")
    check_not_busy(out)
    check_output_folder(out)
    with output_lock(out):
        target = OutputDir.prepare(out, merged, overwrite=False)
        todo = []
        for i, (d, job) in enumerate(zip(dirs, jobs)):
            for k in job_units(job):
                record, there = records[i, k], target.record(k)
                if there is None:
                    todo.append((d, record))
                elif not _same_unit(there, record) or (record["file"] and not (target.out / record["file"]).is_file()):
                    # checked before anything is written: a folder holding other data is left untouched
                    raise FileExistsError(f"{target.out} already holds unit {k}, not the one in {d.out}; "
                                          "merge into a new folder")
                # else: copied by an earlier, interrupted merge
        if not todo and target.is_complete():
            return read_info(target.out)
        for d, record in todo:
            if record["file"]:
                dst = target.out / record["file"]
                tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
                discard_temporary(tmp)  # left by a merge killed while copying
                try:
                    os.link(d.out / record["file"], tmp)
                except OSError:
                    shutil.copyfile(d.out / record["file"], tmp)
                fsync_file(tmp)  # a copy's data (a link's is the shard's file) is on disk before the rename
                os.replace(tmp, dst)  # whole or absent: the record below is what makes the unit count
                fsync_dir(dst.parent)  # and so is the rename, before that record is written
            target.commit(record)
        meta = {k: v for k, v in infos[0].items() if k not in ("parts",)}
        meta.update(shard=None, job_sha256=job_sha256(merged), merged_from=[str(d.out) for d in dirs],
                    device=device)
        return target.finalize(job_units(merged), meta)


def _same_unit(there: dict, record: dict) -> bool:
    """Whether the merged output's record of a unit (``there``) is a copy of the shard's: the same, but for
    the part's size and sha256, which commit adds when a shard (of an older version) has none."""
    def rest(r: dict) -> dict:
        return {k: v for k, v in r.items() if k not in ("bytes", "sha256")}
    return rest(there) == rest(record) and record.get("sha256") in (None, there.get("sha256"))
