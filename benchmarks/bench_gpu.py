"""The study's training step on one device, timed, with its MFU: forward, backward and the update exactly as
the trainer does them (training/precision.py's Precision classes, the configured fused AdamW, the clip), on
the study's own model (a study recipe, with recipes/overlays/study_gpu.yaml at base size; large is the
recipe as written, MERT-330M), on random audio, codes and span masks of the study's crop (5.12 s).

A *case* is MODE-ATTENTION[+LEVER...]:
  MODE       fairseq (fp16 as the study trains: half weights, fp32 masters, fairseq's loss scaler),
             amp (autocast fp16 + GradScaler), bf16 (autocast bf16), fp32
  ATTENTION  math (the plain study runs), relax (PB-relax), sdpa (fused)
  LEVER      gemm (ConvFrontend.impl="gemm"), cudnnbench (torch.backends.cudnn.benchmark on)
e.g. fairseq-math, fairseq-relax, bf16-sdpa, fairseq-math+gemm.

MFU = the step's model FLOPs (``analytic_flops``: every matrix product and convolution of the forward and
backward passes, counted from the configuration: the conv frontend, feature projection, positional conv,
q/k/v/out and FFN projections, attention's QK^T and PV, the heads on the masked frames; not the CQT target,
not elementwise work; the same count for every attention form) / step time / --peak-tflops (H200: 989
TFLOP/s dense fp16/bf16). ``torch count check`` is torch.utils.flop_counter's count of one step, less the CQT
target's forward and less what it overcounts (the grouped positional conv's weight gradient, counted as if
ungrouped: 16x), over the analytic count: 1.000 when the two agree. (The MFU of issue 17 divided the raw count,
which for 5.12 s crops is 16% above the true FLOPs at base size and 11% at large, for that reason.) ``vs matmul`` divides by an 8192^3 matmul of the
mode's dtype timed in the same process (128^3 on a CPU, a smoke test: fp16 matmuls are emulated there, slowly). Rows are printed (a markdown table) and written to --json as they finish,
so a run stopped at a deadline keeps every finished row.

    python benchmarks/bench_gpu.py                                              # base, large x the 3 study cases
    python benchmarks/bench_gpu.py --sizes base --cases fairseq-math --compile trainer   # compile time + speed
    python benchmarks/bench_gpu.py --extra base:fairseq-math+gemm --profile prof.txt
    python benchmarks/bench_gpu.py --device cpu --sizes tiny --cases fp32-sdpa --batch 1 --seconds 0.64 \\
        --steps 1 --warmup 1                                                     # smoke test
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_case import DEFAULT_BATCH, MODE_DTYPE, Case, study_config
from torch.utils.flop_counter import FlopCounterMode

from musiclm_stab.config import Config
from musiclm_stab.data.masking import span_mask
from musiclm_stab.model import MusicMLM
from musiclm_stab.model.frontend import CONV_LAYERS, PAD
from musiclm_stab.training.optim import build_optimizer
from musiclm_stab.training.precision import FairseqFp16, Precision, make_precision

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FRAME_RATE = 75  # frames per second (320 samples at 24 kHz)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_batch(cfg: Config, batch: int, seconds: float, device: torch.device, seed: int = 0) -> dict:
    """Random audio, codes and the study's span masks for ``batch`` crops of ``seconds`` (a whole frame count)."""
    g = torch.Generator().manual_seed(seed)
    T = round(seconds * FRAME_RATE)
    mc = cfg.model
    out = {"wav": 0.1 * torch.randn(batch, 320 * T, generator=g),
           "codes": torch.randint(0, mc.codebook_size, (batch, mc.num_codebooks, T), generator=g),
           "mask": span_mask(batch, T, mc.mask_prob, mc.mask_length, g)}
    return {k: v.to(device) for k, v in out.items()}


