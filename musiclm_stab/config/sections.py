"""The data, optimizer and training settings (``DataConfig``, ``OptimConfig``, ``TrainConfig``) and ``Config``, the
four sections together: each setting typed, with its default, its one-line description and its checks.

Per-size values (None: the model size's, model_section.SIZE_DEFAULTS) and the warmup (from its share of the
run) are filled in by ``Config.resolved()``; ``validate`` checks every section, and every number of every
section is finite.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from musiclm_stab.config.checks import ConfigError, _at_least, _choice, _finite, _setting, _show
from musiclm_stab.config.model_section import MODEL_SIZES, SIZE_DEFAULTS, ModelConfig, _fill
from musiclm_stab.constants import FRAME_RATE, HOP_LENGTH

MIXUP_MODES = ("mert", "rms")
LOSS_UNITS = ("bits", "nats")
MIXED_PRECISION = ("no", "fp16", "bf16")
FP16_MODES = ("fairseq", "amp")  # train.fp16_mode: how fp16 computes (training/precision.py)
FP16_IMPLS = ("auto", "half", "emulate")  # train.fp16_impl: real half tensors or the emulation (model/fp16_arith.py)
CLIP_MODES = ("fixed", "zclip", "autoclip")
# accelerate's trackers (log_with), any of which train.trackers may name when its package is installed;
# "all": every installed one.
TRACKERS = ("all", "tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")

# fp16's loss scale starts here at most: fp16 holds at most 65504, so a larger scale only overflows (~1000
# halvings, one skipped update each, from 1e308); fairseq starts at 2**7, torch amp at 2**16.
MAX_FP16_INIT_SCALE = 2**24


@dataclass
class DataConfig:
    path: str | list[str] = _setting(
        "work/default_corpus_tokens", "tokenized dataset to train on (musiclm-stab tokenize), or a list of "
        "them (YAML list or --data.path=[a,b]), e.g. the shards of --shard i/n")
    # Read it as a stream (datasets.IterableDataset): one pass per epoch, each process taking its own
    # examples of every global batch (data.StreamingCrops), shuffled within a buffer of this many rows
    # (0: in file order, the order of the saved dataset's rows).
    streaming: bool = _setting(
        False, "read the data as a stream: one pass per epoch, shuffled within data.shuffle_buffer rows")
    shuffle_buffer: int = _setting(100, "streaming: rows of the shuffle buffer (0: in file order)")
    crop_seconds: float = _setting(5.0, "random crop per example, aligned to 320-sample frames")
    eval_fraction: float = _setting(
        0.1, "share of *tracks* held out for evaluation (by a hash of the track id)")
    batch_size: int = _setting(4, "crops per process, per micro-step")
    num_workers: int = _setting(0, "DataLoader worker processes of each training process")
    # In-batch noise mixup of the input (targets stay clean): per clip with probability mixup_prob, 1 to
    # mixup_max_segments segments of mixup_min..max_seconds (per size when None) from the other clips.
    # `mert`: cut from the other clips joined end to end and added as they are (MERT's inbatch_noise_augment,
    # volume 1.0); `rms`: each from one other clip, scaled to the clip's RMS times mixup_gain_db.
    mixup_mode: str = _setting(
        "mert", "in-batch noise mixup: the other clips joined end to end (mert) or one clip per segment "
        "at the clip's RMS (rms)", MIXUP_MODES)
    mixup_prob: float = _setting(0.5, "probability that a clip gets noise mixup (targets stay clean)")
    mixup_max_segments: int = _setting(3, "noise segments per mixed clip: 1 to this many")
    mixup_min_seconds: float | None = _setting(None, "shortest noise segment, seconds")
    mixup_max_seconds: float | None = _setting(None, "longest noise segment, seconds")
    mixup_gain_db: tuple[float, float] = _setting(
        (-10.0, 0.0), "`rms` only: segment level relative to the clip's RMS, [low, high] dB")
    # Seed of the data order (None: train.seed, so each seed has its own order). It covers which training
    # segments each step sees and in what order (the epoch's permutation, or the streaming shuffle buffer)
    # and where each crop starts; noise mixup and span masks stay with train.seed, as do init and dropout.
    # Runs with one order_seed and different train.seed see the same crops in the same order.
    order_seed: int | None = _setting(
        None, "seed of the data order: segments, their order, crop starts (none: train.seed)")

    def resolved(self, size: str) -> DataConfig:
        """Copy with the model size's values filled in where not given explicitly."""
        _choice("model.size", size, MODEL_SIZES)
        return _fill(self, SIZE_DEFAULTS[size]["data"])

    def validate(self) -> None:
        paths = self.path if isinstance(self.path, list) else [self.path]
        if not paths or not all(isinstance(p, str) and p for p in paths):
            raise ConfigError(f"data.path must be a folder or a non-empty list of folders, got {_show(self.path)}")
        if self.shuffle_buffer < 0:
            raise ConfigError(f"data.shuffle_buffer must be >= 0 (0 = stream order), got {self.shuffle_buffer}")
        if self.crop_seconds <= 0:
            raise ConfigError(f"data.crop_seconds must be > 0, got {self.crop_seconds}")
        if round(self.crop_seconds * FRAME_RATE) < 1:  # the crop is a whole number of frames (data/crops.py)
            raise ConfigError(f"data.crop_seconds must be at least one {HOP_LENGTH}-sample frame (1/{FRAME_RATE} s "
                              f"= {1 / FRAME_RATE:.4f} s), got {_show(self.crop_seconds)}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {self.batch_size}")
        _at_least("data.num_workers", self.num_workers, 0)
        _choice("data.mixup_mode", self.mixup_mode, MIXUP_MODES)
        if not 0.0 <= self.mixup_prob <= 1.0:
            raise ConfigError(f"data.mixup_prob must be in [0, 1], got {self.mixup_prob}")
        _at_least("data.mixup_max_segments", self.mixup_max_segments, 1)
        if self.mixup_gain_db[0] > self.mixup_gain_db[1]:
            raise ConfigError(f"data.mixup_gain_db must be [low, high] with low <= high, got "
                              f"{list(self.mixup_gain_db)}")
        _at_least("data.order_seed", self.order_seed, 0)
        if self.mixup_min_seconds is not None and self.mixup_max_seconds is not None:
            if not 0 < self.mixup_min_seconds <= self.mixup_max_seconds:
                raise ConfigError("data.mixup_min_seconds must be > 0 and <= data.mixup_max_seconds")


