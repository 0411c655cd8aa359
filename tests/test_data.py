"""Training data: track split, frame-aligned crops, seeded batches, noise mixup on the input only."""

import json

import datasets
import numpy as np
import pytest
import torch

from musiclm_stab.config import DataConfig, ModelConfig
from musiclm_stab.data import (
    Collator,
    CropDataset,
    EpochSampler,
    StreamingCrops,
    eval_tracks,
    example_key,
    noise_mixup,
    split_indices,
)
from musiclm_stab.data.tokenized import (
    DamagedData,
    UncheckedData,
    codes_sha256,
    load_tokenized,
    sha256_of_codes,
)


@pytest.fixture(scope="module")
def hf(tokenized_dataset):
    return load_tokenized(tokenized_dataset)[0]


def test_split_is_by_track_and_stable():
    """Held-out tracks are disjoint from training tracks, stable, and at least one when there are two+."""
    tracks = [f"t{i // 3}" for i in range(30)]  # 10 tracks, 3 segments each
    train, held = split_indices(tracks, 0.2)
    assert {tracks[i] for i in train}.isdisjoint({tracks[i] for i in held})
    assert len({tracks[i] for i in held}) == 2 and len(train) + len(held) == 30
    assert split_indices(tracks, 0.2) == (train, held)
    assert len(eval_tracks(["a", "b"], 0.01)) == 1 and eval_tracks(["a"], 0.5) == set()


def test_crops_are_frame_aligned(hf):
    """A crop's PCM is exactly the samples of its code frames: S = 320 * T at the same offset."""
    ds = CropDataset(hf, list(range(len(hf))), crop_seconds=2.0, seed=3)
    item = ds[0]
    row = hf.with_format("numpy")[item["index"]]
    codes = np.stack(row["codes"]) if row["codes"].dtype == object else row["codes"]
    T = item["codes"].shape[-1]
    assert T == 150 and item["pcm"].shape[0] == 320 * T
    # locate the crop by its codes, then check the PCM comes from the same frames
    starts = [s for s in range(codes.shape[1] - T + 1) if np.array_equal(codes[:, s:s + T], item["codes"].numpy())]
    assert starts, "crop codes not found in the segment"
    s = starts[0]
    np.testing.assert_array_equal(item["pcm"].numpy(), row["pcm"][s * 320:(s + T) * 320])


def test_crops_seeded_by_epoch_and_index(hf):
    """Same (seed, epoch, index) gives the same crop; another epoch a different one; eval crops are fixed."""
    ds = CropDataset(hf, list(range(len(hf))), crop_seconds=2.0, seed=0)
    a = ds[0]["pcm"]
    assert torch.equal(a, ds[0]["pcm"])
    ds.set_epoch(1)
    assert not torch.equal(a, ds[0]["pcm"])
    fixed = CropDataset(hf, list(range(len(hf))), crop_seconds=2.0, random_crop=False)
    assert torch.equal(fixed[0]["pcm"], fixed[0]["pcm"])


def test_short_segments_left_out(hf):
    """Segments shorter than the crop are skipped and counted."""
    ds = CropDataset(hf, list(range(len(hf))), crop_seconds=5.0)
    assert ds.num_skipped == 3 and len(ds) == 3  # the three 2 s tails


def test_sampler_permutation_per_epoch():
    """The sampler is a seeded permutation, different per epoch, identical for the same epoch."""
    s = EpochSampler(50, seed=1)
    e0 = list(s)
    assert sorted(e0) == list(range(50)) and e0 == list(s)
    s.set_epoch(1)
    assert list(s) != e0


@pytest.mark.parametrize("mode", ["mert", "rms"])
def test_mixup_changes_input_only(mode):
    """Mixup adds segments of other clips to the input; the clean crop (targets) is untouched."""
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(4, 24000 * 3, generator=g)
    before = clean.clone()
    mixed = noise_mixup(clean, DataConfig(mixup_prob=1.0, mixup_mode=mode).resolved("tiny"), np.random.default_rng(0))
    assert torch.equal(clean, before)
    changed = (mixed != clean).float().mean(-1)
    assert torch.all(changed > 0.1) and torch.all(changed < 1.0)  # 0.5-1.5 s segments of 3 s clips
    none = noise_mixup(clean, DataConfig(mixup_prob=0.0, mixup_mode=mode).resolved("tiny"), np.random.default_rng(0))
    assert torch.equal(none, clean)


