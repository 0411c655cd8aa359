"""Linear probes, cross-validated over tracks, and their scores with bootstrap intervals over tracks.

A probe is one linear map of frozen features to logits, trained on CPU with full-batch L-BFGS (no
randomness: the weights start at zero) to minimise the mean loss per item plus l2/2 * ||W||^2:
multi-label binary cross-entropy summed over the pitches (pitch), softmax cross-entropy (key, instrument).
Dense features are standardised with the training items' mean and standard deviation; codes are one-hot
indices (the map is a sum of per-codebook embeddings, not standardised).

The protocol (``cross_validate``): the tracks are dealt into K folds (``probe_data.folds_of_tracks``);
for fold k the probe is trained on the other folds' tracks, so no segment of a held-out piece is ever
trained on. Within those, fold k+1 chooses the L2 penalty: a probe per value of ``L2_GRID`` (strongest
first, each warm-started from the last) is trained on the remaining folds and scored by its loss on
fold k+1; the chosen value is then refitted on all training folds. Every track is held out exactly once
and the out-of-fold predictions are scored together; intervals resample the tracks (``bootstrap``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from musiclm_stab.threads import one_thread

L2_GRID = (1e-1, 1e-2, 1e-3, 1e-4)  # strongest first: each fit starts from the previous solution
MAX_ITER = 50  # L-BFGS iterations per fit (warm-started: the scores move < 0.01 from 50 to 100)
BOOTSTRAP = 200  # resamples of the tracks for a 95% interval


@dataclass
class Task:
    """``kind``: "multilabel" (targets float [N, C]) or "multiclass" (targets int64 [N], C classes)."""

    name: str
    kind: str
    num_classes: int


class Probe:
    """logits = standardise(x) @ W + b (dense [N, D]) or sum_k W[x[:, k]] + b (codes, int64 [N, K])."""

    def __init__(self, dim: int, num_classes: int, codes: bool):
        self.codes = codes
        self.W = torch.zeros(dim, num_classes, requires_grad=True)
        self.b = torch.zeros(num_classes, requires_grad=True)
        self.mean: torch.Tensor | None = None
        self.std: torch.Tensor | None = None

    def standardise_on(self, x: torch.Tensor) -> None:
        if not self.codes and x.shape[1] == 0:  # no features: nothing to scale
            self.mean, self.std = x.new_zeros(0), x.new_ones(0)
        elif not self.codes:
            self.mean = x.mean(0)
            std = x.std(0, unbiased=False)
            floor = 1e-6 * float(std.max()) if std.numel() else 0.0  # constant dimensions are left unscaled
            self.std = torch.where(std > floor, std, torch.ones_like(std))

    def prepared(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.codes else (x - self.mean) / self.std

    def logits(self, prepared: torch.Tensor) -> torch.Tensor:
        if self.codes:
            return self.W[prepared].sum(1) + self.b
        return prepared @ self.W + self.b

    def loss(self, prepared: torch.Tensor, y: torch.Tensor, task: Task) -> torch.Tensor:
        """Mean data loss per item (without the penalty)."""
        z = self.logits(prepared)
        if task.kind == "multilabel":
            return F.binary_cross_entropy_with_logits(z, y, reduction="sum") / max(len(y), 1)
        return F.cross_entropy(z, y)

    def fit(self, prepared: torch.Tensor, y: torch.Tensor, task: Task, l2: float, max_iter: int = MAX_ITER) -> None:
        """Full-batch L-BFGS from the current weights."""
        opt = torch.optim.LBFGS([self.W, self.b], lr=1.0, max_iter=max_iter, history_size=20,
                                tolerance_grad=1e-6, tolerance_change=1e-9, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = self.loss(prepared, y, task) + 0.5 * l2 * self.W.square().sum()
            loss.backward()
            return loss

        opt.step(closure)
        if not all(torch.isfinite(p).all() for p in (self.W, self.b)):
            raise FloatingPointError(f"{task.name}: the probe's weights are not finite (l2={l2})")

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.prepared(x))


@one_thread()
def cross_validate(x: torch.Tensor, y: torch.Tensor, item_track: np.ndarray, folds: list[np.ndarray], task: Task,
                   codes_dim: int = 0, l2_grid: tuple[float, ...] = L2_GRID) -> tuple[torch.Tensor, list[float]]:
    """Out-of-fold logits [N, C] of every item and the L2 penalty chosen in each fold (module docstring).

    ``x``: features [N, D] (or codes [N, K]); ``y``: targets; ``item_track``: int [N] track of each item.
    ``l2_grid`` of one value: that penalty in every fold, no choosing (5x fewer fits with 4 folds).
    """
    if not l2_grid or any(not (v >= 0) for v in l2_grid):
        raise ValueError(f"l2_grid must hold penalties >= 0, got {l2_grid}")
    fold_of_track = np.empty(int(max(f.max() for f in folds)) + 1, dtype=np.int64)
    for k, f in enumerate(folds):
        fold_of_track[f] = k
    item_fold = fold_of_track[item_track]
    codes = codes_dim > 0
    dim = codes_dim if codes else x.shape[1]
    out = torch.zeros(len(y), task.num_classes)
    chosen = []
    for k in range(len(folds)):
        val = (k + 1) % len(folds)
        inner = torch.from_numpy((item_fold != k) & (item_fold != val))
        valid = torch.from_numpy(item_fold == val)
        train = torch.from_numpy(item_fold != k)
        test = torch.from_numpy(item_fold == k)
        if not test.any():
            continue
        probe = Probe(dim, task.num_classes, codes)
        best = l2_grid[0]
        if len(l2_grid) > 1:  # choose the penalty on fold k+1 (one given value needs no choice)
            probe.standardise_on(x[inner])
            xi, xv = probe.prepared(x[inner]), probe.prepared(x[valid])
            best_loss, best_state = math.inf, None
            for l2 in l2_grid:
                probe.fit(xi, y[inner], task, l2)
                with torch.no_grad():
                    loss = float(probe.loss(xv, y[valid], task)) if valid.any() else 0.0
                if loss < best_loss:
                    best, best_loss = l2, loss
                    best_state = (probe.W.detach().clone(), probe.b.detach().clone())
            with torch.no_grad():
                probe.W.copy_(best_state[0])
                probe.b.copy_(best_state[1])
        probe.standardise_on(x[train])
        probe.fit(probe.prepared(x[train]), y[train], task, best)
        out[test] = probe.predict(x[test])
        chosen.append(best)
    return out, chosen


# ---------------------------------------------------------------------------------------------- metrics


def average_precision(scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
                      order: torch.Tensor | None = None) -> torch.Tensor:
    """AP per column of [N, C] scores and 0/1 labels: the mean precision at the rank of each positive
    (columns with no positive give NaN). ``weights`` [N] counts each item that many times (a bootstrap
    resample; 0 leaves it out); ``order`` [N, C] is the descending argsort of ``scores`` if already known."""
    if order is None:
        order = torch.argsort(scores, dim=0, descending=True, stable=True)
    hits = torch.gather(labels.float(), 0, order)
    w = torch.ones_like(hits) if weights is None else weights.float()[order]
    positives = (w * hits).cumsum(0)
    precision = positives / w.cumsum(0).clamp_min(1e-12)
    total = positives[-1] if len(hits) else torch.zeros(hits.shape[1])
    return (precision * w * hits).sum(0) / total.where(total > 0, torch.tensor(float("nan")))


def pitch_metrics(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
                  order: torch.Tensor | None = None) -> dict[str, float]:
    """Frame-level multi-label scores: micro precision / recall / F1 at probability 0.5, and mAP (the mean
    AP over the pitches that are active in at least one of the frames scored). ``weights`` and ``order``
    as for ``average_precision``."""
    w = torch.ones(len(labels)) if weights is None else weights.float()
    pred = (logits > 0).float()  # sigmoid(z) > 0.5
    truth = labels.float()
    tp = float((w[:, None] * pred * truth).sum())
    fp, fn = float((w[:, None] * pred * (1 - truth)).sum()), float((w[:, None] * (1 - pred) * truth).sum())
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    present = ((w[:, None] * truth).sum(0) > 0).numpy()  # pitches with a positive among the frames scored
    ap = average_precision(logits, truth, w, order)[torch.from_numpy(present)]
    return {"map": float(ap.mean()) if len(ap) else math.nan, "f1": f1, "precision": precision, "recall": recall}


def mirex_key_score(pred: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """MIREX key score per item (keys 0-11 major, 12-23 minor by tonic): 1 same key, 0.5 the estimate a
    perfect fifth above in the same mode, 0.3 the relative key, 0.2 the parallel key, else 0."""
    pt, pm, tt, tm = pred % 12, pred // 12, truth % 12, truth // 12
    score = np.zeros(len(pred))
    score[(pm == tm) & ((pt - tt) % 12 == 7)] = 0.5
    score[(tm == 0) & (pm == 1) & ((pt - tt) % 12 == 9)] = 0.3  # major -> its relative minor
    score[(tm == 1) & (pm == 0) & ((pt - tt) % 12 == 3)] = 0.3  # minor -> its relative major
    score[(pt == tt) & (pm != tm)] = 0.2
    score[(pt == tt) & (pm == tm)] = 1.0
    return score


def class_metrics(logits: torch.Tensor, labels: torch.Tensor, item_track: np.ndarray, key: bool
                  ) -> dict[str, float]:
    """Segment accuracy (and MIREX score for keys); track accuracy from the summed log-probabilities of a
    track's segments."""
    pred = logits.argmax(1).numpy()
    truth = labels.numpy()
    out = {"accuracy": float((pred == truth).mean())}
    if key:
        out["mirex"] = float(mirex_key_score(pred, truth).mean())
    logp = torch.log_softmax(logits, 1)
    tracks = np.unique(item_track)
    hits = []
    for t in tracks:
        sel = torch.from_numpy(item_track == t)
        hits.append(int(logp[sel].sum(0).argmax()) == int(labels[sel][0]))
    out["track_accuracy"] = float(np.mean(hits))
    return out


