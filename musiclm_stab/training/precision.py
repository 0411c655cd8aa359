"""The trainer's arithmetic: fp32, bf16 autocast, and fp16 as fairseq or as torch amp computes it.

A ``Precision`` does, for the trainer, what depends on the number format (``make_precision`` picks it):

    prepare_model(model)        -> the parameters the optimizer updates (fp32 master copies for fairseq fp16)
    forward()                   the context of the forward pass
    begin_update(frames)        once per update, with the first micro-batch's masked frames
    backward(loss, accum)       backpropagate one micro-batch's loss (scaled where a loss scaler is used)
    after_backward(i)           after micro-batch i's backward (fairseq fp16's per-GPU accumulation)
    ddp_sync                    whether DDP reduces the gradients at the last micro-batch (else the precision does)
    step(model, optimizer, thr) unscale, measure the norm before clipping, clip, update or skip -> StepResult
    loss_scale, state_dict()    logged as ``loss_scale`` / checkpointed (JSON)

- ``train.mixed_precision`` no / bf16 (``Precision``): accelerate's autocast (none for fp32); a non-finite
  gradient skips the update, which still counts as a step.
- fp16, ``train.fp16_mode=amp`` (``AmpFp16``): torch autocast in fp16 (or its emulation, model/fp16_arith.py)
  with torch's GradScaler at its defaults (what accelerate used); an overflowed update counts as a step.
- fp16, ``train.fp16_mode=fairseq`` (``FairseqFp16``): fairseq's ``--fp16`` (its FP16Optimizer and
  DynamicLossScaler), what MERT trained with. The model is fp16 (real half tensors, or fp32 tensors holding
  fp16 values under the emulation), the optimizer updates fp32 master copies, which are rounded back into
  the model after each update. fairseq's criterion sums the loss over masked frames, so its fp16 gradients
  are loss_scale x the gradients of that sum; ours is a mean, so it is backpropagated times the masked frames
  of the update's first micro-batch (one factor for the whole update: the update stays the mean over
  micro-batches of the other modes) times the loss scale. The unscaled gradients are copied into the fp32
  masters; an inf or NaN norm is an overflow: the update is skipped, the scale halved (training/loss_scaler.py),
  and, as in fairseq, it is no update: the step and the learning-rate schedule do not advance.
  ``train.fp16_accum_group`` G reproduces on fewer GPUs how MERT-330M's 64 summed their fp16 gradients
  (fairseq's legacy DDP, ``no_c10d``): each GPU summed its update_freq = 8 micro-batches in fp16, divided that
  sum by the world size in fp16 and the GPUs' sums were added in fp16. Here each group of G micro-batches is
  summed in the model's fp16 gradients, divided in fp16 by the number of groups in the whole update (over
  every process), and the groups are added in fp16 (over processes by an all-reduce in fp16, DDP's own sync
  left out). Without it one fp16 sum covers all of a process's micro-batches: 64 times MERT's on one GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.sections import Config, TrainConfig
from musiclm_stab.model.fp16_arith import Fp16Emulation, emulation, round_fp16, round_parameters_
from musiclm_stab.training.loss_scaler import DynamicLossScaler

MASTER_KEY = "fp32_master_params"  # where the fp32 master weights ride in the optimizer's state dict
# How `accelerate launch` passes its --mixed_precision (or its config file's mixed_precision) to the script
# (accelerate/utils/launch.py, every launcher), read by AcceleratorState when Accelerator gets none.
ACCELERATE_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"


@dataclass
class StepResult:
    grad_norm: float  # total norm of the unscaled gradients before clipping (inf or NaN when not finite)
    applied: bool  # the optimizer updated the parameters
    overflow: bool  # fp16: the scaled gradients overflowed, the update was skipped and the loss scale lowered


def launched_precision(cfg: Config, environ: Mapping[str, str] = os.environ) -> tuple[Config, str | None]:
    """``cfg`` with the mixed precision ``accelerate launch`` was asked for, and a line that says what changed
    (None: nothing did). The trainer passes its own precision to Accelerator, which would otherwise set
    accelerate's aside without a word.

    accelerate sets ACCELERATE_MIXED_PRECISION on every launch, to "no" when neither its flag nor its config
    file names one: "no" is no request, and the config decides (to train a bf16 recipe in fp32, set
    train.mixed_precision=no). bf16 makes the run bf16. fp16 in accelerate is torch amp with a GradScaler,
    this project's train.fp16_mode=amp: a config already in fp16 keeps its own mode (fairseq's, as the study
    recipes), any other becomes fp16 amp. Anything else (fp8) is refused: ConfigError naming both values.
    The run's config.yaml records the precision it trained in.
    """
    asked = environ.get(ACCELERATE_PRECISION_ENV, "no").strip().lower()
    tcfg = cfg.train
    if asked in ("", "no") or asked == tcfg.mixed_precision:
        return cfg, None
    source = f"accelerate launch ({ACCELERATE_PRECISION_ENV}={asked}: --mixed_precision or its config file)"
    if asked == "bf16":
        train = dataclasses.replace(tcfg, mixed_precision="bf16")
    elif asked == "fp16":
        train = dataclasses.replace(tcfg, mixed_precision="fp16", fp16_mode="amp")
    else:
        raise ConfigError(f"{source} asks for mixed precision {asked}, which this trainer does not have; the config "
                          f"says train.mixed_precision={tcfg.mixed_precision} (choices: no, bf16, fp16)")
    said = f"{train.mixed_precision}{' (fp16_mode=amp, as accelerate computes fp16)' if asked == 'fp16' else ''}"
    return (dataclasses.replace(cfg, train=train).validate(),
            f"training in {said}, as {source} asks, not in the config's train.mixed_precision={tcfg.mixed_precision}")


def fp16_impl(tcfg: TrainConfig, device: torch.device | str) -> str:
    """``half`` or ``emulate``: ``train.fp16_impl``, with ``auto`` resolved by the device (half on CUDA)."""
    if tcfg.fp16_impl != "auto":
        return tcfg.fp16_impl
    return "half" if torch.device(device).type == "cuda" else "emulate"


def forward_context(tcfg: TrainConfig, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context of a forward pass in the run's precision, for evaluation outside the trainer (a model
    loaded from a checkpoint: fp32 tensors, with fp16 values for a fairseq-mode run)."""
    device = torch.device(device)
    if tcfg.mixed_precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if tcfg.mixed_precision != "fp16":
        return contextlib.nullcontext()
    if tcfg.fp16_mode == "amp" and fp16_impl(tcfg, device) == "half":
        return torch.autocast(device.type, dtype=torch.float16)
    return Fp16Emulation(tcfg.fp16_mode)  # the checkpoint's weights are fp32 tensors here


