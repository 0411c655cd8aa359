"""Convolutional waveform frontend: 24 kHz samples -> 75 Hz features (total stride 320).

Conv stack as in wav2vec2 / HuBERT / MERT: (C,10,5) + (C,3,2)x4 + (C,2,2)x2, no bias, GroupNorm on
the first conv, GELU. Its receptive field is 400 samples, so S = 320*T samples alone would give T-1
frames. We pad 40 samples on each side: frame t then covers samples [320t - 40, 320t + 360), centred
on the centre of EnCodec's frame t, and S = 320*T samples give exactly T frames, aligned with the
codes [K, T].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from musiclm_stab import HOP_LENGTH

CONV_LAYERS = [(10, 5)] + [(3, 2)] * 4 + [(2, 2)] * 2  # (kernel, stride): total stride 5 * 2^6 = 320
RECEPTIVE_FIELD = 400
PAD = (RECEPTIVE_FIELD - HOP_LENGTH) // 2  # 40 samples each side


class GradMultiply(torch.autograd.Function):
    """Identity forward; gradient scaled by ``scale`` (``feature_grad_mult``)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class ConvFrontend(nn.Module):
    """[B, S] waveform (S a multiple of 320) -> [B, T, C] features with T = S / 320."""

    def __init__(self, conv_dim: int = 512):
        super().__init__()
        layers, in_ch = [], 1
        for i, (k, s) in enumerate(CONV_LAYERS):
            block = [nn.Conv1d(in_ch, conv_dim, k, stride=s, bias=False)]
            if i == 0:
                block.append(nn.GroupNorm(conv_dim, conv_dim, affine=True))
            block.append(nn.GELU())
            layers.append(nn.Sequential(*block))
            in_ch = conv_dim
        self.convs = nn.Sequential(*layers)
        for m in self.modules():
            if isinstance(m, nn.Conv1d):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        if wav.shape[-1] % HOP_LENGTH:
            raise ValueError(f"waveform length {wav.shape[-1]} is not a multiple of {HOP_LENGTH} samples")
        x = F.pad(wav.unsqueeze(1), (PAD, PAD))  # (B, 1, S + 80)
        return self.convs(x).transpose(1, 2)  # (B, T, C)