def test_rms_mixup_segments_come_from_other_clips():
    """mixup_mode=rms: with constant clips, each mixed clip gains only other clips' values scaled to its RMS."""
    clean = torch.stack([torch.full((24000 * 3,), float(v)) for v in (1.0, 2.0)])
    cfg = DataConfig(mixup_prob=1.0, mixup_mode="rms", mixup_gain_db=(0.0, 0.0)).resolved("tiny")
    mixed = noise_mixup(clean, cfg, np.random.default_rng(1))
    # gain 0 dB relative to the clip's RMS: a segment from clip j, scaled to clip i's level, adds clip i's level
    assert set(torch.unique(mixed[0]).tolist()) <= {1.0, 2.0, 3.0, 4.0}
    assert (mixed[0] > 1.0).any()


def test_mert_mixup_is_the_default_and_adds_raw_audio():
    """The default mixup is MERT's: with constant clips 1 and 2, clip 0 gains clip 1's samples as they are
    (volume 1.0, no level matching): 1 + 2k for k overlapping segments, never 1 + 1."""
    assert DataConfig().mixup_mode == "mert"
    clean = torch.stack([torch.full((24000 * 3,), float(v)) for v in (1.0, 2.0)])
    mixed = noise_mixup(clean, DataConfig(mixup_prob=1.0).resolved("tiny"), np.random.default_rng(1))
    assert set(torch.unique(mixed[0]).tolist()) <= {1.0, 3.0, 5.0, 7.0} and (mixed[0] > 1.0).any()
    assert set(torch.unique(mixed[1]).tolist()) <= {2.0, 3.0, 4.0, 5.0} and (mixed[1] > 2.0).any()


def test_mert_mixup_segments_are_pool_slices_that_may_span_two_clips():
    """mert mixup: each added segment is exactly a slice of the other clips joined end to end (the input
    only), of a whole number of samples in [min, max]; some slices straddle the boundary of two clips."""
    B, S = 3, 24000  # 1 s clips; segments 0.25-0.5 s, one per clip
    clean = (torch.arange(B * S, dtype=torch.float32) + 1).view(B, S)  # every sample value unique, exact
    cfg = DataConfig(mixup_prob=1.0, mixup_max_segments=1, mixup_min_seconds=0.25, mixup_max_seconds=0.5)
    straddling = 0
    for seed in range(20):
        mixed = noise_mixup(clean, cfg, np.random.default_rng(seed))
        for i in range(B):
            pool = torch.cat([clean[:i], clean[i + 1:]]).flatten()
            diff = mixed[i] - clean[i]
            where = diff.nonzero().flatten()
            dst, length = int(where[0]), len(where)
            assert int(where[-1]) - dst + 1 == length and 6000 <= length <= 12000  # one contiguous segment
            src = int((pool == diff[dst]).nonzero())  # its start in the pool (values are unique)
            assert torch.equal(diff[dst:dst + length], pool[src:src + length])  # added as is
            straddling += src < S < src + length
    assert straddling > 0  # ~1/5 of the segments: starts within a segment's length of the boundary


def test_collator_batches_are_seeded(hf):
    """A batch depends only on (seed, epoch, indices): same inputs, same wav and masks."""
    ds = CropDataset(hf, list(range(len(hf))), crop_seconds=2.0)
    col = Collator(DataConfig(mixup_prob=1.0), ModelConfig().resolved(), seed=5)
    items = [ds[0], ds[1]]
    a, b = col(items), col(items)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["mask"].shape == (2, 150) and a["codes"].shape == (2, 8, 150)
    assert not torch.equal(a["wav"], a["clean_wav"])
    col.set_epoch(1)
    assert not torch.equal(col(items)["mask"], a["mask"])


def _epoch(ds, epoch: int = 0, skip: int = 0, workers: int = 0) -> list[list[dict]]:
    ds.set_epoch(epoch)
    ds.skip = skip
    return list(torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=list, num_workers=workers))