class Precision:
    """fp32 and bf16: accelerate's autocast; a non-finite gradient skips the update (still a step)."""

    name = "native"
    overflow_advances_step = True  # whether an overflowed (skipped) update still advances the step
    ddp_sync = True  # DDP averages the gradients at the last micro-batch of an update

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator

    def describe(self) -> str:
        return self.accelerator.mixed_precision

    def prepare_model(self, model: nn.Module) -> list[nn.Parameter]:
        return list(model.parameters())

    def forward(self) -> contextlib.AbstractContextManager:
        return self.accelerator.autocast()

    def cast_input(self, wav: torch.Tensor) -> torch.Tensor:
        return wav

    def begin_update(self, frames: torch.Tensor) -> None:
        pass

    def backward(self, loss: torch.Tensor, accum: int) -> None:
        self.accelerator.backward(loss / accum)

    def after_backward(self, micro_batch: int) -> None:
        pass

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, threshold: float) -> StepResult:
        norm = float(self.accelerator.clip_grad_norm_(model.parameters(), threshold))  # one host sync per step
        finite = math.isfinite(norm)
        if finite:
            optimizer.step()
        return StepResult(norm, applied=finite, overflow=False)

    @property
    def loss_scale(self) -> float | None:
        return None

    def grad_scale(self) -> float:
        """The factor still in the model's gradients after backward (per-layer diagnostics divide it out)."""
        return 1.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class AmpFp16(Precision):
    """fp16 as torch amp computes it: autocast (or its emulation) and GradScaler at torch's defaults."""

    name = "amp"

    def __init__(self, accelerator: Accelerator, impl: str):
        super().__init__(accelerator)
        self.impl = impl
        self.scaler = torch.amp.GradScaler(accelerator.device.type)  # init 65536, x2 after 2000 clean steps

    def describe(self) -> str:
        return f"fp16 (amp, {'emulated' if self.impl == 'emulate' else 'half'})"

    def forward(self):
        if self.impl == "half":
            return torch.autocast(self.accelerator.device.type, dtype=torch.float16)
        return Fp16Emulation("amp")

    def backward(self, loss, accum):
        with emulation("amp" if self.impl == "emulate" else None):
            self.accelerator.backward(self.scaler.scale(loss / accum))

    def step(self, model, optimizer, threshold):
        self.scaler.unscale_(optimizer)
        norm = float(self.accelerator.clip_grad_norm_(model.parameters(), threshold))
        self.scaler.step(optimizer)  # skipped when unscale_ found inf or NaN
        self.scaler.update()
        overflow = not math.isfinite(norm)
        return StepResult(norm, applied=not overflow, overflow=overflow)

    @property
    def loss_scale(self):
        return float(self.scaler.get_scale())

    def grad_scale(self):
        return self.loss_scale

    def state_dict(self):
        return {"grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state):
        self.scaler.load_state_dict(state["grad_scaler"])


class FairseqFp16(Precision):
    """fp16 as fairseq's ``--fp16`` computes it (module docstring): fp16 model, fp32 masters, its scaler."""

    name = "fairseq"
    overflow_advances_step = False  # fairseq: an overflowed update is no update (trainer.py set_num_updates)

    def __init__(self, accelerator: Accelerator, tcfg: TrainConfig, impl: str):
        super().__init__(accelerator)
        self.impl = impl
        # fairseq's default window: 2^14 / (data-parallel size x update_freq)
        window = tcfg.fp16_scale_window or max(1, int(2**14 / (accelerator.num_processes * tcfg.grad_accum)))
        self.scaler = DynamicLossScaler(loss_scale=tcfg.fp16_init_scale, scale_window=window,
                                        tolerance=tcfg.fp16_scale_tolerance, min_loss_scale=tcfg.fp16_min_loss_scale)
        self.accum = tcfg.grad_accum
        self.frames = 1.0
        self.params: list[nn.Parameter] = []
        self.master: list[nn.Parameter] = []
        self.group = tcfg.fp16_accum_group  # None: one fp16 sum over this process's micro-batches
        if self.group is not None and tcfg.grad_accum % self.group:
            raise ConfigError(f"train.fp16_accum_group={self.group} must divide train.grad_accum={tcfg.grad_accum} "
                              f"(the micro-batches of an update on each of {accelerator.num_processes} process(es))")
        self.groups = tcfg.grad_accum // self.group * accelerator.num_processes if self.group else 1
        self.ddp_sync = self.group is None
        self.summed: list[torch.Tensor | None] = []  # the fp16 sum of the groups so far (fp16_accum_group)

    def describe(self) -> str:
        return (f"fp16 (fairseq, {'emulated' if self.impl == 'emulate' else 'half'}; loss scale "
                f"{self.scaler.loss_scale:g}, window {self.scaler.scale_window}, floor {self.scaler.min_loss_scale:g})")

    def prepare_model(self, model):
        """Make ``model`` an fp16 model (``.half()``, or its parameters rounded to fp16 values under the
        emulation; modules marked ``keeps_fp32`` stay fp32) on the accelerator's device, and return the
        fp32 master copies of its parameters, built from the fp16 values as fairseq's FP16Optimizer does."""
        model.to(self.accelerator.device)
        if self.impl == "half":
            model.half()
            for module in model.modules():
                if getattr(module, "keeps_fp32", False):
                    module.float()
        else:
            round_parameters_(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        return self.master

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Carry the master weights in ``optimizer``'s state dict (a torch optimizer saves its state but not
        its parameters' values), so that a checkpoint resumes exactly."""
        optimizer.register_state_dict_post_hook(self._save_master)
        optimizer.register_load_state_dict_pre_hook(self._load_master)

    def _save_master(self, optimizer, state_dict):
        state_dict[MASTER_KEY] = [m.detach() for m in self.master]
        return state_dict

    def _load_master(self, optimizer, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTER_KEY, None)
        if saved is None or len(saved) != len(self.master):
            raise ConfigError("the checkpoint's optimizer state has no fp32 master weights of this model: it was not "
                              "written by a train.fp16_mode=fairseq run of the same model")
        with torch.no_grad():
            for m, s, p in zip(self.master, saved, self.params):
                m.copy_(s)
                p.copy_(s if self.impl == "half" else round_fp16(s.to(p.device)))
        return state_dict

    def forward(self):
        return emulation("fairseq" if self.impl == "emulate" else None)

    def cast_input(self, wav):
        # fairseq's trainer casts the sample to half (apply_half); the emulation rounds it, so that every
        # float32 tensor the fp16 model reads holds an fp16 value (the emulation leaves copies unrounded)
        return wav.half() if self.impl == "half" else round_fp16(wav)

    def begin_update(self, frames):
        self.frames = max(1.0, float(frames))

    def backward(self, loss, accum):
        with emulation("fairseq" if self.impl == "emulate" else None):
            self.accelerator.backward(loss * (self.scaler.loss_scale * self.frames))

    def after_backward(self, micro_batch):
        """With ``fp16_accum_group`` G: at the end of each group of G micro-batches, the group's fp16 sum
        divided in fp16 by the number of groups of the update is added, in fp16, to the update's sum; at the
        last, that sum (all-reduced over processes, in fp16) becomes the gradients."""
        if self.group is None or (micro_batch + 1) % self.group:
            return
        with torch.no_grad():
            if not self.summed:
                self.summed = [None] * len(self.params)
            for j, p in enumerate(self.params):
                if p.grad is None:
                    continue
                part = self._fp16(p.grad / self.groups)
                self.summed[j] = part if self.summed[j] is None else self._fp16(self.summed[j] + part)
                p.grad = None
            if micro_batch + 1 < self.accum:
                return
            for p, g in zip(self.params, self.summed):
                if g is not None and self.accelerator.num_processes > 1:
                    torch.distributed.all_reduce(g)  # a sum, in fp16 on real half tensors
                    g = self._fp16(g)
                p.grad = g
            self.summed = []

    def _fp16(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as an fp16 result: rounded under the emulation (real half arithmetic already is)."""
        return t if self.impl == "half" else round_fp16(t)

    def grad_scale(self):
        # the gradients hold loss_scale x masked frames x the sum over micro-batches (over one group of them,
        # the groups' sums divided by their number, with fp16_accum_group)
        return self.scaler.loss_scale * self.frames * (self.group or self.accum)

    def step(self, model, optimizer, threshold):
        inv = 1.0 / self.grad_scale()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if p.grad is None:
                    m.grad = torch.zeros_like(m)
                else:  # fp16 gradients (under DDP their average, rounded as fp16 arithmetic would) -> fp32
                    m.grad = round_fp16(p.grad.float()).mul_(inv)
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, threshold))  # of the unscaled gradients
        if not math.isfinite(norm):
            self.scaler.overflow()  # halve the scale, or MinLossScaleError at the floor
            return StepResult(norm, applied=False, overflow=True)
        optimizer.step()
        with torch.no_grad():  # the masters rounded back into the fp16 model
            for p, m in zip(self.params, self.master):
                p.copy_(m if self.impl == "half" else round_fp16(m))
        self.scaler.update()
        return StepResult(norm, applied=True, overflow=False)

    @property
    def loss_scale(self):
        return self.scaler.loss_scale

    def state_dict(self):
        return {"loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state):
        self.scaler.load_state_dict(state["loss_scaler"])


def make_precision(cfg: Config, accelerator: Accelerator) -> Precision:
    """The Precision of ``cfg.train`` (mixed_precision, fp16_mode, fp16_impl) on ``accelerator``."""
    tcfg = cfg.train
    if tcfg.mixed_precision != "fp16":
        return Precision(accelerator)
    impl = fp16_impl(tcfg, accelerator.device)
    if tcfg.fp16_mode == "amp":
        return AmpFp16(accelerator, impl)
    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise ConfigError(f"train.fp16_mode=fairseq runs on one process or under DDP, not under "
                          f"{accelerator.distributed_type}; use train.fp16_mode=amp or bf16 there")
    return FairseqFp16(accelerator, tcfg, impl)
