"""Pretraining loop on Hugging Face accelerate.

One optimizer update ("step") = ``train.grad_accum`` micro-batches. Per step: forward/backward in the
configured precision (training/precision.py: fp32, bf16, fp16 as fairseq or amp computes it), total gradient
norm measured *before* clipping, clipping, non-finite steps skipped (no parameter or optimizer-state change),
AdamW + warmup/linear-decay schedule. Metrics (names as
in DESIGN.md) go to ``metrics.jsonl`` and the ``train.trackers`` (TensorBoard by default), with the held-out
``eval/*`` metrics every ``train.eval_every`` steps; checkpoints are accelerate states, written aside and
moved into place so a checkpoint directory is either complete or absent.

Launch: ``musiclm-stab train [ACCELERATE OPTIONS --] --config tiny [--section.key=value ...]``, which is
``accelerate launch [ACCELERATE OPTIONS] -m musiclm_stab.pretrain --config tiny ...`` (training/arguments.py)
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration, set_seed
from tqdm.auto import tqdm

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import config_yaml, load_config
from musiclm_stab.config.sections import Config
from musiclm_stab.data.loader import build_data, held_out_loader, micro_batches
from musiclm_stab.model import MusicMLM, count_parameters
from musiclm_stab.training import checkpoint, checkpoint_load
from musiclm_stab.training.arguments import parse_trainer_args
from musiclm_stab.training.checkpoint_writer import CheckpointWriter
from musiclm_stab.training.fits import check_data_fits, check_memory_fits, local_process_count
from musiclm_stab.training.held_out import held_out_metrics
from musiclm_stab.training.loss_scaler import EXIT_DIVERGED, MinLossScaleError
from musiclm_stab.training.optim import build_optimizer, frontend_groups, lr_lambda
from musiclm_stab.training.precision import FairseqFp16, launched_precision, make_precision
from musiclm_stab.training.registered import Registered
from musiclm_stab.training.resume import check_resumable, data_fingerprint
from musiclm_stab.training.run_dir import (
    MetricsWriteError,
    MetricsWriter,
    RunBusy,
    RunLockLost,
    check_run_dir,
    check_run_lock,
    global_batch,
    global_batch_crops,
    lock_run_dir,
    on_main,
    resolve_grad_accum,
    rewind_metrics,
    warmup_line,
    write_run_dir,
)
from musiclm_stab.training.stability import (
    GradClipper,
    SpikeGuard,
    grad_headroom,
    layer_diagnostics,
    record_activations,
    record_attention_logits,
)
from musiclm_stab.training.stop import StopSignal
from musiclm_stab.training.tracking import flat_config, new_interval, reduce_by_name, tracker_names

PROJECT = "musiclm_stab"  # the trackers' project (wandb project, MLflow experiment; TensorBoard's subfolder)


class Trainer:
    """The training loop's state and its two halves: ``train_step`` (micro-batches) and ``update``."""

    def __init__(self, cfg: Config, resume: bool = False):
        self.run_lock = None  # the run directory's lock (run_dir.RunLock), held until the run ends
        try:
            self._setup(cfg, resume)
        except BaseException:
            self.release_run_dir()
            raise

    def check_run_lock(self, doing: str) -> None:
        """Stop, on every process, if the run directory's lock file was deleted or replaced (run_dir.RunLock.check:
        another trainer may be writing the run): called before each metrics row and checkpoint. Collective."""
        check_run_lock(self.accelerator, self.run_lock, doing)

    def lost_run_lock(self, error: BaseException) -> RunLockLost | None:
        """The RunLockLost to report instead of ``error`` (an exception that ended the loop) when the run's lock
        file was deleted or replaced meanwhile: then another trainer may have caused ``error`` (e.g. by
        removing a checkpoint write in progress as a crash's), and the lost lock is what to say (main process)."""
        if self.run_lock is None or isinstance(error, RunBusy) or not isinstance(error, Exception):
            return None
        try:
            self.run_lock.check(f"going on after {type(error).__name__}: {error}")
        except RunLockLost as lost:
            return lost
        return None

    def release_run_dir(self) -> None:
        """Let another trainer have the run directory: at the end of ``run``, or when the start failed."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _setup(self, cfg: Config, resume: bool) -> None:
        cfg = cfg.resolved()  # per-size values and the warmup filled in (load_config's already are)
        # accelerate launch's --mixed_precision (or its config file's) is obeyed, and said: precision.py
        cfg, precision_note = launched_precision(cfg)
        tcfg, ocfg = cfg.train, cfg.optim
        self.accelerator = accelerator = Accelerator(
            # fp16 is ours (training/precision.py: fairseq's or amp's, on any device); bf16 is accelerate's autocast
            mixed_precision="no" if tcfg.mixed_precision == "fp16" else tcfg.mixed_precision,
            log_with=tracker_names(tcfg.trackers),
            # The CQT kernels are constant buffers: no need to broadcast them every step under DDP. With
            # layerdrop a step may skip layers, whose parameters then get no gradient: DDP must look for them
            # (as MERT's find_unused_parameters: true), or it stops waiting for their reduction.
            kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False,
                                                           find_unused_parameters=cfg.model.layerdrop > 0)],
            # Our schedule counts optimizer updates: one scheduler step per update at any process count
            # (by default accelerate steps it once per process).
            step_scheduler_with_optimizer=False,
            project_config=ProjectConfiguration(project_dir=str(cfg.run_dir), logging_dir=str(cfg.run_dir)),
        )
        if precision_note:
            accelerator.print(precision_note)
        launched = int(os.environ.get("WORLD_SIZE", "1"))  # not every launcher sets it: only refuse > 1 vs 1
        if launched > 1 and accelerator.num_processes == 1:
            raise ConfigError(
                f"launched as {launched} processes (WORLD_SIZE) but accelerate set up {accelerator.num_processes}: "
                "they would train as independent runs into the same directory. On CPU set ACCELERATE_USE_CPU=1 "
                "(ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N ...); with GPUs use accelerate launch.")
        # train.global_batch_crops fixes train.grad_accum for this process count
        self.cfg = cfg = resolve_grad_accum(cfg, accelerator.num_processes)
        tcfg = cfg.train
        set_seed(tcfg.seed)  # train.run is legend text ("Run 2"): runs of one seed share their init draws
        tokenizer_info: dict = {}
        loader, self.epoch_objects, held_out = build_data(cfg, accelerator, tokenizer_info)
        # This process's share of the held-out batches (train.eval_every), the same batches at any count.
        self.eval_loader = None if held_out is None else held_out_loader(
            cfg, held_out, max_batches=tcfg.eval_batches, rank=accelerator.process_index,
            world_size=accelerator.num_processes)
        # Before any work: the model against the data's tokenizer and the machine's memory (fits.py), then
        # one trainer per run directory (run_dir.RunLock; every process learns if it is refused)
        check_data_fits(cfg, tokenizer_info)
        check_memory_fits(cfg, accelerator.device, local_process_count(accelerator.num_processes))
        self.run_lock = lock_run_dir(accelerator, cfg.run_dir)
        check_run_dir(cfg, resume, tokenizer_info)
        # the newest intact checkpoint; ResumeRefused (exit 2) where none is, before the directory is written
        resume_from = checkpoint.resume_point(cfg.run_dir) if resume else None
        self.tokenizer_sha256 = tokenizer_info.get("weights_sha256")
        accelerator.wait_for_everyone()  # every process has checked the run directory before it is written
        on_main(accelerator, write_run_dir, cfg, tokenizer_info, accelerator.num_processes, resume)
        accelerator.wait_for_everyone()
        self.run_dir = cfg.run_dir

        model = MusicMLM(cfg.model)
        model.encoder.checkpoint_layers = tcfg.activation_checkpointing
        if tcfg.compile:  # in place: parameter names (checkpoints, export) stay those of the eager model
            model.frontend.compile()
            model.encoder.compile()
        self.precision = make_precision(cfg, accelerator)
        # fairseq fp16: fp32 master copies; optim.frontend_lr: the conv frontend in a group of its own
        optimizer = build_optimizer(frontend_groups(model, self.precision.prepare_model(model), ocfg), ocfg)
        if isinstance(self.precision, FairseqFp16):
            self.precision.attach(optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(ocfg.warmup_steps, tcfg.max_steps))
        if cfg.data.streaming:  # StreamingCrops splits the data across processes itself
            self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)
            self.loader = loader
        else:
            self.model, self.optimizer, self.loader, self.scheduler = accelerator.prepare(
                model, optimizer, loader, scheduler)
        self.clipper, self.guard = GradClipper(ocfg), SpikeGuard(tcfg)
        # Checkpoints written by a thread after a fast CPU copy of the state (checkpoint_writer.CheckpointWriter).
        # Not with the spike guard: each process judges spikes on its own loss, so processes may disagree on
        # a rollback, and the writer's wait before one is collective.
        self.checkpoints = CheckpointWriter(accelerator, self.run_dir, background=not tcfg.spike_guard)
        # (through the lock, not the trainer: a reference from the writer back to the trainer would keep it, and
        # the data loader's worker processes with it, alive past the end of the run)
        self.checkpoints.before_publish = functools.partial(_before_publish, accelerator, self.run_lock)

        self.step, self.consumed, self.rollbacks = 0, 0, 0
        if resume:
            if accelerator.is_main_process:
                for partial in checkpoint.remove_partial(self.run_dir):
                    print(f"removed {partial}: a checkpoint write interrupted by a crash (incomplete, never loaded)")
            accelerator.wait_for_everyone()
            if resume_from is not None:
                self.step = self.load_checkpoint(resume_from)
                accelerator.print(f"resumed from {resume_from} at step {self.step}")
            else:
                accelerator.print(f"--resume: no checkpoint in {self.run_dir / 'checkpoints'}; starting at step 0")
            if accelerator.is_main_process:  # the steps after the checkpoint are logged again: never twice
                aside = rewind_metrics(self.run_dir / "metrics.jsonl", self.step)
                if aside is not None:
                    print(f"moved the rows of metrics.jsonl after step {self.step} (logged after that checkpoint "
                          f"by the run that stopped) to {aside}")
        self.stream = micro_batches(self.loader, self.epoch_objects, accelerator, self.consumed)
        self.global_batch_s = global_batch_crops(cfg, accelerator.num_processes) * cfg.data.crop_seconds

    def registered_objects(self) -> Registered:
        """The trainer's own stateful objects a checkpoint holds, by name: their ``state_dict()`` (plain
        data) is stored as JSON in the checkpoint's registered.json (training/registered.py), never pickled."""
        return [("grad_clipper", self.clipper), ("spike_guard", self.guard), ("precision", self.precision)]

    @functools.cached_property
    def data_identity(self) -> dict:
        """What the checkpoints record of the data their position indexes, and a resume checks
        (training/resume.py): the tokenizer's weights sha256 and the rows' fingerprint."""
        return {"tokenizer_sha256": self.tokenizer_sha256, "data_fingerprint": data_fingerprint(self.cfg.data.path)}

    def load_checkpoint(self, ckpt: Path) -> int:
        """Restore checkpoint ``ckpt`` (already verified against its hashes); returns its step. Refused
        (ConfigError) where it cannot be resumed exactly, or holds anything but data (checkpoint_load)."""
        state = checkpoint.read_state(ckpt)
        check_resumable(ckpt, state, self.cfg, self.accelerator.num_processes, self.data_identity)
        checkpoint_load.load(self.accelerator, ckpt, self.registered_objects())
        self.checkpoints.intact.add(ckpt)  # pruning and a repeated save need not hash it again
        self.consumed = state["consumed_micro_batches"]
        return state["step"]

    def train_step(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Forward/backward over grad_accum micro-batches; returns (metrics by name, means over the
        micro-batches, on the device; diagnostics)."""
        tcfg, acc = self.cfg.train, self.accelerator
        step = self.step + 1
        diagnose = tcfg.diagnostics_every and step % tcfg.diagnostics_every == 0
        sums: dict[str, torch.Tensor] = {}
        activations: dict[str, torch.Tensor] = {}
        for i in range(tcfg.grad_accum):
            batch = next(self.stream)
            self.consumed += 1
            last = i == tcfg.grad_accum - 1
            if diagnose and last:
                record_attention_logits(self.model, True)
            recording = record_activations(self.model) if diagnose and last else contextlib.nullcontext(activations)
            synced = last and self.precision.ddp_sync  # else the precision sums the micro-batches (fp16_accum_group)
            with contextlib.nullcontext() if synced else acc.no_sync(self.model), recording as activations:
                w, frames = self.masked_weight(batch["mask"])
                if i == 0:
                    self.precision.begin_update(frames)
                with self.precision.forward():
                    out = self.model(self.precision.cast_input(batch["wav"]), batch["clean_wav"], batch["codes"],
                                     batch["mask"], frame_weight=w)
                loss = self.perturb_loss(step, out.loss)
                self.precision.backward(loss, tcfg.grad_accum)
                self.precision.after_backward(i)
            out.loss = loss  # the loss as backpropagated (perturb_loss), logged in train.loss_unit
            metrics = out.metrics(tcfg.loss_unit)
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value / tcfg.grad_accum
        diag = {}
        if diagnose:
            diag = layer_diagnostics(self.model, grad_scale=self.precision.grad_scale())
            record_attention_logits(self.model, False)
            diag.update({f"diag/{name}": value for name, value in activations.items()})
            largest_grad = grad_headroom(self.model)  # the model's own gradients: fp16 and scaled in fairseq fp16
            if largest_grad is not None:
                diag["diag/headroom/grad"] = largest_grad
        self.perturb_grads(step)
        return sums, diag

    # Fault-injection seams for the tests of the stability tools (tests/test_stability.py overrides them in
    # a subclass): the loss that is backpropagated and logged, and the gradients before the update.
    def perturb_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def perturb_grads(self, step: int) -> None:
        pass

    def masked_weight(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_local / mean over processes of n, that mean), with n the masked frames of this micro-batch.

        The masked losses are means over local masked frames; weighted by this, the gradient DDP averages
        (and the metrics averaged over processes) are those of the mean over the *global* batch's masked
        frames, as one process with the whole batch would compute. 1 on a single process.
        """
        n = mask.sum().float()
        if self.accelerator.num_processes == 1:
            return torch.ones((), device=mask.device), n
        mean = self.accelerator.reduce(n.clone(), reduction="mean").clamp_min(1.0)
        return n / mean, mean

    def evaluate_held_out(self) -> dict[str, float]:
        """{"eval/<metric>": value} on the held-out batches, as ``musiclm-stab evaluate`` computes them (in
        the run's mixed precision, which the prepared model applies), every process evaluating its share and
        the sums reduced over processes (weighted by masked frames). Dropout off; the model's train/eval
        mode and the global RNG states (CPU and this process's GPU) are restored, so training goes on
        exactly as without the evaluation."""
        acc = self.accelerator
        model = acc.unwrap_model(self.model)
        was_training = model.training
        gpus = [acc.device] if acc.device.type == "cuda" else []
        with torch.random.fork_rng(devices=gpus, device_type="cuda"):
            model.eval()
            try:
                metrics, _ = held_out_metrics(model, self.eval_loader, self.cfg.model, self.cfg.train.loss_unit,
                                              acc.device, reduce_sum=lambda t: acc.reduce(t, reduction="sum"),
                                              forward_context=self.precision.forward,
                                              cast_input=self.precision.cast_input)
            finally:
                model.train(was_training)
        return metrics

    def update(self) -> dict:
        """Clip and apply the accumulated gradients, unless they are non-finite; advances the step, except
        after an overflow in fairseq fp16 (an overflowed update is no update there; training/precision.py).

        Returns {"grad_norm": pre-clip norm (float), "threshold", "clipped", "skipped", "overflow", "advanced"}.
        Raises MinLossScaleError when fairseq's loss scale reaches its floor.
        """
        threshold = self.clipper.threshold()
        result = self.precision.step(self.model, self.optimizer, threshold)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)  # fairseq fp16: the model's own (fp16) gradients
        advanced = not result.overflow or self.precision.overflow_advances_step
        if advanced:
            self.scheduler.step()
            self.step += 1
        if result.applied:
            self.clipper.observe(result.grad_norm)  # skipped and overflow steps feed no statistic
        return {"grad_norm": result.grad_norm, "threshold": threshold,
                "clipped": result.applied and result.grad_norm > threshold,
                "skipped": not result.applied and not result.overflow, "overflow": result.overflow,
                "advanced": advanced}

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
        self.checkpoints.wait()  # a checkpoint still being written is a candidate too
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
        # Named after the run where a tracker has runs (wandb, MLflow); TensorBoard writes <run>/musiclm_stab/.
        acc.init_trackers(PROJECT, config=flat_config(cfg.to_dict()),
                          init_kwargs={"wandb": {"name": tcfg.name, "dir": str(self.run_dir)},
                                       "mlflow": {"run_name": tcfg.name}})
        writer = MetricsWriter(self.run_dir / "metrics.jsonl", acc.is_main_process, self.run_lock)
        if acc.is_main_process:
            print(f"run {self.run_dir}: {count_parameters(self.model) / 1e6:.2f}M parameters, "
                  f"scheme={cfg.model.norm_scheme}, attention={cfg.model.attention}, "
                  f"precision={self.precision.describe()}, {acc.num_processes} process(es), "
                  f"{global_batch(cfg, acc.num_processes)}, {warmup_line(cfg, acc.num_processes)}, "
                  f"{len(self.loader)} micro-batches per epoch per process"
                  + (f" (streamed, shuffle buffer {cfg.data.shuffle_buffer} rows)" if cfg.data.streaming else ""))
        last_step = min(tcfg.max_steps, tcfg.stop_at or tcfg.max_steps)
        bar = tqdm(total=last_step, initial=self.step, desc="train", disable=not acc.is_main_process,
                   dynamic_ncols=True)
        self.model.train()
        stop = StopSignal()
        try:
            self._loop(last_step, stop, bar, writer)
            self.checkpoints.wait()  # the last checkpoint is complete before the run ends
        except BaseException as error:
            lost = self.lost_run_lock(error)
            if lost is None and not isinstance(error, RunBusy):  # RunBusy: the run's lock was taken from it
                self.checkpoints.after_error(error)  # a finished write is published, not left for --resume to remove
            self.release_run_dir()
            if lost is not None:  # what went wrong follows from that (another trainer removed a partial write...)
                raise lost from error
            raise
        finally:
            bar.close()
            stop.restore()
        acc.end_training()
        self.release_run_dir()
        if acc.is_main_process:
            print(f"done: {self.run_dir} (step {self.step}); checkpoints in {self.run_dir / 'checkpoints'}")
        return self.run_dir

    def _loop(self, last_step: int, stop: StopSignal, bar: tqdm, writer: MetricsWriter) -> None:
        """The steps of ``run`` until ``last_step`` or a stop signal."""
        tcfg, acc = self.cfg.train, self.accelerator
        sums: dict[str, torch.Tensor] = {}  # metrics summed over the steps since the last row, on the device
        interval, diag = new_interval(), {}
        while self.step < last_step:
            self.checkpoints.poll()  # publish a background checkpoint write that has finished; never waits
            if stop.requested(acc):
                ckpt = self.save_checkpoint()  # the step's own checkpoint if it has one: not written again
                self.checkpoints.wait()
                acc.print(f"stopped by {stop.name} at step {self.step}; checkpoint {ckpt}. Resume with the same "
                          "command and --resume.")
                break
            step_sums, step_diag = self.train_step()
            try:
                result = self.update()
            except MinLossScaleError as e:
                writer.write({"step": self.step, "event": "min_loss_scale", "loss_scale": self.precision.loss_scale,
                              "overflow_step": interval["overflow"] + 1, "reason": str(e)})
                raise MinLossScaleError(f"step {self.step + 1}: {e}") from None
            diag.update(step_diag)
            for name, value in step_sums.items():
                sums[name] = sums.get(name, 0.0) + value
            interval["steps"] += 1
            interval["overflow"] += int(result["overflow"])
            interval["skipped"] += int(result["skipped"])
            if not (result["skipped"] or result["overflow"]):
                interval["grad_norm"] += result["grad_norm"]
                interval["clipped"] += int(result["clipped"])
            if not result["advanced"]:
                continue  # fairseq fp16 overflow: the same step again with the next batch; counted in the next row
            bar.update(1)

            if self.step % tcfg.log_every == 0 or self.step == last_step:
                row = self.metrics_row(sums, interval, diag)
                if tcfg.eval_every and (self.step % tcfg.eval_every == 0 or self.step == tcfg.max_steps):
                    row.update(self.evaluate_held_out())  # after the row's clock: not in audio_s_per_s
                self.check_run_lock(f"the metrics row of step {self.step}")  # every process stops together
                writer.write(row)
                acc.log({k: v for k, v in row.items() if k != "step"}, step=self.step)
                bar.set_postfix(loss=f"{row['loss']:.3f}", gnorm=f"{row['grad_norm']:.2f}")
                sums = {}
                interval, diag = new_interval(), {}
            if tcfg.spike_guard and self.maybe_roll_back(float(step_sums["loss"]), writer):
                bar.n = self.step
                bar.refresh()
                sums = {}
                interval, diag = new_interval(), {}
                continue  # never checkpoint the spiked state
            if self.step % tcfg.checkpoint_every == 0 or self.step == last_step:
                self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        self.check_run_lock(f"checkpoint {self.step}")
        state = {"consumed_micro_batches": self.consumed, "num_processes": self.accelerator.num_processes,
                 "config": self.cfg.to_dict(), **self.data_identity}
        return self.checkpoints.save(self.step, state, self.cfg.train.keep_checkpoints, self.cfg.train.keep_every,
                                     self.registered_objects())

    def metrics_row(self, sums: dict[str, torch.Tensor], interval: dict, diag: dict) -> dict:
        """One metrics.jsonl row: means over the steps since the last row, reduced across processes."""
        acc = self.accelerator
        means = reduce_by_name(acc, sums, divide=max(1, interval["steps"]))
        elapsed = time.perf_counter() - interval["t0"]
        good = interval["steps"] - interval["skipped"] - interval["overflow"]  # updates applied
        row = {"step": self.step, **means,
               "grad_norm": interval["grad_norm"] / good if good else float("nan"),
               "grad_clipped": interval["clipped"] / good if good else 0.0,
               "grad_clip_threshold": self.clipper.threshold(),
               "skipped_step": interval["skipped"],
               "lr": self.scheduler.get_last_lr()[0],
               "audio_s_per_s": self.global_batch_s * interval["steps"] / elapsed}
        if self.precision.loss_scale is not None:
            row["loss_scale"] = self.precision.loss_scale
            row["overflow_step"] = interval["overflow"]
        if diag:
            row.update({k: float(v) for k, v in diag.items()})
        return row