def class_scorer(logits: torch.Tensor, labels: torch.Tensor, item_track: np.ndarray, key: bool
                 ) -> Callable[[np.ndarray, np.ndarray], dict[str, float]]:
    """``metric(items, groups)``: ``class_metrics(logits[items], labels[items], groups, key)`` where each
    group is the whole of one track of ``item_track`` (``bootstrap``'s resamples, or ``item_track`` itself),
    to the bit, from per-item hits and per-track predictions computed once: a resample only gathers them.
    (The per-row log-softmax and a track's summed rows are the same numbers whichever rows come along.)"""
    pred = logits.argmax(1).numpy()
    truth = labels.numpy()
    correct = pred == truth
    mirex = mirex_key_score(pred, truth) if key else None
    logp = torch.log_softmax(logits, 1)
    track_hit = np.zeros(int(item_track.max(initial=-1)) + 1, dtype=bool)
    for t in np.unique(item_track):
        sel = torch.from_numpy(item_track == t)
        track_hit[t] = int(logp[sel].sum(0).argmax()) == int(labels[sel][0])

    def metric(items: np.ndarray, groups: np.ndarray) -> dict[str, float]:
        out = {"accuracy": float(correct[items].mean())}
        if mirex is not None:
            out["mirex"] = float(mirex[items].mean())
        _, first = np.unique(groups, return_index=True)  # each group's track: that of its first item
        out["track_accuracy"] = float(np.mean(track_hit[item_track[items[first]]]))
        return out
    return metric


