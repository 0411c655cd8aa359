"""A tokenized dataset's codes as one file, and putting them back: `musiclm-stab codes save|restore`.

EnCodec runs in float32, so the same corpus and weights can tokenize to slightly different codes on
another CPU (a few near-ties of the quantizer fall the other way). A study whose runs are trained in
pieces on several machines needs one set of codes: ``save_codes`` writes a dataset's codes (with each
row's id, track and shape, the tokenizer's identity and the codes' sha256) to an xz-compressed .npz;
``restore_codes`` puts them into another tokenization of the same corpus with the same weights, made on
any machine, after checking that it holds the same rows (ids, tracks, shapes) and the same tokenizer.
Only the codes change: the audio (``pcm``) stays the one decoded here. The dataset's tokenizer.json
records the restore (the file, its sha256, the codes this machine had made, how many codes differed)
and its per-codebook usage is recomputed; the rewritten parts' sizes and sha256 replace the old ones in
tokenizer.json, the unit records and state.json's fingerprint, so the data checks (data/part_checks.py
``check_parts``) hold after a restore.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from musiclm_stab.data.mixing import IDENTITY_KEYS
from musiclm_stab.data.part_checks import check_parts, dataset_fingerprint, file_sha256
from musiclm_stab.data.tokenized import codes_sha256, load_tokenized, sha256_of_codes
from musiclm_stab.data.tokenized_format import (
    METADATA_FILE,
    RESTORED_KEY,
    RESTORING_KEY,
    STATE_DIR,
    _data_files,
    codebook_usage,
    read_info,
)
from musiclm_stab.durable import fsync_dir, fsync_file
from musiclm_stab.host import machine

FORMAT = 1


class CodesMismatch(ValueError):
    """A codes file does not fit a dataset: other rows, shapes or tokenizer."""


def _columns(dataset: Path, check: bool = True) -> tuple[dict[str, Any], list[str], list[str], np.ndarray, np.ndarray,
                                                         str]:
    """(tokenizer info, ids, tracks, shapes [N, 2], codes of every row flattened in order, their
    ``codes_sha256``) of a dataset, in one read of its codes. ``check=False``: its parts are checked already."""
    hf, info = load_tokenized(dataset, check=check)
    rows = hf.select_columns(["id", "track", "codes"]).with_format("numpy")
    ids, tracks, per_row = [], [], []
    for i in range(0, len(rows), 256):
        batch = rows[i : i + 256]
        for rid, track, codes in zip(batch["id"], batch["track"], batch["codes"]):
            ids.append(str(rid))
            tracks.append(str(track))
            per_row.append(np.asarray(codes, dtype=np.int16))
    shapes = np.asarray([c.shape for c in per_row], dtype=np.int64).reshape(-1, 2)
    values = np.concatenate([c.reshape(-1) for c in per_row]) if per_row else np.zeros(0, np.int16)
    return info, ids, tracks, shapes, values, sha256_of_codes(zip(tracks, per_row))


def save_codes(dataset: str | Path, out: str | Path) -> dict[str, Any]:
    """Write ``dataset``'s codes to ``out`` (xz-compressed .npz); returns the file's header."""
    dataset, out = Path(dataset), Path(out)
    info, ids, tracks, shapes, values, sha = _columns(dataset)
    header = {
        "format": FORMAT,
        "codes_sha256": sha,
        "num_rows": len(ids),
        "num_codes": int(values.size),
        "tokenizer": {k: info.get(k) for k in IDENTITY_KEYS},
        "source": str(dataset),
        "tokenized_at": info.get("created_at"),
        "saved_on": machine(),  # where the codes were made, unless the dataset had them restored:
        "restored": info.get(RESTORED_KEY),  # then its record of the restore
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    buffer = io.BytesIO()
    np.savez(buffer, header=np.array(json.dumps(header)), id=np.array(ids), track=np.array(tracks),
             shape=shapes, codes=values.astype("<i2"))
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(lzma.compress(buffer.getvalue(), preset=9))
    fsync_file(tmp)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return header


def read_codes(path: str | Path) -> dict[str, Any]:
    """A codes file's header and arrays (id, track, shape, codes); a clear error for anything else."""
    path = Path(path)
    try:
        raw = lzma.decompress(path.read_bytes())
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            got = {k: z[k] for k in ("header", "id", "track", "shape", "codes")}
        header = json.loads(str(got["header"]))
    except FileNotFoundError:
        raise
    except (OSError, lzma.LZMAError, ValueError, KeyError, EOFError) as e:
        raise ValueError(f"{path} is not a codes file written by `musiclm-stab codes save`: {e}") from e
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: codes file format {header.get('format')!r}, this version reads {FORMAT}")
    shape = got["shape"]
    if shape.ndim != 2 or len(shape) != header["num_rows"] or int(np.prod(shape, axis=1).sum()) != got["codes"].size:
        raise ValueError(f"{path}: its shapes ({len(shape)} rows) do not add up to its {got['codes'].size} codes")
    return {"header": header, "id": got["id"], "track": got["track"], "shape": shape, "codes": got["codes"]}