def _before_publish(accelerator, lock, step: int) -> None:
    check_run_lock(accelerator, lock, f"publishing checkpoint {step}")


def train(cfg: Config, resume: bool = False) -> Path:
    """Run (or resume) pretraining as configured; returns the run directory."""
    return Trainer(cfg, resume).run()


def leave_process_group() -> None:
    """Tear down torch.distributed, and whatever keeps gloo's threads running, before the interpreter
    exits: ``main`` calls it on every exit (a finished run, an error every process raised such as a
    failed checkpoint write, any other exception). Left to exit-time destructors, the process group's
    threads sometimes abort a rank that has done and printed everything ("terminate called without an
    active exception", exit -6 under torchrun; seen on clean-clone CI runs after a finished run and after
    a failed write, and here in 1 of 28 runs of the failed-write test).

    ``destroy_process_group`` alone does not stop those threads: the DDP model's reducer holds the group
    until the model is freed, which its reference cycles leave to the garbage collector (at exit, for an
    exception's traceback keeps the model's frames). So it also waits for a background checkpoint write
    still running (a thread in torch.save at exit is killed mid-call), drops the locals of the finished
    frames of an exception in flight (the traceback still prints) and collects, which frees the model and
    joins gloo's threads here. (``main`` imports ``torch.distributed.nn`` before any group exists, see
    there.) A no-op in a single process but for the collection; local (no collective): it never waits
    on another process."""
    import gc
    import threading
    import traceback

    import torch.distributed as dist

    for thread in threading.enumerate():  # CheckpointWriter's thread (daemon: not waited for at exit)
        if thread.name.startswith("checkpoint-") and thread is not threading.current_thread():
            thread.join()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    error = sys.exc_info()[1]
    if error is not None:
        traceback.clear_frames(error.__traceback__)  # the running frames (main's) keep theirs
    gc.collect()


