"""The stability study's four figures, drawn from run directories.

    musiclm-stab plot runs/pre_clip10 runs/pre_clip1 runs/deepnorm runs/relax --out figures/

Reads each run's ``config.yaml`` (for the legend text) and ``metrics.jsonl`` (one row per logged
step) and draws, one line per run:

  loss.png                   training loss          y "Loss Scale" (the study's wording for the loss
                                                    axis; not the fp16 ``loss_scale`` metric)
  grad_norm.png              grad norm before clip  y "Gradient Norm"
  musical_mlm_loss.png       CQT regression loss    y "Musical MLM Loss", log-scaled steps
  acoustic_mlm_loss_cb0.png  codebook-0 CE          y "Acoustic MLM Loss on Codebook-0", log-scaled steps

in the study's style: x "Training Step" labelled in K, legend upper right, colours blue / orange /
green / pink with markers o ^ v D. Skipped (non-finite) steps are marked with small x's on the x axis
and loss-spike-guard rollbacks with dashed vertical lines. Plots read run directories only, never the
training loop; problems with the files are warnings (`PlotWarning`), not crashes.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, Formatter, MaxNLocator, NullFormatter

from musiclm_stab.analysis.runs import PlotWarning, RunMetrics, plot_warning, read_run, run_label

__all__ = ["PlotWarning", "RunMetrics", "cli_main", "make_figures", "plot_runs", "read_run", "run_label"]

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

SKIPPED_LABEL = "Skipped step (non-finite)"
ROLLBACK_LABEL = "Rollback (loss-spike guard)"

@dataclass(frozen=True)
class FigureSpec:
    name: str  # file stem
    metric: str  # metrics.jsonl key
    ylabel: str
    log_x: bool  # default x scale (the study draws the MLM losses against log-scaled steps)


def figure_specs(codebooks: Iterable[int] = (0,)) -> list[FigureSpec]:
    """The study's figures, in order; one acoustic figure per requested codebook."""
    specs = [
        FigureSpec("loss", "loss", "Loss Scale", False),
        FigureSpec("grad_norm", "grad_norm", "Gradient Norm", False),
        FigureSpec("musical_mlm_loss", "musical_mlm_loss", "Musical MLM Loss", True),
    ]
    for k in codebooks:
        if int(k) < 0:
            raise ValueError(f"codebook index must be >= 0, got {k}")
        specs.append(
            FigureSpec(
                f"acoustic_mlm_loss_cb{k}",
                f"acoustic_mlm_loss/cb{k}",
                f"Acoustic MLM Loss on Codebook-{k}",
                True,
            )
        )
    return specs


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


def _style_x_axis(ax, log_x: bool, max_step: float) -> None:
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


def _resolve_labels(runs: Sequence[RunMetrics], labels: Sequence[str] | None) -> list[str]:
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


def make_figures(
    runs: Sequence[RunMetrics | str | Path],
    *,
    labels: Sequence[str] | None = None,
    smooth: float = 0.0,
    log_x: bool | None = None,
    codebooks: Iterable[int] = (0,),
) -> dict[str, Figure]:
    """The study's figures as matplotlib Figures, keyed by file stem ("loss", "grad_norm", ...).

    One line per run, run i always in COLOURS[i] / MARKERS[i % 4] in every figure. ``log_x`` None
    keeps each figure's default (log steps for the MLM losses); True/False forces all. A figure no
    run has data for is left out, with a warning.
    """
    runs = [r if isinstance(r, RunMetrics) else read_run(r) for r in runs]
    if not runs:
        raise ValueError("no runs to plot")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    legend_texts = _resolve_labels(runs, labels)

    ends = {run.name: run.last_step for run in runs if run.last_step is not None}
    if len(set(ends.values())) > 1:
        plot_warning(
            "runs end at different steps ("
            + ", ".join(f"{n}: {s}" for n, s in ends.items())
            + "); the x axis spans the longest"
        )

    figures: dict[str, Figure] = {}
    for spec in figure_specs(codebooks):
        with_data = []
        for i, run in enumerate(runs):
            if run.metric(spec.metric) is not None:
                with_data.append(i)
            elif run.last_step is not None:  # runs with no rows at all were reported by read_run
                plot_warning(f"run {run.name!r} has no {spec.metric!r} values: no line for it in {spec.name}")
        if not with_data:
            plot_warning(f"no run has {spec.metric!r} values: figure {spec.name} not drawn")
            continue
        figures[spec.name] = _draw(
            spec, runs, legend_texts, with_data, smooth, spec.log_x if log_x is None else log_x
        )
    return figures


def _marker_indices(steps: np.ndarray, ax, offset: float, count: int = MARKERS_PER_LINE) -> list[int]:
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


