"""Typed run configuration: the single source of truth for every setting of a run.

A recipe is a small YAML file with the sections below (`data`, `model`, `optim`, `train`); anything
not given takes the dataclass default. Overlays (recipes/overlays/*.yaml) are recipes layered after
another: ``--config study_prenorm_clip1_run2 --config overlays/tiny``. Command-line overrides use dotted keys:
``--model.norm_scheme=post --train.max_steps=20``. The fully resolved config is written to
``runs/<name>/config.yaml`` and is what evaluation, plotting and export read back.

Every value is validated here, before any work starts: unknown keys, bad types and unknown choices
fail with a message that names the setting and the valid choices; every number must be finite (checked
over all fields of every section, so a new setting is covered too) and in its range.

Per-size defaults. The settings that MERT's two configs set differently (``SIZE_DEFAULTS``: dimensions,
norm placement, dropouts, layerdrop, feature_grad_mult, final_dim, noise-mixup segment lengths) default
to None and are filled from the size's row by ``Config.resolved()``: ``base`` is MERT-95M
(config/pretrain/MERT_RVQ-VAE_CQT_95M.yaml), ``large`` MERT-330M (..._330M.yaml), ``tiny`` this project's
CPU size (its values are the project's earlier defaults). A value given in a recipe or on the command
line wins over the size's. ``load_config`` returns the resolved config, and the resolved values are what
``runs/<name>/config.yaml`` records. docs/FIDELITY.md compares every setting with MERT's.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from musiclm_stab.constants import FRAME_RATE, HOP_LENGTH, SAMPLE_RATE

NORM_SCHEMES = ("pre", "post", "deepnorm", "sandwich", "subln")
ATTENTION_FORMS = ("sdpa", "math", "relax")
NORM_TYPES = ("layernorm", "rmsnorm")
INIT_SCHEMES = ("mert", "xavier")
MIXUP_MODES = ("mert", "rms")
LOSS_UNITS = ("bits", "nats")
MIXED_PRECISION = ("no", "fp16", "bf16")
FP16_MODES = ("fairseq", "amp")  # train.fp16_mode: how fp16 computes (training/precision.py)
FP16_IMPLS = ("auto", "half", "emulate")  # train.fp16_impl: real half tensors or the emulation (model/fp16_arith.py)
CLIP_MODES = ("fixed", "zclip", "autoclip")
# accelerate's trackers (log_with), any of which train.trackers may name when its package is installed;
# "all": every installed one.
TRACKERS = ("all", "tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")
# List settings that may be empty (every other list setting must name at least one thing).
EMPTY_LIST_OK = ("train.trackers",)

# fp16's loss scale starts here at most: fp16 holds at most 65504, so a larger scale only overflows (~1000
# halvings, one skipped update each, from 1e308); fairseq starts at 2**7, torch amp at 2**16.
MAX_FP16_INIT_SCALE = 2**24

# Per-size defaults, one row per size (section -> setting -> value); see the module docstring. The MERT
# config lines are in docs/FIDELITY.md. Settings absent from a row are the same for every size.
SIZE_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {  # this project's CPU size: the earlier defaults, final_dim as the tiny recipes had it
        "model": dict(num_layers=2, width=128, ffn_dim=512, num_heads=4, conv_dim=64, norm_scheme="pre",
                      dropout=0.1, attention_dropout=0.1, feature_dropout=0.1, layerdrop=0.0,
                      feature_grad_mult=0.1, final_dim=64),
        "data": dict(mixup_min_seconds=0.5, mixup_max_seconds=1.5),
    },
    "base": {  # MERT-95M: post-LN (layer_norm_first false), layerdrop 0.05
        "model": dict(num_layers=12, width=768, ffn_dim=3072, num_heads=12, conv_dim=512, norm_scheme="post",
                      dropout=0.1, attention_dropout=0.1, feature_dropout=0.1, layerdrop=0.05,
                      feature_grad_mult=0.1, final_dim=64),
        "data": dict(mixup_min_seconds=0.5, mixup_max_seconds=1.0),  # 12000-24000 samples
    },
    "large": {  # MERT-330M: pre-LN, no dropout, full gradient into the conv frontend
        "model": dict(num_layers=24, width=1024, ffn_dim=4096, num_heads=16, conv_dim=512, norm_scheme="pre",
                      dropout=0.0, attention_dropout=0.0, feature_dropout=0.0, layerdrop=0.0,
                      feature_grad_mult=1.0, final_dim=128),
        "data": dict(mixup_min_seconds=0.5, mixup_max_seconds=1.5),  # 12000-36000 samples
    },
}
MODEL_SIZES = tuple(SIZE_DEFAULTS)

# What a run directory written before a setting existed did, for the settings added since (issue 15):
# config_from_run fills these in when its config.yaml lacks them, so an old run reads back as it ran.
SETTINGS_BEFORE_THEY_EXISTED: dict[str, dict[str, Any]] = {
    "model": {"init": "xavier", "require_same_masks": False},
    "data": {"mixup_mode": "rms"},
    "train": {"loss_unit": "nats", "fp16_mode": "amp"},
}


class ConfigError(ValueError):
    """A setting is unknown, of the wrong type, or not one of the valid choices."""


# A value as an error message shows it: at most a few elements per level, a few levels deep, long strings
# and numbers cut, so the message stays a line whatever the value (a YAML alias can make a small file hold
# a list of billions of elements, and its full repr took 80 s and 3.6 GB).
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxdict = 3, 4, 4, 4
_SHOW.maxstring, _SHOW.maxlong, _SHOW.maxother = 80, 40, 80
_SHOW_AT_MOST = 160  # characters


def _show(value: Any) -> str:
    """``repr(value)``, bounded (see ``_SHOW``): how every value given by the user is quoted in a message."""
    text = _SHOW.repr(value)
    return text if len(text) <= _SHOW_AT_MOST else text[:_SHOW_AT_MOST - 3] + "..."


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={_show(value)} is not valid; choose one of: {', '.join(choices)}")


def _at_least(name: str, value: float | None, low: float, strict: bool = False) -> None:
    """``value >= low`` (``> low`` when strict); None (the size's value, or off) passes."""
    if value is not None and (value <= low if strict else value < low):
        raise ConfigError(f"{name} must be {'>' if strict else '>='} {low}, got {_show(value)}")


def _finite(section: str, values: Any) -> None:
    """Every float of a config section (alone or in a tuple/list) is finite.

    nan fails every comparison, so a range check written as ``if value <= 0: raise`` lets it through, and
    inf passes every lower bound; one check over all fields covers every setting, present and future.
    """
    for f in dataclasses.fields(values):
        value = getattr(values, f.name)
        numbers = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            raise ConfigError(f"{section}.{f.name} must be a finite number, got {_show(value)}")


def _setting(default: Any, doc: str, choices: tuple[str, ...] = ()) -> Any:
    """A setting's field: its default, one line saying what it does and, for a setting with a fixed set of
    values, its choices (``metadata={"help": ...}``, as HfArgumentParser reads it): the trainer's --help
    lists every setting from these (``setting_docs``)."""
    metadata = {"help": doc, **({"choices": choices} if choices else {})}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


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
class ModelConfig:
    size: str = _setting(
        "tiny", "model size, whose defaults fill every setting left at none: tiny (CPU), base (MERT-95M), "
        "large (MERT-330M)", MODEL_SIZES)
    # None: the size's value (SIZE_DEFAULTS); setting one overrides it.
    num_layers: int | None = _setting(None, "transformer layers")
    width: int | None = _setting(None, "model width (embedding dimension)")
    ffn_dim: int | None = _setting(None, "inner dimension of the feed-forward blocks")
    num_heads: int | None = _setting(None, "attention heads (must divide model.width)")
    conv_dim: int | None = _setting(None, "channels of the conv frontend")
    # Normalization scheme and its orthogonal switches (see model/norm_schemes.py).
    norm_scheme: str | None = _setting(
        None, "normalization scheme: placement, residual scaling and init (model/norm_schemes.py)", NORM_SCHEMES)
    attention: str = _setting(
        "sdpa", "attention: fused (sdpa), explicit as MERT computed it (math), or PB-relax (relax)", ATTENTION_FORMS)
    norm_type: str = _setting("layernorm", "the norm the scheme places", NORM_TYPES)
    qk_norm: bool = _setting(False, "normalize queries and keys before their product (QK-Norm)")
    relax_alpha: float = _setting(
        32.0, "attention=relax: queries divided by relax_alpha x sqrt(d) before the product")
    # Encoder weight init: `mert` N(0, 0.02) for every encoder Linear (fairseq's init_bert_params), `xavier`
    # xavier_normal_; either way the scheme's gain multiplies fc1, fc2, out_proj, v_proj (model/encoder.py).
    init: str = _setting(
        "mert", "encoder weight init: N(0, 0.02) as MERT (mert) or xavier normal; the scheme's gain on top",
        INIT_SCHEMES)
    # Regularization (None: the size's value).
    dropout: float | None = _setting(None, "dropout in the transformer layers")
    attention_dropout: float | None = _setting(None, "dropout on the attention weights")
    activation_dropout: float = _setting(0.0, "dropout after the feed-forward activation")
    feature_dropout: float | None = _setting(
        None, "dropout on the frontend's features (MERT's dropout_input)")
    layerdrop: float | None = _setting(None, "probability that a training step skips a transformer layer")
    feature_grad_mult: float | None = _setting(None, "scale of the gradient into the conv frontend")
    # Masking (HuBERT span masking). require_same_masks: as fairseq, every row of a batch is trimmed to
    # the batch's smallest masked count by unmasking random masked frames (data/masking.py).
    mask_prob: float = _setting(0.8, "HuBERT span masking: share of frames masked, before spans overlap")
    mask_length: int = _setting(5, "frames per masked span")
    require_same_masks: bool = _setting(
        True, "trim every row of a batch to the batch's smallest masked count, as fairseq")
    # Acoustic stream: HuBERT-style cosine logits against label embeddings, one head per codebook.
    num_codebooks: int = _setting(8, "EnCodec codebooks predicted, one head each (the data's tokenizer's)")
    codebook_size: int = _setting(1024, "codes per codebook (the data's tokenizer's)")
    final_dim: int | None = _setting(
        None, "dimension the acoustic heads project to (cosine logits against label embeddings)")
    logit_temp: float = _setting(0.1, "temperature of the acoustic heads' cosine logits")
    # Musical stream: CQT regression of the clean crop.
    cqt_bins: int = _setting(336, "bins of the musical stream's CQT target")
    cqt_bins_per_octave: int = _setting(48, "CQT bins per octave")
    cqt_fmin: float = _setting(32.7, "lowest CQT frequency, Hz")
    musical_weight: float = _setting(1.0, "weight of the musical (CQT) loss")
    features_pen_weight: float = _setting(
        10.0, "weight of the features penalty (mean square of the frontend's output)")
    pos_conv_kernel: int = _setting(128, "kernel width of the positional convolution")
    pos_conv_groups: int = _setting(16, "groups of the positional convolution (must divide model.width)")

    def resolved(self) -> ModelConfig:
        """Copy with the size's values filled in where not given explicitly."""
        _choice("model.size", self.size, MODEL_SIZES)
        return _fill(self, SIZE_DEFAULTS[self.size]["model"])

    def validate(self) -> None:
        _choice("model.size", self.size, MODEL_SIZES)
        r = self.resolved()
        _choice("model.norm_scheme", r.norm_scheme, NORM_SCHEMES)
        _choice("model.attention", self.attention, ATTENTION_FORMS)
        _choice("model.norm_type", self.norm_type, NORM_TYPES)
        _choice("model.init", self.init, INIT_SCHEMES)
        for name in ("num_layers", "width", "ffn_dim", "num_heads", "conv_dim", "final_dim", "num_codebooks",
                     "codebook_size", "cqt_bins", "cqt_bins_per_octave", "pos_conv_kernel", "pos_conv_groups"):
            _at_least(f"model.{name}", getattr(r, name), 1)
        for name in ("logit_temp", "cqt_fmin"):
            _at_least(f"model.{name}", getattr(r, name), 0, strict=True)
        for name in ("feature_grad_mult", "musical_weight", "features_pen_weight"):
            _at_least(f"model.{name}", getattr(r, name), 0)
        if r.width % r.num_heads:
            raise ConfigError(f"model.width={r.width} must be divisible by model.num_heads={r.num_heads}")
        if r.width % self.pos_conv_groups:
            raise ConfigError(f"model.width={r.width} must be divisible by model.pos_conv_groups")
        if not 0.0 <= self.mask_prob <= 1.0:
            raise ConfigError(f"model.mask_prob must be in [0, 1], got {self.mask_prob}")
        for name in ("dropout", "attention_dropout", "activation_dropout", "feature_dropout", "layerdrop"):
            if not 0.0 <= getattr(r, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(r, name)}")
        if self.mask_length < 1:
            raise ConfigError(f"model.mask_length must be >= 1, got {self.mask_length}")
        if self.relax_alpha <= 0:
            raise ConfigError(f"model.relax_alpha must be > 0, got {self.relax_alpha}")
        if self.attention == "relax" and self.qk_norm:
            # QK-norm bounds the logits itself; stacking PB-relax on it is not a scheme of the study.
            raise ConfigError("model.attention=relax cannot be combined with model.qk_norm=true")
        _check_cqt(self.cqt_bins, self.cqt_fmin, self.cqt_bins_per_octave)


# The longest kernel of the CQT target (its lowest bin's, Q * sample rate / cqt_fmin samples; MERT's 32.7 Hz
# at 48 bins per octave: 50,800) is computed and held at model build; beyond this it takes minutes and GBs.
MAX_CQT_KERNEL_SAMPLES = 2**20  # 43.7 s


def _check_cqt(bins: int, fmin: float, per_octave: int) -> None:
    """The CQT target (model/cqt.py, whose formulas these are) can be built: its top bin's band below the
    Nyquist frequency, its longest kernel within MAX_CQT_KERNEL_SAMPLES. ConfigError with the range otherwise."""
    r2 = 2.0 ** (2.0 / per_octave)
    q = (r2 + 1.0) / (r2 - 1.0)  # 1 / cqt.relative_bandwidth
    edge = 1 + 0.5 * 1.5 / q  # band edge over centre frequency (cqt.HANN_BANDWIDTH = 1.5)
    nyquist = SAMPLE_RATE / 2

    def fits(n: int) -> bool:
        octaves = (n - 1) / per_octave
        return octaves < 1024 and fmin * 2.0 ** octaves * edge <= nyquist  # 2.0 ** 1024 overflows

    if not fits(bins):
        most = 0
        if fmin * edge <= nyquist:
            most = max(0, math.floor(per_octave * math.log2(nyquist / (fmin * edge))) + 1)
            most += 1 if fits(most + 1) else -1 if most > 0 and not fits(most) else 0  # the float edge, as cqt.py
        raise ConfigError(f"model.cqt_bins={_show(bins)} reaches above the Nyquist frequency ({nyquist:g} Hz) "
                          f"from model.cqt_fmin={fmin:g} Hz at model.cqt_bins_per_octave={per_octave}: at most "
                          f"{most} bins")
    longest = q * SAMPLE_RATE / fmin
    if longest > MAX_CQT_KERNEL_SAMPLES:
        raise ConfigError(f"model.cqt_fmin={fmin:g} Hz at model.cqt_bins_per_octave={per_octave} makes the "
                          f"CQT's lowest kernel {longest:,.0f} samples; at most {MAX_CQT_KERNEL_SAMPLES:,} "
                          f"({MAX_CQT_KERNEL_SAMPLES / SAMPLE_RATE:.1f} s): cqt_fmin must be >= "
                          f"{q * SAMPLE_RATE / MAX_CQT_KERNEL_SAMPLES:.3g} Hz at that resolution, or use fewer "
                          "bins per octave")


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

def _fill(section: Any, defaults: dict[str, Any]) -> Any:
    """Copy of a config section with the None fields named in ``defaults`` set to their default."""
    out = dataclasses.replace(section)
    for name, value in defaults.items():
        if getattr(out, name) is None:
            setattr(out, name, value)
    return out


def _lists(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_lists(v) for v in obj]
    return obj


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Turn a YAML or command-line value into the field's declared type, or raise ConfigError."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        lists = [a for a in inner if typing.get_origin(a) is list]
        if lists and (isinstance(value, (list, tuple)) or (isinstance(value, str) and value.strip().startswith("["))):
            return _coerce(key, value, lists[0])
        return _coerce(key, value, inner[0])
    if origin is list:  # YAML list, or "[a, b]" on the command line
        if isinstance(value, str):
            value = [v.strip() for v in value.strip().strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or (not value and key not in EMPTY_LIST_OK):
            raise ConfigError(f"{key} must be a non-empty list, got {_show(value)}")
        return [_coerce(key, v, args[0]) for v in value]
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {_show(value)}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key} must be true or false, got {_show(value)}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {_show(value)}")
        if not isinstance(value, (int, float, str)):  # checked before str(value) below formats a whole list
            raise ConfigError(f"{key} must be {annotation.__name__}, got {_show(value)}")
        try:
            number = float(value) if annotation is float else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be {annotation.__name__}, got {_show(value)}") from None
        return number
    if annotation is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare `no` / `yes` as a boolean
            return "no" if value is False else "yes"
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {_show(value)}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {annotation}")


def setting_text(value: Any) -> str:
    """A setting's value as the command line writes it (``--section.key=TEXT``), which ``_coerce`` reads back:
    true/false, none, [a,b] for a list or pair, a float's repr."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(setting_text(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else str(value)


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(f"unknown setting {_show(dotted)}; settings are <section>.<key> with section one of: "
                          f"{', '.join(sections)}")
    section = getattr(cfg, parts[0])
    hints = typing.get_type_hints(type(section))
    names = [f.name for f in dataclasses.fields(section)]
    if parts[1] not in names:
        raise ConfigError(f"unknown setting {_show(dotted)}; valid keys of {parts[0]}: {', '.join(names)}")
    setattr(section, parts[1], _coerce(dotted, value, hints[parts[1]]))


# A recipe or a run's config.yaml has a few hundred values; YAML aliases (``*name``) may repeat a part of the
# file, and a few nested ones a billion times over (a 301-byte "alias bomb"): refused beyond this many values.
MAX_YAML_VALUES = 10_000


class _SettingsLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain values only: a ``!!python/...`` tag is refused) that also refuses what a
    settings file must not hold: a key given twice in one mapping (the YAML spec forbids it; SafeLoader
    keeps the last silently), and aliases that expand the document beyond ``MAX_YAML_VALUES`` values."""

    def compose_document(self):
        node = super().compose_document()
        _count_values(node, {}, set())
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: what follows may override it
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.get(key)
                except TypeError:  # unhashable: SafeLoader's own error says so below
                    continue
                if seen is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found duplicate key {_show(key)} (first on line {seen.start_mark.line + 1})",
                        key_node.start_mark)
                first[key] = key_node
        return super().construct_mapping(node, deep)


