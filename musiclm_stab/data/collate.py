"""Batches: stacked crops, in-batch noise mixup of the input, span masks. Seeded per example."""

from __future__ import annotations

import numpy as np
import torch

from musiclm_stab import SAMPLE_RATE
from musiclm_stab.config import DataConfig, ModelConfig
from musiclm_stab.data.crops import seeded_rng
from musiclm_stab.data.masking import span_mask


class Collator:
    """Stacks crops, applies in-batch noise mixup to the input, draws span masks. Seeded per batch."""

    def __init__(self, data: DataConfig, model: ModelConfig, seed: int = 0, mixup: bool = True):
        self.data, self.model, self.seed, self.mixup, self.epoch = data, model, seed, mixup, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, items: list[dict]) -> dict:
        indices = [it["index"] for it in items]
        clean = torch.stack([it["pcm"] for it in items])  # (B, S)
        codes = torch.stack([it["codes"] for it in items])  # (B, K, T)
        wav = noise_mixup(clean, self.data, seeded_rng(self.seed, self.epoch, 0xBA7C, *indices)) if self.mixup else clean
        # Masks per example, seeded by its index: the same whatever the batch split across processes.
        masks = [span_mask(1, codes.shape[-1], self.model.mask_prob, self.model.mask_length,
                           torch.Generator().manual_seed(int(seeded_rng(self.seed, self.epoch, 0x3A5C, i).integers(2**62))))
                 for i in indices]
        return {"wav": wav, "clean_wav": clean, "codes": codes, "mask": torch.cat(masks)}


def noise_mixup(clean: torch.Tensor, cfg: DataConfig, rng: np.random.Generator) -> torch.Tensor:
    """With probability ``mixup_prob`` per clip, add 1..mixup_max_segments segments of
    mixup_min..max_seconds cut from *other* clips of the batch, at a random level of ``mixup_gain_db``
    relative to the clip's RMS. Input only: targets are computed from ``clean``. [B, S] -> [B, S]."""
    B, S = clean.shape
    out = clean.clone()
    if B < 2:
        return out
    rms = clean.pow(2).mean(-1).sqrt().clamp_min(1e-5)  # (B,)
    for i in range(B):
        if rng.random() >= cfg.mixup_prob:
            continue
        for _ in range(int(rng.integers(1, cfg.mixup_max_segments + 1))):
            j = int(rng.choice([b for b in range(B) if b != i]))
            length = min(S, int(rng.uniform(cfg.mixup_min_seconds, cfg.mixup_max_seconds) * SAMPLE_RATE))
            src, dst = int(rng.integers(0, S - length + 1)), int(rng.integers(0, S - length + 1))
            seg = clean[j, src:src + length]
            seg_rms = seg.pow(2).mean().sqrt().clamp_min(1e-5)
            gain = float(10 ** (rng.uniform(*cfg.mixup_gain_db) / 20))
            out[i, dst:dst + length] += seg * (rms[i] / seg_rms * gain)
    return out
