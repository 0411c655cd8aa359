"""Training throughput of the tiny recipe: 1 process vs 2 gloo processes at the same global batch.

Each configuration is a real launch of recipes/pretrain.py: 1 process with plain python, 2 processes with
``ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2`` (the launch the tests use; ``accelerate launch --cpu``
starts one process here). Both use the same cores in total: by default each process gets
cores / processes threads. With ``train.log_every=1`` metrics.jsonl holds one row per step whose
``audio_s_per_s`` times that step alone (from the end of the previous step's logging), so start-up and the
final checkpoint are outside; the first ``--warmup`` steps are dropped, the rest give steps/s and
audio-s/s. Launches alternate (1, 2, 1, 2, ...) so load from other jobs hits both alike.

    python benchmarks/bench_processes.py --data work/default_corpus_tokens --steps 40 --warmup 5 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, procs: int, out: Path, name: str) -> list[dict]:
    """Train ``args.steps`` steps with ``procs`` processes; the metrics rows after the warm-up."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // procs)
    script = [str(REPO / "recipes" / "pretrain.py"), "--config", str(REPO / "recipes" / "tiny.yaml"),
              f"--data.path={args.data}", f"--train.output_dir={out}", f"--train.name={name}",
              f"--data.batch_size={args.global_batch // procs}", f"--data.crop_seconds={args.crop_seconds}",
              f"--train.max_steps={args.steps}", "--train.log_every=1",
              f"--train.checkpoint_every={args.steps}", *[f"--{s}" for s in args.set]]
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": str(threads)}
    if procs == 1:
        cmd = [sys.executable, *script]
    else:
        env["ACCELERATE_USE_CPU"] = "1"
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(procs), "--master_port", str(free_port()), *script]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{procs}-process run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    if f"{procs} process(es)" not in proc.stdout:
        sys.exit(f"expected {procs} process(es), the run says:\n{proc.stdout[-2000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "audio_s_per_s" in r and r["step"] > args.warmup]


def summarize(rows: list[dict], global_batch_s: float) -> dict:
    seconds = [global_batch_s / r["audio_s_per_s"] for r in rows]  # one step each
    steps_per_s = len(seconds) / sum(seconds)
    return {"steps": len(seconds), "steps_per_s": steps_per_s, "audio_s_per_s": steps_per_s * global_batch_s,
            "median_step_s": statistics.median(seconds)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO / "work" / "default_corpus_tokens"), help="tokenized dataset")
    p.add_argument("--steps", type=int, default=40, help="steps per launch, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    p.add_argument("--global-batch", type=int, default=4, help="crops per update (even: split over 2 processes)")
    p.add_argument("--crop-seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=1, help="launches per configuration, alternating")
    p.add_argument("--threads", type=int, default=None, help="threads per process (default: cores / processes)")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE", help="more recipe overrides")
    args = p.parse_args(argv)
    if args.global_batch % 2 or args.steps <= args.warmup:
        p.error("--global-batch must be even and --steps larger than --warmup")
    global_batch_s = args.global_batch * args.crop_seconds
    out = Path(tempfile.mkdtemp(prefix="bench_processes_"))
    results: dict[int, list[dict]] = {1: [], 2: []}
    try:
        for r in range(args.repeats):
            for procs in (1, 2):
                rows = launch(args, procs, out, f"p{procs}_r{r}")
                results[procs].append(summarize(rows, global_batch_s))
                print(f"  {procs} process(es), launch {r + 1}: {results[procs][-1]['audio_s_per_s']:.2f} audio-s/s",
                      file=sys.stderr)
    finally:
        shutil.rmtree(out, ignore_errors=True)

    cores = os.cpu_count()
    print(f"tiny recipe, global batch {args.global_batch} x {args.crop_seconds:g} s = {global_batch_s:g} audio-s per "
          f"update, {args.steps} steps per launch, first {args.warmup} not timed, {cores} cores\n")
    print("| processes | batch per process | threads per process | launch | steps timed | steps/s | audio-s/s "
          "| median step |")
    print("|---|---|---|---|---|---|---|---|")
    pooled = {}
    for procs, runs in results.items():
        threads = args.threads or max(1, (cores or 1) // procs)
        for i, s in enumerate(runs):
            print(f"| {procs} | {args.global_batch // procs} | {threads} | {i + 1} | {s['steps']} | "
                  f"{s['steps_per_s']:.3f} | {s['audio_s_per_s']:.2f} | {s['median_step_s']:.3f} s |")
        pooled[procs] = sum(s["steps"] for s in runs) / sum(s["steps"] / s["steps_per_s"] for s in runs)
    print(f"\nall launches pooled: 1 process {pooled[1]:.3f} steps/s, 2 processes {pooled[2]:.3f} steps/s "
          f"(2 / 1 = {pooled[2] / pooled[1]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
