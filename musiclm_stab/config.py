"""Typed run configuration: the single source of truth for every setting of a run.

A recipe is a small YAML file with the sections below (`data`, `model`, `optim`, `train`); anything
not given takes the dataclass default. Overlays (recipes/overlays/*.yaml) are recipes layered after
another: ``--config recipe.yaml --config recipes/overlays/tiny.yaml``. Command-line overrides use dotted keys:
``--model.norm_scheme=post --train.max_steps=20``. The fully resolved config is written to
``runs/<name>/config.yaml`` and is what evaluation, plotting and export read back.

Every value is validated here, before any work starts: unknown keys, bad types and unknown choices
fail with a message that names the setting and the valid choices.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

NORM_SCHEMES = ("pre", "post", "deepnorm", "sandwich", "subln")
ATTENTION_FORMS = ("sdpa", "math", "relax")
NORM_TYPES = ("layernorm", "rmsnorm")
MIXED_PRECISION = ("no", "fp16", "bf16")
CLIP_MODES = ("fixed", "zclip", "autoclip")

# name -> (num_layers, width, ffn_dim, num_heads, conv_dim)
MODEL_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (2, 128, 512, 4, 64),
    "base": (12, 768, 3072, 12, 512),
    "large": (24, 1024, 4096, 16, 512),
}


class ConfigError(ValueError):
    """A setting is unknown, of the wrong type, or not one of the valid choices."""


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")


@dataclass
class DataConfig:
    # Tokenized dataset (musiclm-stab tokenize ...), or a list of them, e.g. the shards of --shard i/n:
    # YAML list or --data.path=[a,b].
    path: str | list[str] = "work/default_corpus_tokens"
    # Read it as a stream (datasets.IterableDataset): one pass per epoch, each process taking its own
    # examples of every global batch (data.StreamingCrops), shuffled within a buffer of this many rows
    # (0: in file order, the order of the saved dataset's rows).
    streaming: bool = False
    shuffle_buffer: int = 100
    crop_seconds: float = 5.0  # random crop per example, aligned to 320-sample frames
    eval_fraction: float = 0.1  # share of *tracks* held out for evaluation (by a hash of the track id)
    batch_size: int = 4  # per process, per micro-step
    num_workers: int = 0
    mixup_prob: float = 0.5  # in-batch noise mixup (input only)
    mixup_max_segments: int = 3
    mixup_min_seconds: float = 0.5
    mixup_max_seconds: float = 1.5
    mixup_gain_db: tuple[float, float] = (-10.0, 0.0)  # added segment level relative to the clip's RMS

    def validate(self) -> None:
        paths = self.path if isinstance(self.path, list) else [self.path]
        if not paths or not all(isinstance(p, str) and p for p in paths):
            raise ConfigError(f"data.path must be a folder or a non-empty list of folders, got {self.path!r}")
        if self.shuffle_buffer < 0:
            raise ConfigError(f"data.shuffle_buffer must be >= 0 (0 = stream order), got {self.shuffle_buffer}")
        if self.crop_seconds <= 0:
            raise ConfigError(f"data.crop_seconds must be > 0, got {self.crop_seconds}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if not 0.0 <= self.mixup_prob <= 1.0:
            raise ConfigError(f"data.mixup_prob must be in [0, 1], got {self.mixup_prob}")
        if not 0 < self.mixup_min_seconds <= self.mixup_max_seconds:
            raise ConfigError("data.mixup_min_seconds must be > 0 and <= data.mixup_max_seconds")


@dataclass
class ModelConfig:
    size: str = "tiny"
    # Sizes fill these when left at None; setting one overrides the size's value.
    num_layers: int | None = None
    width: int | None = None
    ffn_dim: int | None = None
    num_heads: int | None = None
    conv_dim: int | None = None
    # Normalization scheme and its orthogonal switches (see model/norm_schemes.py).
    norm_scheme: str = "pre"
    attention: str = "sdpa"
    norm_type: str = "layernorm"
    qk_norm: bool = False
    relax_alpha: float = 32.0
    # Regularization.
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation_dropout: float = 0.0
    feature_dropout: float = 0.1
    layerdrop: float = 0.0
    feature_grad_mult: float = 0.1
    # Masking (HuBERT span masking).
    mask_prob: float = 0.8
    mask_length: int = 5
    # Acoustic stream: HuBERT-style cosine logits against label embeddings, one head per codebook.
    num_codebooks: int = 8
    codebook_size: int = 1024
    final_dim: int = 256
    logit_temp: float = 0.1
    # Musical stream: CQT regression of the clean crop.
    cqt_bins: int = 336
    cqt_bins_per_octave: int = 48
    cqt_fmin: float = 32.7
    musical_weight: float = 1.0
    features_pen_weight: float = 10.0
    pos_conv_kernel: int = 128
    pos_conv_groups: int = 16

    def resolved(self) -> ModelConfig:
        """Copy with the size's values filled in where not given explicitly."""
        _choice("model.size", self.size, tuple(MODEL_SIZES))
        layers, width, ffn, heads, conv = MODEL_SIZES[self.size]
        out = dataclasses.replace(self)
        for name, value in zip(
            ("num_layers", "width", "ffn_dim", "num_heads", "conv_dim"), (layers, width, ffn, heads, conv)
        ):
            if getattr(out, name) is None:
                setattr(out, name, value)
        return out

    def validate(self) -> None:
        _choice("model.size", self.size, tuple(MODEL_SIZES))
        _choice("model.norm_scheme", self.norm_scheme, NORM_SCHEMES)
        _choice("model.attention", self.attention, ATTENTION_FORMS)
        _choice("model.norm_type", self.norm_type, NORM_TYPES)
        r = self.resolved()
        if r.width % r.num_heads:
            raise ConfigError(f"model.width={r.width} must be divisible by model.num_heads={r.num_heads}")
        if r.width % self.pos_conv_groups:
            raise ConfigError(f"model.width={r.width} must be divisible by model.pos_conv_groups")
        if not 0.0 <= self.mask_prob <= 1.0:
            raise ConfigError(f"model.mask_prob must be in [0, 1], got {self.mask_prob}")
        for name in ("dropout", "attention_dropout", "activation_dropout", "feature_dropout", "layerdrop"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.mask_length < 1:
            raise ConfigError(f"model.mask_length must be >= 1, got {self.mask_length}")
        if self.relax_alpha <= 0:
            raise ConfigError(f"model.relax_alpha must be > 0, got {self.relax_alpha}")
        if self.attention == "relax" and self.qk_norm:
            # QK-norm bounds the logits itself; stacking PB-relax on it is not a scheme of the study.
            raise ConfigError("model.attention=relax cannot be combined with model.qk_norm=true")


@dataclass
class OptimConfig:
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 10
    fused: bool = True  # torch's fused AdamW kernel (CPU and CUDA): ~5x faster optimizer step than foreach on CPU
    # Gradient clipping (see stability.GradClipper): `fixed` clips at clip_grad; the adaptive rules
    # `zclip` and `autoclip` use clip_grad until clip_warmup finite norms have been seen.
    clip_mode: str = "fixed"
    clip_grad: float = 10.0
    clip_warmup: int = 25
    zclip_z: float = 2.5
    zclip_alpha: float = 0.97
    autoclip_percentile: float = 10.0

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        _choice("optim.clip_mode", self.clip_mode, CLIP_MODES)
        if self.clip_grad <= 0:
            raise ConfigError(f"optim.clip_grad must be > 0, got {self.clip_grad}")
        if not 0 < self.zclip_alpha < 1:
            raise ConfigError(f"optim.zclip_alpha must be in (0, 1), got {self.zclip_alpha}")
        if not 0 < self.autoclip_percentile <= 100:
            raise ConfigError(f"optim.autoclip_percentile must be in (0, 100], got {self.autoclip_percentile}")


@dataclass
class TrainConfig:
    name: str = "tiny"  # run directory: <output_dir>/<name>
    output_dir: str = "runs"
    run: int = 1  # run number, shown in legends ("Run 1"); seeds differ unless train.seed is set
    label: str | None = None  # legend text; derived from the config when not given
    seed: int = 0
    max_steps: int = 100  # optimizer updates; the lr schedule decays to 0 here
    stop_at: int | None = None  # stop early at this step (with a checkpoint), schedule unchanged; --resume goes on
    mixed_precision: str = "no"
    grad_accum: int = 1
    # Speed and memory (results unchanged up to float rounding): torch.compile of the frontend and the
    # encoder, in place (state-dict names unchanged; the first step compiles, ~20 s for tiny on CPU), and
    # recomputing each encoder layer in the backward pass (less activation memory, ~1/3 more compute).
    compile: bool = False
    activation_checkpointing: bool = False
    log_every: int = 1
    checkpoint_every: int = 50
    keep_checkpoints: int = 2  # the newest N checkpoints are kept ...
    keep_every: int = 0  # ... and every one at a multiple of this step, never pruned (0 = off)
    # Diagnostics: per-layer max attention logit and gradient norm every N steps (0 = off).
    diagnostics_every: int = 0
    # Loss-spike guard (off by default): roll back to the newest checkpoint and skip the offending batches.
    spike_guard: bool = False
    spike_window: int = 50
    spike_warmup: int = 20
    spike_z: float = 6.0
    spike_min_rel: float = 0.1
    max_rollbacks: int = 10

    def validate(self) -> None:
        _choice("train.mixed_precision", self.mixed_precision, MIXED_PRECISION)
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
        if self.stop_at is not None and self.stop_at < 1:
            raise ConfigError(f"train.stop_at must be >= 1, got {self.stop_at}")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> Config:
        for section in (self.data, self.model, self.optim, self.train):
            section.validate()
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.train.output_dir) / self.train.name

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (tuples as lists) with the model size resolved, ready for YAML."""
        out = dataclasses.asdict(self)
        out["model"] = dataclasses.asdict(self.model.resolved())
        return _lists(out)


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
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"{key} must be a non-empty list, got {value!r}")
        return [_coerce(key, v, args[0]) for v in value]
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        try:
            number = float(value) if annotation is float else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be {annotation.__name__}, got {value!r}") from None
        return number
    if annotation is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare `no` / `yes` as a boolean
            return "no" if value is False else "yes"
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {annotation}")


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(f"unknown setting {dotted!r}; settings are <section>.<key> with section one of: "
                          f"{', '.join(sections)}")
    section = getattr(cfg, parts[0])
    hints = typing.get_type_hints(type(section))
    names = [f.name for f in dataclasses.fields(section)]
    if parts[1] not in names:
        raise ConfigError(f"unknown setting {dotted!r}; valid keys of {parts[0]}: {', '.join(names)}")
    setattr(section, parts[1], _coerce(dotted, value, hints[parts[1]]))


def load_config(path: str | Path | list[str | Path] | tuple | None = None, overrides: list[str] | None = None
                ) -> Config:
    """Read a recipe YAML, or several layered in order (a recipe, then overlays such as
    recipes/overlays/tiny.yaml: a later file sets what it names, the rest stays), apply ``section.key=value``
    overrides, validate.

    Raises ConfigError naming the offending setting and the valid choices.
    """
    cfg = Config()
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    for path in map(Path, paths):
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}")
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping")
            for key, value in values.items():
                _set(cfg, f"{section}.{key}", value)
    for item in overrides or []:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        _set(cfg, key, value)  # raw text: _coerce converts it by the field's type ("no" stays a string)
    return cfg.validate()


def save_config(cfg: Config, path: str | Path, comment: str = "") -> None:
    """Write the resolved config as YAML, after ``comment`` (as # lines, which loading ignores)."""
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    Path(path).write_text(header + yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_from_run(run_dir: str | Path) -> Config:
    """The resolved config of an existing run directory."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: {path.name} is missing")
    return load_config(path)