def test_streaming_processes_read_disjoint_examples_covering_the_epoch(tokenized_dataset, hf):
    """On a stream, 2 processes (rank given explicitly) read disjoint examples that together are the epoch's
    training examples (held-out tracks and too-short rows left out, the split of split_indices); each
    global batch holds the examples of 1 process's batch, with the same crops; an epoch is reproducible,
    the next one shuffled differently; skip resumes mid-epoch; loader workers change nothing."""
    stream, _ = load_tokenized(tokenized_dataset, streaming=True)
    train_idx, _ = split_indices(hf["track"], 0.3)
    expected = {example_key(hf[i]["id"]) for i in train_idx}  # 2 tracks x (10 s + 2 s), all >= the 2 s crop
    kw = dict(eval_fraction=0.3, crop_seconds=2.0, seed=4, shuffle_buffer=3)
    one = StreamingCrops(stream, batch_size=2, **kw)
    ranks = [StreamingCrops(stream, batch_size=1, rank=r, world_size=2, **kw) for r in range(2)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 2 and one.num_examples == 4

    whole = _epoch(one)
    parts = [_epoch(d) for d in ranks]
    seen = [[it["index"] for b in p for it in b] for p in parts]
    assert set(seen[0]).isdisjoint(seen[1]) and set(seen[0]) | set(seen[1]) == expected
    for g, batch in enumerate(whole):  # global batch g = rank 0's g-th micro-batch + rank 1's
        split = parts[0][g] + parts[1][g]
        assert [it["index"] for it in batch] == [it["index"] for it in split]
        assert all(torch.equal(a["pcm"], b["pcm"]) and torch.equal(a["codes"], b["codes"]) for a, b in zip(batch, split))

    again = _epoch(ranks[0])
    assert all(torch.equal(a["pcm"], b["pcm"]) for x, y in zip(parts[0], again) for a, b in zip(x, y))
    order = [it["index"] for b in whole for it in b]
    later = [it["index"] for b in _epoch(one, epoch=1) for it in b]
    assert sorted(later) == sorted(order) and later != order
    tail = _epoch(ranks[1], skip=1)
    assert len(tail) == 1 and torch.equal(tail[0][0]["pcm"], parts[1][1][0]["pcm"])
    by_workers = _epoch(one, workers=2)
    assert [[it["index"] for it in b] for b in by_workers] == [[it["index"] for it in b] for b in whole]
    single = StreamingCrops(stream, batch_size=1, **kw)  # 4 micro-batches: resume after 1 with 2 workers
    order = [[it["index"] for it in b] for b in _epoch(single)]
    assert [[it["index"] for it in b] for b in _epoch(single, skip=1, workers=2)] == order[1:]
    assert [[it["index"] for it in b] for b in _epoch(single, skip=3, workers=2)] == order[3:]

    # 6 examples, global batches of 2 x 2: one batch, the remainder dropped on both processes alike
    ranks = [StreamingCrops(stream, 0.0, 2.0, batch_size=2, rank=r, world_size=2) for r in range(2)]
    assert [len(d) for d in ranks] == [1, 1] and [len(_epoch(d)) for d in ranks] == [1, 1]


@pytest.mark.filterwarnings(f"ignore::{UncheckedData.__module__}.{UncheckedData.__name__}")  # no part hashes
def test_codes_sha256_sees_one_code_and_the_shape(tokenized_dataset, hf, tmp_path):
    """The study's record of its data: the same codes in another folder layout hash the same; one code
    changed by one, or a row's codes in another shape (the same bytes in the same order), do not (such a
    row does not load: its shape disagrees with num_frames and the codebook count)."""

    info = json.loads((tokenized_dataset / "tokenizer.json").read_text())
    info.pop("parts")  # folders written by save_to_disk are read through their state.json

    def saved(name, table):
        out = tmp_path / name
        datasets.Dataset.from_dict(table, features=hf.features).save_to_disk(out)
        (out / "tokenizer.json").write_text(json.dumps(info))
        return out

    table = hf.to_dict()
    reference = codes_sha256(tokenized_dataset)
    assert codes_sha256(saved("same", table)) == reference
    one_code = json.loads(json.dumps(table))
    one_code["codes"][len(hf) // 2][3][7] = (one_code["codes"][len(hf) // 2][3][7] + 1) % 1024
    assert codes_sha256(saved("one_code", one_code)) != reference
    reshaped = json.loads(json.dumps(table))  # row 0's (K, T) codes as (K / 2, 2 T): the same bytes in order
    rows = np.asarray(reshaped["codes"][0])
    reshaped["codes"][0] = rows.reshape(rows.shape[0] // 2, -1).tolist()
    assert sha256_of_codes(zip(reshaped["track"], reshaped["codes"])) != reference
    assert sha256_of_codes(zip(table["track"], table["codes"])) == reference
    with pytest.raises(DamagedData, match="row 0 has codes of 4 codebooks, not 8"):
        load_tokenized(saved("reshaped", reshaped))
