"""MusicMLM: the MERT-style dual-stream masked language model.

    wav [B, S] --conv frontend--> [B, T, C] --LN, Linear--> [B, T, D] --mask--> encoder --> [B, T, D]
      masked frames --> acoustic heads: logits [N, K, V] vs EnCodec codes   (CE per codebook)
                    --> musical head:   [N, n_bins]   vs CQT of the clean crop (MSE)
    loss: the objective of model/objective.py (sum_k CE_k + musical_weight * MSE + 10 * features penalty)
"""

from __future__ import annotations

import torch
from torch import nn

from musiclm_stab.config.model_section import ModelConfig
from musiclm_stab.constants import SAMPLE_RATE
from musiclm_stab.model.attention import fast_dropout
from musiclm_stab.model.cqt import CQT
from musiclm_stab.model.encoder import Encoder
from musiclm_stab.model.fp16_arith import fp32, no_rounding
from musiclm_stab.model.frontend import ConvFrontend, GradMultiply
from musiclm_stab.model.heads import AcousticHeads, MusicalHead
from musiclm_stab.model.objective import MLMOutput, mlm_objective


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class MusicMLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg = cfg.resolved()
        self.cfg = cfg
        self.frontend = ConvFrontend(cfg.conv_dim)
        self.feature_norm = nn.LayerNorm(cfg.conv_dim)
        self.feature_proj = nn.Linear(cfg.conv_dim, cfg.width)
        self.mask_emb = nn.Parameter(torch.empty(cfg.width).uniform_())
        self.encoder = Encoder(cfg)
        self.acoustic = AcousticHeads(cfg.width, cfg.num_codebooks, cfg.codebook_size, cfg.final_dim, cfg.logit_temp)
        self.musical = MusicalHead(cfg.width, cfg.cqt_bins)
        self.cqt = CQT(SAMPLE_RATE, fmin=cfg.cqt_fmin, n_bins=cfg.cqt_bins, bins_per_octave=cfg.cqt_bins_per_octave)

    def features(self, wav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S] -> (projected features [B, T, D], features penalty scalar)."""
        feats = self.frontend(wav)  # (B, T, C)
        if self.cfg.feature_grad_mult != 1.0 and self.training:
            feats = GradMultiply.apply(feats, self.cfg.feature_grad_mult)
        pen = fp32(feats).pow(2).mean()  # in fp32, as MERT computes it from its fp16 features
        feats = self.feature_norm(feats)
        x = self.feature_proj(feats)  # (B, T, D)
        return fast_dropout(x, self.cfg.feature_dropout, self.training), pen

    def encode(self, wav: torch.Tensor, mask: torch.Tensor | None = None, return_hidden: bool = False):
        """Encoder states for [B, S] audio; masked frames (mask [B, T] True) get the mask embedding."""
        x, pen = self.features(wav)
        if mask is not None:
            x = torch.where(mask.unsqueeze(-1), self.mask_emb.to(x.dtype), x)
        return self.encoder(x, return_hidden=return_hidden), pen

    def forward(self, wav: torch.Tensor, clean_wav: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor,
                frame_weight: torch.Tensor | float = 1.0) -> MLMOutput:
        """wav: [B, S] input (maybe noise-mixed); clean_wav: [B, S] for the CQT target;
        codes: [B, K, T] EnCodec codes of the clean crop; mask: [B, T] bool; frame_weight: see
        model/objective.py (1 on one process)."""
        x, pen = self.encode(wav, mask)  # (B, T, D)
        if codes.shape[-1] != x.shape[1] or mask.shape != x.shape[:2]:
            raise ValueError(f"codes {tuple(codes.shape)} / mask {tuple(mask.shape)} do not match {x.shape[1]} frames")
        with torch.no_grad(), no_rounding():
            cqt = self.cqt(clean_wav)  # (B, T, n_bins), fp32: a target, not a value of the fp16 model
        h = x[mask]  # (N, D)
        return mlm_objective(self.acoustic(h), codes, self.musical(h), cqt, pen, mask, self.cfg.musical_weight,
                             self.cfg.features_pen_weight, frame_weight)
