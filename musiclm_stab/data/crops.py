"""Frame-aligned crops of tokenized segments: the held-out split by track, random (training) or centre
(evaluation) crops, and the epoch's permutation.

Everything random here is seeded from (seed, epoch, dataset index), so a batch is the same whatever the
number of loader workers, and a resumed run sees exactly the data an uninterrupted run would have seen.
``CropDataset`` indexes a saved (memory-mapped) dataset and is split across processes by accelerate's
sampler; ``data.streaming.StreamingCrops`` is the streamed counterpart.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from musiclm_stab.constants import FRAME_RATE, HOP_LENGTH


def example_key(text: str) -> int:
    """A stable 64-bit key of a string (a segment id, a track name): the same on every machine."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big")


def eval_tracks(tracks: list[str], fraction: float) -> set[str]:
    """The held-out tracks: the ``fraction`` of tracks (at least one, if there are two or more and
    fraction > 0) with the smallest hash of their id. Stable across runs and machines."""
    unique = sorted(set(tracks), key=example_key)
    if fraction <= 0 or len(unique) < 2:
        return set()
    n = min(len(unique) - 1, max(1, round(fraction * len(unique))))
    return set(unique[:n])


def split_indices(tracks: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """(train row indices, eval row indices), split by track so no track is on both sides."""
    held = eval_tracks(tracks, fraction)
    train = [i for i, t in enumerate(tracks) if t not in held]
    evals = [i for i, t in enumerate(tracks) if t in held]
    return train, evals


def seeded_rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]))


class CropDataset(Dataset):
    """Random (train) or fixed (eval) crops of ``crop_seconds`` from tokenized segments.

    Item: {"index": int, "pcm": float32 [S], "codes": int64 [K, T]} with S = 320 * T.
    Rows shorter than the crop are left out (``num_skipped`` says how many).
    """

    def __init__(self, hf_dataset, indices: list[int], crop_seconds: float, seed: int = 0, random_crop: bool = True):
        self.crop_frames = int(round(crop_seconds * FRAME_RATE))
        # the column read in one go: a datasets Column indexed row by row reads its table once per row
        frames = list(hf_dataset.select_columns(["num_frames"])["num_frames"])
        self.indices = [i for i in indices if frames[i] >= self.crop_frames]
        self.num_skipped = len(indices) - len(self.indices)
        self.ds = hf_dataset.select_columns(["pcm", "codes"]).with_format("numpy")
        self.seed, self.random_crop, self.epoch = seed, random_crop, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        row = self.ds[self.indices[i]]
        codes = row["codes"]
        if codes.dtype == object:  # ragged storage comes back as an array of arrays
            codes = np.stack(codes)
        seed = (self.seed, self.epoch) if self.random_crop else None
        return crop_item(self.indices[i], row["pcm"], codes, self.crop_frames, seed)


def crop_start(index: int, num_frames: int, crop_frames: int, seed: tuple[int, int] | None) -> int:
    """The first frame of a segment's crop: drawn from (seed, epoch, index) when ``seed`` = (seed, epoch)
    is given, else the centre crop's."""
    if seed is not None:
        return int(seeded_rng(*seed, index).integers(0, num_frames - crop_frames + 1))
    return (num_frames - crop_frames) // 2


def crop_item(index: int, pcm: np.ndarray, codes: np.ndarray, crop_frames: int, seed: tuple[int, int] | None,
              start: int | None = None) -> dict:
    """The item of a segment (pcm [S], codes [K, T]): a crop of ``crop_frames`` frames from ``start``
    (default ``crop_start``): {"index", "pcm": float32 [320 * crop_frames], "codes": int64 [K, crop_frames]}."""
    if start is None:
        start = crop_start(index, codes.shape[-1], crop_frames, seed)
    end = start + crop_frames
    pcm = np.array(pcm[start * HOP_LENGTH:end * HOP_LENGTH], dtype=np.float32)  # a copy: arrow buffers are read-only
    return {"index": index, "pcm": torch.from_numpy(pcm), "codes": torch.from_numpy(codes[:, start:end].astype(np.int64))}


class EpochSampler(Sampler[int]):
    """A permutation of range(n) seeded by (seed, epoch); ``set_epoch`` picks the epoch."""

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.n))
        return iter(seeded_rng(self.seed, self.epoch, 0x5A5A).permutation(self.n).tolist())
