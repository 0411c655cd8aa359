"""Seeded Lloyd k-means for fitting codebooks, exact on a power-of-two grid (the same bits on every CPU).
"""

from __future__ import annotations

import math

import torch


def _assign(x: torch.Tensor, centroids: torch.Tensor, block: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of each row of x [N, D] among centroids [K, D] -> (index [N], squared dist [N])."""
    c_sq = centroids.pow(2).sum(1)  # (K,)
    ct = centroids.t().contiguous()  # (D, K)
    index, dist = [], []
    for xb in x.split(block):
        # |c|^2 - 2 x.c: |x|^2 is the same for every centroid, so it is added only to the minimum
        d = torch.addmm(c_sq, xb, ct, alpha=-2)  # (n, K)
        m, i = d.min(dim=1)
        index.append(i)
        dist.append((m + xb.pow(2).sum(1)).clamp_min(0))
    return torch.cat(index), torch.cat(dist)


GRID_BITS = 21  # exact k-means: values on a grid of 2^21 steps per sign, see exact_grid


def exact_grid(x: torch.Tensor) -> float:
    """A power-of-two step on which the values of x (float64) take at most 2^21 steps either side of 0.

    On such a grid k-means is exact in float64 whatever the CPU: a distance |c|^2 - 2 x.c over D = 128
    dimensions is at most 3 * 128 * 2^42 < 2^53 steps^2, so every product and every partial sum is an
    integer number of steps^2 that float64 holds exactly, in any summation order (BLAS blocking, AVX2 or
    AVX-512, threads). Ties are then real ties, broken alike everywhere (lowest index).
    """
    peak = float(x.abs().max())
    if peak == 0.0:  # nothing left to fit (fewer frames than codes): any fine grid will do
        return 2.0**-60
    return 2.0 ** (math.frexp(peak)[1] - GRID_BITS)  # peak < 2^e, so |x| / step < 2^21


def snap(x: torch.Tensor, step: float) -> torch.Tensor:
    """x rounded to the nearest multiple of ``step`` (a power of two: each operation is exact or one
    IEEE rounding, so the result is the same on every CPU)."""
    return torch.round(x / step) * step


def kmeans(
    x: torch.Tensor, k: int, iters: int, generator: torch.Generator, tol: float = 1e-3, step: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded Lloyd k-means of x [N, D] -> (centroids [k, D], assignment [N], cluster sizes [k]).

    Initialised from k distinct points chosen at random; a cluster left empty is re-seeded with one
    of the points farthest from its centroid, so all k codes stay in use when N >= k. Stops after
    ``iters`` updates, or earlier once at most a ``tol`` share of the points change cluster.
    Works in x's dtype. With ``step`` (x float64 on that grid, see ``exact_grid``) every centroid is kept
    on the grid too, so the result is the same bit for bit on every CPU (``make_local_weights``).
    """
    n, d = x.shape
    distinct = torch.unique(x, dim=0)  # sorted, so the choice below is deterministic
    perm = torch.randperm(len(distinct), generator=generator)
    # Copies of points get a tiny jitter (a few grid steps), so that no two centroids coincide: a point
    # alone in its cluster must have a next-nearest centroid other than its own (held_out_residual).
    jitter_scale = 4 * step if step is not None else float(x.std()) * 1e-3 + 1e-12

    def jittered(points: torch.Tensor) -> torch.Tensor:
        return points + torch.randn(points.shape, generator=generator, dtype=x.dtype) * jitter_scale

    if len(distinct) >= k:
        centroids = distinct[perm[:k]].clone()
    else:  # fewer distinct frames than codes: repeat them with a tiny jitter
        extra = distinct[torch.randint(len(distinct), (k - len(distinct),), generator=generator)]
        centroids = torch.cat([distinct[perm], jittered(extra)])
    if step is not None:
        centroids = snap(centroids, step)
    previous = None
    for _ in range(iters):
        assign, dist = _assign(x, centroids)
        if previous is not None and (assign != previous).sum() <= tol * n:
            break
        previous = assign
        counts = torch.bincount(assign, minlength=k)  # (k,)
        sums = torch.zeros(k, d, dtype=x.dtype).index_add_(0, assign, x)  # (k, D)
        centroids = torch.where((counts > 0)[:, None], sums / counts.clamp_min(1)[:, None], centroids)
        if step is not None:
            centroids = snap(centroids, step)
        empty = (counts == 0).nonzero().squeeze(1)
        if len(empty):
            far = dist.topk(min(len(empty), n)).indices
            centroids[empty[: len(far)]] = jittered(x[far])
            if step is not None:
                centroids = snap(centroids, step)
    assign, _ = _assign(x, centroids)
    return centroids, assign, torch.bincount(assign, minlength=k)


def held_out_residual(
    x: torch.Tensor, centroids: torch.Tensor, assign: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Residual [N, D] each row of x [N, D] would have had it not been part of the k-means fit.

    Subtracting the centroid that a frame itself helped fit leaves too small a residual (zero for a
    cluster of one), so on a small sample the next codebooks get fitted to zeros and the deep levels
    collapse. Without frame i its cluster's centroid is (n c - x_i) / (n - 1), so the residual is
    (x_i - c) n / (n - 1); a frame alone in its cluster falls to its next-nearest centroid instead.
    """
    n = counts[assign].to(x.dtype)[:, None]  # (N, 1)
    residual = (x - centroids[assign]) * n / (n - 1).clamp_min(1)  # (N, D)
    alone = (counts[assign] == 1).nonzero().squeeze(1)
    if len(alone):
        d = torch.addmm(centroids.pow(2).sum(1), x[alone], centroids.t(), alpha=-2)  # (n_alone, K)
        d[torch.arange(len(alone)), assign[alone]] = float("inf")
        residual[alone] = x[alone] - centroids[d.argmin(dim=1)]
    return residual
