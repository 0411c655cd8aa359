"""The main job, end to end: default corpus -> EnCodec weights -> tokenize -> pretrain -> evaluate -> plot.

    musiclm-stab quickstart [--work work] [--steps 200] [--num-tracks 24] [--data TOKENS] [--set S.K=V ...]

Each stage is reused when its output already exists (same settings), so a rerun only trains a new run.
``--data`` trains on tokenized data of your own instead (no corpus, weights or tokenizing). Training runs
through the real ``accelerate launch`` of the trainer (the recipes ship inside the package, so an installed
wheel runs it outside a checkout too), as one process in the recipe's precision: the launch passes
``--num_processes 1 --mixed_precision no``, so accelerate's default config (``accelerate config``) is not
read and the main job gives the same result on every machine (PRECISION_NOTE).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from musiclm_stab.experiments.launch import (
    DEFAULT_NUM_TRACKS,
    accelerate_executable,
    as_overrides,
    banner,
    default_data,
    launch_command,
)

# What --help says of precision, which the launch fixes (launch_command's single process).
PRECISION_NOTE = ("It trains one process in the recipe's precision (fp32 for tiny), whatever accelerate's default "
                  "config (`accelerate config`) says: --set train.mixed_precision=bf16 trains in bf16; "
                  "`musiclm-stab train` obeys accelerate's config.")


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab quickstart",
                                description=f"{__doc__.split(chr(10) * 2)[0]} {PRECISION_NOTE}",
                                epilog="Reference: README.md (Set up: two commands; offline: musiclm-stab docs "
                                "README)")
    p.add_argument("--work", default="work", help="folder for the corpus, weights and tokenized data")
    p.add_argument("--data", help="tokenized dataset to train on (default: the default corpus under --work, "
                   "made if missing)")
    p.add_argument("--runs", default="runs", help="folder for run directories")
    p.add_argument("--num-tracks", type=int, default=DEFAULT_NUM_TRACKS)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--recipe", default="tiny", help="recipe: a packaged one by name or a YAML file (default: tiny)")
    p.add_argument("--set", nargs="+", default=[], metavar="SECTION.KEY=VALUE", dest="extra",
                   help="further settings of the run (e.g. data.batch_size=2 train.mixed_precision=bf16)")
    p.add_argument("--data-only", action="store_true",
                   help="stop after tokenizing (the data `make bench` uses; the studies make their own, "
                   "rendered by tinysoundfont)")
    args = p.parse_args(argv)
    if args.data and args.data_only:
        p.error("--data-only makes the default data; --data names data that exists: not both")
    t0 = time.time()
    tokens = args.data or default_data(args.work, args.num_tracks)
    if args.data_only:
        print(f"\ndata ready in {time.time() - t0:.0f} s: {tokens}")
        return 0

    banner("pretrain (accelerate launch, one process, the recipe's precision)")
    name = time.strftime("tiny-%Y%m%d-%H%M%S")
    cmd = launch_command([args.recipe], [f"--data.path={tokens}", f"--train.name={name}",
                                         f"--train.output_dir={args.runs}", f"--train.max_steps={args.steps}",
                                         *as_overrides(args.extra)],
                         accelerate=accelerate_executable())
    print(shlex.join(cmd), flush=True)
    status = subprocess.run(cmd).returncode
    if status != 0:  # the trainer has said why (`error: ...`); accelerate launch reports any failure as 1
        print(f"musiclm-stab quickstart: error: training failed (exit {status}); nothing evaluated", file=sys.stderr)
        return 1
    run_dir = Path(args.runs) / name

    banner("evaluate and plot")
    from musiclm_stab.analysis.evaluate import evaluate, format_table
    from musiclm_stab.analysis.plot import plot_runs, read_run

    print(format_table(evaluate(run_dir)))
    figures = plot_runs([read_run(run_dir)], run_dir / "figures")
    print(f"figures: {', '.join(str(f) for f in figures if f.suffix == '.png')}")
    print(f"\nmain job done in {time.time() - t0:.0f} s. Run directory: {run_dir}")
    return 0
