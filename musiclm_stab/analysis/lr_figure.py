"""The learning-rate figure of the study: final held-out codebook-0 loss against the peak learning rate.

One line per configuration (legend text; the QK-norm control too where it ran): the mean over seeds of each
run's last held-out codebook-0 loss at each lr of the grid, in a band from the lowest to the highest seed,
on a log lr axis; the held-out unigram level (the loss of predicting the training split's code frequencies,
analysis/unigram.py) as a dashed line. Failed runs are marked by kind (analysis/failures.py), each kind with
its own mark and legend entry (analysis/style.FAILURE_MARKERS):

- diverged (fp16's loss scale reached its floor, or its training loss ended above its start, as the claims'
  rule; or no finite held-out value): an x above the curves at its lr, in its configuration's colour and on
  its configuration's own row (so configurations diverging at one lr do not hide each other), with the
  number of seeds beside it when more than one diverged there; it does not enter the mean (it has no
  final loss).
- dead input (the frontend's output died) and stalled (the final held-out loss within 0.05 bits of the
  unigram level; needs that level): a hollow square or star around the mean of those seeds' final losses,
  which are real losses and stay in the mean, with "n/N" beside it when only n of the cell's N seeds
  failed that way.

The legend sits below the axes, where it hides no point. Wortsman et al. (2023) call the flatness of such a
curve the LR sensitivity (analysis/claims.py gives it with its interval).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from musiclm_stab.analysis.claim_stats import diverged as diverged_run
from musiclm_stab.analysis.failures import failure
from musiclm_stab.analysis.runs import RunMetrics, read_run
from musiclm_stab.analysis.style import BAND_ALPHA, COLOURS, FIGSIZE, MARKERS, PNG_DPI, failure_mark_style

METRIC = "eval/acoustic_mlm_loss/cb0"
DIVERGED_LABEL = "Diverged run (a row per configuration; a number: how many seeds)"
DEAD_LABEL = "Dead input (around its final loss; n/N: n of the N seeds)"
STALLED_LABEL = "Stalled at the unigram level (around its final loss; n/N: n of the N seeds)"
KIND_LABELS = {"dead input": DEAD_LABEL, "stalled": STALLED_LABEL}


def final_value(run: RunMetrics, metric: str = METRIC) -> float:
    """The run's last held-out value of ``metric``; nan when it diverged (the claims' rule,
    ``claim_stats.diverged``: the loss scale at its floor, or the training loss ending above its start) or
    never evaluated."""
    series = run.metric(metric)
    if series is None or diverged_run(run):
        return math.nan
    return float(series[1][-1])


def _lr(run: RunMetrics) -> float:
    return float((run.config.get("optim") or {}).get("lr", math.nan))


def lr_table(runs: Sequence[RunMetrics]) -> dict[str, dict[float, list[float]]]:
    """{legend text: {peak lr: final held-out cb0 of each seed (nan: diverged)}} in first-seen order."""
    table: dict[str, dict[float, list[float]]] = {}
    for run in runs:
        table.setdefault(run.label, {}).setdefault(_lr(run), []).append(final_value(run))
    return table


def lr_failures(runs: Sequence[RunMetrics], unigram_eval_cb0: float | None = None
                ) -> dict[str, dict[float, list[str]]]:
    """{legend text: {peak lr: each seed's failure kind}} in ``lr_table``'s order (analysis/failures.py:
    "none", "diverged", "dead input", "stalled"; stalled only with ``unigram_eval_cb0``); a run without a
    finite final held-out value is "diverged", as ``final_value`` says."""
    table: dict[str, dict[float, list[str]]] = {}
    for run in runs:
        kind = failure(run, unigram_eval_cb0).kind
        if kind != "diverged" and not math.isfinite(final_value(run)):
            kind = "diverged"
        table.setdefault(run.label, {}).setdefault(_lr(run), []).append(kind)
    return table


def lr_figure(runs: Sequence[RunMetrics | str | Path], unigram_eval_cb0: float | None = None,
              stalls: bool = True) -> Figure:
    """The figure (module docstring) of ``runs``, losses in bits."""
    runs = [r.in_unit("bits") if isinstance(r, RunMetrics) else read_run(r, "bits") for r in runs]
    table, kinds = lr_table(runs), lr_failures(runs, unigram_eval_cb0 if stalls else None)
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    handles = []
    diverged: list[tuple[str, str, float, int]] = []  # (legend text, colour, lr, seeds diverged there)
    marked: list[str] = []  # the kinds of the marks drawn around points (dead input, stalled)
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
        for lr, v in zip(lrs, vals):
            cell = np.array(kinds[label][lr])
            for kind in KIND_LABELS:
                of_kind = cell == kind
                if not of_kind.any():
                    continue
                y = float(v[of_kind].mean())
                ax.plot([lr], [y], zorder=4, label="_nolegend_", gid=f"{kind}:{label}",
                        **failure_mark_style(kind, colour))
                if of_kind.sum() < len(cell):
                    ax.annotate(f"{int(of_kind.sum())}/{len(cell)}", (lr, y), xytext=(6, 4),
                                textcoords="offset points", fontsize=7, color=colour)
                if kind not in marked:
                    marked.append(kind)
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
            ax.plot([lr], [y], label="_nolegend_", gid=f"diverged:{label}", **failure_mark_style("diverged", colour))
            if n > 1:
                ax.annotate(str(n), (lr, y), xytext=(5, -3), textcoords="offset points", fontsize=7, color=colour)
        handles.append(Line2D([], [], label=DIVERGED_LABEL, **failure_mark_style("diverged", "0.35")))
    handles += [Line2D([], [], label=KIND_LABELS[kind], **failure_mark_style(kind, "0.35")) for kind in marked]
    ax.set_xscale("log")
    ax.set_xlabel("Peak Learning Rate")
    ax.set_ylabel("Final Held-out Acoustic MLM Loss\non Codebook-0 (bits)")
    ax.grid(True, alpha=0.3, linewidth=0.6)
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return fig


def save_lr_figure(runs: Sequence[RunMetrics | str | Path], out_dir: str | Path, unigram_eval_cb0: float | None = None,
                   formats: Sequence[str] = ("png", "pdf"), stalls: bool = True) -> list[Path]:
    """``lr_sensitivity.<format>`` in ``out_dir``; returns the written files. ``stalls`` False: the unigram
    level is drawn but no run is marked stalled (a design that does not assess stalls)."""
    fig = lr_figure(runs, unigram_eval_cb0, stalls)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in formats:
        path = out / f"lr_sensitivity.{f}"
        fig.savefig(path, format=f, dpi=PNG_DPI if f == "png" else "figure")
        written.append(path)
    return written
