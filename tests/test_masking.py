"""Span masking statistics."""

import torch

from musiclm_stab.data.masking import expected_mask_fraction, span_mask


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
