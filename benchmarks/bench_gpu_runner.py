"""Several study runs sharing one GPU: steps per second in all with 1, 3, 5, 7 runs training at once, as separate
processes (what ``musiclm-stab study --jobs N`` starts) and, for comparison, as one process stepping N models in
turn. Each run steps the study's own synthetic step (bench_gpu.py's ``Step``: a study recipe with
recipes/overlays/study_gpu.yaml, base size, fairseq fp16, batch 16 x 5.12 s; the loader, metrics and
checkpoints of the real loop are measured by bench_gpu_loop.py).

The worker processes are started once and built and warmed up together; then round after round the first N of
them are told to step from a common start time, and every step that finishes inside the common window of
``--window`` seconds (after ``--lead`` seconds of stepping) counts. Idle workers hold their memory but no GPU
time. Rows are printed (a markdown table) and written to --json as each round ends.

    python benchmarks/bench_gpu_runner.py                                   # jobs 1 3 5 7, 15 s windows, and
                                                                            # one process with 3 models in turn
    python benchmarks/bench_gpu_runner.py --device cpu --size tiny --case fp32-sdpa --batch 1 --seconds 0.64 \\
        --jobs 1 2 --inproc 2 --window 2 --lead 0.5 --warmup 1               # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUDY_STEPS = 1000  # steps of one run of the study's GPU plan (recipes/overlays/study_gpu.yaml)


def worker(args) -> None:
    """Build ``args.models`` models (seeds 0..), warm each up, print ``ready``; then per ``go T0 START END N`` line
    on stdin step models 0..N-1 in turn from T0 until END and print the finish times inside [START, END]."""
    import torch
    from bench_gpu import Case, build_step, random_batch, study_config, sync

    from musiclm_stab.model import MusicMLM

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    case = Case.parse(args.case)
    cfg = study_config(args.size, case)
    steps = []
    for i in range(args.models):
        torch.manual_seed(args.seed + i)
        steps.append(build_step(MusicMLM(cfg.model), cfg, random_batch(cfg, args.batch, args.seconds, device,
                                                                       seed=args.seed + i), device))
        for _ in range(args.warmup):
            steps[-1]()
    sync(device)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(json.dumps({"ready": True, "pid": os.getpid(), "peak_mem_gib": mem}), flush=True)
    for line in sys.stdin:
        cmd, *values = line.split()
        if cmd == "quit":
            return
        t0, start, end, n = float(values[0]), float(values[1]), float(values[2]), int(values[3])
        while time.time() < t0:
            time.sleep(0.001)
        done, overflows, i = [], 0, 0
        while True:
            step = steps[i % n]
            before = step.overflows
            step()
            sync(device)
            now = time.time()
            if now > end:
                break
            if now >= start:
                done.append(now)
                overflows += step.overflows - before
            i += 1
        print(json.dumps({"done": len(done), "overflows": overflows}), flush=True)


class Workers:
    """The worker processes, each talking JSON lines over its pipes."""

    def __init__(self, args, count: int, models: int):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--device", args.device, "--size", args.size,
               "--case", args.case, "--batch", str(args.batch), "--seconds", str(args.seconds),
               "--warmup", str(args.warmup), "--models", str(models)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs = [subprocess.Popen(cmd + ["--seed", str(100 * i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=env) for i in range(count)]

    def read(self, i: int) -> dict:
        line = self.procs[i].stdout.readline()
        if not line:
            code = self.procs[i].wait()
            raise SystemExit(f"error: runner worker {i} ended (exit status {code}) before answering; its "
                             "error output is above")
        return json.loads(line)

    def go(self, n: int, lead: float, window: float, models: int = 1) -> list[dict]:
        """Workers 0..n-1 step from a common time; their steps finished in the common window."""
        t0 = time.time() + 0.5
        start = t0 + lead
        for p in self.procs[:n]:
            p.stdin.write(f"go {t0} {start} {start + window} {models}\n")
            p.stdin.flush()
        return [self.read(i) for i in range(n)]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write("quit\n")
                    p.stdin.close()
                except BrokenPipeError:  # it has ended on its own: nothing to tell it
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def row_of(label: str, processes: int, runs: int, answers: list[dict], window: float, one: float | None) -> dict:
    per_run = [a["done"] / window for a in answers] if processes > 1 or runs == 1 else []
    total = sum(a["done"] for a in answers) / window
    return {"layout": label, "processes": processes, "runs": runs, "window_s": window,
            "steps_per_s_all": total, "steps_per_min_all": 60 * total,
            "per_run_steps_per_s_median": statistics.median(per_run) if per_run else total / runs,
            "per_run_steps_per_s_min": min(per_run) if per_run else float("nan"),
            "study_runs_per_hour": 3600 * total / STUDY_STEPS, "vs_one_run": total / one if one else float("nan"),
            "overflowed_steps": sum(a["overflows"] for a in answers)}


def print_row(r: dict) -> None:
    print(f"| {r['layout']} | {r['runs']} | {r['steps_per_s_all']:.2f} | {r['steps_per_min_all']:.0f} | "
          f"{r['per_run_steps_per_s_median']:.2f} | {r['per_run_steps_per_s_min']:.2f} | "
          f"{r['study_runs_per_hour']:.1f} | {r['vs_one_run']:.2f}x | {r['overflowed_steps']} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="base")
    p.add_argument("--case", default="fairseq-math", help="bench_gpu.py's case (the plain study runs: fairseq-math)")
    p.add_argument("--batch", type=int, default=None, help="crops per step of each run (default: the study's, "
                   "data.batch_size of the recipe and overlay: 16 at base size)")
    p.add_argument("--seconds", type=float, default=None, help="crop length (default: the study's, 5.12 s)")
    p.add_argument("--jobs", type=int, nargs="+", default=[1, 3, 5, 7], help="runs at once, one round each")
    p.add_argument("--inproc", type=int, nargs="*", default=[3],
                   help="also one process stepping this many models in turn (one round each; none: skip)")
    p.add_argument("--window", type=float, default=15.0, help="seconds counted per round")
    p.add_argument("--lead", type=float, default=2.0, help="seconds of stepping before the window opens")
    p.add_argument("--warmup", type=int, default=3, help="steps of each model before the first round")
    p.add_argument("--json", default=None, help="also write the rows here (rewritten after each round)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--models", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    if args.batch is None or args.seconds is None:
        from bench_case import Case, study_config

        data = study_config(args.size, Case.parse(args.case)).data
        args.batch = args.batch or data.batch_size
        args.seconds = args.seconds or data.crop_seconds
    if args.worker:
        worker(args)
        return
    if min(args.jobs) < 1 or any(k < 1 for k in args.inproc) or args.window <= 0:
        p.error("--jobs and --inproc take counts >= 1, --window a positive number of seconds")
    print(f"{args.size} {args.case}, batch {args.batch} x {args.seconds} s per run; steps finished in a common "
          f"{args.window:g} s window after {args.lead:g} s; {STUDY_STEPS} steps per study run", flush=True)
    print("| layout | runs | steps/s in all | steps/min in all | per-run steps/s (median) | per-run steps/s (min) | "
          "study runs/hour | vs 1 run | overflowed steps |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows: list[dict] = []

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))

    t = time.perf_counter()
    workers = Workers(args, max(args.jobs), 1)
    inproc = Workers(args, 1, max(args.inproc)) if args.inproc else None
    try:
        ready = [workers.read(i) for i in range(len(workers.procs))]
        ready += [inproc.read(0)] if inproc else []
        setup_s = time.perf_counter() - t
        one = None
        for n in args.jobs:
            answers = workers.go(n, args.lead, args.window)
            if n == 1:
                one = sum(a["done"] for a in answers) / args.window
            row = row_of("processes", n, n, answers, args.window, one)
            row["setup_s"], row["peak_mem_gib_per_process"] = setup_s, max(r["peak_mem_gib"] for r in ready)
            rows.append(row)
            print_row(row)
            save()
        for k in args.inproc:
            answers = inproc.go(1, args.lead, args.window, models=k)
            row = row_of("1 process, models in turn", 1, k, answers, args.window, one)
            rows.append(row)
            print_row(row)
            save()
    finally:
        workers.close()
        if inproc:
            inproc.close()
    print(f"(workers built and warmed up in {setup_s:.0f} s, all at once)")


if __name__ == "__main__":
    main()
