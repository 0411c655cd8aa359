"""Pretraining loop on Hugging Face accelerate.

One optimizer update ("step") = ``train.grad_accum`` micro-batches. Per step: forward/backward under the
configured mixed precision, total gradient norm measured *before* clipping, clipping, non-finite steps
skipped (no parameter or optimizer-state change), AdamW + warmup/linear-decay schedule. Metrics (names as
in DESIGN.md) go to ``metrics.jsonl`` and TensorBoard; checkpoints are accelerate states, written aside and
moved into place so a checkpoint directory is either complete or absent.

Launch: ``accelerate launch recipes/pretrain.py --config recipes/tiny.yaml [--section.key=value ...]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from musiclm_stab.config import Config, ConfigError, load_config, save_config
from musiclm_stab.data import Collator, CropDataset, EpochSampler, split_indices
from musiclm_stab.model import MusicMLM, count_parameters

CHECKPOINT_PREFIX = "step_"
STATE_FILE = "trainer_state.json"


def lr_lambda(warmup_steps: int, max_steps: int):
    """Linear warmup to the peak lr over ``warmup_steps``, then linear decay to 0 at ``max_steps``."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))

    return f


def metric_names(num_codebooks: int) -> list[str]:
    """Per-step metrics averaged over micro-batches (and processes)."""
    return (["loss", "acoustic_mlm_loss", "musical_mlm_loss", "features_pen", "mask_fraction"]
            + [f"acoustic_mlm_loss/cb{k}" for k in range(num_codebooks)]
            + [f"acoustic_acc/cb{k}" for k in range(num_codebooks)])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (a complete one has its trainer_state.json)."""
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob(f"{CHECKPOINT_PREFIX}*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def build_data(cfg: Config, accelerator: Accelerator, tokenizer_info_out: dict):
    from musiclm_stab.tokenize import load_tokenized

    hf, info = load_tokenized(cfg.data.path)
    tokenizer_info_out.update(info)
    train_idx, _ = split_indices(hf["track"], cfg.data.eval_fraction)
    dataset = CropDataset(hf, train_idx, cfg.data.crop_seconds, seed=cfg.train.seed, random_crop=True)
    if dataset.num_skipped:
        accelerator.print(f"note: {dataset.num_skipped} segments shorter than the {cfg.data.crop_seconds} s crop are not used")
    needed = cfg.data.batch_size * accelerator.num_processes
    if len(dataset) < needed:
        raise ConfigError(f"data.path={cfg.data.path}: {len(dataset)} training crops, fewer than one global batch "
                          f"({needed}); lower data.batch_size or data.eval_fraction, or tokenize more audio")
    sampler = EpochSampler(len(dataset), seed=cfg.train.seed)
    collator = Collator(cfg.data, cfg.model.resolved(), seed=cfg.train.seed)
    loader = DataLoader(dataset, batch_size=cfg.data.batch_size, sampler=sampler, collate_fn=collator,
                        drop_last=True, num_workers=cfg.data.num_workers,
                        pin_memory=torch.cuda.is_available(),
                        # Its own generator: starting an epoch's iterator must not draw from the global RNG
                        # (dropout's), or a resumed run would diverge from an uninterrupted one.
                        generator=torch.Generator().manual_seed(cfg.train.seed))
    return loader, (dataset, sampler, collator)


def micro_batches(loader, epoch_objects, accelerator: Accelerator, consumed: int):
    """Endless stream of micro-batches that starts after ``consumed`` ones (exact resume)."""
    per_epoch = len(loader)
    epoch, skip = divmod(consumed, per_epoch)
    while True:
        for obj in epoch_objects:
            obj.set_epoch(epoch)
        loader.set_epoch(epoch)
        it = accelerator.skip_first_batches(loader, skip) if skip else loader
        yield from it
        epoch, skip = epoch + 1, 0


class MetricsWriter:
    """Appends one JSON row per logged step to metrics.jsonl (main process only)."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, row: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


