"""Transformer encoder whose norm placement, residual scaling and init come from a SchemeSpec."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize
import torch.utils.checkpoint
from torch import nn

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.model_section import INIT_SCHEMES, ModelConfig
from musiclm_stab.model.attention import SelfAttention, fast_dropout
from musiclm_stab.model.fp16_arith import fp32
from musiclm_stab.model.norm_schemes import SchemeSpec, make_norm, resolve_scheme


class FeedForward(nn.Module):
    """fc1 -> GELU -> dropout -> (Sub-LN) -> fc2 on [B, T, D]."""

    def __init__(self, dim: int, hidden: int, dropout: float, sublayer_norm: bool, norm_type: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.dropout = dropout
        self.sub_norm = make_norm(norm_type, hidden) if sublayer_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fast_dropout(F.gelu(self.fc1(x)), self.dropout, self.training)
        if self.sub_norm is not None:
            h = self.sub_norm(h)
        return self.fc2(h)


class EncoderLayer(nn.Module):
    """One attention + feed-forward layer; every norm-scheme difference is read from ``spec``."""

    def __init__(self, cfg: ModelConfig, spec: SchemeSpec):
        super().__init__()
        cfg = cfg.resolved()  # sizes filled in, so a layer can be built from a plain ModelConfig
        self.spec, self.dropout = spec, cfg.dropout
        self.attn = SelfAttention(cfg.width, cfg.num_heads, form=cfg.attention, alpha=cfg.relax_alpha,
                                  dropout=cfg.attention_dropout, qk_norm=cfg.qk_norm,
                                  sublayer_norm=spec.sublayer_norm, norm_type=cfg.norm_type)
        self.ffn = FeedForward(cfg.width, cfg.ffn_dim, cfg.activation_dropout, spec.sublayer_norm, cfg.norm_type)

        def norm_if(flag: bool) -> nn.Module | None:
            return make_norm(cfg.norm_type, cfg.width) if flag else None

        self.attn_norm_in, self.ffn_norm_in = norm_if(spec.norm_before), norm_if(spec.norm_before)
        self.attn_norm_out, self.ffn_norm_out = norm_if(spec.norm_after_sublayer), norm_if(spec.norm_after_sublayer)
        self.attn_norm_res, self.ffn_norm_res = norm_if(spec.norm_after_residual), norm_if(spec.norm_after_residual)

    def _block(self, x, sublayer, norm_in, norm_out, norm_res):
        h = norm_in(x) if norm_in is not None else x
        h = sublayer(h)
        if norm_out is not None:
            h = norm_out(h)
        x = self.spec.residual_alpha * x + fast_dropout(h, self.dropout, self.training)  # alpha scales x, not G(x)
        return norm_res(x) if norm_res is not None else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._block(x, self.attn, self.attn_norm_in, self.attn_norm_out, self.attn_norm_res)
        return self._block(x, self.ffn, self.ffn_norm_in, self.ffn_norm_out, self.ffn_norm_res)


BERT_INIT_STD = 0.02  # fairseq's init_bert_params: N(0, 0.02) for every Linear of the encoder
SCALED_AT_INIT = ("fc1", "fc2", "out_proj", "v_proj")  # the weights a scheme's init gain multiplies


def init_encoder_weights(layers: nn.ModuleList, spec: SchemeSpec, init: str = "mert") -> list[str]:
    """Initialise every Linear of the encoder layers (q, k, v, out_proj, fc1, fc2): biases 0, weights

    - ``mert``: N(0, 0.02), fairseq's ``init_bert_params`` that MERT's encoder applies to itself
      (wav2vec2.py ``TransformerEncoder.__init__``), and only there: the conv frontend, feature
      projection, heads, label and mask embeddings keep their own inits, as in MERT;
    - ``xavier``: ``xavier_normal_`` (torchscale's DeepNorm/Magneto init);

    then fc1, fc2, out_proj, v_proj get the scheme's gain (``spec.init_gain``) on their std: DeepNorm's
    beta = (8N)^(-1/4), which is MERT's division by (8N)^(1/4) (mert_model.py TransformerEncoder_extend),
    or Sub-LN's sqrt(log 2N); q and k never.

    Returns the names (relative to ``layers``) of the weights scaled by a gain other than 1, so tests can
    check that exactly the right parameters were touched.
    """
    if init not in INIT_SCHEMES:
        raise ConfigError(f"model.init={init!r} is not valid; choose one of: {', '.join(INIT_SCHEMES)}")
    scaled = []
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            leaf = name.rsplit(".", 1)[-1]
            gain = spec.init_gain if leaf in SCALED_AT_INIT else 1.0
            if init == "mert":
                nn.init.normal_(module.weight, mean=0.0, std=BERT_INIT_STD * gain)
            else:
                nn.init.xavier_normal_(module.weight, gain=gain)
            nn.init.zeros_(module.bias)
            if gain != 1.0:
                scaled.append(f"{i}.{name}.weight")
    return scaled


class Encoder(nn.Module):
    """Conv positional embedding + transformer layers. [B, T, D] -> [B, T, D] (and per-layer states)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg = cfg.resolved()
        self.spec = resolve_scheme(cfg.norm_scheme, cfg.num_layers)
        self.pos_conv = PositionalConv(cfg.width, cfg.pos_conv_kernel, cfg.pos_conv_groups)
        self.embed_norm = make_norm(cfg.norm_type, cfg.width) if self.spec.embed_norm else None
        self.final_norm = make_norm(cfg.norm_type, cfg.width) if self.spec.final_norm else None
        self.dropout, self.layerdrop = cfg.dropout, cfg.layerdrop
        self.layers = nn.ModuleList(EncoderLayer(cfg, self.spec) for _ in range(cfg.num_layers))
        self.checkpoint_layers = False  # activation checkpointing (train.activation_checkpointing)
        self.scaled_at_init = init_encoder_weights(self.layers, self.spec, cfg.init)

    def forward(self, x: torch.Tensor, return_hidden: bool = False):
        """x: [B, T, D]. Returns [B, T, D], or (output, list of num_layers+1 hidden states)."""
        x = x + self.pos_conv(x)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = fast_dropout(x, self.dropout, self.training)
        hidden = [x]
        for layer in self.layers:
            if self.training and self.layerdrop > 0 and torch.rand(()) < self.layerdrop:
                hidden.append(x)
                continue
            if self.checkpoint_layers and self.training and torch.is_grad_enabled():
                # recomputed in backward with the same RNG state, so dropout masks match
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
            hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return (x, hidden) if return_hidden else x


class Fp32WeightNorm(nn.Module):
    """The weight-norm parametrization w = g * v / ||v|| (norms over every dim but ``dim``), computed in fp32
    and rounded once into the model's dtype: what CUDA's fused weight-norm kernel does for half weights (its
    norms stay fp32; torch 1.12 and fairseq's pos_conv took it). torch's own parametrization computes it in
    the weights' dtype on a CPU, rounding the norms, the ratio and the product to fp16 under the emulation.
    In fp32 it is torch's own (``torch._weight_norm``). The same parameters as
    ``nn.utils.parametrizations.weight_norm`` (``parametrizations.weight.original0`` = g,
    ``original1`` = v), so checkpoints and the HuBERT export see no difference."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, weight_g: torch.Tensor, weight_v: torch.Tensor) -> torch.Tensor:
        return torch._weight_norm(fp32(weight_v), fp32(weight_g), self.dim).to(weight_v.dtype)

    def right_inverse(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.norm_except_dim(weight, 2, self.dim), weight


class PositionalConv(nn.Module):
    """Convolutional relative positional embedding (wav2vec2): weight-normed grouped conv + GELU."""

    def __init__(self, dim: int, kernel: int, groups: int):
        super().__init__()
        conv = nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=groups)
        nn.init.normal_(conv.weight, mean=0.0, std=(4.0 / (kernel * dim)) ** 0.5)
        nn.init.zeros_(conv.bias)
        torch.nn.utils.parametrize.register_parametrization(conv, "weight", Fp32WeightNorm(dim=2), unsafe=True)
        self.conv = conv
        self.trim = 1 if kernel % 2 == 0 else 0  # an even kernel yields one extra frame

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.transpose(1, 2))  # (B, D, T + trim)
        if self.trim:
            h = h[..., : -self.trim]
        return F.gelu(h).transpose(1, 2)  # (B, T, D)
