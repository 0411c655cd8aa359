"""Span masking statistics, and fairseq's trim of a batch's masks to one count (require_same_masks)."""

import numpy as np
import pytest
import torch

from musiclm_stab.config import DataConfig, ModelConfig
from musiclm_stab.data.collate import Collator
from musiclm_stab.data.masking import expected_mask_fraction, same_mask_count, span_mask


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors on shared cores: intra-op threads only add overhead (7x here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_masked_fraction_matches_exact_expectation():
    """The empirical masked fraction equals the exact expectation of the configured p and span."""
    g = torch.Generator().manual_seed(0)
    m = span_mask(4000, 375, 0.8, 5, g)
    expected = expected_mask_fraction(375, 0.8, 5)
    assert abs(m.float().mean().item() - expected) < 0.005
    assert 0.5 < expected < 0.8  # overlapping spans: below mask_prob, as in HuBERT


def test_spans_have_configured_length():
    """With few starts, masked runs are exactly one span long (multiples when spans touch)."""
    g = torch.Generator().manual_seed(1)
    m = span_mask(500, 400, 0.02, 7, g)
    runs = []
    for row in m:
        x = torch.cat([torch.tensor([False]), row, torch.tensor([False])]).int()
        d = torch.diff(x)
        starts, ends = (d == 1).nonzero().flatten(), (d == -1).nonzero().flatten()
        runs += (ends - starts).tolist()
    assert runs and min(runs) >= 7
    assert sum(r == 7 for r in runs) / len(runs) > 0.9


def test_masks_reproducible_from_seed():
    """The same generator seed gives the same mask; another seed a different one."""
    a = span_mask(3, 100, 0.8, 5, torch.Generator().manual_seed(5))
    b = span_mask(3, 100, 0.8, 5, torch.Generator().manual_seed(5))
    c = span_mask(3, 100, 0.8, 5, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---------------------------------------------------------------------------------------------------
# fairseq's require_same_masks (model.require_same_masks, on by default)

FAIRSEQ_SHARE_B8_T375 = 0.5483  # fairseq's algorithm (fairseq_masks below), 20,000 batches: s.e. 1e-4


def fairseq_masks(batch: int, frames: int, rng: np.random.Generator, mask_prob=0.8, span=5, min_masks=2):
    """fairseq's compute_mask_indices as MERT calls it (static spans, overlap allowed, min_masks 2,
    require_same_masks), written independently from its description: per row n = max(2, int(p T / L + u))
    starts from range(T - L), the union of the spans; then every row keeps a random subset of the smallest
    row's size."""
    rows = []
    for _ in range(batch):
        n = max(min_masks, int(mask_prob * frames / span + rng.random()))
        starts = rng.choice(frames - span, n, replace=False)
        rows.append(np.unique((starts[:, None] + np.arange(span)).ravel()))
    target = min(len(r) for r in rows)
    mask = np.zeros((batch, frames), dtype=bool)
    for b, r in enumerate(rows):
        mask[b, rng.choice(r, target, replace=False)] = True
    return mask


def _items(first: int, batch: int, frames: int) -> list[dict]:
    return [{"index": first + i, "pcm": torch.zeros(320 * frames), "codes": torch.zeros(8, frames, dtype=torch.long)}
            for i in range(batch)]


def test_masked_share_at_batch_8_is_fairseqs():
    """At batch 8, T = 375 the Collator's masks (trimmed to one count per batch) cover fairseq's share,
    0.548, not the untrimmed 0.583; every row of a batch has the same count."""
    # 400 batches: standard error of the mean share ~0.0008 (measured sd of batch shares 0.015); margin
    # 0.006 is > 7 errors, and 0.035 from the untrimmed share. Measured over 2000 batches: 0.5482.
    col = Collator(DataConfig(), ModelConfig(), seed=0, mixup=False)
    assert col.model.require_same_masks  # the default
    shares = []
    for b in range(400):
        mask = col(_items(8 * b, 8, 375))["mask"]
        assert len(set(mask.sum(-1).tolist())) == 1
        shares.append(mask.float().mean().item())
    assert abs(np.mean(shares) - FAIRSEQ_SHARE_B8_T375) < 0.006
    ref = np.mean([fairseq_masks(8, 375, np.random.default_rng(b)).mean() for b in range(400)])
    assert abs(ref - FAIRSEQ_SHARE_B8_T375) < 0.006  # the reference algorithm, run here, agrees
    untrimmed = Collator(DataConfig(), ModelConfig(require_same_masks=False), seed=0, mixup=False)
    plain = np.mean([untrimmed(_items(8 * b, 8, 375))["mask"].float().mean().item() for b in range(100)])
    assert abs(plain - expected_mask_fraction(375, 0.8, 5)) < 0.006  # 0.5825 without the trim


def test_trim_unmasks_single_frames_of_the_drawn_spans_reproducibly():
    """The trim only unmasks (a subset of each row's spans stays masked), the smallest row is untouched,
    and the batch is the same on every call (seeded by its examples), different for other examples."""
    items = _items(100, 8, 375)
    col = Collator(DataConfig(), ModelConfig(), seed=3, mixup=False)
    untrimmed = Collator(DataConfig(), ModelConfig(require_same_masks=False), seed=3, mixup=False)(items)["mask"]
    mask = col(items)["mask"]
    assert torch.equal(mask, col(items)["mask"])
    assert not (mask & ~untrimmed).any()  # nothing newly masked
    counts = untrimmed.sum(-1)
    assert torch.equal(mask[counts.argmin()], untrimmed[counts.argmin()])
    assert (mask.sum(-1) == counts.min()).all() and counts.max() > counts.min()
    assert not torch.equal(mask, col(_items(200, 8, 375))["mask"])
    direct = same_mask_count(untrimmed, torch.Generator().manual_seed(0))
    assert torch.equal(direct.sum(-1), mask.sum(-1)) and not (direct & ~untrimmed).any()
