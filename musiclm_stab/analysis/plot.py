"""The stability study's figures, drawn from run directories.

    musiclm-stab plot runs/pre_clip10 runs/pre_clip1 runs/deepnorm runs/relax --out figures/ [--unigram 9.29]

Reads each run's ``config.yaml`` (for the legend text) and ``metrics.jsonl`` (one row per logged
step) and draws the study's figures, one line per run: analysis/figure_specs.py lists them, with what each
axis is and why (the first is fairseq's fp16 loss scale; losses in bits, or ``--unit nats``). A run that
failed (analysis/failures.py: diverged, dead input, or, given the held-out unigram level ``--unigram``,
stalled) is never drawn as a healthy one (analysis/panels.py). Plots read run directories only, never the
training loop; problems with the files are warnings (`PlotWarning`), not crashes.

``--window N``: window means, as fairseq logs a run (the mean over each N steps; the study's figures are
such logs). ``--smooth S``: TensorBoard's debiased EMA (after the window means, if any), the raw values
faint behind. ``--bands``: runs with the same legend text are the seeds of one configuration (the seed is
not part of the legend): one line, the mean over seeds of each seed's curve, in a band from the lowest to
the highest seed's (min-max, not +-std: with 3 seeds the band shows every seed), the raw mean faint
behind; a configuration's failed seeds are a line of their own (per kind), out of its healthy line's mean.
``--extra`` adds the figures of ``figure_specs.extra_figures`` (every codebook, attention logits, held-out
curves, the loss scale log-scaled).

This module reads the runs, groups them and saves the figures; analysis/figure_specs.py says which figures,
analysis/panels.py draws each one (panels, lines, marks, the robust y range), the lines come from
analysis/curves.py (runs grouped by legend text, failed runs apart, EMA, seed bands) and the look from
analysis/style.py (colours, markers, the step axis, failure marks).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from musiclm_stab.analysis.curves import (
    RunGroup,
    group_runs,
    resolve_labels,
    run_failures,
    split_by_failure,
    with_derived,
)
from musiclm_stab.analysis.failures import STALL_MARGIN
from musiclm_stab.analysis.figure_specs import extra_figures, figure_specs
from musiclm_stab.analysis.panels import draw_figure
from musiclm_stab.analysis.runs import PlotWarning, RunMetrics, plot_warning, read_run, run_label
from musiclm_stab.analysis.style import PNG_DPI
from musiclm_stab.config.sections import LOSS_UNITS

__all__ = ["PlotWarning", "RunMetrics", "cli_main", "make_figures", "plot_runs", "read_run", "run_label"]


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
    group. ``extra``: also the figures of ``extra_figures`` (every codebook, attention logits per layer,
    held-out curves), drawn when some run logged their metrics.

    Failed runs (``analysis/failures.failure``: diverged, dead input; stalled too when
    ``unigram_eval_cb0``, the held-out unigram level of codebook 0 in bits, is given: a final held-out
    codebook-0 loss less than ``stall_margin`` bits below it) are drawn as failed
    (analysis/panels.py); with ``bands``, a configuration's failed seeds form a line of their own per kind.
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
        fig = draw_figure([spec], groups, smooth, log_x, title=None, window=window)
        if fig is not None:
            figures[spec.name] = fig
    if extra:
        for name, (panels, title) in extra_figures(runs, unit).items():
            evaluated = name.startswith("eval")  # drawn as evaluated: every point is a whole evaluation
            fig = draw_figure(panels, groups, 0.0 if evaluated else smooth, log_x, title=title,
                              warn_missing=False, window=1 if evaluated else window)
            if fig is not None:
                figures[name] = fig
    return figures


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
        "codebook-0 loss stays within --stall-margin of it are drawn as stalled",
    )
    p.add_argument(
        "--stall-margin",
        type=float,
        default=STALL_MARGIN,
        metavar="BITS",
        help=f"with --unigram: how far below the unigram level a run must end not to be stalled (default "
        f"{STALL_MARGIN}; the learning study's 'learned' margin is 0.1)",
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
                stall_margin=args.stall_margin,
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
