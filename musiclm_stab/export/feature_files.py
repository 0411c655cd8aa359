"""Features of a folder of audio, written to .npy files as they are made, resumable, with a manifest.

    musiclm-stab features MODEL SRC OUT [--layers 0 6 12] [--chunk-seconds 30] [--overlap-seconds 10]

See ``export/features.py`` for what a frame and a layer are, and how long audio is chunked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from musiclm_stab import FRAME_RATE, HOP_LENGTH, SAMPLE_RATE
from musiclm_stab.export.features import (
    DEFAULT_CHUNK_SECONDS,
    FeatureModel,
    iter_features,
    load_feature_model,
    overlap_seconds_for,
    resolve_layers,
)
from musiclm_stab.output_errors import OutputWriteError, check_folder_path, writing

MANIFEST = "features.json"
MANIFEST_TMP = ".features.json.tmp"  # the manifest being written
SAME_RUN_KEYS = ("model", "layers", "chunk_seconds", "overlap_seconds", "dtype")


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
) -> int:
    """Write ``out_dir/layer_XX.npy`` ([T, D] each) chunk by chunk, never holding a whole layer; returns T.

    Written under a temporary name and renamed when complete, so a directory that exists is whole.
    """
    T = math.ceil(wav.numel() / HOP_LENGTH)
    np_dtype = np.dtype(dtype)
    partial = _partial(out_dir)
    try:
        with writing(partial):  # a full disk is the output's fault, not the input's: OutputWriteError
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            with ExitStack() as files_open:
                files = {layer: files_open.enter_context(open(partial / f"layer_{layer:02d}.npy", "wb"))
                         for layer in layers}
                for f in files.values():
                    _write_npy_header(f, (T, model.width), np_dtype)
                for _, feats in iter_features(wav, model, layers, chunk_seconds, overlap_seconds):
                    for layer, x in zip(layers, feats):
                        files[layer].write(np.ascontiguousarray(x.numpy().astype(np_dtype)).tobytes())
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # the space it took, back (the error raised says what failed)
        raise
    return T


@dataclass
class FolderSummary:
    written: list[dict] = field(default_factory=list)  # {"source", "output", "frames"}
    skipped: list[str] = field(default_factory=list)  # outputs that existed already
    failed: list[dict] = field(default_factory=list)  # {"source", "kind" (audio.FAILURE_KINDS), "reason"}


def _partial(out_dir: Path) -> Path:
    """Where ``write_features`` builds ``out_dir`` before renaming it into place."""
    return out_dir.with_name(f".{out_dir.name}.partial")


def _output_names(files: list[Path], src: Path) -> list[Path]:
    """Output folder (relative) per file, never one for two files: its path without the suffix
    (``sub/a.wav`` -> ``sub/a``), or with it (``sub/a.wav``) where the short name would meet another
    output: the short name of another file (``a.wav``, ``a.flac``), the long name of another
    (``a.wav.flac`` -> ``a.wav``), a folder holding other outputs (``sub.wav`` -> ``sub`` beside
    ``sub/b.wav``), another's temporary folder (``.a.partial.wav``) or the manifest (``features.json.wav``).

    Long names cannot meet: they are distinct paths of files, none of which is a folder of another, and
    they end in an audio extension where a temporary folder ends in ``.partial``. A file switched to its
    long name may free nothing and clash with no more, so the switching stops.
    """
    rel = [f.relative_to(src) for f in files]
    long: set[int] = set()  # files named by their long name
    while True:
        names = [r if i in long else r.with_suffix("") for i, r in enumerate(rel)]
        taken: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            taken.setdefault(name.as_posix(), []).append(i)
        reserved = {MANIFEST, MANIFEST_TMP} | {_partial(n).as_posix() for n in names} | \
            {parent.as_posix() for n in names for parent in n.parents if parent != Path(".")}
        switch = {i for i, n in enumerate(names) if i not in long and
                  (len(taken[n.as_posix()]) > 1 or n.as_posix() in reserved)}
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
    earlier ones whose output is still there). Files whose directory exists are
    skipped unless ``overwrite``; an ``out`` made with other settings is refused. Unreadable audio is
    reported in ``failed`` (path, kind, reason; any other error while decoding one file is kind ``error``)
    and the run goes on.
    """
    from musiclm_stab.audio import AudioError, list_audio_files, load_audio

    src, out = Path(src), Path(out)
    check_folder_path(out)  # a file in the way: refused before the model is loaded
    if not isinstance(model, FeatureModel):
        model = load_feature_model(model, device)
    failed: list[dict] = []
    if src.is_file():
        files, names = [src], [Path(src.stem)]
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
            frames = write_features(wav, model, target, chosen, chunk_seconds, overlap_seconds, dtype)
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
                                epilog="Reference: docs/EXPORT.md")
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
