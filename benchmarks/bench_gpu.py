"""Training throughput and MFU on one GPU: our model's full training step (forward, backward, fused AdamW,
fp16 with a grad scaler) at base and large size, in bf16 and fp16 autocast.

MFU = FLOPs of one step (torch.utils.flop_counter, attention included) / step time / peak FLOP/s. Two
peaks are reported: the GPU's dense spec (--peak-tflops, H200 SXM: 989 TFLOP/s bf16/fp16) and the dense
matmul rate measured in the same run (8192^3, same dtype).

    python benchmarks/bench_gpu.py                                  # base and large, bf16 and fp16
    python benchmarks/bench_gpu.py --sizes large --dtypes bf16 --compile --activation-checkpointing
    python benchmarks/bench_gpu.py --device cpu --sizes tiny --dtypes bf16 --batch 2 --steps 2 --warmup 1  # smoke test
    python benchmarks/bench_gpu.py --sizes base --dtypes bf16 --frontend conv gemm --profile prof.txt

``--frontend conv gemm`` times both implementations of the conv frontend (``ConvFrontend.impl``) side by
side; ``warmup s`` is the time of the warm-up steps (with ``--compile``: the compile time); ``--profile``
writes torch.profiler's top kernels (by device time) of 3 steps of the first configuration to a file.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from musiclm_stab.config import ModelConfig
from musiclm_stab.data.masking import span_mask
from musiclm_stab.model import MusicMLM

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 20) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t)


def make_step(model, device, dtype_name, batch):
    dtype = DTYPES[dtype_name]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype_name == "fp16")

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype_name != "fp32"):
            loss = model(*batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def write_profile(step, device: torch.device, path: str, title: str, rows: int = 30) -> None:
    """torch.profiler over 3 steps: the top ``rows`` operators/kernels by self device time (CPU time on
    CPU), as a text table in ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(f"# {title}, 3 steps, sorted by {key}\n")
        f.write(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", nargs="+", default=["base", "large"], choices=["tiny", "base", "large"])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--batch", type=int, default=None, help="crops per step (default: base 64, large 32)")
    p.add_argument("--seconds", type=float, default=5.0, help="crop length (the recipes' 5 s)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="train.compile: frontend and encoder compiled")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16/fp16 spec of the GPU")
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--frontend", nargs="+", default=["conv"], choices=["conv", "gemm"],
                   help="ConvFrontend.impl: nn.Conv1d layers or matrix products over frames")
    p.add_argument("--profile", default=None, help="write the top kernels of 3 profiled steps here")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --device cpu for a smoke test")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__} compile={args.compile} "
          f"activation_checkpointing={args.activation_checkpointing} crop={args.seconds} s")
    print("| size | dtype | frontend | batch | s/step | audio-s/s | TFLOP/step | TFLOP/s | MFU (spec) | "
          "matmul TFLOP/s | vs matmul | peak mem GiB | warmup s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for size in args.sizes:
        batch_size = args.batch or {"tiny": 8, "base": 64, "large": 32}[size]
        T = int(args.seconds * 75)
        torch.manual_seed(0)
        wav = torch.randn(batch_size, 320 * T, device=device) * 0.1
        batch = (wav, wav, torch.randint(0, 1024, (batch_size, 8, T), device=device),
                 span_mask(batch_size, T, 0.8, 5).to(device))
        for dtype_name, impl in [(d, f) for d in args.dtypes for f in args.frontend]:
            model = MusicMLM(ModelConfig(size=size)).to(device).train()
            model.frontend.impl = impl
            model.encoder.checkpoint_layers = args.activation_checkpointing
            if args.compile:
                model.frontend.compile()
                model.encoder.compile()
            step = make_step(model, device, dtype_name, batch)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            for _ in range(args.warmup):
                step()
            sync(device)
            warmup_s = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(device)
            dt = (time.perf_counter() - t) / args.steps
            with FlopCounterMode(display=False) as fc:
                step()
            flops = fc.get_total_flops()
            if args.profile and not rows:
                write_profile(step, device, args.profile, f"{size} {dtype_name} frontend={impl} batch={batch_size}")
            mm = matmul_rate(device, DTYPES[dtype_name], args.matmul_n if device.type == "cuda" else 1024)
            mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            row = {"size": size, "dtype": dtype_name, "frontend": impl, "batch": batch_size, "s_per_step": dt,
                   "audio_s_per_s": batch_size * args.seconds / dt, "tflop_per_step": flops / 1e12,
                   "tflops": flops / dt / 1e12, "mfu_spec": flops / dt / (args.peak_tflops * 1e12),
                   "matmul_tflops": mm / 1e12, "vs_matmul": flops / dt / mm, "peak_mem_gib": mem,
                   "warmup_s": warmup_s, "compile": args.compile}
            rows.append(row)
            print(f"| {size} | {dtype_name} | {impl} | {batch_size} | {dt:.3f} | {row['audio_s_per_s']:.0f} | "
                  f"{row['tflop_per_step']:.2f} | {row['tflops']:.1f} | {row['mfu_spec']:.1%} | "
                  f"{row['matmul_tflops']:.1f} | {row['vs_matmul']:.1%} | {mem:.1f} | {warmup_s:.1f} |", flush=True)
            del model, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