@dataclass
class OptimConfig:
    lr: float = _setting(5e-4, "peak learning rate (AdamW)")
    # The conv frontend's own peak lr (its parameters in a group of their own, on the same schedule); None:
    # optim.lr, as in MERT. A study arm that compares the transformer's norm schemes across a wide lr grid
    # can hold the frontend at a rate where it lives (docs/STUDY.md): under Adam a gradient multiplier such as
    # model.feature_grad_mult barely changes the frontend's steps, its lr does.
    frontend_lr: float | None = _setting(None, "peak learning rate of the conv frontend (none: optim.lr)")
    betas: tuple[float, float] = _setting((0.9, 0.98), "AdamW betas")
    eps: float = _setting(1e-6, "AdamW epsilon")
    weight_decay: float = _setting(0.01, "AdamW weight decay")
    # Linear warmup over warmup_steps updates; when not given, over warmup_share of train.max_steps
    # (0.08: MERT's 32k of 400k updates, both sizes).
    warmup_steps: int | None = _setting(
        None, "updates of linear warmup (none: optim.warmup_share of train.max_steps)")
    warmup_share: float = _setting(
        0.08, "warmup as a share of train.max_steps, when optim.warmup_steps is none")
    fused: bool = _setting(
        True, "torch's fused AdamW kernel (CPU and CUDA): ~5x faster optimizer step than foreach on CPU")
    # Gradient clipping (see stability.GradClipper): `fixed` clips at clip_grad; the adaptive rules
    # `zclip` and `autoclip` use clip_grad until clip_warmup finite norms have been seen.
    clip_mode: str = _setting(
        "fixed", "gradient clipping: at optim.clip_grad (fixed), or adaptive (zclip, autoclip)", CLIP_MODES)
    clip_grad: float = _setting(
        10.0, "gradient-norm clipping threshold (adaptive modes: until optim.clip_warmup norms are seen)")
    clip_warmup: int = _setting(25, "adaptive clipping: finite norms seen before the rule takes over")
    zclip_z: float = _setting(
        2.5, "zclip: clip norms more than this many standard deviations above their mean")
    zclip_alpha: float = _setting(0.97, "zclip: decay of the norm's running mean and variance")
    autoclip_percentile: float = _setting(
        10.0, "autoclip: the threshold is this percentile of the norms seen")

    def resolved(self, max_steps: int) -> OptimConfig:
        """Copy with warmup_steps filled in from warmup_share of ``max_steps`` where not given."""
        out = dataclasses.replace(self)
        if out.warmup_steps is None:
            out.warmup_steps = int(round(self.warmup_share * max_steps))
        return out

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if self.frontend_lr is not None and not self.frontend_lr > 0:
            raise ConfigError(f"optim.frontend_lr must be > 0 (or null: optim.lr), got {self.frontend_lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas must be in [0, 1), got {list(self.betas)}")
        _at_least("optim.eps", self.eps, 0)
        _at_least("optim.weight_decay", self.weight_decay, 0)
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_share < 1.0:
            raise ConfigError(f"optim.warmup_share must be in [0, 1), got {self.warmup_share}")
        _choice("optim.clip_mode", self.clip_mode, CLIP_MODES)
        if self.clip_grad <= 0:
            raise ConfigError(f"optim.clip_grad must be > 0, got {self.clip_grad}")
        _at_least("optim.clip_warmup", self.clip_warmup, 0)
        _at_least("optim.zclip_z", self.zclip_z, 0, strict=True)
        if not 0 < self.zclip_alpha < 1:
            raise ConfigError(f"optim.zclip_alpha must be in (0, 1), got {self.zclip_alpha}")
        if not 0 < self.autoclip_percentile <= 100:
            raise ConfigError(f"optim.autoclip_percentile must be in (0, 100], got {self.autoclip_percentile}")


