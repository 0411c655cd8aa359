"""How long the training loop is blocked per checkpoint: the synchronous ``checkpoint.save`` (accelerate's
save_state, then hashing, manifest, rename) vs ``checkpoint_writer.CheckpointWriter`` (a CPU copy of the state;
the files written, fsynced and hashed by a thread, published at the next poll/save/wait).

Our model with fused AdamW moments (as after a step), LambdaLR and the trainer's registered objects;
rounds alternate sync, background so that load from other jobs hits both alike. "background blocked" is
what ``save`` costs the loop; "background total" is until the checkpoint is published (``wait``).

    python benchmarks/bench_checkpoint.py --sizes tiny base --rounds 3 --dir /tmp/bench_ckpt
    python benchmarks/bench_checkpoint.py --device cuda --sizes large --rounds 3 --dir /tmp/bench_ckpt   # GPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from musiclm_stab.config import ModelConfig, OptimConfig
from musiclm_stab.model import MusicMLM
from musiclm_stab.training import checkpoint, checkpoint_writer
from musiclm_stab.training.stability import GradClipper


def setup(size: str, device: str) -> tuple[Accelerator, list]:
    """The accelerate state of a model of ``size`` after a first step, and the registered objects a
    trainer checkpoints with it (stored as JSON)."""
    acc = Accelerator(cpu=device == "cpu")
    model = MusicMLM(ModelConfig(size=size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    for p in model.parameters():  # the optimizer's moments exist, as after a first step (no forward needed)
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return acc, [("grad_clipper", GradClipper(OptimConfig()))]


def dir_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "base"], choices=["tiny", "base", "large"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    print(f"device={args.device} dir={root} threads={torch.get_num_threads()}, median of {args.rounds} rounds, "
          "sync and background alternating")
    print("| size | checkpoint MiB | sync blocked s | background blocked s | background total s | sync / background blocked |")
    print("|---|---|---|---|---|---|")
    rows = []
    for size in args.sizes:
        acc, objects = setup(size, args.device)
        run_dir = root / size
        shutil.rmtree(run_dir, ignore_errors=True)
        writer = checkpoint_writer.CheckpointWriter(acc, run_dir / "bg")
        assert writer.background, checkpoint_writer.snapshot_unsupported(acc)
        t_sync, t_blocked, t_total = [], [], []
        for r in range(args.rounds + 1):  # round 0: warm-up (pinned buffers, page cache, imports)
            t = time.perf_counter()
            final = checkpoint.save(acc, run_dir / "sync", r, {}, keep=1, objects=objects)
            dt_sync = time.perf_counter() - t
            t = time.perf_counter()
            writer.save(r, {}, keep=1, objects=objects)
            dt_blocked = time.perf_counter() - t
            writer.wait()
            dt_total = time.perf_counter() - t
            if r:
                t_sync.append(dt_sync)
                t_blocked.append(dt_blocked)
                t_total.append(dt_total)
        row = {"size": size, "mib": dir_mib(final), "sync_s": statistics.median(t_sync),
               "background_blocked_s": statistics.median(t_blocked),
               "background_total_s": statistics.median(t_total)}
        row["ratio"] = row["sync_s"] / row["background_blocked_s"]
        rows.append(row)
        print(f"| {size} | {row['mib']:.0f} | {row['sync_s']:.3f} | {row['background_blocked_s']:.3f} | "
              f"{row['background_total_s']:.3f} | {row['ratio']:.1f}x |", flush=True)
        del acc, writer
        AcceleratorState._reset_state(reset_partial_state=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
