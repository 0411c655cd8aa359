"""The stability study's figures, drawn from run directories.

    musiclm-stab plot runs/pre_clip10 runs/pre_clip1 runs/deepnorm runs/relax --out figures/ [--unigram 9.29]

Reads each run's ``config.yaml`` (for the legend text) and ``metrics.jsonl`` (one row per logged
step) and draws, one line per run:

  loss_scale.png             fp16 loss scale        y "Loss Scale", from 0, linear (fp16 runs only)
  loss.png                   training loss          y "Training Loss (bits)"
  grad_norm.png              grad norm before clip  y "Gradient Norm"
  musical_mlm_loss.png       CQT regression loss    y "Musical MLM Loss (MSE / ln 2)", log-scaled steps
  acoustic_mlm_loss_cb0.png  codebook-0 CE          y "Acoustic MLM Loss on Codebook-0 (bits)", log-scaled steps

The study's first seed figure is fairseq's fp16 loss scale as fairseq logs it, not a training loss: its y
axis "Loss Scale" runs 0-2 and its lines end near 0.05, which no training loss of the model reaches
(codebook 0 alone stays above 5.6 bits), while fairseq's scale is a power of two that halves at every
overflow (2^-4 = 0.0625, 2^-5 = 0.031: "0.03-0.07"). It is the scale itself, not divided by anything:
fairseq logs ``loss_scale`` raw (the window's last value, rounded to 4 decimals), and the seed's start at
1.5-2 could not be a scale divided by fairseq's initial 128, since MERT-330M's fp16 musical MSE caps the scale
at 32 (docs/FIDELITY.md, "musical loss"). So loss_scale.png draws the logged scale on the seed's axes:
linear, from 0, the seed's 0-2 with its 0.25 ticks when every curve fits, else widened to the curves (our
runs' scales live far above 2; ``--extra``'s loss_scale_log.png shows them log-scaled); with ``--window``,
each window's last value, as fairseq logs it. The training loss has a figure of its own, under its own name.

Losses are drawn in bits by default, the unit of the study's figures (fairseq logs every loss divided by
ln 2: the codebook-0 CE starts near log2(1024) = 10), or in nats (``--unit nats``); the axis label names
the unit. Each run's losses are converted from the unit it logged (``train.loss_unit``; nats for runs
made before that setting existed), so runs of either kind share a figure correctly. The MSE is not an
information quantity: "bits" there means divided by ln 2 as fairseq logs it, hence its label.

in the study's style: x "Training Step" labelled in K, legend upper right, colours blue / orange /
green / pink with markers o ^ v D. Skipped (non-finite) steps are marked with small x's on the x axis
and loss-spike-guard rollbacks with dashed vertical lines. A run that failed (analysis/failures.py:
diverged, dead input, or, given the held-out unigram level ``--unigram``, stalled) is never drawn as a
healthy one: its line is dashed and faded from the step it failed at (a stalled one throughout), a mark of
its kind (x diverged, square dead input, star stalled) sits at that step (a stall's at its end), and its
legend entry says so, e.g. "... (dead input at 250)". Plots read run directories only, never the
training loop; problems with the files are warnings (`PlotWarning`), not crashes.

``--window N``: window means, as fairseq logs a run (the mean over each N steps; the study's figures are
such logs). ``--smooth S``: TensorBoard's debiased EMA (after the window means, if any), the raw values
faint behind. ``--bands``: runs with the same legend text are the seeds of one configuration (the seed is
not part of the legend): one line, the mean over seeds of each seed's curve, in a band from the lowest to
the highest seed's (min-max, not +-std: with 3 seeds the band shows every seed), the raw mean faint
behind; a configuration's failed seeds are a line of their own (per kind), out of its healthy line's mean.
y limits are robust: they span the drawn curves (lines and bands) except an excursion far beyond their
bulk (``curves.robust_limits``), and raw values beyond them are marked with a triangle at the edge (so
one point of 10^4 does not flatten every curve); every curve's start (its first 5% of steps; with
``--window``, its first logged row is a point of its own) is always on the axis, and the bulk an excursion
is measured against reaches the starts, so a spike to the height of the start (the seed's DeepNorm) is drawn.
``--extra`` adds:

  acoustic_mlm_loss_codebooks.png  every codebook's CE, one panel each (2 x 4), log-scaled steps
  grad_norm_log.png                the gradient norm, log-scaled
  max_attn_logit.png               largest attention logit |q.k|/sqrt(d) over the layers (diagnostics_every)
  max_attn_logit_layers.png        the same, one panel per layer
  eval.png                         held-out loss, musical MLM loss, codebook-0 CE (train.eval_every), as
                                   evaluated: neither smoothed nor averaged over windows
  loss_scale_log.png               fp16's loss scale, log-scaled

This module lays out the figures and panels; the lines come from analysis/curves.py (runs grouped by
legend text, failed runs apart, EMA, seed bands) and the look from analysis/style.py (colours, markers,
the step axis, failure marks).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FormatStrFormatter, MultipleLocator

from musiclm_stab.analysis.curves import (
    MAX_LOGIT,
    RunGroup,
    SeedCurve,
    curve_start,
    group_runs,
    layer_count,
    resolve_labels,
    robust_limits,
    run_failures,
    seed_curve,
    split_by_failure,
    with_derived,
)
from musiclm_stab.analysis.failures import STALL_MARGIN
from musiclm_stab.analysis.runs import PlotWarning, RunMetrics, plot_warning, read_run, run_label
from musiclm_stab.analysis.style import (
    BAND_ALPHA,
    COLOURS,
    FAILED_ALPHA,
    FAILED_LINESTYLE,
    FIGSIZE,
    MARKERS,
    PNG_DPI,
    RAW_ALPHA,
    failure_mark_style,
    marker_indices,
    style_x_axis,
)
from musiclm_stab.config.sections import LOSS_UNITS

__all__ = ["PlotWarning", "RunMetrics", "cli_main", "make_figures", "plot_runs", "read_run", "run_label"]

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
# The seed's first figure: fairseq's fp16 loss scale on a linear axis from 0 to 2, ticked every 0.25.
SEED_LOSS_SCALE_RANGE = (0.0, 2.0, 0.25)

CODEBOOK = re.compile(r"^acoustic_mlm_loss/cb(\d+)$")


@dataclass(frozen=True)
class FigureSpec:
    name: str  # file stem
    metric: str  # metrics.jsonl key
    ylabel: str
    log_x: bool  # default x scale (the study draws the MLM losses against log-scaled steps)
    log_y: bool = False  # log-scaled values (the extra gradient-norm figure: spikes of 1e4 beside norms of 1)
    reduce: str = "mean"  # what --window keeps of each window: its mean, or its "last" value (the loss scale)
    optional: bool = False  # drawn only when some run logged it, and silently left out otherwise (fp16 only)
    # (bottom, top, tick step): the seed's y axis, kept while every curve fits in it, else widened to them
    seed_range: tuple[float, float, float] | None = None


def figure_specs(codebooks: Iterable[int] = (0,), unit: str = "bits") -> list[FigureSpec]:
    """The study's figures, in order; one acoustic figure per requested codebook. Loss axes name ``unit``."""
    if unit not in LOSS_UNITS:
        raise ValueError(f"loss unit {unit!r} is not valid; choose one of: {', '.join(LOSS_UNITS)}")
    mse = "MSE / ln 2" if unit == "bits" else "MSE"
    specs = [
        # The seed's "Loss Scale" figure is fairseq's fp16 loss scale (module docstring), not a loss.
        FigureSpec("loss_scale", "loss_scale", "Loss Scale", False, reduce="last", optional=True,
                   seed_range=SEED_LOSS_SCALE_RANGE),
        FigureSpec("loss", "loss", f"Training Loss ({unit})", False),
        FigureSpec("grad_norm", "grad_norm", "Gradient Norm", False),
        FigureSpec("musical_mlm_loss", "musical_mlm_loss", f"Musical MLM Loss ({mse})", True),
    ]
    for k in codebooks:
        if int(k) < 0:
            raise ValueError(f"codebook index must be >= 0, got {k}")
        specs.append(
            FigureSpec(
                f"acoustic_mlm_loss_cb{k}",
                f"acoustic_mlm_loss/cb{k}",
                f"Acoustic MLM Loss on Codebook-{k} ({unit})",
                True,
            )
        )
    return specs


