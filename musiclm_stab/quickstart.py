"""The main job, end to end: default corpus -> EnCodec weights -> tokenize -> pretrain -> evaluate -> plot.

    musiclm-stab quickstart [--work work] [--steps 200] [--num-tracks 24]

Each stage is reused when its output already exists (same settings), so a rerun only trains a new run.
Training runs through the real ``accelerate launch recipes/pretrain.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def ensure_weights(corpus_dir: Path, work: Path) -> tuple[str | None, str | None]:
    """(weights file or None for the pretrained model, note for the data's metadata)."""
    from musiclm_stab.encodec_weights import WeightsUnavailable, load_encodec, make_local_weights

    try:
        load_encodec(None)
        print("using the pretrained EnCodec 24 kHz model")
        return None, None
    except WeightsUnavailable as e:
        reason = str(e).splitlines()[0]
    local = work / "encodec_local_seed0.pt"
    note = ("local weights made by `musiclm-stab make-weights` (random encoder, codebooks fitted by seeded "
            f"k-means on the default corpus) because the pretrained model could not be had: {reason}")
    print("*" * 78)
    print("The pretrained EnCodec weights could not be downloaded (no internet?).")
    print(f"Using LOCAL weights instead: {local}")
    print("They are recorded in the tokenized data's metadata (tokenizer.json: weights, weights_sha256, weights_note).")
    print("*" * 78, flush=True)
    if not local.exists():
        files = sorted(p for p in corpus_dir.iterdir() if p.suffix in (".flac", ".wav"))
        make_local_weights(files, local, seed=0, max_seconds=600)
    return str(local), note


def ensure_tokens(corpus_dir: Path, out: Path, weights: str | None, note: str | None) -> Path:
    from musiclm_stab.encodec_weights import load_encodec
    from musiclm_stab.tokenize import tokenize

    meta = out / "tokenizer.json"
    if meta.exists():
        _, info = load_encodec(weights)
        if json.loads(meta.read_text()).get("weights_sha256") == info["weights_sha256"]:
            print(f"reusing tokenized data in {out}")
            return out
        print(f"{out} was tokenized with other weights: tokenizing again")
        shutil.rmtree(out)
    print(tokenize(corpus_dir, out, weights=weights, weights_note=note))
    return out


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab quickstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="work", help="folder for the corpus, weights and tokenized data")
    p.add_argument("--runs", default="runs", help="folder for run directories")
    p.add_argument("--num-tracks", type=int, default=24)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    p.add_argument("--data-only", action="store_true",
                   help="stop after tokenizing (the data the benchmarks and the study use)")
    args = p.parse_args(argv)
    t0 = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    from musiclm_stab.corpus import build_corpus

    _banner(f"1/5 default corpus ({args.num_tracks} Bach chorales rendered with a General MIDI soundfont)")
    corpus_dir = work / "default_corpus"
    build_corpus(corpus_dir, num_tracks=args.num_tracks, seed=0)

    _banner("2/5 EnCodec weights")
    weights, note = ensure_weights(corpus_dir, work)

    _banner("3/5 tokenize")
    tokens = ensure_tokens(corpus_dir, work / "default_corpus_tokens", weights, note)
    if args.data_only:
        print(f"\ndata ready in {time.time() - t0:.0f} s: {tokens}")
        return 0

    _banner("4/5 pretrain (accelerate launch recipes/pretrain.py)")
    name = time.strftime("tiny-%Y%m%d-%H%M%S")
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate) if accelerate.exists() else "accelerate", "launch", "--num_processes", "1",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(REPO / "recipes" / "pretrain.py"), "--config", args.recipe, f"--data.path={tokens}",
           f"--train.name={name}", f"--train.output_dir={args.runs}", f"--train.max_steps={args.steps}"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    run_dir = Path(args.runs) / name

    _banner("5/5 evaluate and plot")
    from musiclm_stab.evaluate import evaluate, format_table
    from musiclm_stab.plot import plot_runs, read_run

    print(format_table(evaluate(run_dir)))
    figures = plot_runs([read_run(run_dir)], run_dir / "figures")
    print(f"figures: {', '.join(str(f) for f in figures if f.suffix == '.png')}")
    print(f"\nmain job done in {time.time() - t0:.0f} s. Run directory: {run_dir}")
    return 0
