"""Ours vs transformers.HubertModel at the identical configuration and precision, side by side on one device: the
study's training step (bench_gpu.py's ``Step``: the trainer's precision, fused AdamW, clip) of our MusicMLM and
of the peer, HubertModel with *our* heads and loss on top (bench_train_step.PeerMLM: same conv frontend, width,
depth, heads, FFN, pre-LN, positional conv, dropouts), the two alternating step by step.

Attention: our ``math`` runs against HubertModel's ``eager`` attention (the explicit product), our ``sdpa``
against its ``sdpa``; ``relax`` has no counterpart in HubertModel and is refused.

    python benchmarks/bench_gpu_peer.py                      # base and large, fairseq-math and bf16-sdpa
    python benchmarks/bench_gpu_peer.py --device cpu --sizes tiny --cases fp32-sdpa --batch 1 --seconds 0.64 \\
        --steps 1 --warmup 1                                  # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_gpu import DEFAULT_BATCH, Case, analytic_flops, build_step, random_batch, study_config, sync
from bench_train_step import PeerMLM

from musiclm_stab.model import MusicMLM

PEER_ATTENTION = {"math": "eager", "sdpa": "sdpa"}


class Peer(PeerMLM):
    """PeerMLM called as the trainer calls our model (``frame_weight`` is 1 on one process)."""

    def forward(self, wav, clean_wav, codes, mask, frame_weight=1.0):
        return super().forward(wav, clean_wav, codes, mask)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", nargs="+", default=["base", "large"], choices=list(DEFAULT_BATCH))
    p.add_argument("--cases", nargs="+", type=Case.parse,
                   default=[Case.parse(c) for c in ("fairseq-math", "bf16-sdpa")])
    p.add_argument("--batch", type=int, default=None, help="crops per step (default: base 64, large 32, tiny 2)")
    p.add_argument("--seconds", type=float, default=5.12)
    p.add_argument("--steps", type=int, default=8, help="timed steps of each model")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--json", default=None, help="also write the rows here (rewritten after each row)")
    args = p.parse_args()
    for case in args.cases:
        if case.attention not in PEER_ATTENTION or case.levers:
            p.error(f"case {case}: HubertModel has math (eager) and sdpa attention, and none of our levers")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device: run on a GPU machine, or pass --device cpu for a smoke test")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__} crop={args.seconds} s, median of {args.steps} steps each after "
          f"{args.warmup} warm-up, ours and the peer alternating; MFU from our analytic FLOPs", flush=True)
    print("| size | case | peer attention | batch | ours s/step | peer s/step | ours / peer speed | ours MFU | "
          "peer MFU | overflowed steps ours / peer |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for size in args.sizes:
        batch_size = args.batch or DEFAULT_BATCH[size]
        for case in args.cases:
            cfg = study_config(size, case)
            batch = random_batch(cfg, batch_size, args.seconds, device)
            torch.manual_seed(0)
            ours = MusicMLM(cfg.model)
            peer = Peer(cfg.model, MusicMLM(cfg.model), attn_implementation=PEER_ATTENTION[case.attention])
            steps = {"ours": build_step(ours, cfg, batch, device), "peer": build_step(peer, cfg, batch, device)}
            for _ in range(args.warmup):
                for fn in steps.values():
                    fn()
            for fn in steps.values():
                fn.overflows = 0  # an overflowed (skipped) update is cheaper: counted in the timed steps
            times: dict[str, list[float]] = {n: [] for n in steps}
            for _ in range(args.steps):
                for n, fn in steps.items():
                    sync(device)
                    t = time.perf_counter()
                    fn()
                    sync(device)
                    times[n].append(time.perf_counter() - t)
            med = {n: statistics.median(v) for n, v in times.items()}
            flops = analytic_flops(cfg, batch_size, batch["mask"].shape[1], int(batch["mask"].sum()))
            row = {"size": size, "case": str(case), "peer_attention": PEER_ATTENTION[case.attention],
                   "batch": batch_size, "seconds": args.seconds, "ours_s": med["ours"], "peer_s": med["peer"],
                   "ours_over_peer": med["peer"] / med["ours"],
                   "ours_mfu": flops / med["ours"] / (args.peak_tflops * 1e12),
                   "peer_mfu": flops / med["peer"] / (args.peak_tflops * 1e12),
                   "overflowed_steps": {n: fn.overflows for n, fn in steps.items()}, "timed_steps": args.steps,
                   "device": name}
            rows.append(row)
            print(f"| {size} | {case} | {row['peer_attention']} | {batch_size} | {med['ours']:.4f} | "
                  f"{med['peer']:.4f} | {row['ours_over_peer']:.2f}x | {row['ours_mfu']:.1%} | "
                  f"{row['peer_mfu']:.1%} | {steps['ours'].overflows} / {steps['peer'].overflows} of {args.steps} |",
                  flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
            del ours, peer, steps
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
