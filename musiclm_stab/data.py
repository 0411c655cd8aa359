"""Training data: tokenized segments -> frame-aligned random crops -> batches with noise mixup and masks.

Everything random here is seeded from (seed, epoch, dataset indices), so a batch is the same whatever the
number of loader workers, and a resumed run sees exactly the data an uninterrupted run would have seen.

Two readers: ``CropDataset`` indexes a saved (memory-mapped) dataset and is split across processes by
accelerate's sampler; ``StreamingCrops`` reads a ``datasets.IterableDataset`` in one pass per epoch and
does the split across processes itself (see its docstring for the rule and what it guarantees).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from musiclm_stab import FRAME_RATE, HOP_LENGTH, SAMPLE_RATE
from musiclm_stab.config import DataConfig, ModelConfig
from musiclm_stab.masking import span_mask


def _str_key(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big")


def eval_tracks(tracks: list[str], fraction: float) -> set[str]:
    """The held-out tracks: the ``fraction`` of tracks (at least one, if there are two or more and
    fraction > 0) with the smallest hash of their id. Stable across runs and machines."""
    unique = sorted(set(tracks), key=_str_key)
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


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]))


class CropDataset(Dataset):
    """Random (train) or fixed (eval) crops of ``crop_seconds`` from tokenized segments.

    Item: {"index": int, "pcm": float32 [S], "codes": int64 [K, T]} with S = 320 * T.
    Rows shorter than the crop are left out (``num_skipped`` says how many).
    """

    def __init__(self, hf_dataset, indices: list[int], crop_seconds: float, seed: int = 0, random_crop: bool = True):
        self.crop_frames = int(round(crop_seconds * FRAME_RATE))
        frames = hf_dataset.select_columns(["num_frames"])["num_frames"]
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


def crop_item(index: int, pcm: np.ndarray, codes: np.ndarray, crop_frames: int, seed: tuple[int, int] | None) -> dict:
    """The item of a segment: a crop of ``crop_frames`` frames, at a random start drawn from
    (seed, epoch, index) when ``seed`` = (seed, epoch) is given, else the centre one."""
    T = codes.shape[-1]
    if seed is not None:
        start = int(_rng(*seed, index).integers(0, T - crop_frames + 1))
    else:
        start = (T - crop_frames) // 2
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
        return iter(_rng(self.seed, self.epoch, 0x5A5A).permutation(self.n).tolist())


class StreamingCrops(IterableDataset):
    """Random crops from a streamed tokenized dataset; yields this process's micro-batches (lists of items,
    as CropDataset makes them) of one epoch. Use with ``DataLoader(batch_size=None, collate_fn=Collator)``.

    The rule: an epoch is one pass over the stream (in file order, or through a seeded shuffle buffer of
    ``shuffle_buffer`` rows, 0 = no shuffle). Its training examples (rows of held-out tracks and rows
    shorter than the crop left out) are numbered k = 0, 1, ...; each run of ``batch_size * world_size``
    consecutive examples is one global batch, of which process ``rank`` takes the ``rank``-th
    ``batch_size`` examples; a last, incomplete global batch is dropped. So the processes read disjoint
    examples, together all of the epoch's but that remainder, and a global batch holds the same examples
    at any world size. Every process scans the whole stream in the same order and decodes only its own
    rows. Loader workers take every ``num_workers``-th micro-batch, so the order does not depend on them.

    The held-out tracks are those of ``split_indices`` on the same rows, found by a scan of the ``track``
    and ``num_frames`` columns at construction, which also counts the micro-batches of an epoch
    (``len``). Crops are seeded by (seed, epoch, example), the example being a hash of its ``id``: the
    same at any world size. ``skip`` micro-batches at the start of the epoch are passed over without
    decoding (exact resume).
    """

    def __init__(self, stream, eval_fraction: float, crop_seconds: float, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle_buffer: int = 0):
        self.crop_frames = int(round(crop_seconds * FRAME_RATE))
        self.stream = stream.with_format("arrow")
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.shuffle_buffer, self.epoch, self.skip = seed, shuffle_buffer, 0, 0
        tracks, frames = [], []
        for table in self.stream.select_columns(["track", "num_frames"]).iter(batch_size=1024):
            tracks += table.column("track").to_pylist()
            frames += table.column("num_frames").to_pylist()
        self.held_out = eval_tracks(tracks, eval_fraction)
        train = [n for t, n in zip(tracks, frames) if t not in self.held_out]
        self.num_examples = sum(n >= self.crop_frames for n in train)
        self.num_skipped = len(train) - self.num_examples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_examples // (self.batch_size * self.world_size)

    def __iter__(self):
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        stream = self.stream
        if self.shuffle_buffer:
            stream = stream.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
            stream.set_epoch(self.epoch)
        per_global, num_batches, k, mine = self.batch_size * self.world_size, len(self), 0, []
        for table in stream.iter(batch_size=64):
            tracks, frames = table.column("track").to_pylist(), table.column("num_frames").to_pylist()
            for row, (track, n) in enumerate(zip(tracks, frames)):
                if track in self.held_out or n < self.crop_frames:
                    continue
                batch, pos = divmod(k, per_global)
                k += 1
                if batch >= num_batches:
                    return
                if (pos // self.batch_size != self.rank or batch < self.skip
                        or (batch - self.skip) % num_workers != worker_id):  # the loader reads worker 0 first
                    continue
                mine.append(self._item(table, row))
                if len(mine) == self.batch_size:
                    yield mine
                    mine = []

    def _item(self, table, row: int) -> dict:
        pcm = table.column("pcm")[row].values.to_numpy(zero_copy_only=False)
        rows = table.column("codes")[row].values  # K lists of T codes
        codes = rows.flatten().to_numpy(zero_copy_only=False).reshape(len(rows), -1)
        index = _str_key(table.column("id")[row].as_py())
        return crop_item(index, pcm, codes, self.crop_frames, (self.seed, self.epoch))


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
        wav = noise_mixup(clean, self.data, _rng(self.seed, self.epoch, 0xBA7C, *indices)) if self.mixup else clean
        # Masks per example, seeded by its index: the same whatever the batch split across processes.
        masks = [span_mask(1, codes.shape[-1], self.model.mask_prob, self.model.mask_length,
                           torch.Generator().manual_seed(int(_rng(self.seed, self.epoch, 0x3A5C, i).integers(2**62))))
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
