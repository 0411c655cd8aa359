"""HuBERT span masking, as fairseq's ``compute_mask_indices`` does it for MERT (data_utils.py).

For each sequence of T frames, n = floor(mask_prob * T / span + u), u ~ U[0, 1), span starts are drawn
without replacement from [0, T - span) and each masks ``span`` frames. Spans may overlap, so the masked
fraction is below ``mask_prob`` (``expected_mask_fraction`` gives its exact expectation: 0.5825 for
T = 375, p = 0.8, span 5).

fairseq's default ``require_same_masks=True`` then trims every row of the batch to the batch's smallest
masked count, keeping a random subset of each row's masked frames (so single frames, not whole spans,
are unmasked): ``same_mask_count``. That lowers the share to about 0.548 for batches of 8 at T = 375.
"""

from __future__ import annotations

import math

import torch


def span_mask(batch: int, frames: int, mask_prob: float, span: int, generator: torch.Generator | None = None
              ) -> torch.Tensor:
    """Boolean mask [B, T]; True = masked frame (input replaced by the mask embedding, loss computed)."""
    mask = torch.zeros(batch, frames, dtype=torch.bool)
    num_starts = frames - span
    if num_starts <= 0 or mask_prob <= 0:
        return mask
    offsets = torch.arange(span)
    for b in range(batch):
        u = torch.rand((), generator=generator).item()
        n = min(int(mask_prob * frames / span + u), num_starts)
        if n == 0:
            continue
        starts = torch.randperm(num_starts, generator=generator)[:n]
        mask[b, (starts[:, None] + offsets).reshape(-1)] = True
    return mask


def expected_mask_fraction(frames: int, mask_prob: float, span: int) -> float:
    """Exact expected fraction of masked frames under ``span_mask`` (for tests and documentation)."""
    num_starts = frames - span
    base = mask_prob * frames / span
    lo = int(math.floor(base))
    total = 0.0
    for n, p_n in ((lo, 1.0 - (base - lo)), (lo + 1, base - lo)):
        n = min(n, num_starts)
        if p_n == 0:
            continue
        for i in range(frames):
            covering = min(i, num_starts - 1) - max(0, i - span + 1) + 1  # starts whose span covers frame i
            covering = max(covering, 0)
            # P(no covering start chosen) = C(num_starts - covering, n) / C(num_starts, n)
            p_free = math.comb(num_starts - covering, n) / math.comb(num_starts, n) if n <= num_starts else 0.0
            total += p_n * (1.0 - p_free)
    return total / frames


def same_mask_count(mask: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fairseq's ``require_same_masks``: every row of ``mask`` [B, T] trimmed to the smallest row's masked
    count by unmasking randomly chosen masked frames of the longer rows. Returns a new [B, T] mask."""
    out = mask.clone()
    counts = mask.sum(-1)  # (B,)
    target = int(counts.min()) if mask.shape[0] else 0
    for b in range(mask.shape[0]):
        extra = int(counts[b]) - target
        if extra > 0:
            masked = mask[b].nonzero().flatten()  # (count,)
            drop = masked[torch.randperm(len(masked), generator=generator)[:extra]]
            out[b, drop] = False
    return out