def _draw(
    spec: FigureSpec,
    runs: list[RunMetrics],
    legend_texts: list[str],
    with_data: list[int],
    smooth: float,
    log_x: bool,
) -> Figure:
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    FigureCanvasAgg(fig)  # non-interactive Agg canvas; no pyplot state
    ax = fig.add_subplot()
    max_step = 0.0
    for i in with_data:
        run = runs[i]
        marks = [run.metric(spec.metric)[0][-1], *run.skipped_steps, *(rb.step for rb in run.rollbacks)]
        max_step = max(max_step, float(max(marks)))
    handles: list[Line2D] = []
    any_skipped = any_rollback = False
    lines = {}
    for i in with_data:
        run = runs[i]
        steps, values = run.metric(spec.metric)
        colour, marker = COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]
        if smooth > 0:
            ax.plot(
                steps,
                values,
                color=colour,
                alpha=RAW_ALPHA,
                linewidth=0.8,
                zorder=1,
                label="_nolegend_",
                gid=f"raw:{run.name}",
            )
        (line,) = ax.plot(
            steps,
            ema(values, smooth),
            color=colour,
            marker=marker,
            markersize=4,
            linewidth=1.2,
            zorder=2,
            label=legend_texts[i],
            gid=f"run:{run.name}",
        )
        lines[i] = line
        handles.append(line)
        if len(run.skipped_steps):
            any_skipped = True
            # x in data, y in axes fraction: a row of small x's just above the x axis.
            ax.plot(
                run.skipped_steps,
                np.full(len(run.skipped_steps), 0.02),
                transform=ax.get_xaxis_transform(),
                linestyle="none",
                marker="x",
                markersize=5,
                color=colour,
                zorder=3,
                clip_on=False,
                label="_nolegend_",
                gid=f"skipped:{run.name}",
            )
        for rb in run.rollbacks:
            any_rollback = True
            ax.axvline(
                rb.step,
                color=colour,
                linestyle="--",
                linewidth=1.0,
                alpha=0.8,
                zorder=1.5,
                label="_nolegend_",
                gid=f"rollback:{run.name}",
            )
    _style_x_axis(ax, log_x, max_step)  # sets the x limits the marker positions are spread over
    for i, line in lines.items():
        line.set_markevery(_marker_indices(runs[i].metric(spec.metric)[0], ax, offset=(i % 4) / 4))
    # One legend entry for each kind of mark, in neutral grey (the colour says which run).
    if any_skipped:
        handles.append(Line2D([], [], color="0.35", marker="x", linestyle="none", label=SKIPPED_LABEL))
    if any_rollback:
        handles.append(Line2D([], [], color="0.35", linestyle="--", label=ROLLBACK_LABEL))
    ax.set_ylabel(spec.ylabel)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)
    return fig


def plot_runs(
    runs: Sequence[RunMetrics | str | Path],
    out_dir: str | Path,
    *,
    labels: Sequence[str] | None = None,
    smooth: float = 0.0,
    log_x: bool | None = None,
    codebooks: Iterable[int] = (0,),
    formats: Sequence[str] = ("png", "pdf"),
) -> list[Path]:
    """Draw the study's figures for ``runs`` into ``out_dir``; returns the written files.

    Each figure is saved once per format (PNG at 150 dpi; PDF/SVG are vector).
    """
    formats = [f.lower().lstrip(".") for f in formats]
    supported = FigureCanvasAgg(Figure()).get_supported_filetypes()
    for f in formats:
        if f not in supported:
            raise ValueError(f"unknown figure format {f!r}; choose from: {', '.join(sorted(supported))}")
    figures = make_figures(runs, labels=labels, smooth=smooth, log_x=log_x, codebooks=codebooks)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures.items():
        for f in formats:
            path = out / f"{name}.{f}"
            fig.savefig(path, format=f, dpi=PNG_DPI if f in ("png", "jpg", "jpeg") else "figure")
            written.append(path)
    return written


# ---------------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="musiclm-stab plot", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (config.yaml + metrics.jsonl)"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the figures")
    p.add_argument(
        "--labels", nargs="+", metavar="LABEL", help="legend text, one per run (default: from config)"
    )
    p.add_argument(
        "--smooth",
        type=float,
        default=0.0,
        help="EMA smoothing in [0, 1), raw curve drawn faint behind (default 0: off)",
    )
    p.add_argument(
        "--log-x",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log-scaled steps on every figure (default: only the MLM-loss figures)",
    )
    p.add_argument(
        "--codebooks",
        nargs="+",
        type=int,
        default=[0],
        metavar="K",
        help="codebooks to draw acoustic MLM loss for (default: 0)",
    )
    p.add_argument(
        "--format",
        nargs="+",
        default=["png", "pdf"],
        dest="formats",
        metavar="FMT",
        help="file formats (default: png pdf)",
    )
    return p


def cli_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlotWarning)
        try:
            written = plot_runs(
                args.run_dirs,
                args.out,
                labels=args.labels,
                smooth=args.smooth,
                log_x=args.log_x,
                codebooks=args.codebooks,
                formats=args.formats,
            )
        except (FileNotFoundError, ValueError) as e:
            _print_warnings(caught)
            print(f"musiclm-stab plot: error: {e}", file=sys.stderr)
            return 2
    _print_warnings(caught)
    if not written:
        print("musiclm-stab plot: nothing to plot (no run has metric rows)", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def _print_warnings(caught: list[warnings.WarningMessage]) -> None:
    for w in caught:
        if issubclass(w.category, PlotWarning):
            print(f"musiclm-stab plot: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


if __name__ == "__main__":
    sys.exit(cli_main())
