"""Cost of fp16: one training step in fp32 vs fp16 in fairseq and amp mode, side by side (CPU or GPU).

One step = forward + backward + the precision's update (fairseq: unscale into the fp32 masters, clip,
AdamW, round back into the model; amp: GradScaler and AdamW; fp32: clip and AdamW), through the trainer's
own ``Precision`` classes (training/precision.py), on random audio and codes. On a CPU fp16 is emulated
(``train.fp16_impl=auto``); ``--real-half`` adds fairseq mode on real half tensors (torch's CPU half
kernels), the alternative the emulation replaced; ``--unoptimized`` adds the fairseq emulation with its
bit-identical speed-ups undone (copies rounded again, every argument list through the pytree: the module
patched around that mode's steps). On CUDA fp16 is real half tensors / autocast, and the
table adds each mode's peak memory. Modes alternate within each round (fp32, fairseq, amp, ...) so that load
from other jobs hits all alike; the table gives each mode's median step time and its ratio to fp32 in the
same rounds.

    python benchmarks/bench_fp16.py --layers 8 --width 128 --batch 4 --seconds 2 --rounds 5   # the CPU study's size
    python benchmarks/bench_fp16.py --device cuda --size large --batch 8 --seconds 5.12 --rounds 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from accelerate import Accelerator

from musiclm_stab.config import Config, ModelConfig, TrainConfig
from musiclm_stab.data.masking import span_mask
from musiclm_stab.model import MusicMLM, fp16_arith
from musiclm_stab.training.optim import build_optimizer
from musiclm_stab.training.precision import AmpFp16, FairseqFp16, Precision

_UNOPTIMIZED_KINDS: dict = {}


@contextlib.contextmanager
def unoptimized():
    """The fairseq emulation as it was before issue 55's speed-ups: copies rounded, the pytree on every
    argument list (the same bits, tests/test_fp16_audit.py)."""
    saved = fp16_arith._tensors, fp16_arith.VALUE_COPIES, fp16_arith.Fp16Emulation._kinds
    fp16_arith._tensors = lambda args, kwargs: [t for t in torch.utils._pytree.tree_flatten((args, kwargs))[0]
                                                if isinstance(t, torch.Tensor)]
    fp16_arith.VALUE_COPIES, fp16_arith.Fp16Emulation._kinds = frozenset(), _UNOPTIMIZED_KINDS
    try:
        yield
    finally:
        fp16_arith._tensors, fp16_arith.VALUE_COPIES, fp16_arith.Fp16Emulation._kinds = saved


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(mode: str, mcfg: ModelConfig, accelerator: Accelerator):
    torch.manual_seed(0)
    model = MusicMLM(mcfg)
    tcfg = TrainConfig(mixed_precision="no" if mode == "fp32" else "fp16")
    if mode == "fp32":
        precision = Precision(accelerator)
    elif mode == "amp":
        precision = AmpFp16(accelerator, "emulate")
    else:
        precision = FairseqFp16(accelerator, tcfg, "half" if mode == "fairseq-half" else "emulate")
    params = precision.prepare_model(model)
    model.to(accelerator.device)
    optimizer = build_optimizer(params, Config().optim)
    if isinstance(precision, FairseqFp16):
        precision.attach(optimizer)
    return model, optimizer, precision


def one_step(model, optimizer, precision, batch, reference: bool = False) -> float:
    device = batch["wav"].device
    sync(device)
    t0 = time.perf_counter()
    with unoptimized() if reference else contextlib.nullcontext():
        precision.begin_update(batch["mask"].sum())
        with precision.forward():
            out = model(precision.cast_input(batch["wav"]), batch["wav"], batch["codes"], batch["mask"])
        precision.backward(out.loss, 1)
        precision.step(model, optimizer, 10.0)
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="tiny", choices=["tiny", "base", "large"])
    parser.add_argument("--layers", type=int, help="default: 8 for tiny (the CPU study), else the size's")
    parser.add_argument("--width", type=int, help="default: the size's")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--attention", default="math", choices=["sdpa", "math", "relax"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    parser.add_argument("--real-half", action="store_true", help="also fairseq mode on real half tensors")
    parser.add_argument("--unoptimized", action="store_true",
                        help="also the fairseq emulation without its bit-identical speed-ups (CPU)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    tiny = args.size == "tiny"
    layers = args.layers or (8 if tiny else None)
    mcfg = ModelConfig(size=args.size, num_layers=layers, width=args.width,
                       ffn_dim=4 * args.width if args.width else None, attention=args.attention,
                       cqt_bins=84 if tiny else 336, cqt_bins_per_octave=12 if tiny else 48,
                       dropout=0.0, attention_dropout=0.0, feature_dropout=0.0).resolved()
    device = torch.device(args.device)
    accelerator = Accelerator(cpu=device.type == "cpu")
    g = torch.Generator().manual_seed(0)
    T = int(args.seconds * 75)
    batch = {"wav": 0.1 * torch.randn(args.batch, 320 * T, generator=g),
             "codes": torch.randint(0, 1024, (args.batch, 8, T), generator=g),
             "mask": span_mask(args.batch, T, 0.8, 5, g)}
    batch = {k: v.to(device) for k, v in batch.items()}
    modes = (["fp32", "fairseq", "amp"] + (["fairseq-half"] if args.real_half else [])
             + (["fairseq-unoptimized"] if args.unoptimized else []))
    built, peak = {}, {}
    for mode in modes:  # each mode's peak above what the modes before it hold; then all kept for the rounds
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        built[mode] = build(mode, mcfg, accelerator)
        for _ in range(args.warmup):
            one_step(*built[mode], batch, mode == "fairseq-unoptimized")
        if device.type == "cuda":
            peak[mode] = (torch.cuda.max_memory_allocated(device) - held) / 2**30
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            times[mode].append(one_step(*built[mode], batch, mode == "fairseq-unoptimized"))
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)")
    print(f"{args.size} {mcfg.num_layers} x {mcfg.width}, batch {args.batch} x {args.seconds:g} s, attention "
          f"{args.attention}, {where}, {args.rounds} rounds")
    print("| mode | median s/step | steps/s | vs fp32 |" + (" peak GiB |" if peak else ""))
    print("|---|---|---|---|" + ("---|" if peak else ""))
    result = {"args": vars(args), "device": where, "modes": {}}
    for mode in modes:
        med = statistics.median(times[mode])
        ratio = statistics.median([t / f for t, f in zip(times[mode], times["fp32"])])
        result["modes"][mode] = {"median_s": med, "ratio_to_fp32": ratio, "times": times[mode],
                                 "peak_gib": peak.get(mode)}
        print(f"| {mode} | {med:.4f} | {1 / med:.2f} | {ratio:.2f}x |" + (f" {peak[mode]:.1f} |" if peak else ""))
    if args.unoptimized:  # the speed-ups change no bit: both models took the same updates
        ratio = statistics.median([a / b for a, b in zip(times["fairseq"], times["fairseq-unoptimized"])])
        same = all(torch.equal(a, b) for a, b in zip(built["fairseq"][0].parameters(),
                                                     built["fairseq-unoptimized"][0].parameters()))
        result["fairseq_vs_unoptimized"] = {"ratio": ratio, "same_parameters": same}
        print(f"fairseq / fairseq-unoptimized, median per round: {ratio:.3f}; the same parameters after "
              f"{args.warmup + args.rounds} updates: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