def bootstrap_draws(metric: Callable[[np.ndarray, np.ndarray], dict[str, float]], item_track: np.ndarray,
                    seed: int, resamples: int = BOOTSTRAP) -> dict[str, list[float]]:
    """Each metric on each of ``resamples`` resamplings of the tracks (with replacement), in draw order.
    ``metric(items, groups)`` scores the items given by index; ``groups`` [len(items)] tells the draws
    apart, so a track drawn twice counts as two tracks. The draws depend only on ``item_track`` and
    ``seed``: two metrics of the same items are resampled alike (``bootstrap_interval`` of their difference
    per draw is a paired interval)."""
    tracks = np.unique(item_track)
    items_of = {t: np.flatnonzero(item_track == t) for t in tracks}
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xB007]))
    values: dict[str, list[float]] = {}
    for _ in range(resamples):
        drawn = rng.choice(tracks, size=len(tracks), replace=True)
        items = np.concatenate([items_of[t] for t in drawn])
        groups = np.concatenate([np.full(len(items_of[t]), i) for i, t in enumerate(drawn)])
        for name, v in metric(items, groups).items():
            values.setdefault(name, []).append(v)
    return values


def bootstrap_interval(draws: list[float]) -> list[float]:
    """The 95% percentile interval [lo, hi] of a metric's resampled values (NaN draws left out)."""
    return [float(np.nanpercentile(draws, 2.5)), float(np.nanpercentile(draws, 97.5))]


def bootstrap(metric: Callable[[np.ndarray, np.ndarray], dict[str, float]], item_track: np.ndarray, seed: int,
              resamples: int = BOOTSTRAP) -> dict[str, list[float]]:
    """95% percentile intervals of each metric over ``resamples`` resamplings of the tracks
    (``bootstrap_draws``)."""
    return {name: bootstrap_interval(v) for name, v in bootstrap_draws(metric, item_track, seed, resamples).items()}
