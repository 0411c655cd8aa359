"""A sweep's results: the LR sensitivity of each scheme, the table, the figure and the files
(sweep.json, sweep.csv, lr_sensitivity.png/.pdf); experiments/sweep.py runs the sweep. Here, in analysis/,
because the study's claims and its lr grid (claims.py, lr_grid.py) use its sensitivity and lr labels too."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

DEFAULT_LAST = 10  # logged steps averaged into a run's final loss


def lr_text(lr: float) -> str:
    """A learning rate in short scientific notation, exactly: 0.003 -> "3e-3", 0.0015 -> "1.5e-3", 1 -> "1e0"."""
    mantissa, exponent = f"{lr:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


# ---------------------------------------------------------------------------------------------------
# Results and the sensitivity number


@dataclass
class SweepResult:
    """One (scheme, lr) run of the sweep."""

    scheme: str
    lr: float
    label: str  # legend text of the scheme
    initial_loss: float  # step-1 loss (before any update): the cap
    final_loss: float  # mean of the last `last` logged losses; nan if any of them is non-finite
    steps: int  # last logged step
    grad_norm_max: float  # largest finite pre-clip grad norm
    skipped_steps: int  # updates skipped for a non-finite gradient
    seconds: float  # wall time of the run's training (in-process Trainer, set-up included)
    run_dir: str
    peak_loss: float = math.nan  # largest finite logged loss: transient blow-ups the final loss hides
    steps_above_initial: int = 0  # logged steps with a loss above the initial loss (non-finite included)

    @property
    def diverged(self) -> bool:
        """Non-finite final loss, or a final loss above the initial loss."""
        return not math.isfinite(self.final_loss) or self.final_loss > self.initial_loss

    @property
    def capped_loss(self) -> float:
        """min(final loss, initial loss); a non-finite final loss counts as the initial loss."""
        return self.initial_loss if self.diverged else self.final_loss

    def row(self) -> dict:
        return {**asdict(self), "diverged": self.diverged, "capped_loss": self.capped_loss}


def lr_sensitivity(final_losses: Sequence[float], caps: Sequence[float]) -> float:
    """Wortsman et al.'s LR sensitivity: mean over the grid of min(loss, cap) minus the best loss.

    ``caps`` are the initial losses (one per lr; non-finite losses count as the cap). nan when no lr
    trained at all (every run capped), where "best" would be meaningless.
    """
    if len(final_losses) != len(caps) or not len(final_losses):
        raise ValueError("need one cap per final loss, and at least one run")
    capped = np.array([min(x, c) if math.isfinite(x) else c for x, c in zip(final_losses, caps)])
    trained = [x for x, c in zip(final_losses, caps) if math.isfinite(x) and x <= c]
    if not trained:
        return math.nan
    return float(np.mean(capped) - min(trained))


def sensitivities(results: Sequence[SweepResult]) -> dict[str, float]:
    """Scheme -> LR sensitivity, in the order the schemes first appear."""
    out: dict[str, float] = {}
    for scheme in dict.fromkeys(r.scheme for r in results):
        runs = [r for r in results if r.scheme == scheme]
        out[scheme] = lr_sensitivity([r.final_loss for r in runs], [r.initial_loss for r in runs])
    return out


# ---------------------------------------------------------------------------------------------------
# Outputs: figure, tables, files


def make_sweep_figure(results: Sequence[SweepResult], last: int = DEFAULT_LAST):
    """Final loss vs learning rate (log x), one line per scheme in plot.py's colour/marker order.

    Diverged runs are drawn at their cap (the initial loss) with an extra ``x``; each legend entry
    carries the scheme's LR sensitivity.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from musiclm_stab.analysis.style import COLOURS, FIGSIZE, MARKERS

    if not results:
        raise ValueError("no sweep results to plot")
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    sens = sensitivities(results)
    handles, any_diverged = [], False
    for i, scheme in enumerate(sens):
        runs = sorted((r for r in results if r.scheme == scheme), key=lambda r: r.lr)
        colour, marker = COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]
        lrs = [r.lr for r in runs]
        (line,) = ax.plot(
            lrs,
            [r.capped_loss for r in runs],
            color=colour,
            marker=marker,
            markersize=6,
            linewidth=1.4,
            label=f"{runs[0].label} (LR sens. {sens[scheme]:.3g})",
            gid=f"scheme:{scheme}",
        )
        handles.append(line)
        bad = [r for r in runs if r.diverged]
        if bad:
            any_diverged = True
            ax.plot(
                [r.lr for r in bad],
                [r.capped_loss for r in bad],
                linestyle="none",
                marker="x",
                markersize=11,
                markeredgewidth=2,
                color=colour,
                label="_nolegend_",
                gid=f"diverged:{scheme}",
            )
    if any_diverged:
        handles.append(
            Line2D(
                [],
                [],
                color="0.35",
                marker="x",
                markersize=9,
                linestyle="none",
                label="Diverged (capped at initial loss)",
            )
        )
    ax.set_xscale("log")
    ax.set_xlabel("Learning Rate")
    ax.set_ylabel(f"Final Loss (mean of last {last} steps)")
    ax.grid(True, which="both", alpha=0.3, linewidth=0.6)
    ax.legend(handles=handles, loc="best", fontsize=8, framealpha=0.9)
    return fig


