"""The study's real training loop against its synthetic step at the same batch (issue 46: "the real loop within
5% of the synthetic step"): one run launched as the study launches it (``accelerate launch recipes/pretrain.py``
with a study recipe and recipes/overlays/study_gpu.yaml: base size, fairseq fp16, batch 16 x 5.12 s, 4 loader
workers; real tokens through the real loader, noise mixup, span masks, the CQT target, metrics rows, TensorBoard,
per-layer diagnostics as the study logs them, a checkpoint mid-run), its s/step read from metrics.jsonl (each
row's ``audio_s_per_s``, the first rows dropped: start-up), then bench_gpu.py's synthetic step of the same
recipe, size, case, batch and crop (random data already on the device).

Held-out evaluation is off (``train.eval_every=0``): its time is outside the rows' clock anyway.

    python benchmarks/bench_gpu_loop.py --data TOKENS --steps 200 --log-every 10
    python benchmarks/bench_gpu_loop.py --data TOKENS --device cpu --size tiny --batch 1 --seconds 0.64 \\
        --workers 0 --steps 2 --log-every 1 --skip-rows 0 --synthetic-steps 1 --synthetic-warmup 0  # smoke test
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
sys.path.insert(0, str(REPO))

from musiclm_stab.experiments.launch import accelerate_executable, launch_command  # noqa: E402


def run(cmd: list[str], env: dict, log: Path) -> None:
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed ({proc.returncode}); its output: {log}\n{log.read_text()[-3000:]}")


def loop_rates(metrics: Path, batch: int, seconds: float, skip_rows: int) -> list[float]:
    """s/step of each metrics row (its ``audio_s_per_s`` over its steps), the first ``skip_rows`` dropped."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [r["audio_s_per_s"] for r in rows if "audio_s_per_s" in r][skip_rows:]
    return [batch * seconds / r for r in rates]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a tokenized dataset (musiclm-stab tokenize)")
    p.add_argument("--case", default="fairseq-math",
                   help="bench_gpu.py's case; its attention picks the recipe (relax: the relax recipe)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="base")
    p.add_argument("--batch", type=int, default=None, help="crops per step (default: the study's, 16 at base size)")
    p.add_argument("--seconds", type=float, default=None, help="crop length (default: the study's, 5.12 s)")
    p.add_argument("--workers", type=int, default=None, help="loader workers (default: the study's, 4)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=0, help="0: half the steps (one write mid-run)")
    p.add_argument("--skip-rows", type=int, default=3, help="metrics rows dropped at the start")
    p.add_argument("--synthetic-steps", type=int, default=20)
    p.add_argument("--synthetic-warmup", type=int, default=3, help="untimed synthetic steps first")
    p.add_argument("--out", default=None, help="folder for the logs and the JSON row (default: a temp dir)")
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    from bench_case import MODES, OVERLAYS, PLAIN_RECIPE, RECIPES, Case, study_config

    case = Case.parse(args.case)
    data = study_config(args.size, case).data  # the study's batch, crop and loader workers unless given
    args.batch = args.batch or data.batch_size
    args.seconds = args.seconds or data.crop_seconds
    args.workers = data.num_workers if args.workers is None else args.workers
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_loop_"))
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="bench_loop_runs_"))
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    mp, fp16_mode = MODES[case.mode]
    # the files bench_gpu.py's study_config layers for this size and attention: the same model in both
    configs = [str(REPO / RECIPES.get(case.attention, PLAIN_RECIPE)), *(str(REPO / o) for o in OVERLAYS[args.size])]
    ckpt_every = args.checkpoint_every or max(1, args.steps // 2)
    overrides = [f"--data.path={args.data}", f"--data.batch_size={args.batch}", f"--data.crop_seconds={args.seconds}",
                 f"--data.num_workers={args.workers}", f"--model.size={args.size}",
                 f"--model.attention={case.attention}", f"--train.mixed_precision={mp}",
                 f"--train.fp16_mode={fp16_mode}", f"--train.output_dir={runs}", "--train.name=loop",
                 f"--train.max_steps={args.steps}", "--train.stop_at=null", f"--train.log_every={args.log_every}",
                 f"--train.checkpoint_every={ckpt_every}", "--train.eval_every=0", "--data.eval_fraction=0",
                 "--train.global_batch_crops=null", "--optim.warmup_steps=null"]  # the warmup a share of the run
    if "gemm" in case.levers or "cudnnbench" in case.levers:
        sys.exit("error: the real loop has no switch for a lever; measure levers with bench_gpu.py")
    cmd = launch_command(configs, overrides, accelerate=accelerate_executable())
    run(cmd, env, out / "loop.log")
    per_step = loop_rates(runs / "loop" / "metrics.jsonl", args.batch, args.seconds, args.skip_rows)
    if not per_step:
        sys.exit(f"error: no metrics rows left after dropping {args.skip_rows}: raise --steps")
    loop_median, loop_mean = statistics.median(per_step), statistics.fmean(per_step)

    synth_json = out / "synthetic.json"
    synth_cmd = [sys.executable, str(HERE / "bench_gpu.py"), "--device", args.device, "--sizes", args.size,
                 "--cases", args.case, "--batch", str(args.batch), "--seconds", str(args.seconds),
                 "--steps", str(args.synthetic_steps), "--warmup", str(args.synthetic_warmup), "--json", str(synth_json)]
    run(synth_cmd, env, out / "synthetic.log")
    (synth,) = json.loads(synth_json.read_text())
    row = {"case": args.case, "configs": configs, "size": args.size, "batch": args.batch, "seconds": args.seconds,
           "workers": args.workers, "steps": args.steps, "log_every": args.log_every, "rows_used": len(per_step),
           "loop_s_per_step_median": loop_median, "loop_s_per_step_mean": loop_mean,
           "synthetic_s_per_step": synth["s_per_step"], "loop_over_synthetic_mean": loop_mean / synth["s_per_step"],
           "loop_over_synthetic_median": loop_median / synth["s_per_step"], "checkpoint_every": ckpt_every}
    (out / "loop.json").write_text(json.dumps(row, indent=1))
    print(f"real loop ({' + '.join(Path(c).name for c in configs)}; {args.steps} steps, rows of {args.log_every} "
          f"steps, first {args.skip_rows} dropped, checkpoint at step {ckpt_every}) vs the synthetic step "
          "(bench_gpu.py), same recipe, size, case, batch and crop")
    print("| size | case | batch | loader workers | loop s/step (mean of rows) | loop s/step (median) | "
          "synthetic s/step | loop / synthetic (mean) | loop / synthetic (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.size} | {args.case} | {args.batch} x {args.seconds} s | {args.workers} | {loop_mean:.4f} | "
          f"{loop_median:.4f} | {synth['s_per_step']:.4f} | {row['loop_over_synthetic_mean']:.3f}x | "
          f"{row['loop_over_synthetic_median']:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
