"""Convolutional waveform frontend: 24 kHz samples -> 75 Hz features (total stride 320).

Conv stack as in wav2vec2 / HuBERT / MERT: (C,10,5) + (C,3,2)x4 + (C,2,2)x2, no bias, GroupNorm on
the first conv, GELU. Its receptive field is 400 samples, so S = 320*T samples alone would give T-1
frames. We pad 40 samples on each side: frame t then covers samples [320t - 40, 320t + 360), centred
on the centre of EnCodec's frame t, and S = 320*T samples give exactly T frames, aligned with the
codes [K, T].

Two implementations of the same function, with the same parameters (``convs.{i}.0.weight``,
``convs.0.1.{weight,bias}``: checkpoints and the HuBERT export see no difference), chosen by
``ConvFrontend.impl``:

- ``"conv"`` (default): ``nn.Conv1d`` layers in (B, C, T) layout, as wav2vec2 / HuBERT run them.
- ``"gemm"``: every convolution as a matrix product over frames. The first conv (1 -> C, kernel 10,
  stride 5) is ``W [C, 10] @ frames [B, 10, T0]`` over the overlapping 10-sample frames of the padded
  waveform (a strided view, no copy), giving (B, C, T0) for the GroupNorm as before. The layers after
  it run channels-last (B, T, C): a (kernel 2, stride 2) conv is a reshape of (B, T, C) into
  (B, T/2, 2C) (no copy) times the weight permuted to [C, 2C]; a (kernel 3, stride 2) conv multiplies
  the unfolded (B, T', C * 3) windows. Meant for the GPU, where the profile of issue 17 put cuDNN's
  convolutions of the C_in = 1 first layer and its NCHW <-> NHWC copies at ~40% of a base step; on
  the 2-core CPU it was not faster (benchmarks/README.md), hence not the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from musiclm_stab.constants import HOP_LENGTH
from musiclm_stab.model.fp16_arith import fp32

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


IMPLS = ("conv", "gemm")


class Fp32GroupNorm(nn.GroupNorm):
    """GroupNorm computed in fp32 and returned in the input's dtype, in an fp16 model too (fairseq's
    ``Fp32GroupNorm``, the only norm of wav2vec2's conv frontend). The same parameters as ``nn.GroupNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(fp32(x), self.num_groups, fp32(self.weight), fp32(self.bias), self.eps).to(x.dtype)


class ConvFrontend(nn.Module):
    """[B, S] waveform (S a multiple of 320) -> [B, T, C] features with T = S / 320.

    ``impl``: "conv" or "gemm" (module docstring); it may be changed on a built model (an attribute,
    not a parameter: the state dict is the same for both)."""

    def __init__(self, conv_dim: int = 512, impl: str = "conv"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"frontend impl {impl!r}: choose one of {', '.join(IMPLS)}")
        self.impl = impl
        layers, in_ch = [], 1
        for i, (k, s) in enumerate(CONV_LAYERS):
            block = [nn.Conv1d(in_ch, conv_dim, k, stride=s, bias=False)]
            if i == 0:
                block.append(Fp32GroupNorm(conv_dim, conv_dim, affine=True))
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
        if self.impl == "gemm":
            return self._forward_gemm(wav)
        if self.impl != "conv":  # set on a built model: refuse rather than fall back silently
            raise ValueError(f"frontend impl {self.impl!r}: choose one of {', '.join(IMPLS)}")
        x = F.pad(wav.unsqueeze(1), (PAD, PAD))  # (B, 1, S + 80)
        return self.convs(x).transpose(1, 2)  # (B, T, C)

    def _forward_gemm(self, wav: torch.Tensor) -> torch.Tensor:
        """The "gemm" implementation: [B, S] -> [B, T, C], equal to the convolutions up to float rounding."""
        k, s = CONV_LAYERS[0]
        first = self.convs[0]
        w = first[0].weight  # (C, 1, 10)
        frames = F.pad(wav, (PAD, PAD)).unfold(-1, k, s)  # (B, T0, 10), overlapping view of the samples
        # (B, C, T0) as the conv gives it: the norm (convs.0.1) keeps its (B, C, L) input, so a module put
        # in its place (export/features.py swaps in fixed statistics) is used unchanged.
        x = torch.matmul(w.view(w.shape[0], k), frames.transpose(1, 2))
        for module in list(first)[1:]:  # GroupNorm, GELU
            x = module(x)
        x = x.transpose(1, 2).contiguous()  # (B, T0, C): channels-last for the remaining layers
        for block in list(self.convs)[1:]:
            conv = block[0]
            k, s = conv.kernel_size[0], conv.stride[0]
            w = conv.weight  # (C_out, C_in, k)
            B, T, C = x.shape
            if k == s:  # non-overlapping windows: a reshape, no copy; rows (k, C_in) order
                n = T // k
                x = F.linear(x[:, : n * k].reshape(B, n, k * C), w.permute(0, 2, 1).reshape(w.shape[0], k * C))
            else:  # overlapping windows: unfold gives (B, T', C_in, k), the weight's own (C_in, k) order
                x = F.linear(x.unfold(1, k, s).reshape(B, -1, C * k), w.reshape(w.shape[0], C * k))
            for module in list(block)[1:]:  # GELU
                x = module(x)
        return x  # (B, T, C)