def analytic_flops(cfg: Config, batch: int, frames: int, masked: int) -> int:
    """Model FLOPs of one training step (forward + backward) from the configuration (module docstring).

    A product of an [m, k] and a [k, n] matrix is 2mkn FLOPs forward and twice that backward (the gradients of
    both operands); the first convolution's input (the waveform) needs no gradient, so its backward is the
    weight gradient alone."""
    m = cfg.model
    B, T, C, D, F, L = batch, frames, m.conv_dim, m.width, m.ffn_dim, m.num_layers
    total, length, c_in = 0, 320 * T + 2 * PAD, 1
    for i, (k, s) in enumerate(CONV_LAYERS):  # the conv frontend
        length = (length - k) // s + 1
        fwd = 2 * B * length * c_in * k * C
        total += fwd * (2 if i == 0 else 3)
        c_in = C
    total += 6 * B * T * C * D  # feature projection
    trim = 1 if m.pos_conv_kernel % 2 == 0 else 0
    total += 3 * 2 * B * (T + trim) * D * (D // m.pos_conv_groups) * m.pos_conv_kernel  # positional conv
    per_layer = 6 * B * T * (4 * D * D + 2 * D * F) + 3 * 4 * B * T * T * D  # projections; QK^T and PV
    total += L * per_layer
    K, V, Fd = m.num_codebooks, m.codebook_size, m.final_dim
    total += 6 * masked * (D * Fd * K + K * V * Fd + D * m.cqt_bins)  # acoustic proj, cosine logits, musical head
    return total


def pos_conv_overcount(cfg: Config, batch: int, frames: int) -> int:
    """What torch.utils.flop_counter counts beyond the true FLOPs of one step: it counts the weight gradient of
    the grouped positional convolution as if the convolution were not grouped (``groups`` times its forward
    FLOPs instead of once; measured against the per-module counts: tests/test_benchmarks.py)."""
    m = cfg.model
    trim = 1 if m.pos_conv_kernel % 2 == 0 else 0
    fwd = 2 * batch * (frames + trim) * m.width * (m.width // m.pos_conv_groups) * m.pos_conv_kernel
    return (m.pos_conv_groups - 1) * fwd


class Bf16(Precision):
    """bf16 autocast as the trainer has it (accelerate's autocast), without a second Accelerator in one process
    (accelerate's state is process-wide)."""

    def forward(self):
        return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16)


_ACCELERATOR = None


def accelerator_for(device: torch.device):
    global _ACCELERATOR
    if _ACCELERATOR is None:
        from accelerate import Accelerator

        _ACCELERATOR = Accelerator(cpu=device.type == "cpu", mixed_precision="no")
    return _ACCELERATOR


@dataclass
class Step:
    """One training step of a model, as Trainer.train_step + Trainer.update run it with one micro-batch on one
    process: begin_update with the masked frames, forward in the precision's context, backward, the metrics
    (on the device), clip and update (or skip on an overflow), zero the gradients."""

    model: torch.nn.Module
    precision: Precision
    optimizer: torch.optim.Optimizer
    batch: dict
    threshold: float
    loss_unit: str = "bits"
    overflows: int = 0
    results: list = field(default_factory=list)

    def __call__(self) -> None:
        b = self.batch
        mask = b["mask"]
        self.precision.begin_update(mask.sum().float())  # the trainer's masked_weight gives this device tensor
        with self.precision.forward():
            out = self.model(self.precision.cast_input(b["wav"]), b["wav"], b["codes"], mask,
                             frame_weight=torch.ones((), device=mask.device))
        loss = out.loss if hasattr(out, "loss") else out
        self.precision.backward(loss, 1)
        if hasattr(out, "metrics"):
            out.metrics(self.loss_unit)
        result = self.precision.step(self.model, self.optimizer, self.threshold)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self.overflows += int(result.overflow)


def build_step(model: torch.nn.Module, cfg: Config, batch: dict, device: torch.device) -> Step:
    """``model`` (built on the CPU) made ready as the trainer makes it (``make_precision``,
    ``prepare_model``, ``build_optimizer``, fairseq's master weights attached) for ``cfg``'s precision."""
    accelerator = accelerator_for(device)
    if cfg.train.mixed_precision == "bf16":
        precision = Bf16(accelerator)
    else:
        precision = make_precision(cfg, accelerator)
    params = precision.prepare_model(model)
    model.to(device).train()
    optimizer = build_optimizer(params, cfg.optim)
    if isinstance(precision, FairseqFp16):
        precision.attach(optimizer)
    return Step(model, precision, optimizer, batch, threshold=cfg.optim.clip_grad or 1e9, loss_unit=cfg.train.loss_unit)


def compile_model(model: MusicMLM, how: str, backend: str) -> None:
    """``trainer``: frontend and encoder compiled, as train.compile does; ``layers``: the frontend and each
    encoder layer on its own (one graph, reused by every layer)."""
    if how == "none":
        return
    model.frontend.compile(backend=backend)
    if how == "trainer":
        model.encoder.compile(backend=backend)
    else:
        for layer in model.encoder.layers:
            layer.compile(backend=backend)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 20) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t)


