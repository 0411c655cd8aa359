"""The unigram level a run's held-out codebook loss is judged against.

A model that learned nothing about its input but the codes' frequencies predicts every masked frame with
the training split's code distribution. Its cross-entropy on the frames that held-out evaluation scores
(the masked frames of ``musiclm-stab evaluate``'s batches: centre crops of the held-out tracks, span masks
from the fixed evaluation seed) is the level below which a run has learned something from the audio:

    unigram_eval_cb{k} = - mean over the held-out masked frames of log2 p_train(code_k)

with p_train the frequencies of codebook k's codes over every frame of the training split, add-one smoothed
over the codebook's entries (so an unseen code costs log2 of the count, not infinity). In bits, as the
losses are logged.
"""

from __future__ import annotations

import math

import numpy as np

from musiclm_stab.config.sections import Config
from musiclm_stab.data import CropDataset, split_indices
from musiclm_stab.data.loader import EVAL_SEED, held_out_loader


def code_counts(hf, rows: list[int], codebook: int, size: int) -> np.ndarray:
    """Add-one counts [size] of codebook ``codebook``'s codes over every frame of the given rows."""
    counts = np.ones(size, dtype=np.float64)
    codes = hf.select(rows).select_columns(["codes"]).with_format("numpy")
    for start in range(0, len(codes), 64):  # a few rows at a time: codes are [K, T] each
        for row in codes[start:start + 64]["codes"]:
            counts += np.bincount(np.asarray(row[codebook]), minlength=size)[:size]
    return counts


def unigram_eval_loss(cfg: Config, codebook: int = 0) -> dict:
    """{"unigram_eval_cb{k}": bits, "masked_frames": n, "train_frames": m} for the run config ``cfg``'s data,
    held-out split, crop length and masking (the frames ``musiclm-stab evaluate`` scores)."""
    from musiclm_stab.data.tokenized import load_tokenized

    cfg = cfg.resolved()
    hf, _ = load_tokenized(cfg.data.path)
    train_idx, eval_idx = split_indices(hf["track"], cfg.data.eval_fraction)
    size = cfg.model.codebook_size
    counts = code_counts(hf, train_idx, codebook, size)
    log_p = np.log2(counts / counts.sum())
    dataset = CropDataset(hf, eval_idx, cfg.data.crop_seconds, seed=EVAL_SEED, random_crop=False)
    total, frames = 0.0, 0
    for batch in held_out_loader(cfg, dataset):
        codes = batch["codes"][:, codebook]  # (B, T)
        masked = codes[batch["mask"]].numpy()
        total -= float(log_p[masked].sum())
        frames += len(masked)
    return {f"unigram_eval_cb{codebook}": total / frames if frames else math.nan, "masked_frames": frames,
            "train_frames": int(counts.sum() - size)}