@dataclass
class TrainConfig:
    name: str = _setting("tiny", "run directory: train.output_dir/train.name")
    output_dir: str = _setting("runs", "folder of the run directories")
    run: int | None = _setting(
        None, 'run number in legends ("Run 2") of numbered runs of one configuration, as the study\'s (none: '
        "not numbered); legend text only: init and data follow train.seed")
    label: str | None = _setting(None, "legend text (none: derived from the config)")
    seed: int = _setting(
        0, "seed of init, dropout, masks and mixup (and of the data order unless data.order_seed)")
    max_steps: int = _setting(100, "optimizer updates; the lr schedule decays to 0 here")
    stop_at: int | None = _setting(
        None, "stop early at this step (with a checkpoint), schedule unchanged; --resume goes on")
    mixed_precision: str = _setting(
        "no", "number format: fp32 (no), bf16 autocast, or fp16 (train.fp16_mode)", MIXED_PRECISION)
    # fp16 (mixed_precision=fp16) as fairseq's --fp16 computes it, what MERT trained with (`fairseq`: weights,
    # activations and gradients in fp16, fp32 master weights, fairseq's dynamic loss scaler below), or torch
    # autocast with its GradScaler (`amp`: fp32 weights and residual stream; init scale 65536, growth every
    # 2000 steps, no floor). fp16_impl: `half` (real half tensors), `emulate` (fp32 tensors rounded to fp16
    # wherever the fp16 model holds one: any CPU, the same on every one), `auto` (half on CUDA, else emulate).
    fp16_mode: str = _setting(
        "fairseq", "fp16 as fairseq's --fp16 computed it (MERT's) or as torch amp", FP16_MODES)
    fp16_impl: str = _setting(
        "auto", "fp16 as half tensors, emulated in fp32 (the same on any CPU), or auto (half on CUDA)", FP16_IMPLS)
    # fairseq's DynamicLossScaler (fairseq mode): start at fp16_init_scale, halve on every overflow (the update
    # is skipped and not counted), double after fp16_scale_window clean updates since the last overflow
    # (None: 2^14 / (processes x grad_accum), fairseq's default), stop the run below fp16_min_loss_scale.
    # fp16_scale_tolerance: the share of overflows since the last rescale below which the scale is kept.
    fp16_init_scale: float = _setting(128.0, "fairseq fp16: initial loss scale")
    fp16_scale_window: int | None = _setting(
        None, "fairseq fp16: clean updates before the scale doubles (none: 2^14 / (processes x grad_accum))")
    fp16_scale_tolerance: float = _setting(
        0.0, "fairseq fp16: share of overflows since the last rescale below which the scale is kept")
    fp16_min_loss_scale: float = _setting(
        1e-4, "fairseq fp16: the run ends (diverged) when the loss scale falls to this")
    # fairseq fp16 on fewer GPUs than MERT-330M's 64: the fp16 gradients summed over groups of this many
    # micro-batches (a GPU's update_freq: 8 for MERT-330M), each group's sum divided in fp16 by the number of
    # groups in the whole update (MERT's world size) and the groups added in fp16, as fairseq's legacy DDP does
    # (training/precision.py). None: all of this process's train.grad_accum micro-batches summed in fp16 (the
    # same on 64 GPUs; on one GPU 512 micro-batches, 64x MERT's sum). Must divide train.grad_accum.
    fp16_accum_group: int | None = _setting(
        None, "fairseq fp16: micro-batches per fp16 gradient sum, as MERT's per-GPU sums (none: all)")
    grad_accum: int = _setting(1, "micro-batches per optimizer update")
    # Crops per optimizer update over all processes; when set, train.grad_accum is derived from it and the
    # process count (global_batch_crops / (data.batch_size x processes), which must be whole).
    global_batch_crops: int | None = _setting(
        None, "crops per update over all processes; sets train.grad_accum from the process count")
    # Unit of the logged losses (metrics.jsonl, TensorBoard, evaluation): `bits` divides every loss by ln 2,
    # as fairseq logs them (the study's figures); `nats` logs them as computed. The objective is the same.
    loss_unit: str = _setting("bits", "unit of the logged losses", LOSS_UNITS)
    # Speed and memory (results unchanged up to float rounding): torch.compile of the frontend and the
    # encoder, in place (state-dict names unchanged; the first step compiles, ~20 s for tiny on CPU), and
    # recomputing each encoder layer in the backward pass (less activation memory, ~1/3 more compute).
    compile: bool = _setting(False, "torch.compile the frontend and encoder (the first step compiles)")
    activation_checkpointing: bool = _setting(
        False, "recompute each encoder layer in the backward pass (less memory, more compute)")
    log_every: int = _setting(1, "steps per metrics row")
    checkpoint_every: int = _setting(50, "steps between checkpoints")
    keep_checkpoints: int = _setting(2, "the newest N checkpoints are kept (and those of train.keep_every)")
    keep_every: int = _setting(0, "checkpoints at a multiple of this step are never pruned (0: off)")
    diagnostics_every: int = _setting(
        0, "per-layer diagnostics (attention logits, gradient norms, fp16 headroom) every N steps (0: off)")
    # Held-out evaluation every N steps and at train.max_steps (0 = off), as `musiclm-stab evaluate` does it
    # (centre crops, no mixup, fixed-seed masks, dropout off), on the first eval_batches batches of 8 crops
    # (0 = all); its eval/* metrics join that step's metrics.jsonl row and the trackers.
    eval_every: int = _setting(0, "held-out evaluation every N steps and at train.max_steps (0: off)")
    eval_batches: int = _setting(0, "held-out batches of 8 crops per evaluation (0: all)")
    # accelerate trackers (log_with) that get every metrics.jsonl row: TensorBoard, or e.g. wandb, mlflow
    # when installed; "all": every installed one; []: none. metrics.jsonl is written either way.
    trackers: list[str] = _setting(
        ["tensorboard"], "accelerate trackers that get every metrics row ([]: none; all: every installed one)",
        TRACKERS)
    spike_guard: bool = _setting(
        False, "on a loss spike, roll back to the newest checkpoint and skip the batches since")
    spike_window: int = _setting(50, "spike guard: losses in the running baseline")
    spike_warmup: int = _setting(20, "spike guard: losses seen before it acts")
    spike_z: float = _setting(
        6.0, "spike guard: a spike exceeds the baseline's mean by this many standard deviations")
    spike_min_rel: float = _setting(0.1, "spike guard: a spike also exceeds the baseline's mean by this share of it")
    max_rollbacks: int = _setting(10, "spike guard: most rollbacks in a run")

    def validate(self) -> None:
        if self.name in ("", ".", "..") or any(c in self.name for c in "/\\\0"):
            # "" or "." would make train.output_dir itself the run directory, "a/b" a folder of a folder
            raise ConfigError(f"train.name must be a folder name (not empty, '.' or '..', without '/'; the folder "
                              f"that holds it is train.output_dir), got {_show(self.name)}")
        _choice("train.mixed_precision", self.mixed_precision, MIXED_PRECISION)
        _choice("train.fp16_mode", self.fp16_mode, FP16_MODES)
        _choice("train.fp16_impl", self.fp16_impl, FP16_IMPLS)
        _at_least("train.fp16_init_scale", self.fp16_init_scale, 0, strict=True)
        if self.fp16_init_scale > MAX_FP16_INIT_SCALE:  # a larger one only overflows, halving once per update
            raise ConfigError(f"train.fp16_init_scale must be <= 2**24 = {MAX_FP16_INIT_SCALE} (fairseq starts at "
                              f"128, torch amp at 65536), got {_show(self.fp16_init_scale)}")
        if not 0 < self.fp16_min_loss_scale < self.fp16_init_scale:
            raise ConfigError(f"train.fp16_min_loss_scale must be > 0 and below train.fp16_init_scale="
                              f"{self.fp16_init_scale}, got {self.fp16_min_loss_scale}")
        if self.fp16_scale_window is not None and self.fp16_scale_window < 1:
            raise ConfigError(f"train.fp16_scale_window must be >= 1 (or null), got {self.fp16_scale_window}")
        if self.fp16_accum_group is not None and self.fp16_accum_group < 1:
            raise ConfigError(f"train.fp16_accum_group must be >= 1 (or null), got {self.fp16_accum_group}")
        if not 0.0 <= self.fp16_scale_tolerance <= 1.0:
            raise ConfigError(f"train.fp16_scale_tolerance must be in [0, 1], got {self.fp16_scale_tolerance}")
        if self.global_batch_crops is not None and self.global_batch_crops < 1:
            raise ConfigError(f"train.global_batch_crops must be >= 1 (or null), got {self.global_batch_crops}")
        _choice("train.loss_unit", self.loss_unit, LOSS_UNITS)
        if self.max_steps < 1:
            raise ConfigError(f"train.max_steps must be >= 1, got {self.max_steps}")
        for name in ("grad_accum", "log_every", "checkpoint_every", "keep_checkpoints", "spike_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.diagnostics_every < 0 or (self.diagnostics_every and self.diagnostics_every % self.log_every):
            raise ConfigError(f"train.diagnostics_every={self.diagnostics_every} must be 0 (off) or a multiple "
                              f"of train.log_every={self.log_every}")
        if self.keep_every < 0:
            raise ConfigError(f"train.keep_every must be >= 0 (0 = off), got {self.keep_every}")
        if self.eval_every < 0 or (self.eval_every and self.eval_every % self.log_every):
            # the eval/* metrics join the row of their step, so that step must write one
            raise ConfigError(f"train.eval_every={self.eval_every} must be 0 (off) or a multiple "
                              f"of train.log_every={self.log_every}")
        if self.eval_batches < 0:
            raise ConfigError(f"train.eval_batches must be >= 0 (0 = all), got {self.eval_batches}")
        for tracker in self.trackers:
            _choice("train.trackers", tracker, TRACKERS)
        if self.stop_at is not None and self.stop_at < 1:
            raise ConfigError(f"train.stop_at must be >= 1, got {self.stop_at}")
        for name in ("run", "seed", "spike_min_rel", "max_rollbacks"):
            _at_least(f"train.{name}", getattr(self, name), 0)
        if self.seed >= 2**32:  # set_seed seeds numpy too, whose seeds are 32 bits
            raise ConfigError(f"train.seed must be < 2**32, got {self.seed}")
        _at_least("train.spike_z", self.spike_z, 0, strict=True)
        if not 0 <= self.spike_warmup <= self.spike_window:  # more than the window holds: never a spike
            raise ConfigError(f"train.spike_warmup must be in [0, train.spike_window={self.spike_window}], "
                              f"got {self.spike_warmup}")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> Config:
        for f in dataclasses.fields(self):
            _finite(f.name, getattr(self, f.name))
        for section in (self.data, self.model, self.optim, self.train):
            section.validate()
        data = self.data.resolved(self.model.size)  # per-size values are checked once filled in
        if not 0 < data.mixup_min_seconds <= data.mixup_max_seconds:
            raise ConfigError("data.mixup_min_seconds must be > 0 and <= data.mixup_max_seconds")
        return self

    def resolved(self) -> Config:
        """Copy with every per-size value and the warmup filled in (see the module docstring)."""
        return Config(data=self.data.resolved(self.model.size), model=self.model.resolved(),
                      optim=self.optim.resolved(self.train.max_steps), train=dataclasses.replace(self.train))

    @property
    def run_dir(self) -> Path:
        return Path(self.train.output_dir) / self.train.name

    @property
    def data_order_seed(self) -> int:
        """The seed of the data order: ``data.order_seed``, or ``train.seed`` when it is None."""
        return self.train.seed if self.data.order_seed is None else self.data.order_seed

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (tuples as lists) of the resolved config, ready for YAML."""
        return _lists(dataclasses.asdict(self.resolved()))


# A setting's name as a regular expression (``train.max_steps``): how messages and the command line are read
# for settings, whatever the sections.
SETTING_NAME = r"(?:" + "|".join(f.name for f in dataclasses.fields(Config)) + r")\.\w+"


def _lists(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_lists(v) for v in obj]
    return obj