def _check_fits(dataset: Path, path: Path, saved: dict, info: dict, ids: list[str], tracks: list[str],
                shapes: np.ndarray) -> None:
    differ = [k for k in IDENTITY_KEYS if saved["header"]["tokenizer"].get(k) != info.get(k)]
    if differ:
        shown = "; ".join(f"{k}: {saved['header']['tokenizer'].get(k)!r} there, {info.get(k)!r} here" for k in differ)
        raise CodesMismatch(f"{path} holds codes of another tokenizer than {dataset}'s ({shown})")
    if len(ids) != len(saved["id"]):
        raise CodesMismatch(f"{path} holds {len(saved['id'])} rows, {dataset} {len(ids)}: not the same corpus "
                            "or segmenting")
    for i, (a, t, s) in enumerate(zip(ids, tracks, shapes)):
        if a != saved["id"][i] or t != saved["track"][i] or tuple(s) != tuple(saved["shape"][i]):
            raise CodesMismatch(
                f"row {i} differs: {dataset} has {a!r} (track {t!r}, codes {tuple(s)}), {path} has "
                f"{saved['id'][i]!r} (track {saved['track'][i]!r}, codes {tuple(saved['shape'][i])}): "
                "not the same corpus or segmenting")


def _nested(values: np.ndarray, shapes: np.ndarray, type_: pa.DataType) -> pa.Array:
    """Rows of [K, T] codes as an arrow list<list<int16>> column of type ``type_``."""
    inner_lengths = np.repeat(shapes[:, 1], shapes[:, 0])
    inner = pa.ListArray.from_arrays(np.concatenate([[0], np.cumsum(inner_lengths)]).astype(np.int32),
                                     pa.array(values, type=pa.int16()))
    outer = pa.ListArray.from_arrays(np.concatenate([[0], np.cumsum(shapes[:, 0])]).astype(np.int32), inner)
    return outer.cast(type_)


