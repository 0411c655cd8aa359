"""Normalization schemes, resolved in one place.

A scheme is more than a norm module: it fixes where the norms sit, how the residual is scaled and how
weights are initialised. ``resolve_scheme`` turns the one config value into a ``SchemeSpec`` that the
encoder layer reads; nothing else in the code branches on the scheme's name.

Per sublayer G (attention or feed-forward), with x the residual stream:

- ``pre``      x = x + G(LN(x));                  final LN after the last layer (wav2vec2 "stable layer norm")
- ``post``     x = LN(x + G(x));                  LN on the embeddings before the first layer
- ``deepnorm`` x = LN(alpha * x + G(x));          alpha = (2N)^(1/4); fc1, fc2, out_proj, v_proj
                                                  initialised with gain beta = (8N)^(-1/4); q, k untouched
                                                  (MERT's deepnorm: its residual_alpha and init_scale)
- ``sandwich`` x = x + LN(G(LN(x)));              CogView's sandwich-LN; final LN
- ``subln``    x = x + G(LN(x)) with an extra LN inside G (before out_proj, before fc2);
               fc1, fc2, out_proj, v_proj initialised with gain sqrt(log(2N)) (Magneto, encoder-only)

N is the number of layers. The gain multiplies the std of the base init (``model.init``: MERT's N(0, 0.02)
or xavier_normal_; model/encoder.py). The attention form (sdpa / math / relax), norm type (LayerNorm / RMSNorm)
and QK-norm are orthogonal switches handled by the attention and norm factories.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.model_section import NORM_SCHEMES, NORM_TYPES


@dataclass(frozen=True)
class SchemeSpec:
    name: str
    norm_before: bool  # LN on the sublayer's input
    norm_after_sublayer: bool  # LN on the sublayer's output, before the residual add (sandwich)
    norm_after_residual: bool  # LN after the residual add (post-LN family)
    sublayer_norm: bool  # extra LN inside attention (before out_proj) and FFN (before fc2)
    residual_alpha: float  # multiplies the residual x, never G(x)
    init_gain: float  # multiplies the init std of fc1, fc2, out_proj, v_proj (1.0: the base init as is)
    embed_norm: bool  # LN on the embeddings before the first layer
    final_norm: bool  # LN after the last layer


# Legend text of each scheme in the study's figures: (base norm, modifier or None), e.g. DeepNorm is drawn as
# "Post-Norm | DeepNorm". Kept beside the schemes so that a new scheme gets its label in the same place.
LEGEND: dict[str, tuple[str, str | None]] = {
    "pre": ("Pre-Norm", None),
    "post": ("Post-Norm", None),
    "deepnorm": ("Post-Norm", "DeepNorm"),
    "sandwich": ("Sandwich-Norm", None),
    "subln": ("Sub-LN", None),
}


def resolve_scheme(name: str, num_layers: int) -> SchemeSpec:
    """The placement, residual scaling and init of scheme ``name`` for an ``num_layers``-layer encoder."""
    n = num_layers
    common = dict(norm_after_sublayer=False, sublayer_norm=False, residual_alpha=1.0, init_gain=1.0)
    if name == "pre":
        return SchemeSpec(name, norm_before=True, norm_after_residual=False, embed_norm=False,
                          final_norm=True, **common)
    if name == "post":
        return SchemeSpec(name, norm_before=False, norm_after_residual=True, embed_norm=True,
                          final_norm=False, **common)
    if name == "deepnorm":
        return SchemeSpec(name, norm_before=False, norm_after_sublayer=False, norm_after_residual=True,
                          sublayer_norm=False, residual_alpha=deepnorm_alpha(n), init_gain=deepnorm_beta(n),
                          embed_norm=True, final_norm=False)
    if name == "sandwich":
        return SchemeSpec(name, norm_before=True, norm_after_sublayer=True, norm_after_residual=False,
                          sublayer_norm=False, residual_alpha=1.0, init_gain=1.0, embed_norm=False,
                          final_norm=True)
    if name == "subln":
        return SchemeSpec(name, norm_before=True, norm_after_sublayer=False, norm_after_residual=False,
                          sublayer_norm=True, residual_alpha=1.0, init_gain=math.sqrt(math.log(2 * n)),
                          embed_norm=False, final_norm=True)
    raise ConfigError(f"model.norm_scheme={name!r} is not valid; choose one of: {', '.join(NORM_SCHEMES)}")


def deepnorm_alpha(num_layers: int) -> float:
    """DeepNorm residual multiplier for an encoder of N layers: (2N)^(1/4)."""
    return (2 * num_layers) ** 0.25


def deepnorm_beta(num_layers: int) -> float:
    """DeepNorm init gain of fc1, fc2, out_proj, v_proj for an encoder of N layers: (8N)^(-1/4)."""
    return (8 * num_layers) ** -0.25


def make_norm(norm_type: str, dim: int) -> nn.Module:
    """LayerNorm or RMSNorm over the last dimension."""
    if norm_type == "layernorm":
        return nn.LayerNorm(dim)
    if norm_type == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-5)
    raise ConfigError(f"model.norm_type={norm_type!r} is not valid; choose one of: {', '.join(NORM_TYPES)}")
