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
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration, send_to_device, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from musiclm_stab import checkpoint
from musiclm_stab.config import Config, ConfigError, load_config, save_config
from musiclm_stab.data import Collator, CropDataset, EpochSampler, StreamingCrops, split_indices
from musiclm_stab.model import MusicMLM, count_parameters
from musiclm_stab.stability import GradClipper, SpikeGuard, layer_diagnostics, record_attention_logits


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


# A checkpoint's data position (micro-batches consumed) means the same batches only with these unchanged.
DATA_POSITION_KEYS = (("data", "batch_size"), ("data", "crop_seconds"), ("data", "eval_fraction"),
                      ("data", "streaming"), ("data", "shuffle_buffer"), ("train", "grad_accum"), ("train", "seed"))


def keep_configured_kernel(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Optimizer ``load_state_dict`` pre-hook: keep the kernel the optimizer was built with.

    torch restores a checkpoint's ``param_groups`` whole, kernel choice (``fused``, ``foreach``) included,
    so a run resumed with another ``optim.fused`` would silently keep the old kernel. The kernel does not
    change the math, so the configured one wins; each ``step`` counter moves to where that kernel keeps it
    (fused or capturable: on the parameter's device, which torch's load does; else on the CPU, as a fresh
    optimizer has it, instead of one host sync per parameter and step)."""
    for saved, now in zip(state_dict["param_groups"], optimizer.param_groups):
        for key in ("fused", "foreach"):
            if key in now:
                saved[key] = now[key]
        if now.get("fused") or now.get("capturable"):
            continue
        for pid in saved["params"]:
            step = state_dict["state"].get(pid, {}).get("step")
            if isinstance(step, torch.Tensor):
                state_dict["state"][pid]["step"] = step.cpu()
    return state_dict


def build_data(cfg: Config, accelerator: Accelerator, tokenizer_info_out: dict):
    """The training loader and the objects that take ``set_epoch``. ``data.path`` is one tokenized folder or
    several (shards are read in the order a single run wrote them). Saved data: a DataLoader that
    ``accelerator.prepare`` splits across processes. ``data.streaming``: a DataLoader over StreamingCrops,
    which does the split itself (this process's examples only), so it is not prepared."""
    from musiclm_stab.tokenize import TokenizerMismatch, load_tokenized

    dcfg = cfg.data
    try:
        hf, info = load_tokenized(dcfg.path, streaming=dcfg.streaming)
    except TokenizerMismatch:
        raise
    except (FileNotFoundError, ValueError) as e:  # missing, unfinished or not a tokenized dataset
        raise ConfigError(f"data.path: {e}") from e
    tokenizer_info_out.update(info)
    collator = Collator(dcfg, cfg.model.resolved(), seed=cfg.train.seed)
    if dcfg.streaming:
        try:
            dataset = StreamingCrops(hf, dcfg.eval_fraction, dcfg.crop_seconds, dcfg.batch_size,
                                     seed=cfg.train.seed, rank=accelerator.process_index,
                                     world_size=accelerator.num_processes, shuffle_buffer=dcfg.shuffle_buffer)
        except ValueError as e:  # a part file that is not arrow data, or lacks a column: named in e
            raise ConfigError(f"data.path: {e}") from e
        count = dataset.num_examples
    else:
        train_idx, _ = split_indices(hf["track"], dcfg.eval_fraction)
        dataset = CropDataset(hf, train_idx, dcfg.crop_seconds, seed=cfg.train.seed, random_crop=True)
        count = len(dataset)
    if dataset.num_skipped:
        accelerator.print(f"note: {dataset.num_skipped} segments shorter than the {dcfg.crop_seconds} s crop are not used")
    needed = dcfg.batch_size * accelerator.num_processes
    if count < needed:
        raise ConfigError(f"data.path={dcfg.path}: {count} training crops, fewer than one global batch "
                          f"({needed}); lower data.batch_size or data.eval_fraction, or tokenize more audio")
    # Its own generator: starting an epoch's iterator must not draw from the global RNG (dropout's), or a
    # resumed run would diverge from an uninterrupted one.
    common = dict(collate_fn=collator, num_workers=dcfg.num_workers, pin_memory=torch.cuda.is_available(),
                  generator=torch.Generator().manual_seed(cfg.train.seed))
    if dcfg.streaming:
        return DataLoader(dataset, batch_size=None, **common), (dataset, collator)
    sampler = EpochSampler(len(dataset), seed=cfg.train.seed)
    loader = DataLoader(dataset, batch_size=dcfg.batch_size, sampler=sampler, drop_last=True, **common)
    return loader, (dataset, sampler, collator)


def micro_batches(loader, epoch_objects, accelerator: Accelerator, consumed: int):
    """Endless stream of micro-batches that starts after ``consumed`` ones (exact resume)."""
    per_epoch = len(loader)
    epoch, skip = divmod(consumed, per_epoch)
    streaming = isinstance(loader.dataset, StreamingCrops)
    while True:
        for obj in epoch_objects:
            obj.set_epoch(epoch)
        if streaming:  # a plain DataLoader (not prepared): skip without decoding, place on the device here
            loader.dataset.skip = skip
            it = (send_to_device(batch, accelerator.device) for batch in loader)
        else:
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


def global_batch_crops(cfg: Config, num_processes: int) -> int:
    """Crops in one optimizer update, over all processes and accumulated micro-batches."""
    return cfg.data.batch_size * cfg.train.grad_accum * num_processes


def global_batch(cfg: Config, num_processes: int) -> str:
    """One line stating the global batch (one optimizer update) in crops and audio-seconds."""
    crops = global_batch_crops(cfg, num_processes)
    return (f"global batch {crops} crops = {crops * cfg.data.crop_seconds:g} audio-s per update "
            f"(data.batch_size {cfg.data.batch_size} x train.grad_accum {cfg.train.grad_accum} x "
            f"{num_processes} process(es) x data.crop_seconds {cfg.data.crop_seconds:g})")


def write_run_dir(cfg: Config, tokenizer_info: dict, num_processes: int = 1) -> Path:
    run_dir = cfg.run_dir
    saved_cfg = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    save_config(cfg, saved_cfg, comment=f"launched with {global_batch(cfg, num_processes)}")
    (run_dir / "tokenizer.json").write_text(json.dumps(tokenizer_info, indent=2))
    return run_dir


class Trainer:
    """The training loop's state and its two halves: ``train_step`` (micro-batches) and ``update``."""

    def __init__(self, cfg: Config, resume: bool = False):
        self.cfg = cfg
        tcfg, ocfg = cfg.train, cfg.optim
        if tcfg.mixed_precision == "fp16" and not torch.cuda.is_available():
            raise ConfigError("train.mixed_precision=fp16 needs a CUDA GPU: on CPU accelerate neither autocasts "
                              "nor scales the loss, so the run would silently be fp32. Use bf16 or no on CPU "
                              "(the fp16 behaviour of the attention forms is tested on fp16 tensors).")
        self.accelerator = accelerator = Accelerator(
            mixed_precision=tcfg.mixed_precision,
            log_with="tensorboard",
            # The CQT kernels are constant buffers: no need to broadcast them every step under DDP.
            kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
            # Our schedule counts optimizer updates: one scheduler step per update at any process count
            # (by default accelerate steps it once per process).
            step_scheduler_with_optimizer=False,
            project_config=ProjectConfiguration(project_dir=str(cfg.run_dir), logging_dir=str(cfg.run_dir)),
        )
        launched = int(os.environ.get("WORLD_SIZE", "1"))  # not every launcher sets it: only refuse > 1 vs 1
        if launched > 1 and accelerator.num_processes == 1:
            raise ConfigError(
                f"launched as {launched} processes (WORLD_SIZE) but accelerate set up {accelerator.num_processes}: "
                "they would train as independent runs into the same directory. On CPU set ACCELERATE_USE_CPU=1 "
                "(ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N ...); with GPUs use accelerate launch.")
        set_seed(tcfg.seed + 1000 * tcfg.run)
        tokenizer_info: dict = {}
        loader, self.epoch_objects = build_data(cfg, accelerator, tokenizer_info)
        check_run_dir(cfg, resume, tokenizer_info)
        self.tokenizer_sha256 = tokenizer_info.get("weights_sha256")
        accelerator.wait_for_everyone()  # every process has checked the run directory before it is written
        if accelerator.is_main_process:
            write_run_dir(cfg, tokenizer_info, accelerator.num_processes)
        accelerator.wait_for_everyone()
        self.run_dir = cfg.run_dir

        model = MusicMLM(cfg.model)
        model.encoder.checkpoint_layers = tcfg.activation_checkpointing
        if tcfg.compile:  # in place: parameter names (checkpoints, export) stay those of the eager model
            model.frontend.compile()
            model.encoder.compile()
        optimizer = torch.optim.AdamW(model.parameters(), lr=ocfg.lr, betas=ocfg.betas, eps=ocfg.eps,
                                      weight_decay=ocfg.weight_decay, fused=ocfg.fused or None)
        optimizer.register_load_state_dict_pre_hook(keep_configured_kernel)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(ocfg.warmup_steps, tcfg.max_steps))
        if cfg.data.streaming:  # StreamingCrops splits the data across processes itself
            self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)
            self.loader = loader
        else:
            self.model, self.optimizer, self.loader, self.scheduler = accelerator.prepare(
                model, optimizer, loader, scheduler)
        self.clipper, self.guard = GradClipper(ocfg), SpikeGuard(tcfg)
        accelerator.register_for_checkpointing(self.clipper, self.guard)

        self.step, self.consumed, self.rollbacks = 0, 0, 0
        self.injected: set[str] = set()  # fault injection fires once, even if a rollback replays the step
        if resume:
            if accelerator.is_main_process:
                for partial in checkpoint.remove_partial(self.run_dir):
                    print(f"removed {partial}: a checkpoint write interrupted by a crash (incomplete, never loaded)")
            accelerator.wait_for_everyone()
            ckpt = checkpoint.newest_valid(self.run_dir)
            if ckpt is not None:
                self.step = self.load_checkpoint(ckpt)
                accelerator.print(f"resumed from {ckpt} at step {self.step}")
            else:
                accelerator.print(f"--resume: no complete checkpoint in {self.run_dir / 'checkpoints'}; "
                                  "starting at step 0")
        self.stream = micro_batches(self.loader, self.epoch_objects, accelerator, self.consumed)
        self.names = metric_names(cfg.model.num_codebooks)
        self.pen_weight = cfg.model.features_pen_weight
        self.global_batch_s = global_batch_crops(cfg, accelerator.num_processes) * cfg.data.crop_seconds

    def load_checkpoint(self, ckpt: Path) -> int:
        state = checkpoint.read_state(ckpt)
        saved = state.get("num_processes", 1)
        if saved != self.accelerator.num_processes:
            raise ConfigError(f"{ckpt} was written by {saved} process(es); resume it with {saved} (its data "
                              f"position and RNG states are per process), not {self.accelerator.num_processes}")
        then, now = state.get("config") or {}, self.cfg.to_dict()
        changed = [f"{sec}.{key}: {then[sec][key]!r} in the checkpoint, {now[sec][key]!r} now"
                   for sec, key in DATA_POSITION_KEYS if key in then.get(sec, {}) and then[sec][key] != now[sec][key]]
        if changed:
            raise ConfigError(f"cannot resume {ckpt} exactly: settings that define its data position changed\n  "
                              + "\n  ".join(changed) + "\nset them back, or start a new run (another --train.name)")
        self.accelerator.load_state(str(ckpt))
        self.consumed = state["consumed_micro_batches"]
        return state["step"]

    def train_step(self) -> tuple[torch.Tensor, dict]:
        """Forward/backward over grad_accum micro-batches; returns (metric vector, diagnostics)."""
        tcfg, acc = self.cfg.train, self.accelerator
        step = self.step + 1
        diagnose = tcfg.diagnostics_every and step % tcfg.diagnostics_every == 0
        spike = self._inject("spike", step == tcfg.inject_spike_at)
        sums = torch.zeros(len(self.names), device=acc.device)
        for i in range(tcfg.grad_accum):
            batch = next(self.stream)
            self.consumed += 1
            last = i == tcfg.grad_accum - 1
            if diagnose and last:
                record_attention_logits(self.model, True)
            with contextlib.nullcontext() if last else acc.no_sync(self.model):
                with acc.autocast():
                    out = self.model(batch["wav"], batch["clean_wav"], batch["codes"], batch["mask"])
                w = self.masked_weight(batch["mask"])
                loss = w * (out.loss - self.pen_weight * out.features_pen) + self.pen_weight * out.features_pen
                loss = loss * 1000.0 if spike else loss
                acc.backward(loss / tcfg.grad_accum)
            vec = _metric_vector(out).detach()
            vec[0], vec[1:3], vec[5:] = loss.detach().float(), vec[1:3] * w, vec[5:] * w
            sums += vec / tcfg.grad_accum
        diag = {}
        if diagnose:
            scale = float(acc.scaler.get_scale()) if acc.scaler is not None else 1.0
            diag = layer_diagnostics(self.model, grad_scale=scale)
            record_attention_logits(self.model, False)
        if self._inject("nan", step == tcfg.inject_nan_at):
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        return sums, diag

    def masked_weight(self, mask: torch.Tensor) -> torch.Tensor:
        """n_local / mean over processes of n, with n the masked frames of this micro-batch.

        The masked losses are means over local masked frames; weighted by this, the gradient DDP averages
        (and the metrics averaged over processes) are those of the mean over the *global* batch's masked
        frames, as one process with the whole batch would compute. 1 on a single process.
        """
        if self.accelerator.num_processes == 1:
            return torch.ones((), device=mask.device)
        n = mask.sum().float()
        return n / self.accelerator.reduce(n.clone(), reduction="mean").clamp_min(1.0)

    def _inject(self, fault: str, due: bool) -> bool:
        if due and fault not in self.injected:
            self.injected.add(fault)
            return True
        return False

    def update(self) -> dict:
        """Clip and apply the accumulated gradients, unless they are non-finite. Advances the step.

        Returns {"grad_norm": pre-clip norm (float), "clipped", "skipped", "overflow"}.
        """
        acc = self.accelerator
        threshold = self.clipper.threshold()
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), threshold)  # norm before clipping
        norm = float(grad_norm)  # one host sync per step: needed to skip non-finite updates
        finite = math.isfinite(norm)
        if acc.scaler is not None:
            self.optimizer.step()  # fp16: the grad scaler skips non-finite updates itself, lowers the scale
            # The norm is of the unscaled gradients, so non-finite means the scaler found inf and skipped
            # (accelerate's optimizer_step_was_skipped stays False with fused AdamW, which skips in-kernel).
            overflow = not finite
        else:
            overflow = False
            if finite:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        skipped = not finite and not overflow
        if finite and not overflow:
            self.clipper.observe(norm)  # skipped and overflow steps feed no statistic
        return {"grad_norm": norm, "threshold": threshold, "clipped": finite and norm > threshold,
                "skipped": skipped, "overflow": overflow}

    def maybe_roll_back(self, step_loss: float, writer: MetricsWriter) -> bool:
        """Spike guard: roll back to the newest checkpoint before this step; the data stream goes on, so
        the batches since that checkpoint are skipped. Returns True if it rolled back."""
        tcfg = self.cfg.train
        if not tcfg.spike_guard:
            return False
        if not self.guard.is_spike(step_loss):
            self.guard.observe(step_loss)
            return False
        spike_step = self.step
        earlier = [c for c in checkpoint.list_checkpoints(self.run_dir)
                   if checkpoint.checkpoint_step(c) < spike_step and checkpoint.verify(c) is None]
        if not earlier or self.rollbacks >= tcfg.max_rollbacks:
            why = "no earlier checkpoint" if not earlier else f"train.max_rollbacks={tcfg.max_rollbacks} reached"
            writer.write({"step": spike_step, "event": "spike", "loss": step_loss, "reason": f"not rolled back: {why}"})
            self.accelerator.print(f"loss spike at step {spike_step} ({step_loss:.4g}); not rolled back: {why}")
            return False
        consumed = self.consumed
        to_step = self.load_checkpoint(earlier[-1])
        skipped = consumed - self.consumed
        self.consumed, self.step = consumed, to_step  # keep the data position: skip the offending batches
        self.rollbacks += 1
        reason = f"loss {step_loss:.4g} is a spike against the last {len(self.guard.window)} steps"
        writer.write({"step": spike_step, "event": "rollback", "to_step": to_step, "loss": step_loss,
                      "skipped_micro_batches": skipped, "reason": reason})
        self.accelerator.print(f"loss spike at step {spike_step}: {reason}; rolled back to step {to_step}, "
                               f"skipping {skipped} micro-batches")
        return True

    def run(self) -> Path:
        cfg, tcfg, acc = self.cfg, self.cfg.train, self.accelerator
        acc.init_trackers("tensorboard", config=_flat(cfg.to_dict()))
        writer = MetricsWriter(self.run_dir / "metrics.jsonl", acc.is_main_process)
        if acc.is_main_process:
            print(f"run {self.run_dir}: {count_parameters(self.model) / 1e6:.2f}M parameters, "
                  f"scheme={cfg.model.norm_scheme}, attention={cfg.model.attention}, precision={tcfg.mixed_precision}, "
                  f"{acc.num_processes} process(es), {global_batch(cfg, acc.num_processes)}, "
                  f"{len(self.loader)} micro-batches per epoch per process"
                  + (f" (streamed, shuffle buffer {cfg.data.shuffle_buffer} rows)" if cfg.data.streaming else ""))
        last_step = min(tcfg.max_steps, tcfg.stop_at or tcfg.max_steps)
        bar = tqdm(total=last_step, initial=self.step, desc="train", disable=not acc.is_main_process,
                   dynamic_ncols=True)
        sums = torch.zeros(len(self.names), device=acc.device)
        interval, diag = new_interval(), {}
        self.model.train()
        stop = StopSignal()
        while self.step < last_step:
            if stop.requested(acc):
                ckpt = self.save_checkpoint()
                acc.print(f"stopped by {stop.name} at step {self.step}; checkpoint {ckpt}. Resume with the same "
                          "command and --resume.")
                break
            step_sums, step_diag = self.train_step()
            result = self.update()
            diag.update(step_diag)
            sums += step_sums
            interval["steps"] += 1
            interval["overflow"] += int(result["overflow"])
            interval["skipped"] += int(result["skipped"])
            if not (result["skipped"] or result["overflow"]):
                interval["grad_norm"] += result["grad_norm"]
                interval["clipped"] += int(result["clipped"])
            bar.update(1)

            if self.step % tcfg.log_every == 0 or self.step == last_step:
                row = self.metrics_row(sums, interval, diag)
                writer.write(row)
                acc.log({k: v for k, v in row.items() if k != "step"}, step=self.step)
                bar.set_postfix(loss=f"{row['loss']:.3f}", gnorm=f"{row['grad_norm']:.2f}")
                sums.zero_()
                interval, diag = new_interval(), {}
            if tcfg.spike_guard and self.maybe_roll_back(float(step_sums[0]), writer):
                bar.n = self.step
                bar.refresh()
                sums.zero_()
                interval, diag = new_interval(), {}
                continue  # never checkpoint the spiked state
            if self.step % tcfg.checkpoint_every == 0 or self.step == last_step:
                self.save_checkpoint()
        bar.close()
        stop.restore()
        acc.end_training()
        if acc.is_main_process:
            print(f"done: {self.run_dir} (step {self.step}); checkpoints in {self.run_dir / 'checkpoints'}")
        return self.run_dir

    def save_checkpoint(self) -> Path:
        state = {"consumed_micro_batches": self.consumed, "num_processes": self.accelerator.num_processes,
                 "config": self.cfg.to_dict(),
                 "tokenizer_sha256": self.tokenizer_sha256}
        return checkpoint.save(self.accelerator, self.run_dir, self.step, state, self.cfg.train.keep_checkpoints,
                               self.cfg.train.keep_every)

    def metrics_row(self, sums: torch.Tensor, interval: dict, diag: dict) -> dict:
        """One metrics.jsonl row: means over the steps since the last row, reduced across processes."""
        acc = self.accelerator
        values = acc.reduce(sums, reduction="mean") / max(1, interval["steps"])
        elapsed = time.perf_counter() - interval["t0"]
        good = interval["steps"] - interval["skipped"] - interval["overflow"]
        row = {"step": self.step, **dict(zip(self.names, values.tolist())),
               "grad_norm": interval["grad_norm"] / good if good else float("nan"),
               "grad_clipped": interval["clipped"] / good if good else 0.0,
               "grad_clip_threshold": self.clipper.threshold(),
               "skipped_step": interval["skipped"],
               "lr": self.scheduler.get_last_lr()[0],
               "audio_s_per_s": self.global_batch_s * interval["steps"] / elapsed}
        if acc.scaler is not None:
            row["loss_scale"] = float(acc.scaler.get_scale())
            row["overflow_step"] = interval["overflow"]
        if diag:
            row.update({k: float(v) for k, v in diag.items()})
        return row


class StopSignal:
    """SIGTERM / SIGINT (what schedulers send before preemption) ask the loop to checkpoint and stop
    after the current step. Under several processes the request is agreed on by all ranks."""

    def __init__(self):
        self.name: str | None = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.name = signal.Signals(signum).name

    def requested(self, accelerator: Accelerator) -> bool:
        if accelerator.num_processes == 1:
            return self.name is not None
        flag = torch.tensor([1.0 if self.name else 0.0], device=accelerator.device)
        if accelerator.reduce(flag, reduction="sum").item() > 0:
            self.name = self.name or "a signal on another process"
            return True
        return False

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def train(cfg: Config, resume: bool = False) -> Path:
    """Run (or resume) pretraining as configured; returns the run directory."""
    return Trainer(cfg, resume).run()


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
    except checkpoint.CheckpointWriteError as e:  # e.g. disk full: stop, the previous checkpoint is intact
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
