"""The statistics of the study's claims, one run at a time, and the paired test over seeds that turns
them into verdicts (analysis/claims.py assembles the table).

Runs are sorted into the four configurations by their config (norm scheme, attention form, clip value)
and paired by ``train.seed``: in the study the runs of one seed share the data order (``data.order_seed``
unset, so it is ``train.seed``), so a paired difference between two configurations at one seed is not
moved by which batches came when. With W = the warmup steps and T = the run's steps (each run's config),
losses in bits, every statistic from each run's ``metrics.jsonl`` (as ``musiclm-stab plot`` reads it):

  early(c, s)   mean training loss over steps 1..2W (warmup and as long again: the study's "early")
  gnorm(c, s)   median gradient norm (before clipping) over the steps after W
  events(c, s)  loss-spike events: steps t > 20 with loss_t > K_SPIKE x the median of the 20 logged
                steps before t (runs of consecutive such steps are one event); recovered when within
                max(20, T/10) steps the loss is back below 1.1 x that median

A paired statistic d_s (one per seed, oriented so that d_s > 0 is what the claim says) is a ``Paired``:
its t = mean(d) / (sd(d) / sqrt(n)) and its verdict by the rule in analysis/claims.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from musiclm_stab.analysis.runs import RunMetrics

# The four configurations, in the study's legend order, with the short names of the table's columns.
ROLES = ("clip10", "clip1", "deepnorm", "relax")
ROLE_TITLES = {
    "clip10": "Pre-Norm, clip 10",
    "clip1": "Pre-Norm, clip 1",
    "deepnorm": "Post-Norm DeepNorm, clip 1",
    "relax": "Pre-Norm Attn. Relax, clip 1",
}
K_SPIKE = 1.5  # the study's codebook-0 spike is 9.2 / 5.8 = 1.59x its level: a spike of that size counts
SPIKE_WINDOW = 20  # logged steps of the running median
RECOVER_FACTOR = 1.1
# One-sided 5% points of Student's t by degrees of freedom (n seeds - 1).
T_CRIT = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}


def role_of(cfg: dict) -> str | None:
    """Which of the study's four configurations a run's config is (None: none of them)."""
    model, optim = cfg.get("model") or {}, cfg.get("optim") or {}
    scheme, attention = model.get("norm_scheme", "pre"), model.get("attention", "sdpa")
    clip = float(optim.get("clip_grad", 10.0))
    if model.get("qk_norm") or optim.get("clip_mode", "fixed") != "fixed":
        return None
    if scheme == "deepnorm" and attention != "relax" and clip == 1.0:
        return "deepnorm"
    if scheme == "pre" and attention == "relax" and clip == 1.0:
        return "relax"
    if scheme == "pre" and attention != "relax":
        return {10.0: "clip10", 1.0: "clip1"}.get(clip)
    return None


def run_seed(cfg: dict) -> int:
    return int((cfg.get("train") or {}).get("seed", 0))


def run_steps(cfg: dict) -> tuple[int, int]:
    """(W, T): warmup steps and max steps of a run, from its saved (resolved) config."""
    train, optim = cfg.get("train") or {}, cfg.get("optim") or {}
    total = int(train.get("max_steps", 100))
    warmup = optim.get("warmup_steps")
    if warmup is None:  # a config saved before warmup was resolved into it
        warmup = int(round(float(optim.get("warmup_share", 0.08)) * total))
    return int(warmup), total


# ---------------------------------------------------------------------------------------------------
# Per-run statistics


def early_loss(run: RunMetrics, metric: str = "loss") -> float:
    """Mean of ``metric`` over steps 1..2W (NaN when the run logged none there)."""
    warmup, _ = run_steps(run.config)
    series = run.metric(metric)
    if series is None:
        return math.nan
    steps, values = series
    sel = (steps >= 1) & (steps <= max(1, 2 * warmup))
    return float(values[sel].mean()) if sel.any() else math.nan


def median_grad_norm(run: RunMetrics, after_warmup: bool = True) -> float:
    """Median gradient norm over the steps after W (``after_warmup``) or up to W."""
    warmup, _ = run_steps(run.config)
    series = run.metric("grad_norm")
    if series is None:
        return math.nan
    steps, values = series
    sel = steps > warmup if after_warmup else steps <= warmup
    return float(np.median(values[sel])) if sel.any() else math.nan


def peak_grad_norm(run: RunMetrics) -> tuple[float, int | None]:
    """(largest gradient norm after step W/2, its step): the study's peaks sit around the end of warmup."""
    warmup, _ = run_steps(run.config)
    series = run.metric("grad_norm")
    if series is None:
        return math.nan, None
    steps, values = series
    sel = steps > warmup // 2
    if not sel.any():
        return math.nan, None
    i = int(np.argmax(values[sel]))
    return float(values[sel][i]), int(steps[sel][i])


