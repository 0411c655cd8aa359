"""The learning-rate figure of the study: final held-out codebook-0 loss against the peak learning rate.

One line per configuration (legend text; the QK-norm control too where it ran): the mean over seeds of each
run's last held-out codebook-0 loss at each lr of the grid, in a band from the lowest to the highest seed,
on a log lr axis; the held-out unigram level (the loss of predicting the training split's code frequencies,
analysis/unigram.py) as a dashed line; a diverged run (fp16's loss scale reached its floor, or no finite
held-out value) is an x above the curves at its lr, in its configuration's colour and on its configuration's
own row (so configurations diverging at one lr do not hide each other), with the number of seeds beside it
when more than one diverged there, and does not enter the mean. The legend sits below the axes, where it
hides no point. Wortsman et al. (2023) call the flatness of such a curve the LR sensitivity
(analysis/claims.py gives it with its interval).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from musiclm_stab.analysis.runs import RunMetrics, read_run
from musiclm_stab.analysis.style import BAND_ALPHA, COLOURS, FIGSIZE, MARKERS, PNG_DPI

METRIC = "eval/acoustic_mlm_loss/cb0"
DIVERGED_LABEL = "Diverged run (a row per configuration; a number: how many seeds)"


def final_value(run: RunMetrics, metric: str = METRIC) -> float:
    """The run's last held-out value of ``metric``; nan when it diverged or never evaluated."""
    series = run.metric(metric)
    if getattr(run, "diverged_at", None) is not None or series is None:
        return math.nan
    return float(series[1][-1])


def lr_table(runs: Sequence[RunMetrics]) -> dict[str, dict[float, list[float]]]:
    """{legend text: {peak lr: final held-out cb0 of each seed (nan: diverged)}} in first-seen order."""
    table: dict[str, dict[float, list[float]]] = {}
    for run in runs:
        lr = float((run.config.get("optim") or {}).get("lr", math.nan))
        table.setdefault(run.label, {}).setdefault(lr, []).append(final_value(run))
    return table


def lr_figure(runs: Sequence[RunMetrics | str | Path], unigram_eval_cb0: float | None = None) -> Figure:
    """The figure (module docstring) of ``runs``, losses in bits."""
    runs = [r.in_unit("bits") if isinstance(r, RunMetrics) else read_run(r, "bits") for r in runs]
    table = lr_table(runs)
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    handles = []
    diverged: list[tuple[str, str, float, int]] = []  # (legend text, colour, lr, seeds diverged there)
    for i, (label, by_lr) in enumerate(table.items()):
        colour, marker = COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]
        lrs = np.array(sorted(by_lr))
        vals = [np.array(by_lr[lr], dtype=np.float64) for lr in lrs]
        ok = [v[np.isfinite(v)] for v in vals]
        mean = np.array([v.mean() if len(v) else np.nan for v in ok])
        lo = np.array([v.min() if len(v) else np.nan for v in ok])
        hi = np.array([v.max() if len(v) else np.nan for v in ok])
        ax.fill_between(lrs, lo, hi, color=colour, alpha=BAND_ALPHA, linewidth=0, label="_nolegend_")
        (line,) = ax.plot(lrs, mean, color=colour, marker=marker, markersize=5, linewidth=1.2, label=label)
        handles.append(line)
        diverged += [(label, colour, lr, int((~np.isfinite(v)).sum())) for lr, v in zip(lrs, vals)
                     if not np.isfinite(v).all()]
    if unigram_eval_cb0 is not None and math.isfinite(unigram_eval_cb0):
        handles.append(ax.axhline(unigram_eval_cb0, color="0.3", linestyle="--", linewidth=1.0,
                                  label=f"Unigram level (held-out): {unigram_eval_cb0:.2f} bits"))
    if diverged:
        rows = list(dict.fromkeys(label for label, *_ in diverged))  # one row per configuration, legend order
        lo, hi = ax.get_ylim()
        step = (hi - lo) * 0.06
        ax.set_ylim(lo, hi + step * (len(rows) + 0.5))  # room above the curves: the marks cover no point
        for label, colour, lr, n in diverged:
            y = hi + step * (rows.index(label) + 0.75)
            ax.plot([lr], [y], linestyle="none", marker="x", markersize=6, color=colour, label="_nolegend_",
                    gid=f"diverged:{label}")
            if n > 1:
                ax.annotate(str(n), (lr, y), xytext=(5, -3), textcoords="offset points", fontsize=7, color=colour)
        handles.append(Line2D([], [], color="0.35", marker="x", linestyle="none", label=DIVERGED_LABEL))
    ax.set_xscale("log")
    ax.set_xlabel("Peak Learning Rate")
    ax.set_ylabel("Final Held-out Acoustic MLM Loss\non Codebook-0 (bits)")
    ax.grid(True, alpha=0.3, linewidth=0.6)
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return fig


def save_lr_figure(runs: Sequence[RunMetrics | str | Path], out_dir: str | Path, unigram_eval_cb0: float | None = None,
                   formats: Sequence[str] = ("png", "pdf")) -> list[Path]:
    """``lr_sensitivity.<format>`` in ``out_dir``; returns the written files."""
    fig = lr_figure(runs, unigram_eval_cb0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in formats:
        path = out / f"lr_sensitivity.{f}"
        fig.savefig(path, format=f, dpi=PNG_DPI if f == "png" else "figure")
        written.append(path)
    return written
