"""HuBERT span masking.

For each sequence of T frames, n = floor(mask_prob * T / span + u), u ~ U[0, 1), span starts are drawn
without replacement from [0, T - span) and each masks ``span`` frames. Spans may overlap, so the masked
fraction is below ``mask_prob`` (``expected_mask_fraction`` gives its exact expectation).
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
