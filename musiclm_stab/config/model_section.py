"""The model's settings (``ModelConfig``) and the per-size defaults of the settings MERT's sizes set differently.

Per-size defaults. The settings that MERT's two configs set differently (``SIZE_DEFAULTS``: dimensions,
norm placement, dropouts, layerdrop, feature_grad_mult, final_dim, noise-mixup segment lengths) default
to None and are filled from the size's row by ``Config.resolved()``: ``base`` is MERT-95M
(config/pretrain/MERT_RVQ-VAE_CQT_95M.yaml), ``large`` MERT-330M (..._330M.yaml), ``tiny`` this project's
CPU size (its values are the project's earlier defaults). A value given in a recipe or on the command
line wins over the size's. ``load_config`` returns the resolved config, and the resolved values are what
``runs/<name>/config.yaml`` records. docs/FIDELITY.md compares every setting with MERT's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from musiclm_stab.config.checks import ConfigError, _at_least, _choice, _setting, _show
from musiclm_stab.constants import SAMPLE_RATE

NORM_SCHEMES = ("pre", "post", "deepnorm", "sandwich", "subln")
ATTENTION_FORMS = ("sdpa", "math", "relax")
NORM_TYPES = ("layernorm", "rmsnorm")
INIT_SCHEMES = ("mert", "xavier")

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


def _fill(section: Any, defaults: dict[str, Any]) -> Any:
    """Copy of a config section with the None fields named in ``defaults`` set to their default."""
    out = dataclasses.replace(section)
    for name, value in defaults.items():
        if getattr(out, name) is None:
            setattr(out, name, value)
    return out



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
