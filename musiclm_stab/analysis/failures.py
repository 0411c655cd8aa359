"""How a run failed, by kind and step: the endpoints that tell a transformer's instability from a dead input.

A study that compares the transformer's norm schemes must know where a run failed: a conv frontend shrunk to
nothing by its features penalty leaves every scheme blind alike, and the fp16 loss scaler's routine probing
is not instability. Each function reads a run's logged rows (``RunMetrics``, losses in bits); the kinds,
with their precedence (a run has one kind: the first that applies):

- **diverged**: fp16's loss scale reached its floor (a ``min_loss_scale`` event), or the mean of the finite
  training losses of the last 10% of the logged rows is above the first logged loss L0, or none of them
  is finite (``claim_stats.diverged``, the CPU study's rule). Its step: the floor event's, else the first
  logged step from which the loss stays above L0 (or non-finite) to the end.
- **dead input**: the RMS of the conv frontend's output (what the transformer is fed) ends the run below
  ``DEAD_SHARE`` of its first logged value. It is read from ``features_pen`` (mean(features^2), logged on
  every row: RMS = sqrt of it; ``diag/frontend_rms`` logs the same value on diagnostic steps). Its step:
  the first logged step below that share (a dying frontend may flicker back above it). Calibrated on the
  CPU study's 42 runs (docs/STUDY.md): the 18 that stalled at the unigram level (every run at lr 1e-2,
  DeepNorm at 3e-3) ended with an RMS at most 4e-4 of its first value, and the 24 that learned never went
  below 0.035 of it.
- **stalled**: the final held-out codebook-0 loss is no more than ``stall_margin`` bits below the unigram
  level of the held-out masked frames (the codes' marginal; ``analysis/unigram.py``): the model never
  learned more than code frequencies. Needs the unigram level; no step.
- **none**: none of these.

Spike cascades (``cascades``), which are not a kind but an event count: fairseq's scaler doubles its
scale after ``scale_window`` clean updates and halves it at the next overflow, so a run overflows about
once per window by design (54-63 times in 2400 steps at window 32); that is its clock, not instability.
A cascade is a fall of the loss scale by at least 2^CASCADE_BITS below its largest value over the
``CASCADE_STEPS`` steps before (several overflows in a row, or at short intervals); consecutive logged
rows in a cascade are one event, and a divergence (the floor) is one too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from musiclm_stab.analysis.claim_stats import diverged, final_eval_cb0, logged
from musiclm_stab.analysis.runs import RunMetrics

KINDS = ("none", "diverged", "dead input", "stalled")
DEAD_SHARE = 0.01  # frontend RMS below 1% of its first value to the end: dead input
STALL_MARGIN = 0.05  # bits below the unigram level the final held-out cb0 must reach not to be stalled
CASCADE_BITS = 3  # a cascade: the loss scale at least 2^3 = 8x below its recent maximum
CASCADE_STEPS = 32  # "recent": the steps before (MERT-330M's loss-scale window)


@dataclass
class Failure:
    kind: str  # one of KINDS
    step: int | None  # where it began (None: no failure, or a stall, which has no step)
    why: str = ""  # the numbers that decided it


def _stays_from(bad: np.ndarray) -> int | None:
    """Index of the first element of the final all-True stretch of ``bad`` (None when its last is False)."""
    if not len(bad) or not bad[-1]:
        return None
    good = np.flatnonzero(~bad)
    return int(good[-1]) + 1 if len(good) else 0


def divergence_step(run: RunMetrics) -> int | None:
    """The step a diverged run diverged at (module docstring); None when it did not diverge."""
    if not diverged(run):
        return None
    if run.diverged_at is not None:
        return int(run.diverged_at)
    steps, v = logged(run, "loss")
    finite = v[np.isfinite(v)]
    if not len(steps):
        return None
    l0 = float(finite[0]) if len(finite) else math.nan
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(v) | (v > l0)
    i = _stays_from(bad)
    return int(steps[i]) if i is not None else int(steps[-1])


def frontend_rms(run: RunMetrics) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, RMS of the frontend's output) on every logged row, from ``features_pen`` in the unit it was
    logged in (the penalty is logged divided by ln 2 in bits); None without it."""
    series = run.metric("features_pen")
    if series is None:
        return None
    steps, pen = series
    per_nat = math.log(2.0) if run.unit == "bits" else 1.0  # features_pen is held in the run's loss unit
    return steps, np.sqrt(np.maximum(pen * per_nat, 0.0))


