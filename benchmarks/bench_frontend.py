"""The conv frontend's two implementations side by side (``ConvFrontend.impl``: "conv" = nn.Conv1d layers,
"gemm" = matrix products over frames): forward + backward of the frontend alone, same weights, same
input, the two alternating call by call so that load from other jobs hits both alike.

    python benchmarks/bench_frontend.py --device cpu --batch 2 --dtypes fp32 bf16 --repeats 5
    python benchmarks/bench_frontend.py --device cuda --batch 64 --dtypes bf16 fp16 --repeats 20   # GPU suite
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from musiclm_stab.model.frontend import ConvFrontend

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fwd_bwd(frontend: ConvFrontend, wav: torch.Tensor, dtype: str) -> None:
    """One forward + backward of the frontend (loss: mean of squares, as the features penalty)."""
    with torch.autocast(wav.device.type, dtype=DTYPES[dtype], enabled=dtype != "fp32"):
        y = frontend(wav)
    y.float().pow(2).mean().backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--conv-dim", type=int, default=512, help="512: base and large")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    ref = ConvFrontend(args.conv_dim).to(device)
    impls = {"conv": ref, "gemm": ConvFrontend(args.conv_dim, impl="gemm").to(device)}
    impls["gemm"].load_state_dict(ref.state_dict())
    wav = torch.randn(args.batch, int(args.seconds * 24000) // 320 * 320, device=device) * 0.1
    print(f"device={device} conv_dim={args.conv_dim} batch={args.batch} x {args.seconds} s, "
          f"threads={torch.get_num_threads()}, median of {args.repeats} after a warm-up, alternating")
    print("| dtype | conv ms | gemm ms | conv / gemm |")
    print("|---|---|---|---|")
    rows = []
    for dtype in args.dtypes:
        times = {n: [] for n in impls}
        for m in impls.values():  # warm-up (cuDNN / mkldnn algorithm choice, allocator)
            fwd_bwd(m, wav, dtype)
        for _ in range(args.repeats):
            for n, m in impls.items():
                m.zero_grad(set_to_none=True)
                sync(device)
                t = time.perf_counter()
                fwd_bwd(m, wav, dtype)
                sync(device)
                times[n].append(time.perf_counter() - t)
        med = {n: statistics.median(v) for n, v in times.items()}
        row = {"dtype": dtype, "conv_ms": med["conv"] * 1e3, "gemm_ms": med["gemm"] * 1e3,
               "conv_over_gemm": med["conv"] / med["gemm"], "batch": args.batch, "device": str(device)}
        rows.append(row)
        print(f"| {dtype} | {row['conv_ms']:.1f} | {row['gemm_ms']:.1f} | {row['conv_over_gemm']:.2f}x |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
