"""Tokenizing music: audio files or an HF dataset -> EnCodec codes, saved as an HF dataset on disk.

Each track is decoded to 24 kHz mono, cut into segments of ``segment_seconds`` (a multiple of the
320-sample hop; a shorter tail is kept if it lasts at least ``min_seconds``), and every segment is
encoded with EnCodec at 6 kbps into ``codes`` [8, T] with T = samples / 320. One row per segment:

    id (str "{track}@{start_sample}"), track (str), start (float s), pcm (float32 [S]),
    codes (int16 [8, T]), num_frames (int T)

``tokenizer.json`` in the output folder identifies the tokenizer (weights sha256, bandwidth, rates);
``check_same_tokenizer`` refuses to mix data made with different ones. Files that cannot be decoded
are skipped and listed in ``failures.jsonl`` with the reason; the run fails only if all of them do.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import torch
from datasets.arrow_writer import ArrowWriter
from tqdm.auto import tqdm

from musiclm_stab import HOP_LENGTH, NUM_CODEBOOKS, SAMPLE_RATE, __version__
from musiclm_stab.audio import AudioError, decode_bytes, from_array, list_audio_files, load_audio
from musiclm_stab.encodec_weights import WeightsUnavailable, load_encodec

if TYPE_CHECKING:
    from encodec import EncodecModel

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
# Fields that must agree for two tokenized datasets (or a dataset and a model) to be mixed.
IDENTITY_KEYS = ("weights_sha256", "model", "bandwidth", "sample_rate", "frame_rate", "hop_length",
                 "num_codebooks", "codebook_size")


class TokenizerMismatch(ValueError):
    """Two datasets (or a dataset and a model) were tokenized with different EnCodec weights/settings."""


class TokenizeError(RuntimeError):
    """The source gave nothing to tokenize (no audio, or every file failed)."""


@dataclass
class TokenizeSummary:
    out_dir: str
    num_tracks: int
    num_rows: int
    total_seconds: float
    num_failures: int
    seconds_taken: float

    @property
    def realtime_factor(self) -> float:
        """Seconds of audio tokenized per second of wall time."""
        return self.total_seconds / max(self.seconds_taken, 1e-9)

    def __str__(self) -> str:
        return (
            f"tokenized {self.num_tracks} tracks into {self.num_rows} segments "
            f"({self.total_seconds / 3600:.3f} h of audio) in {self.seconds_taken:.1f} s "
            f"({self.realtime_factor:.1f}x real time); {self.num_failures} failed -> {self.out_dir}"
        )


@dataclass
class _Track:
    name: str  # stable track id: path relative to SRC, or a row index / path column of an HF dataset
    where: str  # what to name in a failure record
    load: Callable[[], torch.Tensor]  # -> (S,) float32 at 24 kHz; raises AudioError


# ---------------------------------------------------------------------------------------------------
# Sources


def _is_hf_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _folder_tracks(src: Path) -> list[_Track]:
    files = list_audio_files(src)
    return [_Track(p.relative_to(src).as_posix(), str(p), lambda p=p: load_audio(p)) for p in files]


def _hf_tracks(src: Path, audio_column: str, split: str | None) -> list[_Track]:
    """Tracks of an HF dataset saved with ``save_to_disk``.

    The audio column may be an ``Audio`` feature (read with ``decode=False``: decoding through
    ``datasets`` needs torchcodec and FFmpeg), a struct of ``{"bytes", "path"}``, a struct of
    ``{"array", "sampling_rate"}``, or plain path strings (relative paths are tried against the
    working directory, then the dataset folder). Tracks are named by a unique ``path`` column if
    there is one, else by row index.
    """
    ds = datasets.load_from_disk(str(src))
    if isinstance(ds, datasets.DatasetDict):
        if split is None and len(ds) == 1:
            split = next(iter(ds))
        if split not in ds:
            raise TokenizeError(f"{src} has splits {', '.join(ds)}; choose one with --split")
        ds = ds[split]
    if audio_column not in ds.column_names:
        raise TokenizeError(f"{src} has no column {audio_column!r} (columns: {', '.join(ds.column_names)}); "
                            "name the audio column with --audio-column")
    if isinstance(ds.features[audio_column], datasets.Audio):
        ds = ds.cast_column(audio_column, datasets.Audio(decode=False))
    names = [str(i) for i in range(len(ds))]
    if "path" in ds.column_names and ds.features["path"] == datasets.Value("string"):
        paths = ds["path"]
        if None not in paths and len(set(paths)) == len(paths):
            names = list(paths)
    audio = ds.select_columns([audio_column])

    def load(i: int) -> torch.Tensor:
        value = audio[i][audio_column]
        where = f"{src}[{i}]"
        if isinstance(value, dict) and value.get("bytes"):
            return decode_bytes(value["bytes"], f"{where} ({value.get('path') or 'bytes'})")
        if isinstance(value, dict) and value.get("array") is not None:
            return from_array(np.asarray(value["array"]), int(value["sampling_rate"]), where)
        path = value.get("path") if isinstance(value, dict) else value
        if not path:
            raise AudioError(where, "row has no audio (neither bytes nor a path)")
        path = Path(path)
        if not path.is_absolute() and not path.exists() and (src / path).exists():
            path = src / path
        return load_audio(path)

    return [_Track(names[i], f"{src}[{i}]", lambda i=i: load(i)) for i in range(len(ds))]


# ---------------------------------------------------------------------------------------------------
# Segmenting and encoding


def segment_bounds(num_samples: int, segment_samples: int, min_samples: int) -> list[tuple[int, int]]:
    """(start, length) of each segment of a track; lengths are multiples of the 320-sample hop.

    Full segments of ``segment_samples``; the tail is trimmed down to a multiple of the hop and
    kept only if it still has at least ``min_samples`` (and at least one frame).
    """
    bounds = []
    for start in range(0, num_samples, segment_samples):
        length = min(segment_samples, num_samples - start) // HOP_LENGTH * HOP_LENGTH
        if length >= max(min_samples, HOP_LENGTH):
            bounds.append((start, length))
    return bounds


def encode_batch(model: EncodecModel, pcm: torch.Tensor) -> torch.Tensor:
    """EnCodec codes of equal-length segments: pcm [B, S] (S a multiple of 320) -> codes [B, K, T] int16."""
    B, S = pcm.shape
    device = next(model.parameters()).device
    with torch.inference_mode():
        frames = model.encode(pcm.to(device).unsqueeze(1))  # x: (B, 1, S)
    assert len(frames) == 1, "the 24 kHz model encodes a segment in one frame"
    codes = frames[0][0]  # (B, K, T)
    assert codes.shape == (B, NUM_CODEBOOKS, S // HOP_LENGTH), \
        f"EnCodec gave codes {tuple(codes.shape)} for input {(B, 1, S)}; expected {(B, NUM_CODEBOOKS, S // HOP_LENGTH)}"
    return codes.to(torch.int16).cpu()


def _rows(
    tracks: list[_Track], model: EncodecModel, segment_samples: int, min_samples: int, batch_size: int,
    failures: list[dict[str, Any]], progress: bool,
) -> Iterator[dict[str, list]]:
    """Batches of output rows, in track order then start. Records bad tracks in ``failures``."""
    pending: list[tuple[str, int, torch.Tensor]] = []  # (track, start, pcm (S,)) waiting for codes

    def flush() -> dict[str, list]:
        codes: list[torch.Tensor | None] = [None] * len(pending)
        by_length: dict[int, list[int]] = {}
        for i, (_, _, pcm) in enumerate(pending):
            by_length.setdefault(len(pcm), []).append(i)
        for idx in by_length.values():  # equal lengths share a batch
            for j in range(0, len(idx), batch_size):
                part = idx[j : j + batch_size]
                for i, c in zip(part, encode_batch(model, torch.stack([pending[i][2] for i in part]))):
                    codes[i] = c  # (K, T)
        batch = {
            "id": [f"{t}@{s}" for t, s, _ in pending],
            "track": [t for t, _, _ in pending],
            "start": [s / SAMPLE_RATE for _, s, _ in pending],
            "pcm": [p.numpy() for _, _, p in pending],
            "codes": [c.numpy() for c in codes],
            "num_frames": [c.shape[1] for c in codes],
        }
        pending.clear()
        return batch

    bar = tqdm(tracks, desc="tokenizing", unit="track", disable=not progress)
    for track in bar:
        try:
            wave = track.load()  # (S,)
        except AudioError as e:  # (an HF row names its row; the reason then names the file, if any)
            failures.append({"path": track.where, "reason": e.reason if e.path == track.where else str(e)})
            continue
        bounds = segment_bounds(len(wave), segment_samples, min_samples)
        if not bounds:
            failures.append({"path": track.where, "reason": f"too short: {len(wave) / SAMPLE_RATE:.3f} s "
                             f"< min_seconds {min_samples / SAMPLE_RATE:g} s"})
            continue
        for start, length in bounds:
            pending.append((track.name, start, wave[start : start + length]))
            if len(pending) >= batch_size:
                yield flush()
        bar.set_postfix(failed=len(failures))
    if pending:
        yield flush()


# ---------------------------------------------------------------------------------------------------
# The job


def _default_note(info: dict[str, Any]) -> str | None:
    if info["weights"] == "pretrained":
        return None
    prov = info.get("weights_provenance")
    if prov:
        return (f"local weights {info['weights_file']} made by {prov.get('made_by')} (seed {prov.get('seed')}, "
                f"fitted on {prov.get('seconds_used')} s of audio): a random encoder with fitted codebooks, "
                "not the pretrained EnCodec model")
    return f"local weights file {info['weights_file']}"


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite (overwrite=True) to replace it")
    if not out.is_dir() or not any((out / f).exists() for f in (METADATA_FILE, FAILURES_FILE, "state.json")):
        raise FileExistsError(f"refusing to overwrite {out}: it does not look like a tokenized dataset "
                              f"(no {METADATA_FILE}); delete it yourself or choose another output")


def tokenize(
    src: str | Path,
    out_dir: str | Path,
    weights: str | Path | None = None,
    segment_seconds: float = 10.0,
    min_seconds: float = 1.0,
    batch_size: int = 8,
    device: str = "cpu",
    weights_note: str | None = None,
    audio_column: str = "audio",
    split: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> TokenizeSummary:
    """Tokenize a folder of audio (recursive) or a saved HF dataset into ``out_dir``.

    ``weights=None`` uses the pretrained EnCodec model (raises WeightsUnavailable offline); a file
    path uses local weights (see ``musiclm-stab make-weights``). ``weights_note`` is free text stored
    in tokenizer.json (a note is derived for locally made weights when none is given).
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out_dir)
    segment_samples = int(round(segment_seconds * SAMPLE_RATE)) // HOP_LENGTH * HOP_LENGTH
    min_samples = math.ceil(min_seconds * SAMPLE_RATE)
    if segment_samples < HOP_LENGTH:
        raise ValueError(f"segment_seconds={segment_seconds} is shorter than one frame ({HOP_LENGTH} samples)")
    if not 0 <= min_samples <= segment_samples:
        raise ValueError(f"min_seconds={min_seconds} must be in [0, segment_seconds={segment_seconds}]")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not src.exists():
        raise FileNotFoundError(f"source {src} does not exist")
    _check_out_dir(out, overwrite)

    if _is_hf_dataset(src):
        kind, tracks = "hf_dataset", _hf_tracks(src, audio_column, split)
    elif src.is_dir():
        kind, tracks = "folder", _folder_tracks(src)
    else:
        raise TokenizeError(f"{src} is neither a folder of audio files nor a dataset saved with save_to_disk")
    if not tracks:
        raise TokenizeError(f"no audio found in {src}")

    model, info = load_encodec(None if weights is None else str(weights))
    model.to(torch.device(device))

    failures: list[dict[str, Any]] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        writer = ArrowWriter(features=FEATURES, path=str(work / "rows.arrow"),
                                                   writer_batch_size=max(8, batch_size))
        num_rows, total_samples, names = 0, 0, set()
        for batch in _rows(tracks, model, segment_samples, min_samples, batch_size, failures, progress):
            writer.write_batch(batch)
            num_rows += len(batch["id"])
            total_samples += sum(len(p) for p in batch["pcm"])
            names.update(batch["track"])
        writer.finalize()
        if num_rows == 0:
            if out.exists():  # overwrite was asked for: this run's result replaces the old one
                shutil.rmtree(out)
            out.mkdir(parents=True)
            _write_failures(out / FAILURES_FILE, failures)
            shown = "; ".join(f"{f['path']}: {f['reason']}" for f in failures[:3])
            raise TokenizeError(f"every one of the {len(tracks)} inputs failed ({shown}); "
                                f"all reasons in {out / FAILURES_FILE}")
        ds = datasets.Dataset.from_file(str(work / "rows.arrow"))
        ds.save_to_disk(str(work / "dataset"))
        del ds
        summary = TokenizeSummary(str(out), len(names), num_rows, total_samples / SAMPLE_RATE, len(failures),
                                  0.0)
        meta = {
            **info,
            "segment_seconds": segment_samples / SAMPLE_RATE,
            "segment_samples": segment_samples,
            "min_seconds": min_seconds,
            "num_rows": num_rows,
            "num_tracks": len(names),
            "total_seconds": round(total_samples / SAMPLE_RATE, 6),
            "num_failures": len(failures),
            "weights_note": weights_note if weights_note is not None else _default_note(info),
            "source": str(src.resolve()),
            "source_kind": kind,
            "created_by": f"musiclm-stab tokenize {__version__}",
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        (work / "dataset" / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _write_failures(work / "dataset" / FAILURES_FILE, failures)
        if out.exists():
            shutil.rmtree(out)
        (work / "dataset").rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary.seconds_taken = time.perf_counter() - t0
    return summary


def _write_failures(path: Path, failures: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(f) + "\n" for f in failures))


def load_tokenized(path: str | Path) -> tuple[datasets.Dataset, dict[str, Any]]:
    """A tokenized dataset and its tokenizer info (the contents of tokenizer.json)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenized dataset {path} does not exist; make it with "
                                f"`musiclm-stab tokenize AUDIO_DIR {path}`")
    if not (path / METADATA_FILE).is_file():
        raise ValueError(f"{path} is not a tokenized dataset: {METADATA_FILE} is missing "
                         f"(make one with `musiclm-stab tokenize AUDIO_DIR OUT_DIR`)")
    info = json.loads((path / METADATA_FILE).read_text())
    ds = datasets.load_from_disk(str(path))
    missing = set(FEATURES) - set(ds.column_names)
    if missing:
        raise ValueError(f"{path} is not a tokenized dataset: columns {sorted(missing)} are missing")
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


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab tokenize",
                                description="Tokenize audio into EnCodec codes, saved as an HF dataset.")
    p.add_argument("src", help="folder of audio files (recursive) or an HF dataset saved with save_to_disk")
    p.add_argument("out", help="output folder (HF dataset + tokenizer.json + failures.jsonl)")
    p.add_argument("--weights", default=None,
                   help="local EnCodec state dict (default: the pretrained model, downloaded at first use)")
    p.add_argument("--weights-note", default=None, help="free text recorded with the data about the weights")
    p.add_argument("--segment-seconds", type=float, default=10.0)
    p.add_argument("--min-seconds", type=float, default=1.0, help="shortest tail segment kept")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--audio-column", default="audio", help="audio column of an HF dataset")
    p.add_argument("--split", default=None, help="split of an HF DatasetDict")
    p.add_argument("--overwrite", action="store_true", help="replace an existing tokenized dataset at OUT")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda was asked for but no CUDA device is available")
    try:
        summary = tokenize(args.src, args.out, weights=args.weights, segment_seconds=args.segment_seconds,
                           min_seconds=args.min_seconds, batch_size=args.batch_size, device=args.device,
                           weights_note=args.weights_note, audio_column=args.audio_column, split=args.split,
                           overwrite=args.overwrite)
    except (WeightsUnavailable, TokenizeError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"musiclm-stab tokenize: {e}", file=sys.stderr)
        return 1
    print(summary)
    if summary.num_failures:
        print(f"  {summary.num_failures} inputs could not be used; reasons in {Path(args.out) / FAILURES_FILE}")
    print(f"  summary: {json.dumps(asdict(summary))}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