def _count_values(node: yaml.Node, counted: dict[int, int], open_nodes: set[int]) -> int:
    """Values (nodes) of ``node`` with every alias expanded, each shared node counted once per use but
    visited once; a YAMLError where that passes ``MAX_YAML_VALUES`` or a node contains itself."""
    if id(node) in counted:
        return counted[id(node)]
    if id(node) in open_nodes:
        raise yaml.composer.ComposerError(None, None, "found an alias inside the node it names (a recursive "
                                          "structure)", node.start_mark)
    open_nodes.add(id(node))
    total = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        total += _count_values(child, counted, open_nodes)
        if total > MAX_YAML_VALUES:
            raise yaml.composer.ComposerError(
                None, None, f"its aliases expand it to more than {MAX_YAML_VALUES:,} values (a settings file has "
                "a few hundred); write the values out", node.start_mark)
    open_nodes.discard(id(node))
    counted[id(node)] = total
    return total


def _yaml_reason(error: yaml.YAMLError) -> str:
    """A YAML error on one line: where (line and column) and what, without PyYAML's excerpt of the file."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = error.problem or error.context or type(error).__name__
        if error.problem and error.context:
            what += f" ({error.context})"
        if "'\\t'" in what:
            what += "; YAML indents with spaces, not tabs"
        if "could not determine a constructor for the tag" in what:
            what += "; a settings file holds plain values only (no tags)"
        return where + " ".join(what.split())
    if isinstance(error, yaml.reader.ReaderError):
        return f"position {error.position}: {' '.join(error.reason.split())} (character #x{ord(error.character):04x})"
    return " ".join(str(error).split())


def read_settings_file(path: str | Path) -> Any:
    """The YAML document of a recipe or a run's config.yaml, read with ``_SettingsLoader``; ConfigError
    ``<path>: <reason>`` for a file that is missing, unreadable, not UTF-8 or not valid YAML."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not part of the text
    except UnicodeDecodeError as e:  # e.start counts from after the mark: the offset named is the file's
        at = e.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
        raise ConfigError(f"{path}: not UTF-8 text: byte 0x{data[at]:02x} at offset {at} cannot be decoded") from None
    try:
        return yaml.load(text, Loader=_SettingsLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {_yaml_reason(e)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: its values are nested too deeply") from None


# The recipes ship inside the package (musiclm_stab/recipes, package data), so their names work in an installed
# wheel as in a checkout, whose recipes/ is a symlink to that folder; its accelerate/ holds accelerate's config
# files for `musiclm-stab train --config_file`.
PACKAGED_RECIPES = Path(__file__).resolve().parent / "recipes"
ACCELERATE_CONFIGS = "accelerate"


def recipe_names(accelerate: bool = False) -> list[str]:
    """The names of the packaged recipes and overlays (``tiny``, ``overlays/tiny``), or with ``accelerate``
    of the packaged accelerate config files (``accelerate/8gpu``)."""
    names = (p.relative_to(PACKAGED_RECIPES).with_suffix("").as_posix() for p in PACKAGED_RECIPES.rglob("*.yaml"))
    return sorted(n for n in names if n.startswith(f"{ACCELERATE_CONFIGS}/") == accelerate)


def recipe_file(name: str | Path, accelerate: bool = False) -> Path:
    """The YAML file a recipe names: a path to an existing file, else a packaged recipe by name, ``.yaml``
    optional and ``recipes/`` as a checkout writes it allowed (``tiny``, ``overlays/tiny``,
    ``recipes/tiny.yaml``); with ``accelerate``, an accelerate config file (``accelerate/8gpu``). The one
    reading of a recipe's name: ``--config``, ``musiclm-stab train --config_file``, ``ms.recipe``. ConfigError
    naming the packaged ones when it is neither."""
    path = Path(name)
    if path.is_file():
        return path
    text = path.as_posix()
    for stem in (text, text.removeprefix("recipes/")):
        stem = stem if stem.endswith(".yaml") else f"{stem}.yaml"
        if stem[:-5] in recipe_names(accelerate):
            return PACKAGED_RECIPES / stem
    what = "accelerate config file" if accelerate else "config file"
    raise ConfigError(f"{what} {name} does not exist, and no packaged one has that name (packaged: "
                      f"{', '.join(recipe_names(accelerate))})")


def load_config(path: str | Path | list[str | Path] | tuple | None = None, overrides: list[str] | None = None,
                recorded: bool = False) -> Config:
    """Read a recipe YAML, or several layered in order (a recipe, then overlays such as
    recipes/overlays/tiny.yaml: a later file sets what it names, the rest stays), apply ``section.key=value``
    overrides, validate, and fill in the per-size values (``Config.resolved``). A recipe is a file or the
    name of a packaged one (``recipe_file``: ``tiny``, ``overlays/tiny``).

    Raises ConfigError naming the offending setting and the valid choices. ``recorded``: the file is a run's
    own record (``config_from_run``), read as the run had it: checks that concern starting a run
    (``check_schedule``, added after runs were made that it refuses) are left out.
    """
    cfg = Config()
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    for path in map(recipe_file, paths):
        raw = read_settings_file(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}")
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: section {_show(section)} must be a mapping")
            for key, value in values.items():
                try:
                    _set(cfg, f"{section}.{key}", value)
                except ConfigError as e:  # which of the files holds the bad value
                    raise ConfigError(f"{path}: {e}") from None
    for item in overrides or []:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {_show(item)} must look like section.key=value")
        key, value = item.split("=", 1)
        _set(cfg, key, value)  # raw text: _coerce converts it by the field's type ("no" stays a string)
    cfg.validate()
    if not recorded:
        check_schedule(cfg)
    return cfg.resolved()


def check_schedule(cfg: Config) -> None:
    """Refuse a warmup longer than the run (``optim.warmup_steps`` > ``train.max_steps``): the lr would never
    reach ``optim.lr``, and the decay after the warmup would never start."""
    warmup, steps = cfg.optim.warmup_steps, cfg.train.max_steps
    if warmup is not None and warmup > steps:
        raise ConfigError(f"optim.warmup_steps={warmup} is longer than the run, train.max_steps={steps}: at most "
                          f"{steps} (or null: optim.warmup_share of the run)")


def config_yaml(cfg: Config, comment: str = "") -> str:
    """The resolved config as YAML, after ``comment`` (as # lines, which loading ignores): what a run's
    config.yaml holds and what the trainer's --print-config prints."""
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    return header + yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: Config, path: str | Path, comment: str = "") -> None:
    """Write the resolved config as YAML (``config_yaml``)."""
    Path(path).write_text(config_yaml(cfg, comment))


def config_from_run(run_dir: str | Path) -> Config:
    """The resolved config of an existing run directory. Settings added after the run was made, and so
    absent from its config.yaml, read back as the run had them (``SETTINGS_BEFORE_THEY_EXISTED``)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: {path.name} is missing")
    saved = read_settings_file(path) or {}
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(saved).__name__}")
    missing = [f"{section}.{key}={value}" for section, values in SETTINGS_BEFORE_THEY_EXISTED.items()
               for key, value in values.items()
               if isinstance(saved.get(section), dict) and key not in saved[section]]
    return load_config(path, missing, recorded=True)
