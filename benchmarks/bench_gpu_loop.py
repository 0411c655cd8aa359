"""The real training loop against the synthetic step at the same batch (issue 17: "the loop within 5% of
the synthetic step"): a real run of recipes/pretrain.py (real tokens, the data loader with its workers,
noise mixup, span masks, CQT target, metrics, checkpoints, accelerate) for a few hundred steps, its s/step
read from metrics.jsonl (``audio_s_per_s`` of each row, the first rows dropped: start-up), then
benchmarks/bench_gpu.py's synthetic step of the same size, dtype, batch and crop length.

    python benchmarks/bench_gpu_loop.py --data TOKENS --config recipes/study_prenorm_clip1_run2.yaml \\
        --size large --dtype fp16 --batch 8 --seconds 5.12 --workers 2 --steps 120 --log-every 10
    python benchmarks/bench_gpu_loop.py --data TOKENS --config recipes/tiny.yaml --device cpu --size tiny \\
        --dtype fp32 --batch 2 --seconds 2 --workers 0 --steps 4 --log-every 1 --skip-rows 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def run(cmd: list[str], env: dict, log: Path) -> None:
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}); its output: {log}\n{log.read_text()[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a tokenized dataset (musiclm-stab tokenize)")
    p.add_argument("--config", default="recipes/study_prenorm_clip1_run2.yaml")
    p.add_argument("--overlay", action="append", default=[], help="further --config files")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="large")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=0, help="0: half the steps (one write mid-run)")
    p.add_argument("--skip-rows", type=int, default=2, help="metrics rows dropped at the start")
    p.add_argument("--synthetic-steps", type=int, default=20)
    p.add_argument("--out", default=None, help="folder for the logs and the JSON row (default: a temp dir)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_loop_"))
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="bench_loop_runs_"))
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    mp = {"fp16": "fp16", "bf16": "bf16", "fp32": "no"}[args.dtype]
    ckpt_every = args.checkpoint_every or max(1, args.steps // 2)
    cmd = [sys.executable, "recipes/pretrain.py", "--config", args.config]
    for o in args.overlay:
        cmd += ["--config", o]
    cmd += [f"--data.path={args.data}", f"--data.batch_size={args.batch}", f"--data.crop_seconds={args.seconds}",
            f"--data.num_workers={args.workers}", f"--model.size={args.size}", f"--train.mixed_precision={mp}",
            f"--train.output_dir={runs}", "--train.name=loop", f"--train.max_steps={args.steps}",
            f"--train.log_every={args.log_every}", f"--train.checkpoint_every={ckpt_every}", "--train.trackers=[]",
            "--train.eval_every=0", "--data.eval_fraction=0",
            # like the synthetic step: one micro-batch per update (not the recipe's global batch), a plain
            # schedule, and fp16 as bench_gpu.py runs it (autocast + GradScaler: train.fp16_mode=amp)
            "--train.global_batch_crops=null", "--train.stop_at=null", "--optim.warmup_steps=null",
            "--train.fp16_mode=amp"]
    run(cmd, env, out / "loop.log")
    rows = [json.loads(line) for line in (runs / "loop" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["audio_s_per_s"] for r in rows if "audio_s_per_s" in r][args.skip_rows:]
    if not rates:
        sys.exit(f"no metrics rows left after dropping {args.skip_rows}: raise --steps")
    crop_s = args.batch * args.seconds
    loop_s = statistics.median(crop_s / r for r in rates)

    synth_json = out / "synthetic.json"
    run([sys.executable, str(HERE / "bench_gpu.py"), "--device", args.device, "--sizes", args.size, "--dtypes",
         args.dtype, "--batch", str(args.batch), "--seconds", str(args.seconds), "--steps", str(args.synthetic_steps),
         "--warmup", "3", "--json", str(synth_json)], env, out / "synthetic.log")
    (synth,) = json.loads(synth_json.read_text())
    row = {"config": args.config, "size": args.size, "dtype": args.dtype, "batch": args.batch, "seconds": args.seconds,
           "workers": args.workers, "loop_s_per_step": loop_s, "synthetic_s_per_step": synth["s_per_step"],
           "loop_over_synthetic": loop_s / synth["s_per_step"], "rows_used": len(rates),
           "checkpoint_every": ckpt_every}
    (out / "loop.json").write_text(json.dumps(row, indent=1))
    print(f"real loop ({args.config}, {args.steps} steps, rows of {args.log_every} steps, first {args.skip_rows} "
          f"dropped, checkpoint every {ckpt_every}) vs synthetic step (bench_gpu.py), same size/dtype/batch/crop")
    print("| size | dtype | batch | loader workers | loop s/step | synthetic s/step | loop / synthetic |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.size} | {args.dtype} | {args.batch} x {args.seconds} s | {args.workers} | {loop_s:.3f} | "
          f"{synth['s_per_step']:.3f} | {row['loop_over_synthetic']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