def make_figures(
    runs: Sequence[RunMetrics | str | Path],
    *,
    labels: Sequence[str] | None = None,
    smooth: float = 0.0,
    log_x: bool | None = None,
    codebooks: Iterable[int] = (0,),
    unit: str = "bits",
    bands: bool = False,
    extra: bool = False,
    window: int = 1,
    unigram_eval_cb0: float | None = None,
    stall_margin: float = STALL_MARGIN,
) -> dict[str, Figure]:
    """The study's figures as matplotlib Figures, keyed by file stem ("loss_scale", "loss", ...).

    One line per run, run i always in COLOURS[i] / MARKERS[i % 4] in every figure. ``log_x`` None
    keeps each figure's default (log steps for the MLM losses); True/False forces all. Losses in
    ``unit`` (bits or nats), whatever unit each run logged. A figure no run has data for is left out,
    with a warning.

    ``bands``: runs with the same legend text are the seeds of one configuration, drawn as one line (the
    mean over seeds of each seed's EMA) with a band from the lowest to the highest seed's EMA, and the
    mean of the raw values faint behind; ``labels`` then name the runs, and runs with one label form a
    group. ``extra``: also the figures of EXTRA_FIGURES (every codebook, attention logits per layer,
    held-out curves), drawn when some run logged their metrics.

    Failed runs (``analysis/failures.failure``: diverged, dead input; stalled too when
    ``unigram_eval_cb0``, the held-out unigram level of codebook 0 in bits, is given: a final held-out
    codebook-0 loss less than ``stall_margin`` bits below it) are drawn as failed
    (module docstring); with ``bands``, a configuration's failed seeds form a line of their own per kind.
    """
    specs = figure_specs(codebooks, unit)  # checks the unit before any run is read
    runs = [r.in_unit(unit) if isinstance(r, RunMetrics) else read_run(r, unit) for r in runs]
    if not runs:
        raise ValueError("no runs to plot")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    if window < 1:
        raise ValueError(f"window must be >= 1 step, got {window}")
    runs = [with_derived(run) for run in runs]
    if bands:
        groups = group_runs(runs, labels)
    else:
        groups = [RunGroup(text, [run]) for run, text in zip(runs, resolve_labels(runs, labels))]
    groups = split_by_failure(groups, run_failures(runs, unigram_eval_cb0, stall_margin))

    ends = {run.name: run.last_step for run in runs if run.last_step is not None}
    if len(set(ends.values())) > 1:
        plot_warning(
            "runs end at different steps ("
            + ", ".join(f"{n}: {s}" for n, s in ends.items())
            + "); the x axis spans the longest"
        )

    figures: dict[str, Figure] = {}
    for spec in specs:
        fig = _figure([spec], groups, smooth, log_x, title=None, window=window)
        if fig is not None:
            figures[spec.name] = fig
    if extra:
        for name, (panels, title) in extra_figures(runs, unit).items():
            evaluated = name.startswith("eval")  # drawn as evaluated: every point is a whole evaluation
            fig = _figure(panels, groups, 0.0 if evaluated else smooth, log_x, title=title, warn_missing=False,
                          window=1 if evaluated else window)
            if fig is not None:
                figures[name] = fig
    return figures


