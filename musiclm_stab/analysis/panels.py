"""One of the study's figures, drawn: its panels (one axes each; several in a grid with one legend below
them), each run group's line (with its seed band and, when smoothed or windowed, its raw values faint
behind), the marks of skipped steps, rollbacks and failures, the legend, and the robust y range.
analysis/figure_specs.py says what each panel draws, analysis/curves.py computes the curves and
analysis/style.py holds the look.

Each figure is drawn in the study's style: x "Training Step" labelled in K, legend upper right, colours blue /
orange / green / pink with markers o ^ v D. Skipped (non-finite) steps are marked with small x's on the x axis
and loss-spike-guard rollbacks with dashed vertical lines. A run that failed (analysis/failures.py: diverged,
dead input, or, given the held-out unigram level ``--unigram``, stalled) is never drawn as a healthy one: its
line is dashed and faded from the step it failed at (a stalled one throughout), a mark of its kind (x
diverged, square dead input, star stalled) sits at that step (a stall's at its end), and its legend entry says
so, e.g. "... (dead input at 250)".

y limits are robust: they span the drawn curves (lines and bands) except an excursion far beyond their bulk
(``curves.robust_limits``), and raw values beyond them are marked with a triangle at the edge (so one point of
10^4 does not flatten every curve); every curve's start (its first 5% of steps; with ``--window``, its first
logged row is a point of its own) is always on the axis, and the bulk an excursion is measured against reaches
the starts, so a spike to the height of the start (the seed's DeepNorm) is drawn.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FormatStrFormatter, MultipleLocator

from musiclm_stab.analysis.curves import RunGroup, SeedCurve, curve_start, robust_limits, seed_curve
from musiclm_stab.analysis.figure_specs import FigureSpec
from musiclm_stab.analysis.runs import plot_warning
from musiclm_stab.analysis.style import (
    BAND_ALPHA,
    COLOURS,
    FAILED_ALPHA,
    FAILED_LINESTYLE,
    FIGSIZE,
    MARKERS,
    RAW_ALPHA,
    failure_mark_style,
    marker_indices,
    style_x_axis,
)

SKIPPED_LABEL = "Skipped step (non-finite)"
ROLLBACK_LABEL = "Rollback (loss-spike guard)"
OUTSIDE_LABEL = "Beyond the axis (marked at its edge)"
BAND_LABEL = "Band: min-max over {} seeds{}"
# The legend's entry for each kind of failure mark (analysis/failures.py); the run's own entry says where.
FAILURE_LABELS = {
    "diverged": "Diverged (fp16 loss scale at its floor, or loss above its start) from the mark",
    "dead input": "Dead input (frontend output below 1% of its first RMS) from the mark",
    "stalled": "Stalled at the held-out unigram level (mark: its end)",
}


def draw_figure(
    panels: list[FigureSpec],
    groups: list[RunGroup],
    smooth: float,
    log_x: bool | None,
    title: str | None,
    warn_missing: bool = True,
    window: int = 1,
) -> Figure | None:
    """One figure of ``panels`` (one axes each; 1 panel: the study's 8 x 5 in, more: a grid of up to 4
    per row). None, with a warning, when no group has any panel's metric."""
    drawable = []
    for spec in panels:
        with_data = [i for i, g in enumerate(groups) if any(r.metric(spec.metric) is not None for r in g.runs)]
        if warn_missing and (with_data or not spec.optional):
            for group in groups:
                for run in group.runs:
                    if run.metric(spec.metric) is None and run.last_step is not None:
                        plot_warning(f"run {run.name!r} has no {spec.metric!r} values: no line for it in {spec.name}")
        if with_data:
            drawable.append((spec, with_data))
    if not drawable:
        if warn_missing and not all(spec.optional for spec in panels):
            plot_warning(f"no run has {panels[0].metric!r} values: figure {panels[0].name} not drawn")
        return None
    n = len(drawable)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    size = FIGSIZE if n == 1 else (4.2 * cols, 3.2 * rows + 0.9)
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)  # non-interactive Agg canvas; no pyplot state
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    handles: list = []
    for ax, (spec, with_data) in zip(axes, drawable):
        handles = _draw_panel(ax, spec, groups, with_data, smooth, spec.log_x if log_x is None else log_x,
                              legend=n == 1, window=window)
        if n > 1:
            ax.set_title(spec.ylabel, fontsize=9)
            ax.set_ylabel("")
    if n > 1:
        if title:
            fig.suptitle(title, fontsize=11)
        _legend_below(fig, handles)
    return fig