def check_run_dir(cfg: Config, resume: bool, tokenizer_info: dict) -> None:
    """Refuse to overwrite a run, to resume with another model config, or to mix tokenizers."""
    from musiclm_stab.tokenize import check_same_tokenizer

    run_dir = cfg.run_dir
    saved_cfg = run_dir / "config.yaml"
    if saved_cfg.exists() and not resume:
        raise ConfigError(f"run directory {run_dir} already exists; pass --resume to continue it, "
                          f"or choose another --train.name")
    if resume and saved_cfg.exists():
        old = yaml.safe_load(saved_cfg.read_text())
        new = cfg.to_dict()
        changed = [k for k in new["model"] if old.get("model", {}).get(k) != new["model"][k]]
        if changed:
            raise ConfigError(f"cannot resume {run_dir} with a changed model config: {', '.join(changed)} "
                              f"differ from {saved_cfg}")
        old_tok = run_dir / "tokenizer.json"
        if old_tok.exists():
            check_same_tokenizer(json.loads(old_tok.read_text()), tokenizer_info, f"run {run_dir}",
                                 f"data {cfg.data.path}")


def write_run_dir(cfg: Config, tokenizer_info: dict) -> Path:
    run_dir = cfg.run_dir
    saved_cfg = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    save_config(cfg, saved_cfg)
    (run_dir / "tokenizer.json").write_text(json.dumps(tokenizer_info, indent=2))
    return run_dir


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, consumed: int, keep: int) -> Path:
    """Write the accelerate state aside, then move it into place: complete or absent."""
    final = run_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = run_dir / "checkpoints" / f".tmp-{CHECKPOINT_PREFIX}{step:08d}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, "consumed_micro_batches": consumed}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def train(cfg: Config, resume: bool = False) -> Path:
    """Run (or resume) pretraining as configured; returns the run directory."""
    tcfg, ocfg = cfg.train, cfg.optim
    accelerator = Accelerator(
        mixed_precision=tcfg.mixed_precision,
        log_with="tensorboard",
        project_config=ProjectConfiguration(project_dir=str(cfg.run_dir), logging_dir=str(cfg.run_dir)),
    )
    set_seed(tcfg.seed + 1000 * tcfg.run)
    tokenizer_info: dict = {}
    loader, epoch_objects = build_data(cfg, accelerator, tokenizer_info)
    check_run_dir(cfg, resume, tokenizer_info)
    if accelerator.is_main_process:
        write_run_dir(cfg, tokenizer_info)
    accelerator.wait_for_everyone()
    run_dir = cfg.run_dir

    model = MusicMLM(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ocfg.lr, betas=ocfg.betas, eps=ocfg.eps,
                                  weight_decay=ocfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(ocfg.warmup_steps, tcfg.max_steps))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step, consumed = 0, 0
    if resume:
        ckpts = list_checkpoints(run_dir)
        if ckpts:
            accelerator.load_state(str(ckpts[-1]))
            state = json.loads((ckpts[-1] / STATE_FILE).read_text())
            step, consumed = state["step"], state["consumed_micro_batches"]
            accelerator.print(f"resumed from {ckpts[-1]} at step {step}")
        else:
            accelerator.print(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}; starting at step 0")

    accelerator.init_trackers("tensorboard", config=_flat(cfg.to_dict()))
    writer = MetricsWriter(run_dir / "metrics.jsonl", accelerator.is_main_process)
    names = metric_names(cfg.model.num_codebooks)
    global_batch_s = cfg.data.batch_size * tcfg.grad_accum * accelerator.num_processes * cfg.data.crop_seconds
    if accelerator.is_main_process:
        print(f"run {run_dir}: {count_parameters(model) / 1e6:.2f}M parameters, scheme={cfg.model.norm_scheme}, "
              f"attention={cfg.model.attention}, precision={tcfg.mixed_precision}, global batch "
              f"{global_batch_s:.0f} audio-s, {len(loader)} micro-batches per epoch")

    stream = micro_batches(loader, epoch_objects, accelerator, consumed)
    sums = torch.zeros(len(names), device=accelerator.device)
    interval = new_interval()
    bar = tqdm(total=tcfg.max_steps, initial=step, desc="train", disable=not accelerator.is_main_process,
               dynamic_ncols=True)
    model.train()
    last_step = min(tcfg.max_steps, tcfg.stop_at or tcfg.max_steps)
    while step < last_step:
        for i in range(tcfg.grad_accum):
            batch = next(stream)
            sync = i == tcfg.grad_accum - 1
            with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                with accelerator.autocast():
                    out = model(batch["wav"], batch["clean_wav"], batch["codes"], batch["mask"])
                accelerator.backward(out.loss / tcfg.grad_accum)
            sums += _metric_vector(out).detach() / tcfg.grad_accum
            consumed += 1
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), ocfg.clip_grad)  # norm before clipping
        finite = bool(torch.isfinite(grad_norm))  # one host sync per step: needed to skip bad updates
        if accelerator.scaler is not None:
            optimizer.step()  # fp16: the grad scaler skips non-finite updates itself and lowers the scale
            overflow = accelerator.optimizer_step_was_skipped
        else:
            overflow = False
            if finite:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        interval["steps"] += 1
        interval["overflow"] += int(overflow)
        interval["skipped"] += int(not finite and not overflow)
        if finite:  # skipped and overflow steps never enter the gradient-norm statistics
            interval["grad_norm"] += float(grad_norm)
            interval["clipped"] += int(float(grad_norm) > ocfg.clip_grad)
        bar.update(1)

        if step % tcfg.log_every == 0 or step == last_step:
            values = accelerator.reduce(sums, reduction="mean") / interval["steps"]
            elapsed = time.perf_counter() - interval["t0"]
            good = interval["steps"] - interval["skipped"] - interval["overflow"]
            row = {"step": step, **dict(zip(names, values.tolist())),
                   "grad_norm": interval["grad_norm"] / good if good else float("nan"),
                   "grad_clipped": interval["clipped"] / max(1, good),
                   "skipped_step": interval["skipped"],
                   "lr": scheduler.get_last_lr()[0],
                   "audio_s_per_s": global_batch_s * interval["steps"] / elapsed}
            if accelerator.scaler is not None:
                row["loss_scale"] = float(accelerator.scaler.get_scale())
                row["overflow_step"] = interval["overflow"]
            writer.write(row)
            accelerator.log({k: v for k, v in row.items() if k != "step"}, step=step)
            bar.set_postfix(loss=f"{row['loss']:.3f}", gnorm=f"{row['grad_norm']:.2f}")
            sums.zero_()
            interval = new_interval()

        if step % tcfg.checkpoint_every == 0 or step == last_step:
            save_checkpoint(accelerator, run_dir, step, consumed, tcfg.keep_checkpoints)
    bar.close()
    accelerator.end_training()
    if accelerator.is_main_process:
        print(f"done: {run_dir} (step {step}); checkpoints in {run_dir / 'checkpoints'}")
    return run_dir


def new_interval() -> dict:
    return {"steps": 0, "skipped": 0, "overflow": 0, "clipped": 0, "grad_norm": 0.0, "t0": time.perf_counter()}


def _metric_vector(out) -> torch.Tensor:
    scalars = [out.loss, out.acoustic_mlm_loss, out.musical_mlm_loss, out.features_pen, out.mask_fraction]
    return torch.cat([torch.stack([s.float() for s in scalars]), out.acoustic_ce.float(), out.acoustic_acc.float()])


def _flat(d: dict, prefix: str = "") -> dict:
    """Flatten the config for TensorBoard's hparams (scalars and strings only)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="recipes/pretrain.py",
        description="Pretrain a music masked-LM. Overrides: --section.key=value (e.g. --model.norm_scheme=post).")
    parser.add_argument("--config", help="recipe YAML (recipes/*.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    args, rest = parser.parse_known_args(argv)
    bad = [r for r in rest if not (r.startswith("--") and "=" in r)]
    if bad:
        parser.error(f"unrecognized arguments {bad}; overrides look like --section.key=value")
    from musiclm_stab.tokenize import TokenizerMismatch

    try:
        cfg = load_config(args.config, rest)
        train(cfg, resume=args.resume)
    except (ConfigError, TokenizerMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