def print_config(configs: list[str], overrides: list[str], environ: Mapping[str, str] = os.environ) -> None:
    """Print the config this launch would train with as YAML, as the run's config.yaml would hold it: the
    recipes, overlays and settings resolved, then what the launch decides (accelerate's precision,
    train.grad_accum from train.global_batch_crops at its process count), each change said in a comment.
    Only the main process prints (a launch of several processes runs this in each); nothing is written."""
    cfg, note = launched_precision(load_config(configs, overrides), environ)
    processes = int(environ.get("WORLD_SIZE", "1"))
    cfg = resolve_grad_accum(cfg, processes)
    if int(environ.get("RANK", "0")) == 0:
        comment = "\n".join([f"launched with {global_batch(cfg, processes)}", *([note] if note else [])])
        print(config_yaml(cfg, comment), end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    """``musiclm-stab train`` / ``-m musiclm_stab.pretrain`` under accelerate launch: train, or with
    --print-config print what would train."""
    args = parse_trainer_args(argv)
    if args.print_config:
        try:
            print_config(args.configs, args.overrides)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    # Before any process group exists: torch.distributed.nn.functional's collectives take
    # group=group.WORLD as a default argument, evaluated when the module is imported. DDP imports it (via
    # torch._dynamo) after accelerate has made the group, and those defaults then held the group, and its
    # gloo threads, until the interpreter's teardown, past destroy_process_group (leave_process_group).
    import torch.distributed.nn.functional  # noqa: F401

    from musiclm_stab.data.tokenized import TokenizerMismatch

    try:
        cfg = load_config(args.configs, args.overrides)
        train(cfg, resume=args.resume)
    except (ConfigError, TokenizerMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (checkpoint.CheckpointWriteError, MetricsWriteError) as e:  # e.g. disk full: the checkpoint is intact
        print(f"error: {e}", file=sys.stderr)
        return 1
    except MinLossScaleError as e:  # the run diverged (fp16): recorded in metrics.jsonl as a min_loss_scale event
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    finally:
        leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