def extra_figures(runs: Sequence[RunMetrics], unit: str) -> dict[str, tuple[list[FigureSpec], str]]:
    """The extra figures' panels: {file stem: (one FigureSpec per panel, figure title)}.

      acoustic_mlm_loss_codebooks  training CE of every codebook (2 x 4 panels for 8), log-scaled steps
      grad_norm_log                the gradient norm on a log scale (one blow-up no longer hides the rest)
      max_attn_logit               largest attention logit over all layers, |q.k|/sqrt(d)
      max_attn_logit_layers        the same per layer, one panel per layer
      eval                         held-out loss, musical MLM loss and codebook-0 CE (train.eval_every)
    """
    mse = "MSE / ln 2" if unit == "bits" else "MSE"
    codebooks = sorted({int(m.group(1)) for run in runs for k in run.series if (m := CODEBOOK.match(k))})
    out = {
        "acoustic_mlm_loss_codebooks": (
            [FigureSpec(f"cb{k}", f"acoustic_mlm_loss/cb{k}", f"Acoustic MLM Loss on Codebook-{k} ({unit})", True)
             for k in codebooks],
            f"Acoustic MLM loss per codebook (training, {unit})",
        ),
        "grad_norm_log": (
            [FigureSpec("grad_norm_log", "grad_norm", "Gradient Norm (log scale)", False, log_y=True)],
            "Gradient norm before clipping, log-scaled",
        ),
        "max_attn_logit": (
            [FigureSpec("max", MAX_LOGIT, "Max Attention Logit (all layers)", False)],
            "Largest attention logit |q.k|/sqrt(d) over all layers",
        ),
        "max_attn_logit_layers": (
            [FigureSpec(f"layer{i}", f"diag/max_attn_logit/layer{i}", f"Max Attention Logit, Layer {i}", False)
             for i in range(layer_count(runs))],
            "Largest attention logit |q.k|/sqrt(d) per layer",
        ),
        "loss_scale_log": (
            [FigureSpec("loss_scale_log", "loss_scale", "fp16 Loss Scale (log scale)", False, log_y=True,
                        reduce="last")],
            "fp16 loss scale (fairseq: halved on an overflow, doubled after a clean window)",
        ),
        "eval": (
            [FigureSpec("eval_loss", "eval/loss", f"Held-out Loss ({unit})", False),
             FigureSpec("eval_musical", "eval/musical_mlm_loss", f"Held-out Musical MLM Loss ({mse})", True),
             FigureSpec("eval_cb0", "eval/acoustic_mlm_loss/cb0", f"Held-out Acoustic MLM Loss on Codebook-0 ({unit})",
                        True)],
            "Held-out evaluation (fixed batches of the held-out tracks)",
        ),
    }
    return {name: (panels, title) for name, (panels, title) in out.items() if panels}