def write_outputs(
    results: Sequence[SweepResult], out: str | Path, settings: dict, last: int = DEFAULT_LAST
) -> list[Path]:
    """sweep.json, sweep.csv, lr_sensitivity.png/.pdf in ``out``; returns the paths."""
    from musiclm_stab.analysis.style import PNG_DPI

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.row() for r in results]
    sens = sensitivities(results)
    payload = {
        "settings": settings,
        "lr_sensitivity": sens,
        "cap": "initial loss (step 1, before any update) of each run",
        "final_loss": f"mean training loss of the last {last} logged steps",
        "results": rows,
    }
    (out / "sweep.json").write_text(json.dumps(payload, indent=2) + "\n")
    with (out / "sweep.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fig = make_sweep_figure(results, last)
    written = [out / "sweep.json", out / "sweep.csv"]
    for fmt in ("png", "pdf"):
        path = out / f"lr_sensitivity.{fmt}"
        fig.savefig(path, format=fmt, dpi=PNG_DPI if fmt == "png" else "figure")
        written.append(path)
    return written


def format_table(results: Sequence[SweepResult]) -> str:
    """Final loss per scheme and lr (``*`` = diverged, shown capped), best lr, LR sensitivity."""
    lrs = sorted({r.lr for r in results})
    sens = sensitivities(results)
    width = max(len(r.label) for r in results)
    head = (
        f"{'scheme':<{width}} "
        + " ".join(f"{'lr ' + f'{lr:g}':>11}" for lr in lrs)
        + f" {'best lr':>8} {'LR sens.':>9}"
    )
    lines = [head, "-" * len(head)]
    for scheme, value in sens.items():
        runs = {r.lr: r for r in results if r.scheme == scheme}
        cells = []
        for lr in lrs:
            r = runs.get(lr)
            cells.append(f"{'':>11}" if r is None else f"{r.capped_loss:>10.3f}{'*' if r.diverged else ' '}")
        ok = [r for r in runs.values() if not r.diverged]
        best = f"{min(ok, key=lambda r: r.final_loss).lr:g}" if ok else "-"
        label = next(iter(runs.values())).label
        lines.append(f"{label:<{width}} " + " ".join(cells) + f" {best:>8} {value:>9.3f}")
    lines.append("* diverged (non-finite, or above the initial loss): counted at the initial loss")
    lines += ["", "steps with a loss above the initial loss (transient blow-ups included) / peak loss"]
    for scheme in sens:
        runs = {r.lr: r for r in results if r.scheme == scheme}
        cells = [
            f"{'':>11}" if lr not in runs else f"{runs[lr].steps_above_initial:>3}/{runs[lr].peak_loss:>7.3g}"
            for lr in lrs
        ]
        lines.append(f"{next(iter(runs.values())).label:<{width}} " + " ".join(cells))
    return "\n".join(lines)
