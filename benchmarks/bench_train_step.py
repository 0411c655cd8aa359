"""Training step of our model vs transformers.HubertModel at an identical configuration, side by side.

Both get the same conv frontend sizes, width, depth, heads, norm placement, sequence length and dtype,
and the *same* heads and loss on top (our AcousticHeads + MusicalHead + CQT target), so the difference
is the backbone. One step = forward + backward + AdamW step. Runs alternate (ours, peer, ours, ...) so
load from other jobs hits both alike. Also reports our step's FLOP/s against the machine's dense matmul
rate measured in the same run.

    python benchmarks/bench_train_step.py --size base --dtypes fp32 bf16 --schemes pre post --repeats 3\n    python benchmarks/bench_train_step.py --variants ours before peer   # the speed work, before/after
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from reference_dropout import torch_dropout
from torch.utils.flop_counter import FlopCounterMode

from musiclm_stab.config import ModelConfig
from musiclm_stab.data.masking import span_mask
from musiclm_stab.model import MusicMLM
from musiclm_stab.model.frontend import PAD
from musiclm_stab.model.objective import acoustic_losses, musical_loss


class PeerMLM(torch.nn.Module):
    """transformers.HubertModel as the backbone, with our heads and loss on top."""

    def __init__(self, cfg: ModelConfig, heads_from: MusicMLM, attn_implementation: str = "sdpa"):
        super().__init__()
        from transformers import HubertConfig, HubertModel

        hc = HubertConfig(
            hidden_size=cfg.width, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.ffn_dim, conv_dim=(cfg.conv_dim,) * 7, conv_stride=(5, 2, 2, 2, 2, 2, 2),
            conv_kernel=(10, 3, 3, 3, 3, 2, 2), conv_bias=False, feat_extract_norm="group",
            do_stable_layer_norm=cfg.norm_scheme == "pre", num_conv_pos_embeddings=cfg.pos_conv_kernel,
            num_conv_pos_embedding_groups=cfg.pos_conv_groups, hidden_dropout=cfg.dropout,
            attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
            feat_proj_dropout=cfg.feature_dropout, layerdrop=0.0, mask_time_prob=0.05,  # > 0 so it has masked_spec_embed; our masks are passed in
            attn_implementation=attn_implementation)
        self.backbone = HubertModel(hc)
        self.acoustic, self.musical, self.cqt = heads_from.acoustic, heads_from.musical, heads_from.cqt
        self.cfg = cfg

    def forward(self, wav, clean_wav, codes, mask):
        x = self.backbone(torch.nn.functional.pad(wav, (PAD, PAD)), mask_time_indices=mask).last_hidden_state
        with torch.no_grad():
            cqt = self.cqt(clean_wav)
        h = x[mask]
        ce_sum, _, _ = acoustic_losses(self.acoustic(h), codes.transpose(1, 2)[mask].long())
        return ce_sum + self.cfg.musical_weight * musical_loss(self.musical(h), cqt[mask])


def step_fn(model, opt, batch, dtype, context=contextlib.nullcontext):
    def run():
        with context(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            out = model(*batch)
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def matmul_rate(dtype: str, n: int = 2048, repeats: int = 5) -> float:
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    a @ b
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="base", choices=["tiny", "base", "large"])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--schemes", nargs="+", default=["pre", "post"], choices=["pre", "post"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--matmul-n", type=int, default=2048, help="size of the dense matmul the step is compared with")
    p.add_argument("--variants", nargs="+", default=["ours", "peer"],
                   choices=["ours", "peer", "before", "compiled", "ckpt"],
                   help="ours: as trained (fused AdamW, CPU fast dropout); peer: HubertModel backbone with our "
                   "heads, fused AdamW; before: ours with foreach AdamW and torch's dropout (the code before the "
                   "speed work); compiled: ours with train.compile; ckpt: ours with activation checkpointing")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    T = int(args.seconds * 75)
    wav = torch.randn(args.batch, 320 * T) * 0.1
    batch = (wav, wav, torch.randint(0, 1024, (args.batch, 8, T)), span_mask(args.batch, T, 0.8, 5))
    audio_s = args.batch * args.seconds
    names = args.variants
    print(f"size={args.size} batch={args.batch} x {args.seconds} s, threads={torch.get_num_threads()}, "
          f"best of {args.repeats} steps after a warm-up, variants alternating")
    print("| scheme | dtype | " + " | ".join(f"{n} s/step" for n in names) + " | " +
          " | ".join(f"{n} audio-s/s" for n in names if n != "peer") +
          (" | " + " | ".join(f"{n}/peer" for n in names if n != "peer") if "peer" in names else "") +
          " | GFLOP/step | ours GFLOP/s | matmul GFLOP/s | ours / matmul |")
    print("|---" * (2 + len(names) + sum(n != "peer" for n in names) * (1 + ("peer" in names)) + 4) + "|")
    for scheme in args.schemes:
        cfg = ModelConfig(size=args.size, norm_scheme=scheme).resolved()
        ours = MusicMLM(cfg).train()
        models = {}
        for n in names:
            if n == "ours":
                models[n] = ours
            elif n == "peer":
                models[n] = PeerMLM(cfg, MusicMLM(cfg)).train()
            else:
                m = MusicMLM(cfg).train()
                m.load_state_dict(ours.state_dict())
                if n == "compiled":
                    m.frontend.compile()
                    m.encoder.compile()
                m.encoder.checkpoint_layers = n == "ckpt"
                models[n] = m
        for dtype in args.dtypes:
            fns = {}
            for n, m in models.items():
                opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=n != "before", foreach=n == "before")
                fns[n] = step_fn(m, opt, batch, dtype, torch_dropout if n == "before" else contextlib.nullcontext)
            for fn in fns.values():
                fn()  # warm-up (and compilation)
            times = {n: [] for n in names}
            for _ in range(args.repeats):
                for n, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    times[n].append(time.perf_counter() - t)
            with FlopCounterMode(display=False) as fc:
                fns["ours" if "ours" in fns else names[0]]()
            flops = fc.get_total_flops()
            rate = matmul_rate(dtype, args.matmul_n)
            best = {n: min(v) for n, v in times.items()}
            o = best.get("ours", best[names[0]])
            cells = [f"{best[n]:.2f}" for n in names] + [f"{audio_s / best[n]:.2f}" for n in names if n != "peer"]
            if "peer" in names:
                cells += [f"{best['peer'] / best[n]:.2f}x" for n in names if n != "peer"]
            cells += [f"{flops / 1e9:.0f}", f"{flops / o / 1e9:.0f}", f"{rate / 1e9:.0f}", f"{flops / o / rate:.0%}"]
            print(f"| {scheme} | {dtype} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