@dataclass
class SpikeEvent:
    step: int  # first step above the threshold
    peak: float  # largest value in the event
    ratio: float  # peak / running median before it
    recovered_at: int | None  # first step back below RECOVER_FACTOR x the median, None if not within reach


def spike_events(run: RunMetrics, metric: str = "loss", k: float = K_SPIKE) -> list[SpikeEvent]:
    """Loss-spike events of ``metric`` (see the module docstring)."""
    _, total = run_steps(run.config)
    series = run.metric(metric)
    if series is None:
        return []
    steps, values = series
    reach = max(SPIKE_WINDOW, total // 10)
    events: list[SpikeEvent] = []
    i = SPIKE_WINDOW
    while i < len(values):
        base = float(np.median(values[i - SPIKE_WINDOW:i]))
        if values[i] > k * base:
            j = i
            while j + 1 < len(values) and values[j + 1] > k * base:
                j += 1
            peak = float(values[i:j + 1].max())
            back = np.nonzero((values[j + 1:] < RECOVER_FACTOR * base) & (steps[j + 1:] <= steps[j] + reach))[0]
            recovered = int(steps[j + 1 + back[0]]) if len(back) else None
            events.append(SpikeEvent(int(steps[i]), peak, peak / base, recovered))
            i = j + 1 + SPIKE_WINDOW  # the next event is judged against a window after this one
        else:
            i += 1
    return events


def final_eval(run: RunMetrics, metric: str = "eval/loss") -> float:
    """The last held-out value of ``metric`` (NaN without train.eval_every)."""
    series = run.metric(metric)
    return float(series[1][-1]) if series is not None else math.nan


def probe_score(run: RunMetrics) -> float:
    """Best-layer pitch mAP of the run's linear probes (``musiclm-stab probe``), NaN when not probed.

    The probe column: reads RUN/probe/probe.json when the run has been probed.
    """
    from musiclm_stab.analysis.probe import best_layer, read_probe  # here: the probe stack is heavier

    path = Path(run.path) / "probe" / "probe.json"
    if not path.is_file():
        return math.nan
    score, _ = best_layer(read_probe(run.path), task="pitch", features="model")
    return float(score)


# ---------------------------------------------------------------------------------------------------
# Paired tests and verdicts


@dataclass
class Paired:
    """A paired statistic: one difference per seed, oriented so that > 0 is what the claim says."""

    diffs: dict[int, float]  # seed -> d_s

    @property
    def values(self) -> np.ndarray:
        return np.array([v for v in self.diffs.values() if math.isfinite(v)])

    @property
    def t(self) -> float:
        d = self.values
        if len(d) < 2:
            return math.nan
        sd = float(d.std(ddof=1))
        if sd == 0.0:
            return math.copysign(math.inf, float(d.mean())) if d.mean() else math.nan
        return float(d.mean()) / (sd / math.sqrt(len(d)))

    def verdict(self) -> str:
        d = self.values
        crit = T_CRIT.get(len(d) - 1, 1.8)
        if len(d) < 2:
            return "inconclusive"
        if (d > 0).all() and self.t >= crit:
            return "reproduced"
        if (d < 0).all() and self.t <= -crit:
            return "refuted"
        return "inconclusive"

    def text(self, fmt: str = "{:+.3g}") -> str:
        d = self.values
        if not len(d):
            return "n/a"
        per_seed = ", ".join(fmt.format(v) for v in d)
        return f"mean {fmt.format(float(d.mean()))} (seeds: {per_seed}; t = {self.t:.2f}, n = {len(d)})"
