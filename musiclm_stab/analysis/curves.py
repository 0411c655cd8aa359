"""What a figure draws, read from run directories: runs grouped into lines by legend text (a configuration's
failed runs apart from its healthy ones, by kind: analysis/failures.py), each line's curve (as logged;
window means as fairseq logs them, one value per ``window`` steps, or the window's last value for the fp16
loss scale, as fairseq logs that; or TensorBoard's debiased EMA) and, for the seeds of one configuration, the
band over seeds; the metrics derived when read (the largest attention logit over layers); and robust y
limits that a single outlier does not set and that keep every curve's start on the axis."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from musiclm_stab.analysis.failures import KINDS, STALL_MARGIN, Failure, failure
from musiclm_stab.analysis.runs import RunMetrics, plot_warning

MAX_LOGIT = "diag/max_attn_logit/max"  # derived when read: the largest of the per-layer values at a step
LAYER_LOGIT = re.compile(r"^diag/max_attn_logit/layer(\d+)$")


def ema(values: np.ndarray, smooth: float) -> np.ndarray:
    """Exponential moving average, debiased like TensorBoard's (the first point is not pulled to 0).

    ``smooth`` in [0, 1): 0 returns the values unchanged, 0.9 averages over ~10 logged points.
    """
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    values = np.asarray(values, dtype=np.float64)
    if smooth == 0.0:
        return values.copy()
    out = np.empty_like(values)
    acc = weight = 0.0
    for i, v in enumerate(values):
        acc = smooth * acc + (1.0 - smooth) * v
        weight = smooth * weight + (1.0 - smooth)
        out[i] = acc / weight
    return out


def window_means(steps: np.ndarray, values: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Means of the logged values over consecutive windows of ``window`` steps, as fairseq logs a run (one
    row per ``log_interval`` updates, the mean over them): window k covers steps (k-1)W+1 .. kW and is
    placed at its last logged step. ``window`` <= 1 returns the values as they are."""
    steps, values = np.asarray(steps), np.asarray(values, dtype=np.float64)
    if window <= 1 or not len(steps):
        return steps.copy(), values.copy()
    bins = (steps - 1) // window
    edges = np.flatnonzero(np.diff(bins)) + 1  # steps are sorted: each window is one contiguous run
    starts = np.concatenate([[0], edges])
    sums = np.add.reduceat(values, starts)
    counts = np.diff(np.concatenate([starts, [len(values)]]))
    ends = np.concatenate([edges, [len(values)]]) - 1
    return steps[ends], sums / counts


