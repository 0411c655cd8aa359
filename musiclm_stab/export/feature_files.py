"""Features of a folder of audio, written to .npy files as they are made, resumable, with a manifest.

    musiclm-stab features MODEL SRC OUT [--layers 0 6 12] [--chunk-seconds 30] [--overlap-seconds 10]

See ``export/features.py`` for what a frame and a layer are, and how long audio is chunked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from musiclm_stab.constants import FRAME_RATE, HOP_LENGTH, SAMPLE_RATE
from musiclm_stab.export.features import (
    DEFAULT_CHUNK_SECONDS,
    FeatureModel,
    iter_features,
    load_feature_model,
    overlap_seconds_for,
    resolve_layers,
)
from musiclm_stab.output_errors import OutputWriteError, check_folder_path, writing
from musiclm_stab.removal import (
    MARKER,
    TEMPORARY,
    discard_temporary,
    mark_output,
    output_kind,
    replace_output,
    run_signs,
    same_name,
    why_not_removable,
)

MANIFEST = "features.json"
MANIFEST_TMP = ".features.json.tmp"  # the manifest being written
SAME_RUN_KEYS = ("model", "layers", "chunk_seconds", "overlap_seconds", "dtype")
LAYER_FILE = re.compile(r"^layer_\d{2,}\.npy$")  # what a file's output folder holds: layer_XX.npy only


def _write_npy_header(f, shape: tuple[int, ...], dtype: np.dtype) -> None:
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(f, header)


def write_features(
    wav: torch.Tensor,
    model: FeatureModel,
    out_dir: Path,
    layers: list[int],
    chunk_seconds: float,
    overlap_seconds: float | None = None,
    dtype: str = "float32",
    *,
    within: Path,
    sources: Sequence[Path] = (),
) -> int:
    """Write ``out_dir/layer_XX.npy`` ([T, D] each) chunk by chunk, never holding a whole layer; returns T.

    Written under a temporary name and renamed when complete, so a directory that exists is whole. An
    earlier ``out_dir`` is replaced only if it is a features folder strictly inside the output folder
    ``within`` and holds none of ``sources`` (removal.py; else removal.Refused, nothing touched).
    """
    T = math.ceil(wav.numel() / HOP_LENGTH)
    np_dtype = np.dtype(dtype)
    partial = _partial(out_dir)
    try:
        with writing(partial):  # a full disk is the output's fault, not the input's: OutputWriteError
            discard_temporary(partial, ignore_errors=True)  # left by a killed run
            partial.mkdir(parents=True)
            with ExitStack() as files_open:
                files = {layer: files_open.enter_context(open(partial / f"layer_{layer:02d}.npy", "wb"))
                         for layer in layers}
                for f in files.values():
                    _write_npy_header(f, (T, model.width), np_dtype)
                for _, feats in iter_features(wav, model, layers, chunk_seconds, overlap_seconds):
                    for layer, x in zip(layers, feats):
                        files[layer].write(np.ascontiguousarray(x.numpy().astype(np_dtype)).tobytes())
            replace_output(partial, out_dir, inside=within, sources=sources, recognised=is_features_folder)
    except BaseException:
        discard_temporary(partial, ignore_errors=True)  # the space it took, back (the error raised says what failed)
        raise
    return T


def is_features_folder(path: Path) -> bool:
    """Whether ``path`` is a file's output folder as ``write_features`` makes them: a real folder holding
    ``layer_XX.npy`` files and nothing else."""
    if path.is_symlink() or not path.is_dir():
        return False
    entries = list(path.iterdir())
    return bool(entries) and all(LAYER_FILE.match(e.name) and e.is_file() and not e.is_symlink() for e in entries)


def _made_by_an_earlier_version(out: Path) -> bool:
    """Whether the unmarked folder ``out`` is a features output of a version before markers: its
    features.json names the settings, or it holds nothing but files' output folders (in subfolders too)
    and temporary folders, as a first run stopped before its manifest leaves it."""
    try:
        old = json.loads((out / MANIFEST).read_text())
        if isinstance(old, dict) and all(k in old for k in (*SAME_RUN_KEYS, "written")):
            return True
    except (OSError, ValueError):
        pass

    def only_outputs(folder: Path) -> bool:
        return all(TEMPORARY.match(e.name) or is_features_folder(e) or
                   (e.is_dir() and not e.is_symlink() and any(e.iterdir()) and only_outputs(e))
                   for e in folder.iterdir() if e.name != MANIFEST_TMP)
    return only_outputs(out)


def _check_output_folder(out: Path) -> None:
    """Refuse (ValueError) an existing ``out`` that is not empty and is not a features output: features are
    never written among files of another kind (nor a folder of them skipped as "existing")."""
    if not out.is_dir() or not any(out.iterdir()) or output_kind(out) == "features":
        return
    signs = run_signs(out)
    if signs:
        raise ValueError(f"refusing to write features into {out}: it holds a training run ({', '.join(signs)}); "
                         "choose another output folder")
    if output_kind(out) is not None or not _made_by_an_earlier_version(out):
        raise ValueError(f"refusing to write features into {out}: it is not empty and is not a features output "
                         f"(no {MARKER} or {MANIFEST}); choose a new or empty output folder")


@dataclass
class FolderSummary:
    written: list[dict] = field(default_factory=list)  # {"source", "output", "frames"}
    skipped: list[str] = field(default_factory=list)  # outputs that existed already
    failed: list[dict] = field(default_factory=list)  # {"source", "kind" (audio.FAILURE_KINDS), "reason"}


def _partial(out_dir: Path) -> Path:
    """Where ``write_features`` builds ``out_dir`` before renaming it into place."""
    return out_dir.with_name(f".{out_dir.name}.partial")


def _short_name(rel: Path) -> Path | None:
    """``rel`` without its suffix (``sub/a.wav`` -> ``sub/a``); None where that leaves no name of its own
    (``...wav`` would be ``..``, ``..wav`` ``.``: the folder above the output, or the output itself)."""
    stem = rel.name[: len(rel.name) - len(rel.suffix)]
    return None if stem in ("", ".", "..") else rel.with_name(stem)


def _output_names(files: list[Path], src: Path) -> list[Path]:
    """Output folder (relative) per file, never one for two files: its path without the suffix
    (``sub/a.wav`` -> ``sub/a``), or with it (``sub/a.wav``) where the short name would be no name of its
    own (``...wav``: ``_short_name``) or would meet another output: the short name of another file
    (``a.wav``, ``a.flac``; names are compared as a case-insensitive file system does, ``A.wav`` meets
    ``a.flac``), the long name of another (``a.wav.flac`` -> ``a.wav``), a folder holding other outputs
    (``sub.wav`` -> ``sub`` beside ``sub/b.wav``), another's temporary folder (``.a.partial.wav``) or any
    temporary name, the manifest (``features.json.wav``) or the marker.

    Long names cannot meet: they are distinct paths of files (every part a real name, never empty, ``.``
    or ``..``), none of which is a folder of another, and they end in an audio extension where a temporary
    folder ends in ``.partial``. A file switched to its long name may free nothing and clash with no more,
    so the switching stops.
    """
    rel = [f.relative_to(src) for f in files]
    short = [_short_name(r) for r in rel]
    long: set[int] = {i for i, s in enumerate(short) if s is None}  # files named by their long name
    while True:
        names = [r if i in long else short[i] for i, r in enumerate(rel)]
        taken: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            taken.setdefault(same_name(name.as_posix()), []).append(i)
        reserved = {same_name(n) for n in (MANIFEST, MANIFEST_TMP, MARKER)} | \
            {same_name(_partial(n).as_posix()) for n in names} | \
            {same_name(parent.as_posix()) for n in names for parent in n.parents if parent != Path(".")}
        switch = {i for i, n in enumerate(names) if i not in long and
                  (len(taken[same_name(n.as_posix())]) > 1 or same_name(n.as_posix()) in reserved
                   or TEMPORARY.match(n.name))}
        if not switch:
            return names
        long |= switch


def extract_folder(
    model: FeatureModel | str | Path,
    src: str | Path,
    out: str | Path,
    layers: Sequence[int] | None = None,
    chunk_seconds: float = DEFAULT_CHUNK_SECONDS,
    overlap_seconds: float | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
    device: str | None = None,
) -> FolderSummary:
    """Features of every audio file under ``src`` (or of the file ``src``) into ``out``.

    One directory per file, ``out/<relative path without suffix>/layer_XX.npy`` ([T, D]), and
    ``out/features.json`` (model, layers, settings, failures, and the files written: by this run and the
    earlier ones whose output is still there). Files whose directory exists are skipped unless ``overwrite``;
    an ``out`` made with other settings is refused, and so is an ``out`` that holds anything but features, or a
    file's folder that is anything but its features (removal.py: nothing outside ``out`` or of another kind is
    ever removed, skipped or written over). Unreadable audio is
    reported in ``failed`` (path, kind, reason; any other error while decoding one file is kind ``error``)
    and the run goes on.
    """
    from musiclm_stab.audio import AudioError, list_audio_files, load_audio

    src, out = Path(src), Path(out)
    check_folder_path(out)  # a file in the way: refused before the model is loaded
    with writing(out, "read the output folder"):
        _check_output_folder(out)  # a folder of other things: refused, also before the model is loaded
    if not isinstance(model, FeatureModel):
        model = load_feature_model(model, device)
    failed: list[dict] = []
    if src.is_file():
        files, names = [src], _output_names([src], src.parent)
    elif src.is_dir():
        problems: list[AudioError] = []  # folders and links the walk could not read: recorded as failures
        try:
            files = list_audio_files(src, problems)
        except AudioError as e:
            raise ValueError(f"cannot read the source {e.path}: {e.reason}") from None
        failed = [{"source": e.path, "kind": e.kind, "reason": e.reason} for e in problems]
        names = _output_names(files, src)
    else:
        raise ValueError(f"{src} is neither an audio file nor a folder")
    chosen = resolve_layers(layers, model.num_layers)
    overlap_seconds = overlap_seconds_for(chunk_seconds, overlap_seconds)
    settings = {
        "model": model.source,
        "model_kind": model.kind,
        "layers": chosen,
        "chunk_seconds": chunk_seconds,
        "overlap_seconds": overlap_seconds,
        "dtype": dtype,
        "frame_rate": FRAME_RATE,
        "sample_rate": SAMPLE_RATE,
        "width": model.width,
        "num_layers": model.num_layers,
    }
    manifest = out / MANIFEST
    made_from: dict[str, str] = {}  # output -> source, as an earlier run recorded them
    earlier: list[dict] = []  # what earlier runs recorded as written: kept in the record, with this run's
    if manifest.is_file() and not overwrite:
        with writing(manifest, "read"):
            text = manifest.read_text()
        try:
            old = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{manifest} is not valid JSON ({e}): delete it (the features stay) or pass "
                             "--overwrite") from None
        differ = [k for k in SAME_RUN_KEYS if old.get(k) != settings[k]]
        if differ:
            raise ValueError(
                f"{out} holds features made with other settings ({', '.join(differ)} differ); "
                "use another output folder or overwrite=True (--overwrite)"
            )
        earlier = old.get("written", [])
        made_from = {w["output"]: w["source"] for w in earlier}
    with writing(out, "create the output folder"):
        out.mkdir(parents=True, exist_ok=True)
        mark_output(out, "features")
    for path, name in zip(files, names):  # before any work: a folder of other things where an output goes
        target = out / name
        in_the_way = why_not_removable(target, inside=out, sources=[src], recognised=is_features_folder) \
            if target.exists() or target.is_symlink() else None
        if in_the_way is not None:
            raise ValueError(f"{target}, the output folder of {path}, is in the way: {in_the_way}; it is never "
                             "written over or skipped: move it away, or choose another output folder")
    summary = FolderSummary(failed=failed)
    for path, name in tqdm(list(zip(files, names)), desc="features", unit="file", disable=not progress):
        target = out / name
        if target.is_dir() and not overwrite:
            other = made_from.get(str(name))
            if other is not None and not _same_source(other, path, src):
                raise ValueError(f"{target} holds the features of {other} (says {manifest}), not of {path}: an "
                                 "earlier version gave both the same output folder; delete that folder (or pass "
                                 "--overwrite) and rerun")
            summary.skipped.append(str(name))
            continue
        try:
            wav = load_audio(path)
        except AudioError as e:
            summary.failed.append({"source": str(path), "kind": e.kind, "reason": e.reason})
            continue
        except Exception as e:  # noqa: BLE001 - any other error decoding this one file: recorded, run goes on
            why = f"{type(e).__name__}: {e}"
            summary.failed.append({"source": str(path), "kind": "error", "reason": why})
            continue
        try:
            frames = write_features(wav, model, target, chosen, chunk_seconds, overlap_seconds, dtype,
                                    within=out, sources=[src])
        except OutputWriteError as e:  # stop: every later write would fail too; what is written stays
            done = len(summary.written) + len(summary.skipped)
            raise OutputWriteError(f"{e}. Stopped; the {done} files whose features are written are kept: "
                                   f"{e.advice()}, then rerun the same command to go on with the rest (it skips "
                                   "them)", e.path, e.errno) from None
        summary.written.append({"source": str(path), "output": str(name), "frames": frames})
    now = {w["output"] for w in summary.written}
    kept = [w for w in earlier if w["output"] not in now and (out / w["output"]).is_dir()]  # still there
    record = {**settings, "written": kept + summary.written, "skipped": summary.skipped, "failed": summary.failed}
    tmp = out / MANIFEST_TMP
    with writing(tmp):  # never half a manifest: a full disk leaves the earlier one
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, manifest)
    return summary


def _same_source(recorded: str, path: Path, src: Path) -> bool:
    """Whether the source an earlier run recorded (as it was given then) is the file ``path`` under ``src``
    (the folder may be given otherwise now: relative, absolute, moved)."""
    rel = path.relative_to(src).as_posix() if path != src else path.name
    return recorded == str(path) or Path(recorded).as_posix().endswith("/" + rel) or recorded == rel


def _parse_layers(values: list[str] | None) -> list[int] | None:
    if not values or values == ["all"]:
        return None
    return [int(v) for item in values for v in item.split(",") if v]


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab features", description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/EXPORT.md (offline: musiclm-stab docs EXPORT)")
    p.add_argument("model", help="run directory, checkpoint directory, or export directory")
    p.add_argument("src", help="audio file, or folder searched recursively")
    p.add_argument("out", help="output folder: <file>/layer_XX.npy ([T, D]) and features.json")
    p.add_argument(
        "--layers", nargs="+", help="layer indices 0..N (negative from the end) or 'all' (default)"
    )
    p.add_argument("--chunk-seconds", type=float, default=DEFAULT_CHUNK_SECONDS)
    p.add_argument("--overlap-seconds", type=float, default=None, help="default: a third of --chunk-seconds")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"], help="storage type")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--overwrite", action="store_true", help="recompute files whose output exists")
    args = p.parse_args(argv)
    try:
        summary = extract_folder(
            args.model,
            args.src,
            args.out,
            _parse_layers(args.layers),
            args.chunk_seconds,
            args.overlap_seconds,
            args.dtype,
            args.overwrite,
            device=args.device,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OutputWriteError as e:  # the output's disk, not the input: one line, what is written stays
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"{len(summary.written)} written, {len(summary.skipped)} skipped (existing), "
        f"{len(summary.failed)} failed -> {Path(args.out) / MANIFEST}"
    )
    for f in summary.failed:
        print(f"  failed: {f['source']}: {f['kind']}: {f['reason']}", file=sys.stderr)
    return 1 if summary.failed and not summary.written and not summary.skipped else 0
