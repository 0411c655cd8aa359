"""Ours vs transformers.HubertModel on one device, side by side: the full training step (forward, backward,
fused AdamW; fp16 with a grad scaler) of our MusicMLM and of the peer (HubertModel at the identical
configuration with *our* heads and loss on top: bench_train_step.PeerMLM), the two alternating step by step.

    python benchmarks/bench_gpu_peer.py                                   # base, batch 64, bf16 and fp16, pre and post
    python benchmarks/bench_gpu_peer.py --device cpu --size tiny --batch 2 --steps 1 --warmup 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_gpu import DTYPES, sync
from bench_train_step import PeerMLM

from musiclm_stab.config import ModelConfig
from musiclm_stab.data.masking import span_mask
from musiclm_stab.model import MusicMLM


def make_step(model, device: torch.device, dtype_name: str, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype_name == "fp16")

    def step():
        with torch.autocast(device.type, dtype=DTYPES[dtype_name], enabled=dtype_name != "fp32"):
            out = model(*batch)
        loss = out.loss if hasattr(out, "loss") else out
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="base", choices=["tiny", "base", "large"])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--schemes", nargs="+", default=["pre", "post"], choices=["pre", "post"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--steps", type=int, default=10, help="timed steps of each model")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --device cpu for a smoke test")
    T = int(args.seconds * 75)
    torch.manual_seed(0)
    wav = torch.randn(args.batch, 320 * T, device=device) * 0.1
    batch = (wav, wav, torch.randint(0, 1024, (args.batch, 8, T), device=device),
             span_mask(args.batch, T, 0.8, 5).to(device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__} size={args.size} batch={args.batch} x {args.seconds} s, "
          f"median of {args.steps} steps each after {args.warmup} warm-up, alternating")
    print("| scheme | dtype | ours s/step | peer s/step | ours audio-s/s | peer audio-s/s | ours / peer speed |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for scheme in args.schemes:
        cfg = ModelConfig(size=args.size, norm_scheme=scheme).resolved()
        for dtype_name in args.dtypes:
            torch.manual_seed(0)
            ours = MusicMLM(cfg).to(device).train()
            peer = PeerMLM(cfg, MusicMLM(cfg)).to(device).train()
            steps = {"ours": make_step(ours, device, dtype_name, batch), "peer": make_step(peer, device, dtype_name, batch)}
            for _ in range(args.warmup):
                for fn in steps.values():
                    fn()
            times = {n: [] for n in steps}
            for _ in range(args.steps):
                for n, fn in steps.items():
                    sync(device)
                    t = time.perf_counter()
                    fn()
                    sync(device)
                    times[n].append(time.perf_counter() - t)
            med = {n: statistics.median(v) for n, v in times.items()}
            row = {"scheme": scheme, "dtype": dtype_name, "batch": args.batch, "ours_s": med["ours"],
                   "peer_s": med["peer"], "ours_over_peer": med["peer"] / med["ours"], "device": name}
            rows.append(row)
            a = args.batch * args.seconds
            print(f"| {scheme} | {dtype_name} | {med['ours']:.3f} | {med['peer']:.3f} | {a / med['ours']:.0f} | "
                  f"{a / med['peer']:.0f} | {row['ours_over_peer']:.2f}x |", flush=True)
            del ours, peer, steps
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