def window_last(steps: np.ndarray, values: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The last logged value of each window of ``window`` steps (windows as ``window_means``), at its last
    logged step: how fairseq logs its fp16 loss scale (``log_scalar("loss_scale", ..., weight=0)``: a meter
    of weight 0 reports its latest value, not a mean). ``window`` <= 1 returns the values as they are."""
    steps, values = np.asarray(steps), np.asarray(values, dtype=np.float64)
    if window <= 1 or not len(steps):
        return steps.copy(), values.copy()
    bins = (steps - 1) // window
    ends = np.concatenate([np.flatnonzero(np.diff(bins)), [len(steps) - 1]])
    return steps[ends], values[ends]


WINDOW_REDUCE = {"mean": window_means, "last": window_last}


def windowed(steps: np.ndarray, values: np.ndarray, window: int, reduce: str = "mean"
             ) -> tuple[np.ndarray, np.ndarray]:
    """A run's curve with ``window`` > 1: its first logged value as a point of its own, where the curve
    starts (the untrained model's loss; the study's curves start at their 0K values), then the windows of
    the rest by ``reduce`` ("mean": ``window_means``, "last": ``window_last``). A window mean of the first
    window alone would hide the start of the descent (the musical loss's 0.84 bits at step 5 averaged
    into 0.6 at step 20). ``window`` <= 1 returns the values as they are."""
    steps, values = np.asarray(steps), np.asarray(values, dtype=np.float64)
    if window <= 1 or len(steps) < 2:
        return steps.copy(), values.copy()
    rest = WINDOW_REDUCE[reduce](steps[1:], values[1:], window)
    return np.concatenate([steps[:1], rest[0]]), np.concatenate([values[:1], rest[1]])
START_SHARE = 0.05  # a curve's start: its points within the first 5% of its steps (at least its first point)


def curve_start(steps: np.ndarray, share: float = START_SHARE) -> int:
    """How many of a curve's first points (``steps`` sorted) are its start: those within the first ``share``
    of its step range, at least one; y limits always show them (``robust_limits``' ``keep``)."""
    if not len(steps):
        return 0
    return max(1, int(np.searchsorted(steps, steps[0] + share * (steps[-1] - steps[0]), side="right")))


def robust_limits(values: np.ndarray, log: bool = False, q: float = 1.0, reach: float = 3.0, pad: float = 0.06,
                  keep: np.ndarray | None = None) -> tuple[float, float] | None:
    """y limits for the drawn curves ``values`` (in log10 when ``log``): their whole range, except that an
    end lying more than ``reach`` times the bulk's span (the ``q``-th to (100 - ``q``)-th percentile,
    widened to every value of ``keep``: the curves' starts) beyond the bulk is cut back to the bulk, padded
    by ``pad`` of the range. So a curve's own descent is shown whole from its first point (one point at the
    start, above a long tail's percentiles, is not an outlier), and so is a spike no higher than the start,
    while a one-window excursion to 10^4 beside values of 10 is drawn as marks at the edge instead of
    flattening every curve. None without finite values."""
    def finite(x) -> np.ndarray:
        x = np.asarray(x if x is not None else [], dtype=np.float64)
        x = x[np.isfinite(x) & ((x > 0) if log else True)]
        return np.log10(x) if log else x

    v, kept = finite(values), finite(keep)
    if not len(v):
        return None
    bulk_lo, bulk_hi = np.percentile(v, [q, 100 - q])
    if len(kept):
        bulk_lo, bulk_hi = min(bulk_lo, kept.min()), max(bulk_hi, kept.max())
    span = bulk_hi - bulk_lo
    lo = v.min() if bulk_lo - v.min() <= reach * span else bulk_lo
    hi = v.max() if v.max() - bulk_hi <= reach * span else bulk_hi
    width = hi - lo if hi > lo else max(abs(hi), 1e-12) * 0.1
    lo, hi = lo - pad * width, hi + pad * width
    return (10**lo, 10**hi) if log else (float(lo), float(hi))


def resolve_labels(runs: Sequence[RunMetrics], labels: Sequence[str] | None) -> list[str]:
    if labels is not None:
        if len(labels) != len(runs):
            raise ValueError(f"got {len(labels)} labels for {len(runs)} runs; give one label per run")
        return [str(label) for label in labels]
    out = [run.label for run in runs]
    for label in {label for label in out if out.count(label) > 1}:
        names = [run.name for run, lab in zip(runs, out) if lab == label]
        plot_warning(
            f"runs {', '.join(names)} share the legend text {label!r}: adding the run name to tell them "
            "apart (set train.label or --labels to choose)"
        )
    return [f"{lab} ({run.name})" if out.count(lab) > 1 else lab for run, lab in zip(runs, out)]


@dataclass
class RunGroup:
    """The runs drawn as one line: one run, or the seeds of one configuration (``bands``), or those of its
    seeds that failed one way (``kind``; ``split_by_failure``)."""

    label: str  # legend text of the configuration
    runs: list[RunMetrics]
    slot: int = 0  # the configuration's place in legend order: its colour and marker
    kind: str = "none"  # how these runs failed (analysis/failures.KINDS)
    fail_steps: list[int] = field(default_factory=list)  # where each run failed (none for a stall)
    of: int = 1  # runs of the configuration (healthy and failed)

    @property
    def name(self) -> str:
        """The run's directory name (one run), else the legend text (with the kind, for failed seeds): the
        line's gid is ``run:<name>``."""
        if len(self.runs) == 1:
            return self.runs[0].name
        return self.label if self.kind == "none" else f"{self.label} ({self.kind})"

    @property
    def legend(self) -> str:
        """Legend text: the configuration's, and for failed runs how and where they failed, e.g.
        ``... (dead input at 250)``, ``... (dead input at 155-250, 2 of 3 seeds)``, ``... (stalled)``."""
        if self.kind == "none":
            return self.label
        at = ""
        if self.fail_steps:
            lo, hi = min(self.fail_steps), max(self.fail_steps)
            at = f" at {lo}" if lo == hi else f" at {lo}-{hi}"
        share = f", {len(self.runs)} of {self.of} seeds" if self.of > 1 else ""
        return f"{self.label} ({self.kind}{at}{share})"

    @property
    def fail_from(self) -> int | None:
        """First step drawn as failed: the earliest failure step; None for healthy runs, and for a stall,
        which is failed from its start."""
        return min(self.fail_steps) if self.kind != "none" and self.fail_steps else None


@dataclass
class SeedCurve:
    """One group's curve of one metric on the union of its runs' logged steps.

    ``raw``: mean over the runs of the logged values; ``line``: mean over the runs of each run's EMA;
    ``lo``/``hi``: min and max over the runs of their EMAs (the band); ``count``: runs with a value there.
    Since the debiased EMA is linear, ``line`` is also the EMA of ``raw`` where every run logged.
    """

    steps: np.ndarray  # [S]
    raw: np.ndarray  # [S]
    line: np.ndarray  # [S]
    lo: np.ndarray  # [S]
    hi: np.ndarray  # [S]
    count: np.ndarray  # [S]


def group_runs(runs: Sequence[RunMetrics], labels: Sequence[str] | None = None) -> list[RunGroup]:
    """Runs with the same legend text (``labels`` or each run's) as one group each, in first-seen order.

    The study's seeds of one configuration share its legend text (the seed is not part of it), so each
    group is one configuration's seeds.
    """
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"got {len(labels)} labels for {len(runs)} runs; give one label per run")
    groups: dict[str, RunGroup] = {}
    for run, label in zip(runs, labels if labels is not None else [r.label for r in runs]):
        groups.setdefault(str(label), RunGroup(str(label), [])).runs.append(run)
    return list(groups.values())


def run_failures(runs: Sequence[RunMetrics], unigram_eval_cb0: float | None = None,
                 stall_margin: float = STALL_MARGIN) -> dict[str, Failure]:
    """{run name: how it failed} (``analysis/failures.failure``, losses read in bits; stalled: a final held-out
    codebook-0 loss less than ``stall_margin`` bits below the unigram level). Without the unigram level no run is
    found stalled."""
    return {run.name: failure(run.in_unit("bits"), unigram_eval_cb0, stall_margin) for run in runs}


def split_by_failure(groups: Sequence[RunGroup], failures: dict[str, Failure]) -> list[RunGroup]:
    """Each group's healthy runs as one group and its failed runs as one group per kind (KINDS order), all
    keeping the configuration's slot (colour, marker) and legend order: a failed seed never enters a healthy
    line's mean, and a line of failed seeds is drawn as failed (``RunGroup.legend``, ``fail_from``)."""
    out: list[RunGroup] = []
    for slot, group in enumerate(groups):
        for kind in KINDS:
            runs = [r for r in group.runs if failures.get(r.name, Failure("none", None)).kind == kind]
            if runs:
                steps = [failures[r.name].step for r in runs if kind != "none" and failures[r.name].step is not None]
                out.append(RunGroup(group.label, runs, slot=slot, kind=kind, fail_steps=steps, of=len(group.runs)))
    return out


def seed_curve(runs: Sequence[RunMetrics], metric: str, smooth: float, window: int = 1,
               reduce: str = "mean") -> SeedCurve | None:
    """The mean, band (min-max of the smoothed curves) and raw mean of ``metric`` over ``runs``.

    ``window`` > 1: each run's values first become window values (``windowed``; ``raw`` is then the mean
    of those). Each run is smoothed on its own logged steps (so a missing step in one seed does not shift
    another's EMA), then the runs are combined step by step over the steps any of them logged. None when no
    run logged the metric.
    """
    series = [windowed(*s, window, reduce) for s in (run.metric(metric) for run in runs) if s is not None]
    if not series:
        return None
    steps = np.unique(np.concatenate([s for s, _ in series]))
    raw = np.full((len(series), len(steps)), np.nan)
    smoothed = np.full_like(raw, np.nan)
    for i, (s, v) in enumerate(series):
        at = np.searchsorted(steps, s)
        raw[i, at] = v
        smoothed[i, at] = ema(v, smooth)
    count = np.sum(~np.isnan(raw), axis=0)
    with warnings.catch_warnings():  # columns are never all-NaN (every step comes from some run)
        warnings.simplefilter("ignore", RuntimeWarning)
        return SeedCurve(steps, np.nanmean(raw, 0), np.nanmean(smoothed, 0), np.nanmin(smoothed, 0),
                         np.nanmax(smoothed, 0), count)


def with_derived(run: RunMetrics) -> RunMetrics:
    """The run with ``diag/max_attn_logit/max``: at each step any layer logged, the largest logit of the
    layers logged there. A layer skipped by layerdrop (base size: 0.05) computed no attention at that step
    and logs nothing; requiring every layer dropped about half the steps of a 12-layer run."""
    layers = [run.series[k] for k in run.series if LAYER_LOGIT.match(k)]
    if not layers:
        return run
    steps = np.unique(np.concatenate([s for s, _ in layers]))
    grid = np.full((len(layers), len(steps)), -np.inf)
    for row, (s, v) in zip(grid, layers):
        row[np.searchsorted(steps, s)] = v
    return replace(run, series={**run.series, MAX_LOGIT: (steps, grid.max(axis=0))})


def layer_count(runs: Sequence[RunMetrics]) -> int:
    """Number of layers with a logged max attention logit in any run (0: none)."""
    found = [int(m.group(1)) for run in runs for k in run.series if (m := LAYER_LOGIT.match(k))]
    return max(found) + 1 if found else 0