def restore_codes(dataset: str | Path, path: str | Path) -> dict[str, Any]:
    """Put the codes of codes file ``path`` into ``dataset`` (in place); returns what was done:
    ``codes_sha256``, ``rows_changed``, ``codes_changed`` (also ``codes_changed_per_codebook``), ``num_codes``,
    and ``already`` (True when the dataset held those codes, and nothing was written).

    Refuses (CodesMismatch, nothing written) unless the dataset has the file's rows (ids, tracks, codes
    shapes, in order) and tokenizer identity (weights sha256, rates, codebooks), and (DamagedData) unless
    its parts are as recorded. The new data files are written beside the old ones; tokenizer.json then
    records the restore under way (``codes_restoring``: each part's size and sha256 before and after, so
    that the dataset is refused until it is finished), the files are renamed into place, and the unit
    records, state.json and tokenizer.json get the new sizes and hashes, tokenizer.json the
    ``codes_restored`` record last. A restore stopped at any point is finished by running it again.
    """
    dataset, path = Path(dataset), Path(path)
    saved = read_codes(path)
    want = saved["header"]["codes_sha256"]
    info = read_info(dataset)
    files = _data_files(dataset, info)
    pending = info.get(RESTORING_KEY)
    entries = [dict(e) for e in info.get("parts") or [{} for _ in files]]
    if pending:  # a restore stopped half-way: each part is as it was before it, or as it wrote it
        for e in entries:
            sides = pending["parts"].get(e["file"], {})
            e.update({k: [sides.get("before", {}).get(k), sides.get("after", {}).get(k)] for k in ("bytes", "sha256")})
    check_parts(dataset, [(f, e) for (_, f), e in zip(files, entries)], info)
    info, ids, tracks, shapes, values, before = _columns(dataset, check=False)
    _check_fits(dataset, path, saved, info, ids, tracks, shapes)
    changed = values != saved["codes"]
    row_ends = np.cumsum(np.prod(shapes, axis=1))
    levels = int(shapes[:, 0].max()) if len(shapes) else 0
    counts = np.zeros((levels, int(info.get("codebook_size") or 1024)), np.int64)  # of the restored codes
    per_level = np.zeros(levels, np.int64)  # codes that differ, per codebook
    rows_changed = 0
    for (k, t), lo, hi in zip(shapes, np.r_[0, row_ends[:-1]], row_ends):
        codes, diff = saved["codes"][lo:hi].reshape(k, t), changed[lo:hi].reshape(k, t)
        rows_changed += bool(diff.any())
        per_level[:k] += diff.sum(axis=1)
        for level in range(k):
            counts[level] += np.bincount(codes[level], minlength=counts.shape[1])
    result = {"codes_sha256": want, "rows_changed": rows_changed, "codes_changed": int(changed.sum()),
              "codes_changed_per_codebook": per_level.tolist(), "num_codes": int(values.size),
              "already": before == want and not pending}
    if result["already"]:
        return result
    made_here = before
    if pending:  # this machine's codes and how the file's differ from them: as the stopped restore found them
        made_here = pending.get("made_here", before)
        if pending.get("result", {}).get("codes_sha256") == want:
            result = {**pending["result"], "already": False}
    meta = read_info(dataset)
    # 1. the new data files, beside the old ones
    row, written = 0, []
    for _, file in files:
        with pa.memory_map(str(file)) as source:
            table = pa.ipc.open_stream(source).read_all()
        n = table.num_rows
        lo = int(row_ends[row - 1]) if row else 0
        hi = int(row_ends[row + n - 1]) if n else lo
        col = table.schema.get_field_index("codes")
        field = table.schema.field(col)
        table = table.set_column(col, field, _nested(saved["codes"][lo:hi], shapes[row : row + n], field.type))
        tmp = file.with_name(file.name + ".restore")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        fsync_file(tmp)
        written.append((file, tmp, {"bytes": tmp.stat().st_size, "sha256": file_sha256(tmp)}))
        row += n
    # 2. the restore under way: until it ends, the dataset is refused, and a rerun accepts either version
    if "parts" in meta:
        old = {e["file"]: e for e in meta["parts"]}
        sides = {}
        for file, _, new in written:
            name = file.relative_to(dataset).as_posix()
            earlier = (pending or {}).get("parts", {}).get(name, {}).get("before")
            sides[name] = {"before": earlier or {k: old[name].get(k) for k in ("bytes", "sha256")}, "after": new}
        meta[RESTORING_KEY] = {"file": str(path), "made_here": made_here, "parts": sides,
                               "result": {k: v for k, v in result.items() if k != "already"}}
        _write_json(dataset / METADATA_FILE, meta)
    # 3. the new files in place
    for file, tmp, _ in written:
        os.replace(tmp, file)
    for folder in {file.parent for file, _, _ in written}:
        fsync_dir(folder)
    # 4. their sizes and hashes recorded: unit records, state.json's fingerprint, tokenizer.json
    digests = {file.relative_to(dataset).as_posix(): new for file, _, new in written}
    if "parts" in meta:
        for p in meta["parts"]:
            p.update(digests[p["file"]])
            record_file = dataset / STATE_DIR / "units" / f"u{p['unit']:06d}.json"
            if record_file.is_file():
                _write_json(record_file, {**json.loads(record_file.read_text()), **digests[p["file"]]}, indent=None)
        state_file = dataset / "state.json"
        if state_file.is_file():
            state = json.loads(state_file.read_text())
            state["_fingerprint"] = dataset_fingerprint(meta.get("job_sha256"), meta["parts"])
            _write_json(state_file, state)
        meta.pop(RESTORING_KEY, None)
        _write_json(dataset / METADATA_FILE, meta)
    after = codes_sha256(dataset)  # read back from the files written (and checked against their hashes)
    if after != want:
        raise RuntimeError(f"{dataset}: codes sha256 {after} after restoring {path}, which records {want}")
    meta[RESTORED_KEY] = {"file": str(path), "codes_sha256_made_here": made_here,
                          **{k: v for k, v in result.items() if k != "already"},
                          "saved_on": saved["header"].get("saved_on"),
                          "restored_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    meta["codebook_usage"] = codebook_usage(counts)
    _write_json(dataset / METADATA_FILE, meta)
    return result


def _write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    """Write a JSON file whole or not at all: a temporary file, fsynced, renamed, the folder fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def describe(result: dict[str, Any]) -> str:
    """One line about a restore."""
    if result["already"]:
        return f"the dataset already holds these codes (sha256 {result['codes_sha256'][:12]}...)"
    return (f"restored codes sha256 {result['codes_sha256'][:12]}...: {result['codes_changed']} of "
            f"{result['num_codes']} codes ({100 * result['codes_changed'] / max(result['num_codes'], 1):.4f}%) "
            f"in {result['rows_changed']} rows differed from this machine's")


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="musiclm-stab codes",
        description="Save a tokenized dataset's codes to one file, or restore them into another tokenization of "
                    "the same corpus with the same weights (made on another CPU, whose float32 tokenizing can "
                    "give a few other codes)",
        epilog="Reference: docs/TOKENIZING.md (offline: musiclm-stab docs TOKENIZING)")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("save", help="write DATASET's codes to FILE (.npz.xz)")
    s.add_argument("dataset")
    s.add_argument("file")
    r = sub.add_parser("restore", help="put FILE's codes into DATASET (same rows and tokenizer), in place")
    r.add_argument("dataset")
    r.add_argument("file")
    args = p.parse_args(argv)
    try:
        if args.action == "save":
            h = save_codes(args.dataset, args.file)
            print(f"saved {h['num_codes']} codes of {h['num_rows']} rows (sha256 {h['codes_sha256']}) to {args.file}")
        else:
            print(describe(restore_codes(args.dataset, args.file)))
    except (ValueError, FileNotFoundError) as e:
        print(f"musiclm-stab codes: error: {e}", file=sys.stderr)
        return 2
    return 0
