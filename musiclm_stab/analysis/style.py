"""The study's look, shared by every figure of the project: colours and markers in legend order, sizes,
the training-step axis ("0K ... 100K", linear or log-scaled) with sparse markers along it, and how a failed
run (analysis/failures.py) is drawn."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.ticker import FixedLocator, Formatter, MaxNLocator, NullFormatter

# The study's colour and marker order; runs past the fourth continue with the rest of tab10 so that
# five or more runs stay distinguishable (markers cycle every four).
COLOURS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:pink",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:gray",
    "tab:olive",
    "tab:cyan",
)
MARKERS = ("o", "^", "v", "D")
MARKERS_PER_LINE = 10  # markers spread evenly along the x axis, so they stay sparse
RAW_ALPHA = 0.25  # the unsmoothed line behind a smoothed one
FIGSIZE = (8.0, 5.0)
PNG_DPI = 150
BAND_ALPHA = 0.2  # the seed band behind a configuration's line

# A failed run (analysis/failures.py: diverged, dead input, stalled) is never drawn as a healthy one: its line
# is dashed and faded from the step it failed at (a stalled run, which never learned, from its start), and a
# mark of its kind sits at that step (a stalled run's at its end). The lr figure marks its points the same way.
FAILURE_MARKERS = {"diverged": "x", "dead input": "s", "stalled": "*"}
FAILURE_SIZES = {"diverged": 8, "dead input": 9, "stalled": 12}
FAILED_ALPHA = 0.5
FAILED_LINESTYLE = "--"


def failure_mark_style(kind: str, colour) -> dict:
    """matplotlib keywords of the mark of a failure of ``kind`` in ``colour`` (for ``ax.plot``): hollow, so
    the point or line it marks shows through."""
    return {"marker": FAILURE_MARKERS[kind], "markersize": FAILURE_SIZES[kind], "markeredgewidth": 1.6,
            "markeredgecolor": colour, "markerfacecolor": "none", "color": colour, "linestyle": "none"}


def _strip(number: float, decimals: int) -> str:
    text = f"{number:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


class StepFormatter(Formatter):
    """Training-step tick labels in thousands, as the study: "0K", "20K", ... "100K".

    Linear axis: every label uses the fewest decimals (0-2) that write all ticks exactly, so a
    500-step run reads "0K", "0.1K", ... "0.5K" and a 100-step run "0K", "0.02K", ... "0.1K". Ticks
    finer than 10 steps (runs of a few dozen steps) would need "0.005K": those axes use plain step
    numbers instead. Log axis (decades): "1K", "10K", "100K" from 1000 up, plain "1", "10", "100"
    below; 0 (symlog) is "0K" when every other tick is in K.
    """

    def __init__(self, log: bool = False):
        self.log = log
        self._ticks: list[float] = []

    def set_locs(self, locs) -> None:
        super().set_locs(locs)
        self._ticks = [float(v) for v in locs]  # the ticks being labelled (matplotlib calls this first)

    def _decimals(self) -> int | None:
        for decimals in (0, 1, 2):
            if all(abs(round(v / 1000, decimals) * 1000 - v) < 1e-6 * max(1.0, abs(v)) for v in self._ticks):
                return decimals
        return None

    def __call__(self, x: float, pos: int | None = None) -> str:
        if self.log:
            positive = [v for v in self._ticks if v > 0]
            if x == 0:
                return "0K" if positive and min(positive) >= 1000 else "0"
            return f"{_strip(x / 1000, 2)}K" if x >= 1000 else _strip(x, 2)
        decimals = self._decimals()
        if decimals is None:
            return _strip(x, 2)
        return f"{_strip(x / 1000 + 0.0, decimals)}K"  # + 0.0 turns -0.0 into 0.0


def _linthresh(max_step: float) -> float:
    """Linear region of the symlog step axis: 0 .. max/100 as a power of ten (1K for a 100K run)."""
    return float(10 ** max(0, math.floor(math.log10(max(max_step, 1.0))) - 2))


def style_x_axis(ax, log_x: bool, max_step: float) -> None:
    ax.set_xlabel("Training Step")
    if not log_x:
        ax.xaxis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=True))
        ax.xaxis.set_major_formatter(StepFormatter(log=False))
        ax.set_xlim(left=0)
        return
    # Step 0 (the initial loss) has no place on a log axis. A symlog axis keeps it: linear from 0 to
    # `linthresh`, logarithmic after, which the study reads as "0K ... 100K, log-scaled".
    linthresh = _linthresh(max_step)
    ax.set_xscale("symlog", linthresh=linthresh, linscale=1.0)
    top = max(max_step * 1.08, linthresh * 1.5)
    decades = [linthresh * 10**i for i in range(int(math.ceil(math.log10(top / linthresh))) + 1)]
    # Fixed ticks: 0 and decades only. The default symlog locator also ticks inside the linear
    # region (100 next to 0 for a 100K run), where labels collide.
    ax.xaxis.set_major_locator(FixedLocator([0.0] + [d for d in decades if d <= top]))
    ax.xaxis.set_minor_locator(FixedLocator([d * m for d in decades for m in range(2, 10) if d * m <= top]))
    ax.xaxis.set_major_formatter(StepFormatter(log=True))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(0.0, top)


def marker_indices(steps: np.ndarray, ax, offset: float, count: int = MARKERS_PER_LINE) -> list[int]:
    """Indices of ~``count`` points evenly spaced along the x axis as drawn (linear or symlog).

    matplotlib's float ``markevery`` spaces markers by path length, which crowds them where a noisy
    line of many points zigzags; spacing by x keeps them sparse. ``offset`` in [0, 1) shifts this
    run's markers by a fraction of the spacing so overlapping runs do not hide each other's.
    """
    if len(steps) == 0:
        return []
    scale = ax.xaxis.get_transform()  # the scale part only: identity or symlog
    x = np.asarray(scale.transform(steps.astype(np.float64)), dtype=np.float64).ravel()
    lo, hi = np.asarray(scale.transform(np.asarray(ax.get_xlim(), dtype=np.float64))).ravel()
    targets = lo + (hi - lo) * (np.arange(count) + offset) / count
    targets = targets[(targets >= x[0]) & (targets <= x[-1])]
    right = np.clip(np.searchsorted(x, targets), 1, len(x) - 1) if len(x) > 1 else np.zeros(len(targets), int)
    left = np.maximum(right - 1, 0)
    nearest = np.where(np.abs(x[left] - targets) <= np.abs(x[right] - targets), left, right)
    return sorted({int(i) for i in nearest})
