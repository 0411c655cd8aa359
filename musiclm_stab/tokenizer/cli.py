"""``musiclm-stab tokenize``: the command line of the tokenizing job (``pipeline.tokenize``) and of
merging shard outputs (``--merge``, ``merge.merge_shards``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from musiclm_stab.data.tokenized import FAILURES_FILE, WARNINGS_FILE
from musiclm_stab.output_errors import OutputWriteError
from musiclm_stab.tokenizer.lock import OutputBusy
from musiclm_stab.tokenizer.merge import merge_shards
from musiclm_stab.tokenizer.pipeline import tokenize
from musiclm_stab.tokenizer.plan import PIECE_SECONDS
from musiclm_stab.tokenizer.policy import SILENCE_POLICIES
from musiclm_stab.tokenizer.sources import TokenizeError
from musiclm_stab.tokenizer.weights import WeightsUnavailable


def cli_main(argv: list[str] | None = None) -> int:
    """``musiclm-stab tokenize [--merge] ...``; returns the exit status (1: a clear error on stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--merge":
        return _merge_main(argv[1:])
    p = argparse.ArgumentParser(prog="musiclm-stab tokenize",
                                description="Tokenize audio into EnCodec codes, saved as an HF dataset. "
                                "Rerun the same command to resume an interrupted run. "
                                "Merge shard outputs with: musiclm-stab tokenize --merge OUT SHARD_DIR...",
                                epilog="Reference: docs/TOKENIZING.md (offline: musiclm-stab docs TOKENIZING)")
    p.add_argument("src", help="folder of audio files (recursive), a manifest (.csv/.jsonl with a 'path' column "
                   "and optional 'id'), an HF dataset saved with save_to_disk, or with --streaming anything "
                   "datasets.load_dataset streams (e.g. a folder of parquet files)")
    p.add_argument("out", help="output folder (HF dataset + tokenizer.json + failures.jsonl)")
    p.add_argument("--weights", default=None,
                   help="local EnCodec state dict (default: the pretrained model, downloaded at first use)")
    p.add_argument("--weights-note", default=None, help="free text recorded with the data about the weights")
    p.add_argument("--segment-seconds", type=float, default=10.0)
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="shortest tail segment kept; shorter tracks are failures of kind too_short (default 1)")
    p.add_argument("--silence", choices=SILENCE_POLICIES, default="skip",
                   help="skip (default): leave out tracks and segments whose peak is below --silence-db, "
                   "reporting the tracks as failures of kind silent; keep: tokenize them")
    p.add_argument("--silence-db", type=float, default=-60.0, help="silence threshold, peak dBFS (default -60)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="segments encoded together (the encoder's LSTM runs on the batch; its convolutions, "
                   "which hold the memory, one segment at a time)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--workers", type=int, default=None,
                   help="encoder processes (default: one per CPU core on cpu, 0 = in this process)")
    p.add_argument("--shard", default=None, help="i/n: do every n-th work unit starting at i (merge with --merge)")
    p.add_argument("--retry-failures", action="store_true", help="run the inputs that failed before again")
    p.add_argument("--streaming", action="store_true", help="stream SRC with datasets.load_dataset(streaming=True)")
    p.add_argument("--audio-column", default="audio", help="audio column of an HF dataset")
    p.add_argument("--split", default=None, help="split of an HF DatasetDict (streaming: default train)")
    p.add_argument("--part-mb", type=float, default=None,
                   help="source MB per work unit (default: 1/64 of the source, within 4-64 MB)")
    p.add_argument("--part-tracks", type=int, default=64, help="most tracks per work unit (default 64)")
    p.add_argument("--piece-seconds", type=float, default=PIECE_SECONDS,
                   help="cut lossless files longer than twice this into work units of this much audio, so that "
                   f"one long track uses every worker (default {PIECE_SECONDS:g}; 0: never)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing tokenized dataset at OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda was asked for but no CUDA device is available")
    try:
        summary = tokenize(args.src, args.out, weights=args.weights, segment_seconds=args.segment_seconds,
                           min_seconds=args.min_seconds, batch_size=args.batch_size, device=args.device,
                           weights_note=args.weights_note, audio_column=args.audio_column, split=args.split,
                           overwrite=args.overwrite, progress=not args.no_progress, silence=args.silence,
                           silence_db=args.silence_db, workers=args.workers, shard=args.shard,
                           retry_failures=args.retry_failures, streaming=args.streaming, part_mb=args.part_mb,
                           part_tracks=args.part_tracks, piece_seconds=args.piece_seconds)
    except OutputBusy as e:  # refused: another writer holds the folder (nothing was touched)
        print(f"musiclm-stab tokenize: {e}", file=sys.stderr)
        return 2
    except (WeightsUnavailable, TokenizeError, FileExistsError, FileNotFoundError, ValueError,
            OutputWriteError) as e:
        print(f"musiclm-stab tokenize: {e}", file=sys.stderr)
        return 1
    print(summary)
    if summary.num_failures:
        print(f"  {summary.num_failures} inputs could not be used; reasons in {Path(args.out) / FAILURES_FILE}"
              + ("" if args.retry_failures else " (rerun with --retry-failures to try them again)"))
    if summary.num_warnings:
        print(f"  {summary.num_warnings} warnings about inputs that were tokenized: {Path(args.out) / WARNINGS_FILE}")
    print(f"  summary: {json.dumps(asdict(summary))}")
    return 0


def _merge_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab tokenize --merge",
                                description="Merge the outputs of --shard 0/n .. n-1/n into one tokenized dataset.",
                                epilog="Reference: docs/TOKENIZING.md (offline: musiclm-stab docs TOKENIZING)")
    p.add_argument("out", help="new output folder")
    p.add_argument("shards", nargs="+", help="the shard output folders")
    args = p.parse_args(argv)
    try:
        meta = merge_shards(args.out, args.shards)
    except OutputBusy as e:
        print(f"musiclm-stab tokenize --merge: {e}", file=sys.stderr)
        return 2
    except (TokenizeError, FileExistsError, FileNotFoundError, ValueError, OutputWriteError) as e:
        print(f"musiclm-stab tokenize --merge: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(args.shards)} shards into {args.out}: {meta['num_rows']} segments of {meta['num_tracks']} "
          f"tracks, {meta['num_failures']} failures")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