def _legend_below(fig: Figure, handles: list) -> None:
    """One legend below the panels, in as many columns (at most 3) as fit the figure's width: long entries (a
    failure's steps and seeds) in 3 columns ran past its right edge, cut off in the saved file."""
    renderer = fig.canvas.get_renderer()
    for ncols in range(min(len(handles), 3), 0, -1):
        legend = fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=8, framealpha=0.9)
        if ncols == 1 or legend.get_window_extent(renderer).width <= fig.bbox.width:
            return
        legend.remove()


def _draw_panel(
    ax,
    spec: FigureSpec,
    groups: list[RunGroup],
    with_data: list[int],
    smooth: float,
    log_x: bool,
    legend: bool = True,
    window: int = 1,
) -> list:
    """Draw ``spec``'s metric for the groups ``with_data`` into ``ax``; returns the legend handles."""
    max_step = 0.0
    curves: dict[int, SeedCurve] = {}
    for i in with_data:
        curves[i] = curve = seed_curve(groups[i].runs, spec.metric, smooth, window, spec.reduce)
        marks = [curve.steps[-1], *groups[i].fail_steps]
        for run in groups[i].runs:
            marks += [*run.skipped_steps, *(rb.step for rb in run.rollbacks)]
        max_step = max(max_step, float(max(marks)))
    handles: list = []
    any_skipped = any_rollback = False
    seeds: set[int] = set()
    kinds: list[str] = []  # the failure kinds drawn, in legend order
    lines: list[tuple[Line2D, int]] = []  # (line, slot): markers spread once the x axis is set
    for i in with_data:
        group, curve = groups[i], curves[i]
        colour, marker = COLOURS[group.slot % len(COLOURS)], MARKERS[group.slot % len(MARKERS)]
        if smooth > 0 or window > 1:
            ax.plot(curve.steps, curve.raw, color=colour, alpha=RAW_ALPHA, linewidth=0.8, zorder=1,
                    label="_nolegend_", gid=f"raw:{group.name}")
        if len(group.runs) > 1:
            seeds.add(len(group.runs))
            ax.fill_between(curve.steps, curve.lo, curve.hi, color=colour, alpha=BAND_ALPHA, linewidth=0,
                            zorder=0.5, label="_nolegend_", gid=f"band:{group.name}")
        drawn, handle = _draw_line(ax, group, curve, colour, marker)
        lines += [(line, group.slot) for line in drawn]
        handles.append(handle)
        if group.kind != "none" and group.kind not in kinds:
            kinds.append(group.kind)
        for run in group.runs:
            if len(run.skipped_steps):
                any_skipped = True
                # x in data, y in axes fraction: a row of small x's just above the x axis.
                ax.plot(run.skipped_steps, np.full(len(run.skipped_steps), 0.02),
                        transform=ax.get_xaxis_transform(), linestyle="none", marker="x", markersize=5,
                        color=colour, zorder=3, clip_on=False, label="_nolegend_", gid=f"skipped:{run.name}")
            for rb in run.rollbacks:
                any_rollback = True
                ax.axvline(rb.step, color=colour, linestyle="--", linewidth=1.0, alpha=0.8, zorder=1.5,
                           label="_nolegend_", gid=f"rollback:{run.name}")
    style_x_axis(ax, log_x, max_step)  # sets the x limits the marker positions are spread over
    for line, slot in lines:
        line.set_markevery(marker_indices(np.asarray(line.get_xdata()), ax, offset=(slot % 4) / 4))
    outside = _robust_y(ax, spec, [curves[i] for i in with_data],
                        [COLOURS[groups[i].slot % len(COLOURS)] for i in with_data])
    # One legend entry for each kind of mark, in neutral grey (the colour says which run).
    for kind in kinds:
        handles.append(Line2D([], [], label=FAILURE_LABELS[kind], **failure_mark_style(kind, "0.35")))
    if seeds:
        counts = f"{min(seeds)}" if len(seeds) == 1 else f"{min(seeds)}-{max(seeds)}"
        per_window = f"last of every {window} steps" if spec.reduce == "last" else f"means over {window} steps"
        how = ", ".join(([per_window] if window > 1 else []) + ([f"EMA {smooth:g}"] if smooth > 0 else []))
        handles.append(Patch(color="0.35", alpha=BAND_ALPHA * 1.5,
                             label=BAND_LABEL.format(counts, f" ({how})" if how else "")))
    if outside:
        handles.append(Line2D([], [], color="0.35", marker="^", linestyle="none", label=OUTSIDE_LABEL))
    if any_skipped:
        handles.append(Line2D([], [], color="0.35", marker="x", linestyle="none", label=SKIPPED_LABEL))
    if any_rollback:
        handles.append(Line2D([], [], color="0.35", linestyle="--", label=ROLLBACK_LABEL))
    ax.set_ylabel(spec.ylabel)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    if legend:
        ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)
    return handles


