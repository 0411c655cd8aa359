"""Masked-prediction losses. Every loss is computed on masked frames only."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def acoustic_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy per codebook on masked frames.

    logits: [N, K, V] for the N masked frames; targets: [N, K] codes.
    Returns (acoustic_mlm_loss = sum over codebooks of the mean CE, ce per codebook [K], accuracy [K]).
    """
    N, K, V = logits.shape
    if N == 0:
        zeros = logits.new_zeros(K)
        return zeros.sum(), zeros, zeros
    ce = F.cross_entropy(logits.reshape(N * K, V).float(), targets.reshape(N * K), reduction="none")
    ce_per_codebook = ce.view(N, K).mean(0)  # (K,)
    acc = (logits.argmax(-1) == targets).float().mean(0)  # (K,)
    return ce_per_codebook.sum(), ce_per_codebook, acc


def musical_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE between predicted and true CQT magnitudes of the masked frames: [N, n_bins] each."""
    if pred.shape[0] == 0:
        return pred.new_zeros(())
    return F.mse_loss(pred.float(), target.float())