# Kernel families of a profile, by name (first match wins): where the step's device time goes.
KERNEL_FAMILIES = [
    ("layout copy (NCHW<->NHWC)", r"nchwToNhwc|nhwcToNchw|convertTensor|transpose_readWrite"),
    ("convolution", r"conv|implicit_gemm|cudnn|wgrad|dgrad|Conv"),
    ("matmul (GEMM)", r"gemm|xmma|cutlass|sm90_|ampere_|matmul|addmm|\bmm\b|bmm"),
    ("attention (fused)", r"flash|fmha|attention|efficient_attention"),
    ("softmax", r"softmax"),
    ("norm", r"layer_norm|LayerNorm|group_norm|GroupNorm|batch_norm"),
    ("optimizer / fp16 update", r"adam|multi_tensor|foreach|_amp_|unscale|norm_kernel"),
    ("copy / cast", r"copy|Memcpy|Memset|cast|CatArrayBatched|fill"),
    ("reduction", r"reduce|sum_|max_|amax"),
    ("elementwise", r"elementwise|vectorized|unrolled|gelu|Gelu|pow|mul|add|where"),
]


def kernel_family(name: str) -> str:
    for family, pattern in KERNEL_FAMILIES:
        if re.search(pattern, name):
            return family
    return "other"


def write_profile(step, device: torch.device, path: str, title: str, steps: int = 3, rows: int = 30) -> dict:
    """torch.profiler over ``steps`` steps: the top ``rows`` operators/kernels by self device time (CPU time on a CPU),
    then the device time by kernel family and the device's busy share of the wall time, into ``path``.
    Returns the family summary."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    wall_us = (time.perf_counter() - t) * 1e6
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()  # once: each call aggregates every event again
    families: dict[str, float] = {}
    if cuda:  # kernels only: each kernel's own duration (operators would count their kernels again)
        kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type.name == "CUDA"]
    else:
        kernels = [(e.key, e.self_cpu_time_total) for e in averages]
    for name, us in kernels:
        families[kernel_family(name)] = families.get(kernel_family(name), 0.0) + us
    busy = sum(families.values())
    summary = {"wall_ms_per_step": wall_us / steps / 1e3, "busy_ms_per_step": busy / steps / 1e3,
               "families_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(families.items(), key=lambda kv: -kv[1])}}
    with open(path, "w") as f:
        f.write(f"# {title}, {steps} steps, sorted by {key}\n")
        f.write(averages.table(sort_by=key, row_limit=rows, max_name_column_width=70))
        what = "device (kernel) time" if cuda else "CPU self time"
        f.write(f"\n# {what} by kernel family, per step (wall {summary['wall_ms_per_step']:.1f} ms, "
                f"{what} {summary['busy_ms_per_step']:.1f} ms = {busy / wall_us:.0%} of the wall time)\n")
        f.write("| family | ms/step | share |\n|---|---|---|\n")
        for fam, ms in summary["families_ms_per_step"].items():
            f.write(f"| {fam} | {ms:.2f} | {ms / max(summary['busy_ms_per_step'], 1e-9):.1%} |\n")
    return summary


HEADER = ("| size | case | compile | batch | s/step | audio-s/s | steps/s | TFLOP/step (analytic) | TFLOP/s | MFU (spec) "
          "| torch count check | CQT share of torch count | matmul TFLOP/s | vs matmul | peak mem GiB | warmup s | "
          "overflowed steps |")


def format_row(r: dict) -> str:
    return (f"| {r['size']} | {r['case']} | {r['compile']} | {r['batch']} | {r['s_per_step']:.4f} | "
            f"{r['audio_s_per_s']:.0f} | {r['steps_per_s']:.2f} | {r['tflop_per_step']:.4g} | {r['tflops']:.4g} | "
            f"{r['mfu_spec']:.1%} | {r['counted_over_analytic']:.3f} | {r['cqt_share']:.1%} | "
            f"{r['matmul_tflops']:.4g} | {r['vs_matmul']:.1%} | {r['peak_mem_gib']:.1f} | {r['warmup_s']:.1f} | "
            f"{r['overflowed_steps']} of {r['timed_steps']} |")


def counted_flops(step: Step) -> tuple[int, int]:
    """(total FLOPs of one step as torch.utils.flop_counter counts them, of which the CQT target's forward).
    The CQT runs under no_grad, so the counter's attribution of its FLOPs to the module is exact (backward
    FLOPs are attributed to modules only loosely)."""
    with FlopCounterMode(display=False) as fc:
        step()
    counts = fc.get_flop_counts()
    cqt = sum(v for name, per_op in counts.items() if name.endswith(".cqt") for v in per_op.values())
    return fc.get_total_flops(), cqt


def run_case(size: str, case: Case, args, device: torch.device, cache: dict) -> tuple[dict, Step]:
    cfg = study_config(size, case, args.set)
    batch_size = args.batch or DEFAULT_BATCH[size]
    batch = random_batch(cfg, batch_size, args.seconds, device)
    torch.manual_seed(0)
    model = MusicMLM(cfg.model)
    model.frontend.impl = "gemm" if "gemm" in case.levers else "conv"
    model.encoder.checkpoint_layers = args.activation_checkpointing
    compile_model(model, args.compile, args.compile_backend)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = "cudnnbench" in case.levers
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step = build_step(model, cfg, batch, device)
    t = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync(device)
    warmup_s = time.perf_counter() - t
    step.overflows = 0
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    dt = (time.perf_counter() - t) / args.steps
    overflows = step.overflows
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    frames, masked = batch["mask"].shape[1], int(batch["mask"].sum())
    flops = analytic_flops(cfg, batch_size, frames, masked)
    key = (size, case.attention, batch_size, args.compile)
    if key not in cache and args.compile == "none":  # the flop counter does not see inside a compiled graph
        cache[key] = counted_flops(step)
    counted, cqt = cache.get((size, case.attention, batch_size, "none"), (float("nan"), float("nan")))
    dtype = MODE_DTYPE[case.mode]
    if dtype not in cache:
        n = args.matmul_n or (8192 if device.type == "cuda" else 128)
        cache[dtype] = matmul_rate(device, DTYPES[dtype], n)
    mm = cache[dtype]
    row = {"size": size, "case": str(case), "mode": case.mode, "attention": case.attention,
           "levers": list(case.levers), "compile": args.compile, "batch": batch_size, "seconds": args.seconds,
           "s_per_step": dt, "steps_per_s": 1 / dt, "audio_s_per_s": batch_size * args.seconds / dt,
           "tflop_per_step": flops / 1e12, "tflops": flops / dt / 1e12,
           "mfu_spec": flops / dt / (args.peak_tflops * 1e12), "counted_tflop_per_step": counted / 1e12,
           "counted_over_analytic": (counted - cqt - pos_conv_overcount(cfg, batch_size, frames)) / flops,
           "cqt_share": cqt / counted,
           "matmul_tflops": mm / 1e12, "vs_matmul": flops / dt / mm, "peak_mem_gib": mem, "warmup_s": warmup_s,
           "overflowed_steps": overflows, "timed_steps": args.steps, "masked_frames": masked, "frames": frames,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__}
    return row, step


def size_case(text: str) -> tuple[str, Case]:
    """``SIZE:CASE`` (an --extra row) -> (size, Case)."""
    size, _, case = text.partition(":")
    if size not in DEFAULT_BATCH:
        raise argparse.ArgumentTypeError(f"{text!r}: SIZE:CASE with SIZE one of {', '.join(DEFAULT_BATCH)}")
    return size, Case.parse(case)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", nargs="*", default=["base", "large"], choices=list(DEFAULT_BATCH))
    p.add_argument("--cases", nargs="*", type=Case.parse,
                   default=[Case.parse(c) for c in ("fairseq-math", "fairseq-relax", "bf16-sdpa")])
    p.add_argument("--extra", nargs="*", type=size_case, default=[], metavar="SIZE:CASE",
                   help="further rows after sizes x cases")
    p.add_argument("--batch", type=int, default=None, help="crops per step (default: base 64, large 32, tiny 2)")
    p.add_argument("--seconds", type=float, default=5.12, help="crop length (the study's 5.12 s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", default="none", choices=["none", "trainer", "layers"],
                   help="trainer: frontend + encoder (train.compile); layers: frontend + each encoder layer")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (eager: a fast smoke test)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense fp16/bf16 spec of the GPU")
    p.add_argument("--matmul-n", type=int, default=None,
                   help="size of the reference matmul (default 8192 on a GPU, 128 on a CPU)")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE", help="config overrides for every case")
    p.add_argument("--profile", default=None, help="write the top kernels of profiled steps of the first row here")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled for --profile")
    p.add_argument("--json", default=None, help="also write the rows here (rewritten after each row)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device: run on a GPU machine, or pass --device cpu for a smoke test")
    runs = [(size, case) for size in args.sizes for case in args.cases] + args.extra
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__} crop={args.seconds} s, {args.steps} timed steps after "
          f"{args.warmup} warm-up; MFU = analytic model FLOPs / s / {args.peak_tflops:g} TFLOP/s", flush=True)
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1), flush=True)
    rows, cache = [], {}
    for size, case in runs:
        row, step = run_case(size, case, args, device, cache)
        rows.append(row)
        print(format_row(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        if args.profile and len(rows) == 1:
            row["profile"] = write_profile(step, device, args.profile, f"{size} {case} batch={row['batch']} "
                                           f"x {args.seconds} s, compile={args.compile}", args.profile_steps)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    torch.backends.cudnn.benchmark = False


if __name__ == "__main__":
    main()