def _figure(
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
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3), fontsize=8,
                   framealpha=0.9)
    return fig


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


def plot_runs(
    runs: Sequence[RunMetrics | str | Path],
    out_dir: str | Path,
    *,
    labels: Sequence[str] | None = None,
    smooth: float = 0.0,
    log_x: bool | None = None,
    codebooks: Iterable[int] = (0,),
    formats: Sequence[str] = ("png", "pdf"),
    unit: str = "bits",
    bands: bool = False,
    extra: bool = False,
    window: int = 1,
    unigram_eval_cb0: float | None = None,
    stall_margin: float = STALL_MARGIN,
) -> list[Path]:
    """Draw the study's figures for ``runs`` into ``out_dir``; returns the written files.

    Each figure is saved once per format (PNG at 150 dpi; PDF/SVG are vector). ``bands``, ``extra``,
    ``window``, ``unigram_eval_cb0`` and ``stall_margin`` (stalled runs): see make_figures.
    """
    formats = [f.lower().lstrip(".") for f in formats]
    supported = FigureCanvasAgg(Figure()).get_supported_filetypes()
    for f in formats:
        if f not in supported:
            raise ValueError(f"unknown figure format {f!r}; choose from: {', '.join(sorted(supported))}")
    figures = make_figures(runs, labels=labels, smooth=smooth, log_x=log_x, codebooks=codebooks, unit=unit,
                           bands=bands, extra=extra, window=window, unigram_eval_cb0=unigram_eval_cb0,
                           stall_margin=stall_margin)
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
    p = argparse.ArgumentParser(prog="musiclm-stab plot", description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/TRAINING.md (offline: musiclm-stab docs TRAINING)")
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
        "--window",
        type=int,
        default=1,
        metavar="N",
        help="window means over N steps, as fairseq logs a run (default 1: as logged)",
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
        "--unit",
        choices=LOSS_UNITS,
        default="bits",
        help="unit of the loss axes: bits (the study's, default) or nats; each run is converted from its own",
    )
    p.add_argument(
        "--bands",
        action="store_true",
        help="runs with the same legend text are seeds of one configuration: one line (mean of their EMAs) "
        "with a min-max band",
    )
    p.add_argument(
        "--extra",
        action="store_true",
        help="also every codebook's loss, the per-layer max attention logit and the held-out curves",
    )
    p.add_argument(
        "--unigram",
        type=float,
        default=None,
        metavar="BITS",
        help="held-out unigram level of codebook 0 (bits; the study prints it): runs whose final held-out "
        "codebook-0 loss stays within 0.05 bits of it are drawn as stalled",
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
                unit=args.unit,
                bands=args.bands,
                extra=args.extra,
                window=args.window,
                unigram_eval_cb0=args.unigram,
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
