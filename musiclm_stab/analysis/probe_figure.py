"""The probe figure: score vs layer, one panel per task, one line per run in the study's colours.

Each run's layers are a solid line in its study colour and marker (analysis/plot.py: run i is COLOURS[i],
MARKERS[i % 4]) with its 95% interval shaded; the same architecture at random init is a dashed line in
the same colour. The layer-free baselines (log CQT, EnCodec codes, no features) are horizontal grey lines,
taken from the first run that has them (runs on the same data share them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from musiclm_stab.analysis.style import COLOURS, MARKERS, PNG_DPI

TASK_TEXT = {"pitch": "Pitch (frames)", "key": "Key (segments)", "instrument": "Instrument (segments)"}
METRIC_TEXT = {"map": "mAP", "f1": "micro-F1", "accuracy": "Accuracy", "mirex": "MIREX Score",
               "track_accuracy": "Track Accuracy"}
FLAT_BASELINES = {  # name: (legend text, line style, grey level)
    "cqt": ("CQT (log)", ":", "0.3"), "codes": ("EnCodec codes", "-.", "0.3"), "prior": ("No features", "-", "0.7"),
}


def legend_texts(results: Sequence[dict]) -> list[str]:
    """The runs' legend texts (``run_label``), with the run name added where two would be the same."""
    labels = [r["label"] for r in results]
    return [f"{lab} ({r['name']})" if labels.count(lab) > 1 else lab for r, lab in zip(results, labels)]


def probe_figure(results: Sequence[dict], tasks: Sequence[str] | None = None,
                 metrics: dict[str, str] | None = None) -> Figure:
    """One panel per task: ``metrics[task]`` (default: the results' primary metric) vs layer."""
    if not results:
        raise ValueError("no probe results to plot")
    tasks = list(tasks or results[0]["tasks"])
    # The legend sits below the panels, one column per panel (at most 3): the study's legend texts are long.
    ncols = max(1, min(len(tasks), 3))
    rows_of_legend = -(-(2 * len(results) + len(FLAT_BASELINES)) // ncols)
    fig = Figure(figsize=(4.2 * len(tasks), 3.8 + 0.2 * rows_of_legend), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    texts = legend_texts(results)
    for ax, task in zip(axes, tasks):
        metric = (metrics or {}).get(task) or results[0]["primary"][task]
        top = 0
        for i, (result, text) in enumerate(zip(results, texts)):
            colour, marker = COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]
            for name, style, label in (("model", "-", text), ("random_init", "--", f"{text}, random init")):
                by_layer = result["results"].get(name)
                if not by_layer or task not in next(iter(by_layer.values())):
                    continue
                layers = sorted(int(layer) for layer in by_layer)
                values = [by_layer[str(layer)][task][metric] for layer in layers]
                ax.plot(layers, values, style, color=colour, marker=marker, markersize=5, label=label,
                        markerfacecolor=colour if name == "model" else "white")
                if name == "model":
                    lo, hi = zip(*(by_layer[str(layer)][task]["ci95"][metric] for layer in layers))
                    ax.fill_between(layers, lo, hi, color=colour, alpha=0.15, linewidth=0)
                top = max(top, *layers)
        for name, (label, style, grey) in FLAT_BASELINES.items():
            owner = next((r for r in results if name in r["results"] and task in r["results"][name]["0"]), None)
            if owner is not None:
                ax.axhline(owner["results"][name]["0"][task][metric], color=grey, linestyle=style, linewidth=1.2,
                           label=label)
        ax.set_xticks(range(top + 1))
        ax.set_xlabel("Layer")
        ax.set_ylabel(METRIC_TEXT.get(metric, metric))
        ax.set_title(TASK_TEXT.get(task, task))
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # every panel draws the same lines
    fig.legend(handles, labels, loc="outside lower center", ncols=min(ncols, len(labels)), fontsize=8,
               frameon=False)
    return fig


def save_probe_figure(results: Sequence[dict], path: str | Path, **kwargs) -> Path:
    """Draw ``probe_figure`` to a PNG at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    probe_figure(results, **kwargs).savefig(path, dpi=PNG_DPI)
    return path
