"""Batches: stacked crops, in-batch noise mixup of the input, span masks. Seeded by the batch's examples.

Everything random is drawn from (seed, epoch, the examples' indices), never from a global RNG, so a batch is
the same whatever the number of loader workers and after a resume. A span mask depends on its example only;
noise mixup and the trim to one masked count per batch (``model.require_same_masks``) depend on the whole
batch, as in MERT, where both happen per batch on each GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from musiclm_stab.config.model_section import ModelConfig
from musiclm_stab.config.sections import DataConfig
from musiclm_stab.constants import SAMPLE_RATE
from musiclm_stab.data.crops import seeded_rng
from musiclm_stab.data.masking import same_mask_count, span_mask


class Collator:
    """Stacks crops, applies in-batch noise mixup to the input, draws span masks. Seeded per batch.

    ``data`` may leave the per-size values (noise-mixup lengths) unset: they are filled in from
    ``model.size``."""

    def __init__(self, data: DataConfig, model: ModelConfig, seed: int = 0, mixup: bool = True):
        model = model.resolved()
        self.data, self.model = data.resolved(model.size), model
        self.seed, self.mixup, self.epoch = seed, mixup, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, items: list[dict]) -> dict:
        indices = [it["index"] for it in items]
        clean = torch.stack([it["pcm"] for it in items])  # (B, S)
        codes = torch.stack([it["codes"] for it in items])  # (B, K, T)
        wav = noise_mixup(clean, self.data, seeded_rng(self.seed, self.epoch, 0xBA7C, *indices)) if self.mixup else clean
        # Masks per example, seeded by its index: the same whatever the batch split across processes.
        masks = torch.cat([span_mask(1, codes.shape[-1], self.model.mask_prob, self.model.mask_length,
                                     _torch_generator(seeded_rng(self.seed, self.epoch, 0x3A5C, i)))
                           for i in indices])  # (B, T)
        if self.model.require_same_masks:
            masks = same_mask_count(masks, _torch_generator(seeded_rng(self.seed, self.epoch, 0x7217, *indices)))
        return {"wav": wav, "clean_wav": clean, "codes": codes, "mask": masks}


def _torch_generator(rng: np.random.Generator) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def noise_mixup(clean: torch.Tensor, cfg: DataConfig, rng: np.random.Generator) -> torch.Tensor:
    """In-batch noise mixup of the input, ``data.mixup_mode``; targets are computed from ``clean``, which
    is left untouched. [B, S] -> [B, S]. ``cfg`` must have its mixup lengths (``DataConfig.resolved``).

    Each clip, with probability ``mixup_prob``, gets k segments (k uniform in 1..mixup_max_segments) of
    other clips of the batch added at uniform positions:

    - ``mert`` (MERT's ``inbatch_noise_augment``, mert_model.py 815-848, applied at 1088-1098): the other
      clips are joined end to end into one pool, so a segment may span two clips; its length is a uniform
      whole number of samples in [min, max] (mixup_min/max_seconds), its start in the pool uniform in
      [0, pool - max]; added as is (volume 1.0, no level matching, no clipping). Where the pool is
      shorter than the longest segment or a drawn segment is longer than the clip, MERT's draws fail
      and its bare ``except`` keeps the clip clean: so does this. (MERT applies the mixup when
      ``rand > mixture_prob``; with its 0.5 that is the same probability 0.5.)
    - ``rms`` (this project's earlier form): each segment from one other clip, length uniform in
      [min, max] s, scaled to the clip's RMS times a gain uniform in ``mixup_gain_db``.
    """
    if cfg.mixup_min_seconds is None or cfg.mixup_max_seconds is None:
        raise ValueError("noise_mixup needs the mixup lengths: pass DataConfig.resolved(model size)")
    B, S = clean.shape
    out = clean.clone()
    if B < 2:
        return out
    if cfg.mixup_mode == "mert":
        return _mixup_mert(clean, out, cfg, rng)
    if cfg.mixup_mode != "rms":
        raise ValueError(f"data.mixup_mode={cfg.mixup_mode!r} is not valid; choose one of: mert, rms")
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


def _mixup_mert(clean: torch.Tensor, out: torch.Tensor, cfg: DataConfig, rng: np.random.Generator) -> torch.Tensor:
    """The ``mert`` form of ``noise_mixup``: adds to ``out`` [B, S] in place and returns it."""
    B, S = clean.shape
    shortest = int(round(cfg.mixup_min_seconds * SAMPLE_RATE))
    longest = int(round(cfg.mixup_max_seconds * SAMPLE_RATE))
    pool_len = (B - 1) * S
    for i in range(B):
        if rng.random() >= cfg.mixup_prob:
            continue
        n = int(rng.integers(1, cfg.mixup_max_segments + 1))
        lengths = rng.integers(shortest, longest + 1, size=n)  # (n,) inclusive, as torch.randint(min, max + 1)
        if pool_len < longest or lengths.max() > S:
            continue  # where MERT's draws fail, its bare `except` keeps the clip clean
        starts = rng.integers(0, pool_len - longest + 1, size=n)  # (n,) in the pool
        pool = torch.cat([clean[:i], clean[i + 1:]]).flatten()  # ((B-1) * S,): the other clips end to end
        for length, src in zip(lengths.tolist(), starts.tolist()):
            dst = int(rng.integers(0, S - length + 1))
            out[i, dst:dst + length] += pool[src:src + length]
    return out