def _draw_line(ax, group: RunGroup, curve: SeedCurve, colour, marker: str) -> tuple[list[Line2D], Line2D]:
    """``group``'s line (gid ``run:<name>``; returns the lines drawn and the legend handle). A failed
    group's line is solid up to the step it failed at and dashed and faded after it (``failed:<name>``),
    all of it for a stall or a failure before its first point, with a mark of its kind at each run's step
    (``failure:<kind>:<name>``; a stall's at the line's end), so it is never taken for a healthy one."""
    steps, y = curve.steps, curve.line
    solid = {"color": colour, "marker": marker, "markersize": 4, "linewidth": 1.2, "zorder": 2}
    failed = {**solid, "linestyle": FAILED_LINESTYLE, "alpha": FAILED_ALPHA}
    if group.kind == "none":
        (line,) = ax.plot(steps, y, label=group.legend, gid=f"run:{group.name}", **solid)
        return [line], line
    start = group.fail_from
    cut = 0 if start is None else int(np.searchsorted(steps, start, side="right"))
    if cut == 0:
        (line,) = ax.plot(steps, y, label=group.legend, gid=f"run:{group.name}", **failed)
        drawn = [line]
    else:
        (line,) = ax.plot(steps[:cut], y[:cut], label=group.legend, gid=f"run:{group.name}", **solid)
        drawn = [line]
        if cut < len(steps):  # from the last healthy point on, so the line does not break
            (after,) = ax.plot(steps[cut - 1:], y[cut - 1:], label="_nolegend_", gid=f"failed:{group.name}",
                               **failed)
            drawn.append(after)
    at = np.asarray(group.fail_steps or [steps[-1]], dtype=np.float64)
    ax.plot(at, np.interp(at, steps, y), zorder=4, label="_nolegend_", gid=f"failure:{group.kind}:{group.name}",
            **failure_mark_style(group.kind, colour))
    return drawn, Line2D([], [], label=group.legend, **failed)


def _robust_y(ax, spec: FigureSpec, curves: list[SeedCurve], colours: list) -> bool:
    """Set ``ax``'s y limits from the drawn curves (``robust_limits``, every curve's start kept on the
    axis; a figure with a ``seed_range`` keeps the seed's axis while the curves fit in it) and mark the raw
    points beyond them with a triangle at the edge they cross; returns whether any point was marked."""
    if spec.log_y:
        ax.set_yscale("log")
    drawn = np.concatenate([np.concatenate([c.line, c.lo, c.hi]) for c in curves])
    starts = np.concatenate([np.concatenate([c.line[:n], c.lo[:n], c.hi[:n]])
                             for c in curves if (n := curve_start(c.steps))] or [np.zeros(0)])
    limits = robust_limits(drawn, log=spec.log_y, keep=starts)
    if limits is None:
        return False
    lo, hi = limits
    if spec.seed_range is not None:
        seed_lo, seed_hi, tick = spec.seed_range
        finite = drawn[np.isfinite(drawn)]
        lo = seed_lo if finite.min() >= seed_lo else lo
        hi = seed_hi if finite.max() <= seed_hi else max(hi, seed_hi)
        if (lo, hi) == (seed_lo, seed_hi):  # the seed's axis: 0.00, 0.25, ... 2.00
            ax.yaxis.set_major_locator(MultipleLocator(tick))
            ax.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax.set_ylim(lo, hi)
    marked = False
    for curve, colour in zip(curves, colours):
        for values, edge, mark in ((curve.raw, hi, "^"), (curve.raw, lo, "v")):
            beyond = values > edge if mark == "^" else values < edge
            if beyond.any():
                marked = True
                ax.plot(curve.steps[beyond], np.full(int(beyond.sum()), 0.985 if mark == "^" else 0.015),
                        transform=ax.get_xaxis_transform(), linestyle="none", marker=mark, markersize=5,
                        color=colour, zorder=3, clip_on=False, label="_nolegend_", gid=f"outside:{mark}")
    return marked