def dead_input_step(run: RunMetrics, share: float = DEAD_SHARE) -> int | None:
    """When the frontend's RMS ends the run below ``share`` of its first logged value (dead input), the
    first logged step it was below; None when it is alive at the end, or was never logged."""
    rms = frontend_rms(run)
    if rms is None or not len(rms[1]) or not rms[1][0] > 0:
        return None
    steps, values = rms
    below = values < share * values[0]
    return int(steps[np.argmax(below)]) if below[-1] else None


def stalled(run: RunMetrics, unigram_eval_cb0: float | None, margin: float = STALL_MARGIN) -> bool | None:
    """Whether the final held-out codebook-0 loss is within ``margin`` bits of the unigram level (or above
    it); None when the unigram level or the evaluation is missing (or the run diverged)."""
    final = final_eval_cb0(run)
    if unigram_eval_cb0 is None or not math.isfinite(final):
        return None
    return final > unigram_eval_cb0 - margin


def failure(run: RunMetrics, unigram_eval_cb0: float | None = None, stall_margin: float = STALL_MARGIN,
            dead_share: float = DEAD_SHARE) -> Failure:
    """The run's failure kind and step (module docstring), with the numbers that decided it."""
    step = divergence_step(run)
    if step is not None:
        why = "the fp16 loss scale at its floor" if run.diverged_at is not None else "the loss above its first value"
        return Failure("diverged", step, why)
    step = dead_input_step(run, dead_share)
    if step is not None:
        _, rms = frontend_rms(run)
        return Failure("dead input", step, f"frontend RMS {rms[-1]:.3g} at the end, {rms[0]:.3g} at first "
                                           f"(below {dead_share:g} of it first at step {step})")
    if stalled(run, unigram_eval_cb0, stall_margin):
        return Failure("stalled", None, f"final held-out cb0 {final_eval_cb0(run):.3f} bits, unigram level "
                                        f"{unigram_eval_cb0:.3f} (needs {stall_margin:g} below)")
    return Failure("none", None)


@dataclass
class Cascade:
    step: int  # first logged step of the event
    scale: float  # the lowest loss scale in it (0: the floor, a divergence)
    before: float  # the largest loss scale over the CASCADE_STEPS steps before it
    overflows: int  # overflowed updates logged in the event's rows


def window_max(steps: np.ndarray, values: np.ndarray, window: int) -> np.ndarray:
    """For each row i, the largest value of the rows logged at steps[i] - window .. steps[i] - 1 (-inf when
    there is none): a sparse table of maxima over powers of two, so a run of n rows costs O(n log n)."""
    n = len(values)
    lo = np.searchsorted(steps, steps - window, side="left")
    hi = np.searchsorted(steps, steps, side="left")
    out = np.full(n, -np.inf)
    width = hi - lo
    has = width > 0
    if not has.any():
        return out
    table = [np.asarray(values, dtype=np.float64)]
    while 2 ** len(table) <= int(width.max()):
        prev, half = table[-1], 2 ** (len(table) - 1)
        table.append(np.maximum(prev[:-half], prev[half:]))
    level = np.zeros(n, dtype=np.int64)
    level[has] = np.floor(np.log2(width[has])).astype(np.int64)
    for k in np.unique(level[has]):
        rows = np.flatnonzero(has & (level == k))
        out[rows] = np.maximum(table[k][lo[rows]], table[k][hi[rows] - 2 ** k])
    return out


def cascades(run: RunMetrics, bits: int = CASCADE_BITS, window: int = CASCADE_STEPS) -> list[Cascade]:
    """The run's spike cascades (module docstring): falls of the fp16 loss scale by >= 2^``bits`` below its
    largest value over the ``window`` steps before, consecutive rows one event, the divergence (the floor)
    one too. Empty for a run without a loss scale (fp32, bf16)."""
    series = run.metric("loss_scale")
    events: list[Cascade] = []
    if series is not None:
        steps, scale = series
        overflow = dict(zip(*(run.metric("overflow_step") or (np.zeros(0), np.zeros(0)))))
        before = window_max(steps, scale, window)
        falling = scale * 2**bits <= before  # False where no row is in the window (-inf)
        edges = np.diff(np.concatenate([[0], falling.astype(np.int8), [0]]))
        for i, j in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
            events.append(Cascade(int(steps[i]), float(scale[i:j].min()), float(before[i]),
                                  sum(int(overflow.get(step, 0)) for step in steps[i:j])))
    if run.diverged_at is not None:
        events.append(Cascade(int(run.diverged_at), 0.0, float(series[1][-1]) if series is not None else math.nan,
                              run.final_overflows))
    return events
