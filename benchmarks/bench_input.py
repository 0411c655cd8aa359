"""Input pipeline cost: training steps per second reading the real tokenized dataset (crops, noise mixup,
masks) vs the same model fed one in-memory batch, alternating in one run.

    python benchmarks/bench_input.py --data work/default_corpus_tokens --size tiny --steps 20 --workers 0 2
    python benchmarks/bench_input.py --data work/hours256_tokens --setup --rounds 3

--setup times what a run does before its first step: building the training crops' index (which segments are
long enough), as CropDataset reads the num_frames column (in one go) against reading it row by row (what it did
before: a datasets Column indexed per row reads its table once per row), alternating.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from torch.utils.data import DataLoader

from musiclm_stab.config import DataConfig, ModelConfig
from musiclm_stab.constants import FRAME_RATE
from musiclm_stab.data import Collator, CropDataset, EpochSampler, split_indices
from musiclm_stab.data.tokenized import load_tokenized
from musiclm_stab.model import MusicMLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="work/default_corpus_tokens")
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--setup", action="store_true", help="time the crops' index only (module docstring)")
    args = p.parse_args()
    hf, _ = load_tokenized(args.data)
    train_idx, _ = split_indices(hf["track"], 0.1)
    if args.setup:
        return setup_cost(hf, train_idx, args.rounds)
    mcfg = ModelConfig(size=args.size, cqt_bins=84, cqt_bins_per_octave=12).resolved()
    data_cfg = DataConfig(batch_size=args.batch)
    model = MusicMLM(mcfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch):
        model(batch["wav"], batch["clean_wav"], batch["codes"], batch["mask"]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def loader(workers):
        ds = CropDataset(hf, train_idx, data_cfg.crop_seconds)
        return DataLoader(ds, batch_size=args.batch, sampler=EpochSampler(len(ds)), drop_last=True,
                          num_workers=workers, collate_fn=Collator(data_cfg, mcfg), persistent_workers=workers > 0)

    loaders = {w: loader(w) for w in args.workers}
    fixed = next(iter(loaders[args.workers[0]]))
    step(fixed)  # warm-up
    results = {"in-memory": []} | {f"dataset, {w} workers": [] for w in args.workers}
    for _ in range(args.rounds):
        t = time.perf_counter()
        for _ in range(args.steps):
            step(fixed)
        results["in-memory"].append(args.steps / (time.perf_counter() - t))
        for w, dl in loaders.items():
            it = itertools.cycle(dl)
            next(it)  # start the workers outside the timing
            t = time.perf_counter()
            for _ in range(args.steps):
                step(next(it))
            results[f"dataset, {w} workers"].append(args.steps / (time.perf_counter() - t))
    base = max(results["in-memory"])
    print(f"size={args.size} batch={args.batch} x {data_cfg.crop_seconds} s, {args.steps} steps x {args.rounds} rounds")
    print("| input | steps/s (best round) | vs in-memory |\n|---|---|---|")
    for name, rates in results.items():
        print(f"| {name} | {max(rates):.2f} | {max(rates) / base:.2f}x |")


def setup_cost(hf, train_idx: list[int], rounds: int) -> None:
    """CropDataset's index of long-enough segments, built as it is and row by row, alternating."""
    crop_frames = int(round(DataConfig().crop_seconds * FRAME_RATE))
    times: dict[str, list[float]] = {"one read (CropDataset)": [], "row by row (before)": []}
    for _ in range(rounds):
        t = time.perf_counter()
        kept = CropDataset(hf, train_idx, DataConfig().crop_seconds).indices
        times["one read (CropDataset)"].append(time.perf_counter() - t)
        t = time.perf_counter()
        column = hf.select_columns(["num_frames"])["num_frames"]
        before = [i for i in train_idx if column[i] >= crop_frames]
        times["row by row (before)"].append(time.perf_counter() - t)
        assert before == kept, "the two reads keep different segments"
    print(f"{len(hf)} rows, {len(train_idx)} training rows, {rounds} rounds (median s)")
    print("| crops' index | s | vs one read |\n|---|---|---|")
    base = statistics.median(times["one read (CropDataset)"])
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.3f} | {statistics.median(ts) / base:.1f}x |")


if __name__ == "__main__":
    main()
